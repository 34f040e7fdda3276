//! The request fields that constrain the output, OpenAI's and vLLM's: `response_format`
//! (`json_schema`, `json_object`), `structured_outputs` {json, regex, choice, grammar,
//! json_object}, and the older `guided_json` / `guided_regex` / `guided_choice` /
//! `guided_grammar` (`guided_decoding_backend` is accepted and ignored: there is one backend).
//! At most one may be given; the result names the field it came from, for errors.

use serde_json::Value;

use crate::backend::OutputConstraint;
use crate::error::ApiError;

/// The constraint fields of a chat or completion request, as parsed.
#[derive(Debug, Default)]
pub struct ConstraintFields<'a> {
    pub response_format: Option<&'a Value>,
    pub structured_outputs: Option<&'a Value>,
    pub guided_json: Option<&'a Value>,
    pub guided_regex: Option<&'a Value>,
    pub guided_choice: Option<&'a Value>,
    pub guided_grammar: Option<&'a Value>,
}

/// The request's constraint and the field it came from, if any.
pub fn constraint(
    f: &ConstraintFields<'_>,
) -> Result<Option<(OutputConstraint, String)>, ApiError> {
    let mut found: Vec<(OutputConstraint, String)> = Vec::new();
    if let Some(rf) = f.response_format
        && let Some(c) = from_response_format(rf)?
    {
        found.push((c, "response_format".into()));
    }
    if let Some(so) = f.structured_outputs.filter(|v| !v.is_null()) {
        found.push(from_structured_outputs(so)?);
    }
    let guided = [
        ("guided_json", f.guided_json),
        ("guided_regex", f.guided_regex),
        ("guided_choice", f.guided_choice),
        ("guided_grammar", f.guided_grammar),
    ];
    for (field, value) in guided {
        if let Some(v) = value.filter(|v| !v.is_null()) {
            found.push((parse_kind(field, kind_of(field), v)?, field.to_string()));
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => {
            let names: Vec<&str> = found.iter().map(|(_, f)| f.as_str()).collect();
            Err(ApiError::invalid(
                names[1],
                format!(
                    "only one output constraint may be given (got {})",
                    names.join(" and ")
                ),
            ))
        }
    }
}

fn kind_of(field: &str) -> &str {
    field.trim_start_matches("guided_")
}

/// `response_format`: `json_schema` and `json_object` constrain; `text` does not. The shape was
/// already checked (`validate_response_format`).
fn from_response_format(rf: &Value) -> Result<Option<OutputConstraint>, ApiError> {
    match rf.get("type").and_then(Value::as_str) {
        Some("json_object") => Ok(Some(OutputConstraint::JsonObject)),
        Some("json_schema") => {
            let js = &rf["json_schema"];
            let strict = match js.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.strict",
                        "'response_format.json_schema.strict' must be a boolean",
                    ));
                }
            };
            // No schema: any JSON value.
            let schema = js.get("schema").cloned().unwrap_or(Value::Bool(true));
            Ok(Some(OutputConstraint::JsonSchema { schema, strict }))
        }
        _ => Ok(None),
    }
}

/// vLLM's `structured_outputs` object: exactly one of its constraint keys; its tuning options
/// are accepted and have no effect.
fn from_structured_outputs(so: &Value) -> Result<(OutputConstraint, String), ApiError> {
    let Value::Object(obj) = so else {
        return Err(ApiError::invalid(
            "structured_outputs",
            "'structured_outputs' must be an object",
        ));
    };
    const KINDS: [&str; 5] = ["json", "regex", "choice", "grammar", "json_object"];
    const OPTIONS: [&str; 5] = [
        "disable_fallback",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
        "backend",
    ];
    let mut chosen = None;
    for (key, value) in obj {
        let field = format!("structured_outputs.{key}");
        if value.is_null() || OPTIONS.contains(&key.as_str()) {
            continue;
        }
        if !KINDS.contains(&key.as_str()) {
            return Err(ApiError::not_supported(
                field,
                format!(
                    "'structured_outputs.{key}' is not supported; use one of json, regex, choice, grammar, json_object"
                ),
            ));
        }
        if key == "json_object" && value == &Value::Bool(false) {
            continue;
        }
        if chosen.is_some() {
            return Err(ApiError::invalid(
                field,
                "'structured_outputs' takes exactly one of json, regex, choice, grammar, json_object",
            ));
        }
        chosen = Some((parse_kind(&field, key, value)?, field));
    }
    chosen.ok_or_else(|| {
        ApiError::invalid(
            "structured_outputs",
            "'structured_outputs' needs one of json, regex, choice, grammar, json_object",
        )
    })
}

