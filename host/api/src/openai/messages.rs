//! OpenAI chat messages: validation and normalisation into the one shape the template sees
//! (documented on [`crate::backend::ChatGenRequest`]).

use std::collections::HashMap;

use serde_json::{Map, Value};

use crate::content::{Part, content_value, openai_image};
use crate::error::ApiError;
use crate::unknown_fields::UnknownFields;

const MESSAGE_FIELDS: [&str; 11] = [
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
    "reasoning",
    // Fields the official clients echo back when a previous response message is reused.
    "refusal",
    "annotations",
    "audio",
    "function_call",
];

/// Validate and normalise OpenAI chat messages; keys a message does not have go to `unknown`.
pub fn normalize_messages(
    messages: &[Value],
    unknown: &mut UnknownFields,
) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must contain at least one message",
        ));
    }
    // tool_call_id -> function name, from every assistant message seen so far.
    let mut call_names: HashMap<String, String> = HashMap::new();
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(obj) = message else {
            return Err(ApiError::invalid(&p, format!("'{p}' must be an object")));
        };
        for key in obj.keys() {
            if !MESSAGE_FIELDS.contains(&key.as_str()) {
                unknown.found(format!("{p}.{key}"))?;
            }
        }
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!("'{p}.role' must be a string"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!("'{p}.role' is required"),
                ));
            }
        };
        let mut norm = Map::new();
        let role = match role {
            "developer" => "system",
            "system" | "user" | "assistant" | "tool" => role,
            other => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!(
                        "'{p}.role' must be one of system, developer, user, assistant, tool (got \"{other}\")"
                    ),
                ));
            }
        };
        norm.insert("role".into(), Value::String(role.into()));
        let content = message_content(obj.get("content"), &format!("{p}.content"), role)?;
        // Only a user message may hold parts (images); every other role's content is text.
        let text = |c: Option<Value>| match c {
            Some(Value::String(s)) => Some(s),
            _ => None,
        };
        if let Some(name) = obj.get("name") {
            match name {
                Value::String(n) => {
                    norm.insert("name".into(), Value::String(n.clone()));
                }
                Value::Null => {}
                _ => {
                    return Err(ApiError::invalid(
                        format!("{p}.name"),
                        format!("'{p}.name' must be a string"),
                    ));
                }
            }
        }
        match role {
            "assistant" => {
                let calls = assistant_tool_calls(obj.get("tool_calls"), &p, &mut call_names)?;
                let reasoning = ["reasoning_content", "reasoning"]
                    .iter()
                    .find_map(|k| match obj.get(*k) {
                        Some(Value::String(s)) => Some(Ok(s.clone())),
                        Some(Value::Null) | None => None,
                        Some(_) => Some(Err(ApiError::invalid(
                            format!("{p}.{k}"),
                            format!("'{p}.{k}' must be a string"),
                        ))),
                    })
                    .transpose()?;
                if content.is_none() && calls.is_empty() && reasoning.is_none() {
                    return Err(ApiError::invalid(
                        format!("{p}.content"),
                        format!("'{p}' needs 'content' or 'tool_calls'"),
                    ));
                }
                norm.insert(
                    "content".into(),
                    Value::String(text(content).unwrap_or_default()),
                );
                if !calls.is_empty() {
                    norm.insert("tool_calls".into(), Value::Array(calls));
                }
                if let Some(r) = reasoning {
                    norm.insert("reasoning_content".into(), Value::String(r));
                }
            }
            "tool" => {
                let content = text(content).ok_or_else(|| {
                    ApiError::invalid(
                        format!("{p}.content"),
                        format!("'{p}.content' is required for a tool message"),
                    )
                })?;
                let id = match obj.get("tool_call_id") {
                    Some(Value::String(id)) => Some(id.clone()),
                    None | Some(Value::Null) => None,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            format!("{p}.tool_call_id"),
                            format!("'{p}.tool_call_id' must be a string"),
                        ));
                    }
                };
                let resolved = id.as_ref().and_then(|id| call_names.get(id)).cloned();
                let name = match (norm.get("name").and_then(Value::as_str), resolved) {
                    (Some(n), _) => n.to_string(),
                    (None, Some(n)) => n,
                    (None, None) => {
                        let why = match &id {
                            Some(id) => format!(
                                "'{p}.tool_call_id' (\"{id}\") matches no tool call of an earlier assistant message"
                            ),
                            None => format!("'{p}.tool_call_id' is missing"),
                        };
                        return Err(ApiError::invalid(
                            format!("{p}.tool_call_id"),
                            format!(
                                "cannot resolve which tool this tool message answers: {why}, and the message has no 'name'"
                            ),
                        ));
                    }
                };
                norm.insert("name".into(), Value::String(name));
                norm.insert("content".into(), Value::String(content));
                if let Some(id) = id {
                    norm.insert("tool_call_id".into(), Value::String(id));
                }
            }
            _ => {
                let content = content.ok_or_else(|| {
                    ApiError::invalid(
                        format!("{p}.content"),
                        format!("'{p}.content' is required for a {role} message"),
                    )
                })?;
                norm.insert("content".into(), content);
            }
        }
        for key in ["tool_calls", "tool_call_id"] {
            let misplaced = match key {
                "tool_calls" => role != "assistant",
                _ => role != "tool",
            };
            if misplaced && obj.get(key).is_some_and(|v| !v.is_null()) {
                return Err(ApiError::invalid(
                    format!("{p}.{key}"),
                    format!("'{key}' is not allowed on a {role} message"),
                ));
            }
        }
        out.push(Value::Object(norm));
    }
    Ok(out)
}

