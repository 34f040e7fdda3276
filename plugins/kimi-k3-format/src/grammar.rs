//! The grammar of K3 assistant output (docs/k3-format.md §4 and §8) in llguidance's Lark
//! dialect, for constrained decoding: special tokens are spelled `<|open|>` etc., JSON values
//! are `%json { schema }`. The `kimi-k3-tools` plugin exports it as WIT `output-grammar`.
//!
//! Shape of a whole message (after the generation prompt):
//! - reasoning text and `<|close|>think<|sep|>` then `<|open|>response<|sep|>`, when the prompt
//!   opened the think channel; otherwise the prompt already opened the response (§2.5);
//! - the content, then `<|close|>response<|sep|>`;
//! - a tools block of calls (`required`: one or more, to any tool; a named function: only it);
//! - `<|close|>message<|sep|><|end_of_msg|>`.
//!
//! `auto` with strict tools and free content constrains only the tools block: the grammar then
//! starts after the trigger `<|open|>tools<|sep|>`.

use k3_plugin_sdk::{GrammarRequest, OutputGrammar, PluginError, ToolChoice};
use serde_json::{Map, Value, json};

/// What opens a tools block: the trigger of the `auto` grammar.
pub const TOOLS_TRIGGER: &str = "<|open|>tools<|sep|>";

/// Text that spells no marker. The model writes markers as special tokens; text tokens that
/// spell one would read as a marker to the parsers, so free text may not contain one.
const TEXT_TERMINAL: &str =
    r#"TEXT: /(?s:.)*/ & ~/(?s:.)*(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)(?s:.)*/"#;
/// An attribute value as the renderer escapes it: no raw `"`, and no `<` (so no marker).
const ATTR_TERMINAL: &str = r#"ATTR: /[^"<]*/"#;
/// Non-string argument types as the renderer writes them (`json_type`).
const JSON_TYPES: [&str; 5] = ["number", "boolean", "null", "object", "array"];

/// The grammar for `request`, or `None` when it needs no constraint.
pub fn output_grammar(request: &GrammarRequest) -> Result<Option<OutputGrammar>, PluginError> {
    let tools = parse_tools(request.tools_json.as_deref())?;
    let content = request.content_lark.as_deref();
    let mut g = Grammar::default();
    match &request.tool_choice {
        ToolChoice::None => {
            let Some(content) = content else {
                return Ok(None);
            };
            g.message(request.prompt_opens_reasoning, content, None)
        }
        ToolChoice::Auto => {
            let strict = tools.iter().any(|t| t.strict);
            match content {
                None if !strict => return Ok(None),
                None => {
                    // Only the tools block, once the model opens it.
                    let calls = g.calls(&tools, Constrain::StrictOnly);
                    g.rule(
                        "start",
                        format!("{calls} {} {}", close("tools"), end_of_message()),
                    );
                    return Ok(Some(OutputGrammar {
                        lark: g.finish(),
                        trigger: Some(TOOLS_TRIGGER.into()),
                    }));
                }
                Some(content) if tools.is_empty() => {
                    g.message(request.prompt_opens_reasoning, content, None)
                }
                Some(content) => {
                    let calls = g.calls(&tools, Constrain::StrictOnly);
                    g.message(
                        request.prompt_opens_reasoning,
                        content,
                        Some(format!("({})?", tools_block(&calls))),
                    )
                }
            }
        }
        ToolChoice::Required => {
            if tools.is_empty() {
                return Err(PluginError::InvalidInput(
                    "tool_choice \"required\" needs at least one tool".into(),
                ));
            }
            let calls = g.calls(&tools, Constrain::All);
            let content = content.unwrap_or("TEXT");
            g.message(
                request.prompt_opens_reasoning,
                content,
                Some(tools_block(&calls)),
            )
        }
        ToolChoice::Function(name) => {
            let Some(tool) = tools.iter().find(|t| &t.name == name) else {
                return Err(PluginError::InvalidInput(format!(
                    "tool_choice names the function {name:?}, which is not among the tools"
                )));
            };
            let calls = g.calls(std::slice::from_ref(tool), Constrain::All);
            let content = content.unwrap_or("TEXT");
            g.message(
                request.prompt_opens_reasoning,
                content,
                Some(tools_block(&calls)),
            )
        }
    }
    Ok(Some(OutputGrammar {
        lark: g.finish(),
        trigger: None,
    }))
}

