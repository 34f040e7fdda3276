//! `POST /v1/messages` request body and its conversion into the OpenAI-shaped
//! [`ChatGenRequest`] the request path takes.

use std::collections::HashSet;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::backend::{ChatGenRequest, ToolChoice};
use crate::content::{Part, anthropic_image, content_value};
use crate::error::ApiError;
use crate::openai::messages::normalize_messages;
use crate::unknown_fields::UnknownFields;
use crate::validate::{self, SamplingFields};

/// The accepted fields; others go to [`UnknownFields`] (ignored, or a 400 in strict mode).
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    /// Required by `/v1/messages`; `count_tokens` has none.
    pub max_tokens: Option<i64>,
    pub messages: Vec<Value>,
    pub system: Option<Value>,
    pub stop_sequences: Option<Value>,
    pub stream: Option<bool>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub thinking: Option<Value>,
    pub metadata: Option<Value>,
    pub service_tier: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ValidMessages {
    pub request: ChatGenRequest,
    pub stream: bool,
    pub parallel_tool_calls: bool,
}

fn text_of_blocks(value: &Value, p: &str) -> Result<String, ApiError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let bp = format!("{p}[{i}]");
                match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => parts.push(t.clone()),
                    (Some("text"), _) => {
                        return Err(ApiError::invalid(
                            format!("{bp}.text"),
                            format!("'{bp}.text' must be a string"),
                        ));
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            &bp,
                            format!("'{bp}' must be a text block"),
                        ));
                    }
                }
            }
            Ok(parts.join("\n"))
        }
        _ => Err(ApiError::invalid(
            p,
            format!("'{p}' must be a string or an array of text blocks"),
        )),
    }
}

/// Convert one Anthropic message into OpenAI-shaped messages (a user turn with tool results
/// becomes tool messages followed by the user's text).
fn convert_message(
    message: &Value,
    i: usize,
    tool_use_ids: &mut HashSet<String>,
    out: &mut Vec<Value>,
    unknown: &mut UnknownFields,
) -> Result<(), ApiError> {
    let p = format!("messages[{i}]");
    let Value::Object(obj) = message else {
        return Err(ApiError::invalid(&p, format!("'{p}' must be an object")));
    };
    for key in obj.keys() {
        if key != "role" && key != "content" {
            unknown.found(format!("{p}.{key}"))?;
        }
    }
    let role = match obj.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("{p}.role"),
                format!("'{p}.role' must be \"user\" or \"assistant\" (got \"{other}\")"),
            ));
        }
        None => {
            return Err(ApiError::invalid(
                format!("{p}.role"),
                format!("'{p}.role' is required and must be a string"),
            ));
        }
    };
    let blocks = match obj.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => {
            return Err(ApiError::invalid(
                format!("{p}.content"),
                format!("'{p}.content' is required and must be a string or an array of blocks"),
            ));
        }
    };
    let mut texts = Vec::new();
    // A user message's text and images, in order.
    let mut parts = Vec::new();
    let mut reasoning = Vec::new();
    let mut calls = Vec::new();
    let mut results = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let bp = format!("{p}.content[{j}]");
        let kind = block.get("type").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(format!("{bp}.type"), format!("'{bp}.type' is required"))
        })?;
        let field = |name: &str| block.get(name);
        match (role, kind) {
            (_, "text") => match field("text") {
                Some(Value::String(t)) => {
                    texts.push(t.clone());
                    parts.push(Part::Text(t.clone()));
                }
                _ => {
                    return Err(ApiError::invalid(
                        format!("{bp}.text"),
                        format!("'{bp}.text' must be a string"),
                    ));
                }
            },
            ("assistant", "thinking") => match field("thinking") {
                Some(Value::String(t)) => reasoning.push(t.clone()),
                _ => {
                    return Err(ApiError::invalid(
                        format!("{bp}.thinking"),
                        format!("'{bp}.thinking' must be a string"),
                    ));
                }
            },
            ("assistant", "redacted_thinking") => {}
            ("assistant", "tool_use") => {
                let id = field("id").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(format!("{bp}.id"), format!("'{bp}.id' must be a string"))
                })?;
                let name = field("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(
                        format!("{bp}.name"),
                        format!("'{bp}.name' must be a string"),
                    )
                })?;
                let input = match field("input") {
                    Some(v @ Value::Object(_)) => v.to_string(),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{bp}.input"),
                            format!("'{bp}.input' must be an object"),
                        ));
                    }
                };
                tool_use_ids.insert(id.to_string());
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input}}));
            }
            ("user", "tool_result") => {
                let id = field("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("{bp}.tool_use_id"),
                            format!("'{bp}.tool_use_id' must be a string"),
                        )
                    })?;
                if !tool_use_ids.contains(id) {
                    return Err(ApiError::invalid(
                        format!("{bp}.tool_use_id"),
                        format!(
                            "'{bp}.tool_use_id' (\"{id}\") matches no tool_use block of an earlier assistant message"
                        ),
                    ));
                }
                let content = match field("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of_blocks(c, &format!("{bp}.content"))?,
                };
                results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            ("user", "image") => parts.push(anthropic_image(block, &bp)?),
            (_, kind @ ("image" | "document" | "search_result")) => {
                return Err(ApiError::not_supported(
                    format!("{bp}.type"),
                    format!("'{kind}' blocks are not supported by this model"),
                ));
            }
            (_, other) => {
                return Err(ApiError::invalid(
                    format!("{bp}.type"),
                    format!("block type \"{other}\" is not valid in a {role} message"),
                ));
            }
        }
    }
    if role == "assistant" {
        let mut m = Map::new();
        m.insert("role".into(), json!("assistant"));
        m.insert("content".into(), json!(texts.join("")));
        if !reasoning.is_empty() {
            m.insert("reasoning_content".into(), json!(reasoning.join("")));
        }
        if !calls.is_empty() {
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        out.push(Value::Object(m));
    } else {
        out.extend(results);
        if !parts.is_empty() {
            out.push(json!({"role": "user", "content": content_value(parts)}));
        }
    }
    Ok(())
}