/// One constraint value by kind (`json`, `regex`, `choice`, `grammar`, `json_object`).
fn parse_kind(field: &str, kind: &str, v: &Value) -> Result<OutputConstraint, ApiError> {
    let text = |what: &str| match v {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        _ => Err(ApiError::invalid(
            field,
            format!("'{field}' must be a non-empty string ({what})"),
        )),
    };
    match kind {
        "json" => {
            // A schema object, or a string holding one.
            let schema = match v {
                Value::String(s) => serde_json::from_str(s).map_err(|e| {
                    ApiError::invalid(field, format!("'{field}' is not valid JSON: {e}"))
                })?,
                other => other.clone(),
            };
            if !(schema.is_object() || schema == Value::Bool(true)) {
                return Err(ApiError::invalid(
                    field,
                    format!("'{field}' must be a JSON Schema object"),
                ));
            }
            Ok(OutputConstraint::JsonSchema {
                schema,
                strict: true,
            })
        }
        "regex" => Ok(OutputConstraint::Regex(text("a regular expression")?)),
        "grammar" => Ok(OutputConstraint::Lark(text("a Lark grammar")?)),
        "json_object" => match v {
            Value::Bool(true) => Ok(OutputConstraint::JsonObject),
            _ => Err(ApiError::invalid(field, format!("'{field}' must be true"))),
        },
        _ => {
            let choices = v.as_array().and_then(|a| {
                a.iter()
                    .map(|c| c.as_str().map(String::from))
                    .collect::<Option<Vec<String>>>()
            });
            match choices {
                Some(c) if !c.is_empty() && c.iter().all(|s| !s.is_empty()) => {
                    Ok(OutputConstraint::Choice(c))
                }
                _ => Err(ApiError::invalid(
                    field,
                    format!("'{field}' must be a non-empty array of non-empty strings"),
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_source_maps_to_its_constraint() {
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}});
        let got = constraint(&ConstraintFields {
            response_format: Some(&rf),
            ..Default::default()
        })
        .unwrap()
        .unwrap();
        assert_eq!(
            got,
            (
                OutputConstraint::JsonSchema {
                    schema: json!({"type": "object"}),
                    strict: true
                },
                "response_format".into()
            )
        );
        let so = json!({"choice": ["a", "b"], "disable_any_whitespace": true});
        let got = constraint(&ConstraintFields {
            structured_outputs: Some(&so),
            ..Default::default()
        })
        .unwrap()
        .unwrap();
        assert_eq!(
            got.0,
            OutputConstraint::Choice(vec!["a".into(), "b".into()])
        );
        assert_eq!(got.1, "structured_outputs.choice");
        let gj = json!("{\"type\": \"integer\"}");
        let got = constraint(&ConstraintFields {
            guided_json: Some(&gj),
            ..Default::default()
        })
        .unwrap()
        .unwrap();
        assert_eq!(got.1, "guided_json");
        let text = json!({"type": "text"});
        assert!(
            constraint(&ConstraintFields {
                response_format: Some(&text),
                ..Default::default()
            })
            .unwrap()
            .is_none()
        );
    }

    #[test]
    fn bad_values_are_named() {
        let two = json!({"regex": "a", "choice": ["b"]});
        let rx = json!("a+");
        let bad_choice = json!([1]);
        let choice = json!(["a"]);
        let cases = [
            (
                ConstraintFields {
                    structured_outputs: Some(&two),
                    ..Default::default()
                },
                "structured_outputs.choice",
            ),
            (
                ConstraintFields {
                    guided_choice: Some(&bad_choice),
                    ..Default::default()
                },
                "guided_choice",
            ),
            (
                ConstraintFields {
                    guided_regex: Some(&rx),
                    guided_choice: Some(&choice),
                    ..Default::default()
                },
                "guided_choice",
            ),
        ];
        for (fields, param) in cases {
            let e = constraint(&fields).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
    }
}