/// A declared tool: its name, its `parameters` schema and whether it is strict.
#[derive(Debug, Clone)]
struct Tool {
    name: String,
    parameters: Value,
    strict: bool,
}

/// OpenAI-shaped tools (`{"type":"function","function":{...}}`, or the function object itself).
fn parse_tools(tools_json: Option<&str>) -> Result<Vec<Tool>, PluginError> {
    let Some(text) = tools_json else {
        return Ok(Vec::new());
    };
    let invalid = PluginError::InvalidInput;
    let value: Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("tools are not JSON: {e}")))?;
    let Value::Array(items) = value else {
        return Err(invalid("tools must be a JSON array".into()));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let f = item.get("function").unwrap_or(item);
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| invalid(format!("tool {i} has no function name")))?;
            let parameters = f.get("parameters").cloned().unwrap_or(json!({}));
            if !parameters.is_object() && !parameters.is_boolean() {
                return Err(invalid(format!(
                    "the parameters of tool {name:?} are not a JSON schema object"
                )));
            }
            Ok(Tool {
                name: name.to_owned(),
                parameters,
                strict: f.get("strict").and_then(Value::as_bool).unwrap_or(false),
            })
        })
        .collect()
}

/// Which tools' calls follow their schema; the others take any arguments.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Constrain {
    All,
    StrictOnly,
}

/// Rules collected while building; `finish` adds the shared terminals.
#[derive(Default)]
struct Grammar {
    rules: Vec<String>,
    free_args: bool,
}

impl Grammar {
    fn rule(&mut self, name: &str, body: String) {
        self.rules.push(format!("{name}: {body}"));
    }

    /// The `start` rule of a whole message; `tools` is the (possibly optional) tools block.
    fn message(&mut self, prompt_opens_reasoning: bool, content: &str, tools: Option<String>) {
        self.rule("content", content.to_owned());
        let mut body = String::new();
        if prompt_opens_reasoning {
            body.push_str(&format!("TEXT {} {} ", close("think"), open("response")));
        }
        body.push_str(&format!("content {}", close("response")));
        if let Some(tools) = tools {
            body.push(' ');
            body.push_str(&tools);
        }
        body.push(' ');
        body.push_str(&end_of_message());
        self.rule("start", body);
    }

    /// A rule for one or more calls to `tools`; returns its name.
    fn calls(&mut self, tools: &[Tool], constrain: Constrain) -> String {
        let mut alternatives = Vec::new();
        for (i, tool) in tools.iter().enumerate() {
            let args = if constrain == Constrain::All || tool.strict {
                self.schema_args(i, &tool.parameters)
            } else {
                self.free_args = true;
                "free_args".to_owned()
            };
            let name = format!("call_{i}");
            let open_call = format!(
                "<|open|> {} INDEX {} <|sep|>",
                lit(&format!(
                    "call tool=\"{}\" index=\"",
                    attr_escape(&tool.name)
                )),
                lit("\"")
            );
            self.rule(&name, format!("{open_call} {args} {}", close("call")));
            alternatives.push(name);
        }
        self.rule("call", alternatives.join(" | "));
        "call+".to_owned()
    }

    /// The arguments of tool `i`: its schema's properties in declaration order (required ones
    /// present), or one `json` block holding the whole object.
    fn schema_args(&mut self, i: usize, schema: &Value) -> String {
        // Clients send argument strings with spaces, and history renders them verbatim in
        // json blocks, so a json block's whitespace is free.
        let json_block = format!(
            "<|open|> {} <|sep|> %json {} {}",
            lit("json type=\"object\""),
            json_schema(schema, true),
            close("json")
        );
        let properties = schema.get("properties").and_then(Value::as_object);
        let Some(properties) = properties.filter(|p| !p.is_empty()) else {
            // No declared properties: any arguments, or a json block.
            self.free_args = true;
            self.rule(&format!("args_{i}"), format!("free_args | {json_block}"));
            return format!("args_{i}");
        };
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut seq = Vec::new();
        for (j, (key, prop)) in properties.iter().enumerate() {
            let name = format!("arg_{i}_{j}");
            let body = argument_alternatives(key, prop).join(" | ");
            self.rule(&name, body);
            seq.push(if required.contains(&key.as_str()) {
                name
            } else {
                format!("{name}?")
            });
        }
        self.rule(
            &format!("args_{i}"),
            format!("{} | {json_block}", seq.join(" ")),
        );
        format!("args_{i}")
    }