fn convert_tools(tools: &[Value], unknown: &mut UnknownFields) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(obj) = tool else {
            return Err(ApiError::invalid(&p, format!("'{p}' must be an object")));
        };
        if let Some(t) = obj.get("type").and_then(Value::as_str)
            && t != "custom"
        {
            return Err(ApiError::not_supported(
                format!("{p}.type"),
                format!("server tool type \"{t}\" is not supported"),
            ));
        }
        for key in obj.keys() {
            if !matches!(
                key.as_str(),
                "name" | "description" | "input_schema" | "type" | "cache_control"
            ) {
                unknown.found(format!("{p}.{key}"))?;
            }
        }
        let mut function = Map::new();
        if let Some(name) = obj.get("name") {
            function.insert("name".into(), name.clone());
        }
        if let Some(d) = obj.get("description") {
            function.insert("description".into(), d.clone());
        }
        match obj.get("input_schema") {
            Some(schema) => {
                function.insert("parameters".into(), schema.clone());
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.input_schema"),
                    format!("'{p}.input_schema' is required"),
                ));
            }
        }
        out.push(json!({"type": "function", "function": Value::Object(function)}));
    }
    // Validate in OpenAI form, then say the Anthropic field names.
    // The converted tools hold only known keys, so `unknown` hears nothing new here.
    validate::validate_tools(&out, unknown).map_err(|mut e| {
        let rename = |s: &str| {
            s.replace(".function.parameters", ".input_schema")
                .replace(".function.", ".")
        };
        e.param = e.param.as_deref().map(rename);
        e.message = rename(&e.message);
        e
    })
}