/// Content: a string, or parts — text joined by newlines, and in a user message images (see
/// `crate::content`). `None` for null/absent. Without images the value is a string.
fn message_content(
    content: Option<&Value>,
    p: &str,
    role: &str,
) -> Result<Option<Value>, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(Value::String(s.clone()))),
        Some(Value::Array(items)) => {
            let mut parts = Vec::with_capacity(items.len());
            for (j, part) in items.iter().enumerate() {
                let pp = format!("{p}[{j}]");
                let Value::Object(part) = part else {
                    return Err(ApiError::invalid(
                        &pp,
                        format!("'{pp}' must be a content part object"),
                    ));
                };
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => match part.get("text") {
                        Some(Value::String(t)) => parts.push(Part::Text(t.clone())),
                        _ => {
                            return Err(ApiError::invalid(
                                format!("{pp}.text"),
                                format!("'{pp}.text' must be a string"),
                            ));
                        }
                    },
                    Some("image_url") if role == "user" => parts.push(openai_image(part, &pp)?),
                    Some("image_url") => {
                        return Err(ApiError::not_supported(
                            format!("{pp}.type"),
                            format!(
                                "images are read in user messages only, not in a {role} message"
                            ),
                        ));
                    }
                    Some(kind @ ("input_audio" | "file" | "image")) => {
                        return Err(ApiError::not_supported(
                            format!("{pp}.type"),
                            format!(
                                "content parts of type \"{kind}\" are not supported by this model"
                            ),
                        ));
                    }
                    Some(other) => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!("unknown content part type \"{other}\" in '{pp}'"),
                        ));
                    }
                    None => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!("'{pp}.type' is required"),
                        ));
                    }
                }
            }
            Ok(Some(content_value(parts)))
        }
        Some(_) => Err(ApiError::invalid(
            p,
            format!("'{p}' must be a string or an array of content parts"),
        )),
    }
}

