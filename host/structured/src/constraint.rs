//! What a request asks its output to match, and its Lark form (llguidance's dialect).

use serde_json::{Map, Value, json};

use crate::ConstraintError;

/// A constraint on generated text, from `response_format`, `structured_outputs`, the older
/// `guided_*` fields, or a Lark grammar. One definition for the protocols and the frontend.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    /// A JSON value matching `schema`. `strict: false` (OpenAI's default) still constrains, but
    /// schema keywords llguidance cannot enforce are ignored instead of refused.
    JsonSchema { schema: Value, strict: bool },
    /// Any JSON object.
    JsonObject,
    /// Text matching a regular expression (Rust `regex` syntax, no look-around), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A complete Lark grammar (llguidance's dialect, rule `start`).
    Lark(String),
}

/// JSON is written compact (no whitespace), as the K3 format writes it: free whitespace lets a
/// small model pad until `max_tokens`, leaving invalid JSON.
fn json_layout() -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ",",
        "key_separator": ":",
    })
}

impl OutputConstraint {
    /// The request field family, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            OutputConstraint::JsonSchema { .. } => "json_schema",
            OutputConstraint::JsonObject => "json_object",
            OutputConstraint::Regex(_) => "regex",
            OutputConstraint::Choice(_) => "choice",
            OutputConstraint::Lark(_) => "grammar",
        }
    }

    /// A Lark expression for this constraint, to be embedded where a rule body may stand (e.g.
    /// the response content inside a chat output grammar). A full Lark grammar has rules of its
    /// own and cannot be embedded: an error.
    pub fn to_lark_expr(&self) -> Result<String, ConstraintError> {
        match self {
            OutputConstraint::JsonSchema { schema, strict } => {
                let schema = schema_with_options(schema, *strict)?;
                Ok(format!("%json {schema}"))
            }
            OutputConstraint::JsonObject => {
                let mut schema = Map::new();
                schema.insert("type".into(), "object".into());
                schema.insert("x-guidance".into(), json_layout());
                Ok(format!("%json {}", Value::Object(schema)))
            }
            OutputConstraint::Regex(rx) => {
                if rx.is_empty() {
                    return Err(ConstraintError::InvalidRegex("the regex is empty".into()));
                }
                Ok(format!("/{}/", escape_regex_slashes(rx)))
            }
            OutputConstraint::Choice(choices) => {
                if choices.is_empty() {
                    return Err(ConstraintError::InvalidChoice(
                        "the list of choices is empty".into(),
                    ));
                }
                if choices.iter().any(String::is_empty) {
                    return Err(ConstraintError::InvalidChoice(
                        "a choice is the empty string".into(),
                    ));
                }
                // Lark string literals take JSON's escapes.
                let alts: Vec<String> = choices
                    .iter()
                    .map(|c| Value::String(c.clone()).to_string())
                    .collect();
                Ok(format!("({})", alts.join(" | ")))
            }
            OutputConstraint::Lark(_) => Err(ConstraintError::NotEmbeddable),
        }
    }

    /// A complete Lark grammar whose `start` is the whole output (raw completions).
    pub fn to_grammar(&self) -> Result<String, ConstraintError> {
        match self {
            OutputConstraint::Lark(g) => {
                if g.trim().is_empty() {
                    return Err(ConstraintError::InvalidGrammar(
                        "the grammar is empty".into(),
                    ));
                }
                Ok(g.clone())
            }
            other => Ok(format!("start: {}\n", other.to_lark_expr()?)),
        }
    }
}

/// The schema with its llguidance options (`x-guidance`, top level only): the fixed JSON layout,
/// and for non-strict schemas leniency toward keywords it cannot enforce.
fn schema_with_options(schema: &Value, strict: bool) -> Result<Value, ConstraintError> {
    let mut options = json_layout();
    if !strict {
        options["lenient"] = true.into();
    }
    match schema {
        Value::Object(map) => {
            let mut map = map.clone();
            if let Some(Value::Object(given)) = map.get("x-guidance") {
                for (k, v) in given {
                    options[k] = v.clone();
                }
            }
            map.insert("x-guidance".into(), options);
            Ok(Value::Object(map))
        }
        // `true` accepts any JSON value.
        Value::Bool(true) => Ok(json!({ "x-guidance": options })),
        _ => Err(ConstraintError::InvalidJsonSchema(
            "a JSON schema must be an object".into(),
        )),
    }
}

/// Lark writes a regex as `/…/`: a `/` inside must be escaped (an already escaped one stays).
fn escape_regex_slashes(rx: &str) -> String {
    let mut out = String::with_capacity(rx.len() + 4);
    let mut escaped = false;
    for c in rx.chars() {
        if c == '/' && !escaped {
            out.push('\\');
        }
        escaped = c == '\\' && !escaped;
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lark_expressions_for_each_kind() {
        let c = OutputConstraint::Choice(vec!["yes".into(), "no \"way\"".into()]);
        assert_eq!(c.to_lark_expr().unwrap(), r#"("yes" | "no \"way\"")"#);
        let r = OutputConstraint::Regex(r"a/b\/c".into());
        assert_eq!(r.to_lark_expr().unwrap(), r"/a\/b\/c/");
        assert_eq!(
            r.to_grammar().unwrap(),
            "start: /a\\/b\\/c/\n",
            "non-Lark constraints become the start rule"
        );
        let j = OutputConstraint::JsonSchema {
            schema: json!({"type": "integer"}),
            strict: false,
        };
        let lark = j.to_lark_expr().unwrap();
        assert!(lark.starts_with("%json {"), "{lark}");
        assert!(lark.contains(r#""lenient":true"#), "{lark}");
        assert!(
            OutputConstraint::Lark("start: \"x\"".into())
                .to_lark_expr()
                .is_err()
        );
        assert!(OutputConstraint::Choice(vec![]).to_grammar().is_err());
        assert!(
            OutputConstraint::JsonSchema {
                schema: json!([1]),
                strict: true
            }
            .to_grammar()
            .is_err()
        );
    }
}