impl MessagesRequest {
    pub fn validate(
        self,
        request_id: String,
        unknown: &mut UnknownFields,
    ) -> Result<ValidMessages, ApiError> {
        let Some(max_tokens) = self.max_tokens else {
            return Err(ApiError::new(
                crate::error::ErrorKind::InvalidRequest,
                "missing required field 'max_tokens'",
            )
            .with_param("max_tokens")
            .with_code("missing_field"));
        };
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            let text = text_of_blocks(system, "system")?;
            messages.push(json!({"role": "system", "content": text}));
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "'messages' must contain at least one message",
            ));
        }
        let mut ids = HashSet::new();
        for (i, m) in self.messages.iter().enumerate() {
            convert_message(m, i, &mut ids, &mut messages, unknown)?;
        }
        let messages = normalize_messages(&messages, unknown)?;
        let tools = convert_tools(self.tools.as_deref().unwrap_or(&[]), unknown)?;
        let (choice, parallel) = match &self.tool_choice {
            None | Some(Value::Null) => (ToolChoice::Auto, true),
            Some(Value::Object(tc)) => {
                let parallel = !tc
                    .get("disable_parallel_tool_use")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                match tc.get("type").and_then(Value::as_str) {
                    Some("auto") => (ToolChoice::Auto, parallel),
                    Some("none") => (ToolChoice::None, parallel),
                    Some("any") => (ToolChoice::Required, parallel),
                    Some("tool") => {
                        let Some(name) = tc.get("name").and_then(Value::as_str) else {
                            return Err(ApiError::invalid(
                                "tool_choice.name",
                                "'tool_choice.name' is required for type \"tool\"",
                            ));
                        };
                        if !tools
                            .iter()
                            .any(|t| t["function"]["name"].as_str() == Some(name))
                        {
                            return Err(ApiError::invalid(
                                "tool_choice.name",
                                format!(
                                    "'tool_choice.name' is \"{name}\", which is not among the tools"
                                ),
                            ));
                        }
                        (ToolChoice::Function(name.to_string()), parallel)
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            "tool_choice.type",
                            "'tool_choice.type' must be auto, any, tool or none",
                        ));
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "'tool_choice' must be an object",
                ));
            }
        };
        let choice = if tools.is_empty() {
            ToolChoice::None
        } else {
            choice
        };
        // Anthropic semantics: no thinking unless asked for.
        let thinking = match &self.thinking {
            None | Some(Value::Null) => false,
            Some(t) => match t.get("type").and_then(Value::as_str) {
                Some("enabled") => true,
                Some("disabled") => false,
                _ => {
                    return Err(ApiError::invalid(
                        "thinking.type",
                        "'thinking.type' must be \"enabled\" or \"disabled\"",
                    ));
                }
            },
        };
        let sampling = validate::validate_sampling(&SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stop: self.stop_sequences,
            stop_param: "stop_sequences",
            max_tokens: Some((max_tokens, "max_tokens")),
            ..Default::default()
        })?;
        let mut kwargs = Map::new();
        kwargs.insert("thinking".into(), Value::Bool(thinking));
        kwargs.insert(
            "tool_choice".into(),
            serde_json::to_value(&choice).unwrap_or(Value::Null),
        );
        Ok(ValidMessages {
            request: ChatGenRequest {
                request_id,
                messages,
                tools,
                tool_choice: choice,
                thinking,
                template_kwargs: kwargs,
                sampling,
                constraint: None,
                constraint_param: String::new(),
            },
            stream: self.stream.unwrap_or(false),
            parallel_tool_calls: parallel,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::parse_json;
    use crate::error::ErrorStyle;

    fn validate(body: Value) -> Result<ValidMessages, ApiError> {
        let mut unknown = UnknownFields::strict();
        parse_json::<MessagesRequest>(
            body.to_string().as_bytes(),
            ErrorStyle::Anthropic,
            &mut unknown,
        )?
        .validate("m".into(), &mut unknown)
    }

    #[test]
    fn converts_a_tool_round_trip() {
        let v = validate(json!({
            "model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "be brief"}],
            "thinking": {"type": "enabled", "budget_tokens": 100},
            "tools": [{"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}],
            "messages": [
                {"role": "user", "content": "add 1"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "2"},
                    {"type": "text", "text": "thanks"}]},
            ]
        }))
        .unwrap();
        let m = &v.request.messages;
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[2]["reasoning_content"], "hmm");
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], "{\"a\":1}");
        assert_eq!(m[3]["role"], "tool");
        assert_eq!(m[3]["name"], "add");
        assert_eq!(m[4], json!({"role": "user", "content": "thanks"}));
        assert!(v.request.thinking);
        assert_eq!(v.request.tool_choice, ToolChoice::Auto);
    }

    #[test]
    fn problems_use_anthropic_names() {
        let e = validate(
            json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "a", "input_schema": {"type": "array"}}]}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].input_schema.type"));
        let e = validate(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = validate(
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}]}),
        )
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].tool_use_id")
        );
    }
}