fn assistant_tool_calls(
    calls: Option<&Value>,
    p: &str,
    call_names: &mut HashMap<String, String>,
) -> Result<Vec<Value>, ApiError> {
    let calls = match calls {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(c)) => c,
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{p}.tool_calls"),
                format!("'{p}.tool_calls' must be an array"),
            ));
        }
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let cp = format!("{p}.tool_calls[{j}]");
        let Value::Object(call) = call else {
            return Err(ApiError::invalid(&cp, format!("'{cp}' must be an object")));
        };
        if let Some(t) = call.get("type")
            && t.as_str() != Some("function")
        {
            return Err(ApiError::invalid(
                format!("{cp}.type"),
                format!("'{cp}.type' must be \"function\""),
            ));
        }
        let Some(Value::Object(func)) = call.get("function") else {
            return Err(ApiError::invalid(
                format!("{cp}.function"),
                format!("'{cp}.function' is required and must be an object"),
            ));
        };
        let name = match func.get("name") {
            Some(Value::String(n)) if !n.is_empty() => n.clone(),
            _ => {
                return Err(ApiError::invalid(
                    format!("{cp}.function.name"),
                    format!("'{cp}.function.name' is required and must be a non-empty string"),
                ));
            }
        };
        let arguments = match func.get("arguments") {
            None | Some(Value::Null) => "{}".to_string(),
            Some(Value::String(s)) => {
                let parsed: Result<Value, _> = serde_json::from_str(s);
                if !matches!(parsed, Ok(Value::Object(_))) {
                    return Err(ApiError::invalid(
                        format!("{cp}.function.arguments"),
                        format!(
                            "'{cp}.function.arguments' must be a JSON object encoded as a string"
                        ),
                    ));
                }
                s.clone()
            }
            Some(Value::Object(o)) => Value::Object(o.clone()).to_string(),
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{cp}.function.arguments"),
                    format!("'{cp}.function.arguments' must be a JSON object encoded as a string"),
                ));
            }
        };
        let id = match call.get("id") {
            Some(Value::String(id)) => Some(id.clone()),
            None | Some(Value::Null) => None,
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{cp}.id"),
                    format!("'{cp}.id' must be a string"),
                ));
            }
        };
        let mut norm = Map::new();
        if let Some(id) = &id {
            call_names.insert(id.clone(), name.clone());
            norm.insert("id".into(), Value::String(id.clone()));
        }
        norm.insert("type".into(), Value::String("function".into()));
        norm.insert(
            "function".into(),
            serde_json::json!({"name": name, "arguments": arguments}),
        );
        out.push(Value::Object(norm));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(messages: Value) -> ApiError {
        normalize_messages(messages.as_array().unwrap(), &mut UnknownFields::strict()).unwrap_err()
    }

    #[test]
    fn normalises_parts_roles_and_tool_names() {
        let msgs = json!([
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "refusal": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\":1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ]);
        let mut unknown = UnknownFields::lenient();
        let out = normalize_messages(msgs.as_array().unwrap(), &mut unknown).unwrap();
        assert!(unknown.paths().is_empty());
        assert_eq!(out[0], json!({"role": "system", "content": "a\nb"}));
        assert_eq!(out[2]["content"], json!(""));
        assert_eq!(out[2]["tool_calls"][0]["function"]["name"], json!("add"));
        assert_eq!(
            out[3],
            json!({"role": "tool", "name": "add", "content": "2", "tool_call_id": "c1"})
        );
    }

    #[test]
    fn user_images_keep_their_place_among_text() {
        let m = normalize_messages(
            &[json!({"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
                {"type": "text", "text": "b"}]})],
            &mut UnknownFields::strict(),
        )
        .unwrap();
        assert_eq!(
            m[0]["content"],
            json!([{"type": "text", "text": "a"},
                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}},
                   {"type": "text", "text": "b"}])
        );
    }

    #[test]
    fn unknown_message_fields_are_ignored_unless_strict() {
        // What litellm sends back with a tool round trip.
        let msgs = json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "provider_specific_fields": {"x": 1},
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ]);
        let mut unknown = UnknownFields::lenient();
        let out = normalize_messages(msgs.as_array().unwrap(), &mut unknown).unwrap();
        assert_eq!(unknown.paths(), ["messages[1].provider_specific_fields"]);
        assert!(out[1].get("provider_specific_fields").is_none());
        assert_eq!(
            err(msgs).param.as_deref(),
            Some("messages[1].provider_specific_fields")
        );
    }

    #[test]
    fn each_problem_names_its_field() {
        assert_eq!(err(json!([])).param.as_deref(), Some("messages"));
        assert_eq!(
            err(json!([{"content": "x"}])).param.as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            err(json!([{"role": "wizard", "content": "x"}]))
                .param
                .as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            err(json!([{"role": "user", "content": 5}]))
                .param
                .as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(
            err(json!([{"role": "user", "content": "x", "colour": 1}]))
                .param
                .as_deref(),
            Some("messages[0].colour")
        );
        let e = err(
            json!([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "zz", "content": "1"}]),
        );
        assert_eq!(e.param.as_deref(), Some("messages[1].tool_call_id"));
        assert!(e.message.contains("zz"), "{}", e.message);
        let e = err(json!([{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]));
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].tool_calls[0].function.arguments")
        );
        let e = err(json!([{"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]));
        assert_eq!(e.code, Some("not_supported"));
        let e = err(json!([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x", "detail": "huge"}}]}]));
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].image_url.detail")
        );
        let e = err(json!([{"role": "user", "content": [{"type": "input_audio"}]}]));
        assert_eq!(e.code, Some("not_supported"));
    }
}