    fn finish(mut self) -> String {
        if self.free_args {
            let types = std::iter::once("string")
                .chain(JSON_TYPES)
                .map(lit)
                .collect::<Vec<_>>()
                .join(" | ");
            self.rule(
                "free_args",
                format!(
                    "free_arg* | <|open|> {} <|sep|> %json {{\"type\":\"object\"}} {}",
                    lit("json type=\"object\""),
                    close("json")
                ),
            );
            self.rule(
                "free_arg",
                format!(
                    "<|open|> {} ATTR {} ({types}) {} <|sep|> TEXT {}",
                    lit("argument key=\""),
                    lit("\" type=\""),
                    lit("\""),
                    close("argument")
                ),
            );
        }
        self.rules.push(TEXT_TERMINAL.into());
        self.rules.push(ATTR_TERMINAL.into());
        self.rules.push("INDEX: /[1-9][0-9]*/".into());
        let mut out = self.rules.join("\n");
        out.push('\n');
        out
    }
}

/// The ways one property can be written: `type="string"` with the raw text, or a JSON type
/// with a compact JSON value held to the property's schema.
fn argument_alternatives(key: &str, schema: &Value) -> Vec<String> {
    let types: Vec<&str> = match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let open = |t: &str| {
        format!(
            "<|open|> {} <|sep|>",
            lit(&format!(
                "argument key=\"{}\" type=\"{t}\"",
                attr_escape(key)
            ))
        )
    };
    let end = close("argument");
    if types.is_empty() {
        // No `type`: a string written raw, or any JSON type held to the schema.
        let mut alts = vec![format!("{} TEXT {end}", open("string"))];
        let json_types = JSON_TYPES.map(lit).join(" | ");
        alts.push(format!(
            "<|open|> {} ({json_types}) {} <|sep|> %json {} {end}",
            lit(&format!("argument key=\"{}\" type=\"", attr_escape(key))),
            lit("\""),
            json_schema(schema, false)
        ));
        return alts;
    }
    let mut alts = Vec::new();
    for t in types {
        let alt = match t {
            "string" => format!("{} {} {end}", open("string"), string_value(schema)),
            // The renderer writes integers as `number`.
            "integer" | "number" | "boolean" | "null" | "object" | "array" => {
                let written = if t == "integer" { "number" } else { t };
                let mut only = schema.clone();
                if let Some(o) = only.as_object_mut() {
                    o.insert("type".into(), Value::String(t.into()));
                }
                format!(
                    "{} %json {} {end}",
                    open(written),
                    json_schema(&only, false)
                )
            }
            _ => continue,
        };
        alts.push(alt);
    }
    if alts.is_empty() {
        alts.push(format!("{} TEXT {end}", open("string")));
    }
    alts
}

/// A raw string value: one of its `enum` / `const` strings, else any text without markers.
fn string_value(schema: &Value) -> String {
    let choices: Vec<&str> = match (schema.get("const"), schema.get("enum")) {
        (Some(Value::String(c)), _) => vec![c.as_str()],
        (_, Some(Value::Array(e))) => e.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    if choices.is_empty() {
        "TEXT".into()
    } else {
        format!(
            "({})",
            choices
                .iter()
                .map(|c| lit(c))
                .collect::<Vec<_>>()
                .join(" | ")
        )
    }
}

/// The schema as `%json` takes it; compact output unless `flexible` (the renderer writes
/// argument values as compact JSON).
fn json_schema(schema: &Value, flexible: bool) -> String {
    let mut s = match schema {
        Value::Object(o) => o.clone(),
        // `false` admits nothing; `true` and anything else, everything.
        Value::Bool(false) => Map::from_iter([("not".to_owned(), json!({}))]),
        _ => Map::new(),
    };
    s.insert(
        "x-guidance".into(),
        json!({ "whitespace_flexible": flexible }),
    );
    Value::Object(s).to_string()
}

/// A Lark string literal for `text` (llguidance reads them as JSON strings).
fn lit(text: &str) -> String {
    Value::String(text.into()).to_string()
}

/// Attribute escaping as the renderer does it (docs/k3-format.md §1).
fn attr_escape(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

fn open(tag: &str) -> String {
    format!("<|open|> {} <|sep|>", lit(tag))
}

fn close(tag: &str) -> String {
    format!("<|close|> {} <|sep|>", lit(tag))
}

fn tools_block(calls: &str) -> String {
    format!("{} {calls} {}", open("tools"), close("tools"))
}

fn end_of_message() -> String {
    format!("{} <|end_of_msg|>", close("message"))
}
