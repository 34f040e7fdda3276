//! Responses `input` items → OpenAI chat messages (the shape [`crate::openai::chat_request`]
//! validates). Consecutive `reasoning`, assistant `message` and `function_call` items form one
//! assistant turn; a `function_call_output` becomes a tool message.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use crate::content::{Part, content_value, openai_image};
use crate::error::ApiError;
use crate::unknown_fields::UnknownFields;

/// Chat messages with, for each, the request field it came from (`instructions`, `input[3]`),
/// so errors found later on the chat form can name the Responses field.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ChatMessages {
    pub messages: Vec<Value>,
    pub origins: Vec<String>,
}

impl ChatMessages {
    fn push(&mut self, message: Value, origin: String) {
        self.messages.push(message);
        self.origins.push(origin);
    }
}

/// The assistant turn being gathered from consecutive items.
#[derive(Debug, Default)]
struct AssistantTurn {
    origin: Option<String>,
    reasoning: Option<String>,
    content: Option<String>,
    tool_calls: Vec<Value>,
}

impl AssistantTurn {
    fn is_empty(&self) -> bool {
        self.reasoning.is_none() && self.content.is_none() && self.tool_calls.is_empty()
    }

    fn begin(&mut self, origin: &str) {
        if self.origin.is_none() {
            self.origin = Some(origin.to_string());
        }
    }

    fn flush(&mut self, out: &mut ChatMessages) {
        let turn = std::mem::take(self);
        if turn.is_empty() {
            return;
        }
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        message.insert("content".into(), json!(turn.content.unwrap_or_default()));
        if !turn.tool_calls.is_empty() {
            message.insert("tool_calls".into(), Value::Array(turn.tool_calls));
        }
        if let Some(reasoning) = turn.reasoning {
            message.insert("reasoning_content".into(), json!(reasoning));
        }
        out.push(Value::Object(message), turn.origin.unwrap_or_default());
    }
}

/// Fields each item type may carry: what the official clients send, including what they echo
/// back when a response's `output` is reused as input. Anything else is a 400 naming it.
fn known_fields(kind: &str) -> &'static [&'static str] {
    match kind {
        "message" => &["type", "role", "content", "id", "status", "phase"],
        "reasoning" => &[
            "type",
            "id",
            "summary",
            "content",
            "encrypted_content",
            "status",
        ],
        "function_call" => &[
            "type",
            "id",
            "call_id",
            "name",
            "arguments",
            "status",
            "namespace",
            "caller",
            "async",
        ],
        "function_call_output" => &[
            "type",
            "id",
            "call_id",
            "output",
            "status",
            "name",
            "namespace",
            "caller",
        ],
        _ => &[],
    }
}

fn check_fields(
    item: &Map<String, Value>,
    kind: &str,
    p: &str,
    unknown: &mut UnknownFields,
) -> Result<(), ApiError> {
    let known = known_fields(kind);
    for key in item.keys() {
        if !known.contains(&key.as_str()) {
            unknown.found(format!("{p}.{key}"))?;
        }
    }
    Ok(())
}

fn required_string<'a>(
    item: &'a Map<String, Value>,
    key: &str,
    p: &str,
) -> Result<&'a str, ApiError> {
    match item.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.as_str()),
        _ => Err(ApiError::invalid(
            format!("{p}.{key}"),
            format!("'{p}.{key}' is required and must be a non-empty string"),
        )),
    }
}

/// The text of a message's `content` (a string, or parts of the types `allowed`) joined by
/// newlines. Files, audio and (outside `user_content`) images are a 400 `not_supported`.
fn content_text(content: Option<&Value>, allowed: &[&str], p: &str) -> Result<String, ApiError> {
    let parts = match content {
        Some(Value::String(s)) => return Ok(s.clone()),
        Some(Value::Array(parts)) => parts,
        _ => {
            return Err(ApiError::invalid(
                p,
                format!("'{p}' is required and must be a string or an array of content parts"),
            ));
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (k, part) in parts.iter().enumerate() {
        let pp = format!("{p}[{k}]");
        let kind = part.get("type").and_then(Value::as_str);
        match kind {
            Some(kind) if allowed.contains(&kind) => {
                // A refusal part carries its text under `refusal`.
                let key = if kind == "refusal" { "refusal" } else { "text" };
                match part.get(key) {
                    Some(Value::String(t)) => texts.push(t.clone()),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{pp}.{key}"),
                            format!("'{pp}.{key}' must be a string"),
                        ));
                    }
                }
            }
            Some(kind @ ("input_image" | "input_file" | "input_audio")) => {
                // (Images are read in user messages only: `user_content`.)
                return Err(ApiError::not_supported(
                    format!("{pp}.type"),
                    format!("content parts of type \"{kind}\" are not supported by this model"),
                ));
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{pp}.type"),
                    format!(
                        "'{pp}.type' must be one of {} here (got \"{other}\")",
                        allowed.join(", ")
                    ),
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
    Ok(texts.join("\n"))
}

/// A user message's content: text, or `input_text` and `input_image` parts (an image by
/// `image_url`, a data: or http(s) URL; `file_id` images are not supported) in the chat shape
/// (`crate::content`).
fn user_content(content: Option<&Value>, p: &str) -> Result<Value, ApiError> {
    let Some(Value::Array(parts)) = content else {
        return content_text(content, &["input_text"], p).map(Value::String);
    };
    if !parts
        .iter()
        .any(|x| x.get("type").and_then(Value::as_str) == Some("input_image"))
    {
        return content_text(content, &["input_text"], p).map(Value::String);
    }
    let mut out = Vec::with_capacity(parts.len());
    for (k, part) in parts.iter().enumerate() {
        let pp = format!("{p}[{k}]");
        match part.get("type").and_then(Value::as_str) {
            Some("input_image") => {
                let Some(Value::String(url)) = part.get("image_url") else {
                    return Err(ApiError::not_supported(
                        format!("{pp}.image_url"),
                        format!(
                            "'{pp}' needs an 'image_url' (images by 'file_id' are not supported)"
                        ),
                    ));
                };
                let mut image = Map::new();
                image.insert("url".into(), Value::String(url.clone()));
                if let Some(d) = part.get("detail").filter(|d| !d.is_null()) {
                    image.insert("detail".into(), d.clone());
                }
                let Value::Object(chat_part) = json!({"type": "image_url", "image_url": image})
                else {
                    unreachable!("a JSON object literal");
                };
                out.push(openai_image(&chat_part, &pp)?);
            }
            Some("input_text") => match part.get("text") {
                Some(Value::String(t)) => out.push(Part::Text(t.clone())),
                _ => {
                    return Err(ApiError::invalid(
                        format!("{pp}.text"),
                        format!("'{pp}.text' must be a string"),
                    ));
                }
            },
            Some(kind @ ("input_file" | "input_audio")) => {
                return Err(ApiError::not_supported(
                    format!("{pp}.type"),
                    format!("content parts of type \"{kind}\" are not supported by this model"),
                ));
            }
            _ => {
                return Err(ApiError::invalid(
                    format!("{pp}.type"),
                    format!("'{pp}.type' must be input_text or input_image here"),
                ));
            }
        }
    }
    Ok(content_value(out))
}

/// A reasoning item's text: its `content` (`reasoning_text` parts), else its `summary`.
fn reasoning_text(item: &Map<String, Value>, p: &str) -> Result<String, ApiError> {
    let mut texts = Vec::new();
    for (key, part_type) in [("content", "reasoning_text"), ("summary", "summary_text")] {
        match item.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Array(parts)) => {
                for (k, part) in parts.iter().enumerate() {
                    let pp = format!("{p}.{key}[{k}]");
                    if part.get("type").and_then(Value::as_str) != Some(part_type) {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!("'{pp}.type' must be \"{part_type}\""),
                        ));
                    }
                    match part.get("text") {
                        Some(Value::String(t)) => texts.push(t.clone()),
                        _ => {
                            return Err(ApiError::invalid(
                                format!("{pp}.text"),
                                format!("'{pp}.text' must be a string"),
                            ));
                        }
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.{key}"),
                    format!("'{p}.{key}' must be an array"),
                ));
            }
        }
        if !texts.is_empty() {
            break;
        }
    }
    Ok(texts.join("\n"))
}

/// Convert `instructions` and `input` into chat messages.
pub fn to_chat_messages(
    instructions: Option<&str>,
    input: &Value,
    unknown: &mut UnknownFields,
) -> Result<ChatMessages, ApiError> {
    let mut out = ChatMessages::default();
    if let Some(text) = instructions {
        out.push(
            json!({"role": "system", "content": text}),
            "instructions".into(),
        );
    }
    let items = match input {
        Value::String(text) => {
            out.push(json!({"role": "user", "content": text}), "input".into());
            return Ok(out);
        }
        Value::Array(items) if !items.is_empty() => items,
        Value::Array(_) => {
            return Err(ApiError::invalid(
                "input",
                "'input' must contain at least one item",
            ));
        }
        _ => {
            return Err(ApiError::invalid(
                "input",
                "'input' must be a string or an array of input items",
            ));
        }
    };
    // call_id -> function name, from every function_call item so far.
    let mut call_names: HashMap<String, String> = HashMap::new();
    let mut turn = AssistantTurn::default();
    for (j, item) in items.iter().enumerate() {
        let p = format!("input[{j}]");
        let Value::Object(item) = item else {
            return Err(ApiError::invalid(&p, format!("'{p}' must be an object")));
        };
        // An item without `type` but with a `role` is a message (the "easy" input form).
        let kind = match item.get("type") {
            Some(Value::String(t)) => t.as_str(),
            None if item.contains_key("role") => "message",
            _ => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    format!("'{p}.type' is required and must be a string"),
                ));
            }
        };
        match kind {
            "message" => {
                check_fields(item, kind, &p, unknown)?;
                let role = required_string(item, "role", &p)?;
                match role {
                    "user" => {
                        turn.flush(&mut out);
                        let content = user_content(item.get("content"), &format!("{p}.content"))?;
                        out.push(json!({"role": role, "content": content}), p);
                    }
                    "system" | "developer" => {
                        turn.flush(&mut out);
                        let text = content_text(
                            item.get("content"),
                            &["input_text"],
                            &format!("{p}.content"),
                        )?;
                        out.push(json!({"role": role, "content": text}), p);
                    }
                    "assistant" => {
                        if turn.content.is_some() || !turn.tool_calls.is_empty() {
                            turn.flush(&mut out);
                        }
                        let text = content_text(
                            item.get("content"),
                            &["output_text", "input_text", "refusal"],
                            &format!("{p}.content"),
                        )?;
                        turn.begin(&p);
                        turn.content = Some(text);
                    }
                    other => {
                        return Err(ApiError::invalid(
                            format!("{p}.role"),
                            format!(
                                "'{p}.role' must be one of user, system, developer, assistant (got \"{other}\")"
                            ),
                        ));
                    }
                }
            }
            "reasoning" => {
                check_fields(item, kind, &p, unknown)?;
                let text = reasoning_text(item, &p)?;
                if !turn.is_empty() {
                    turn.flush(&mut out);
                }
                // Only encrypted content (never produced here) leaves nothing to replay.
                if !text.is_empty() {
                    turn.begin(&p);
                    turn.reasoning = Some(text);
                }
            }
            "function_call" => {
                check_fields(item, kind, &p, unknown)?;
                let call_id = required_string(item, "call_id", &p)?;
                let name = required_string(item, "name", &p)?;
                let arguments = match item.get("arguments") {
                    Some(Value::String(s))
                        if matches!(serde_json::from_str(s), Ok(Value::Object(_))) =>
                    {
                        s.clone()
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{p}.arguments"),
                            format!("'{p}.arguments' must be a JSON object encoded as a string"),
                        ));
                    }
                };
                call_names.insert(call_id.to_string(), name.to_string());
                turn.begin(&p);
                turn.tool_calls.push(json!({
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }));
            }
            "function_call_output" => {
                check_fields(item, kind, &p, unknown)?;
                turn.flush(&mut out);
                let call_id = required_string(item, "call_id", &p)?;
                let Some(name) = call_names.get(call_id) else {
                    return Err(ApiError::invalid(
                        format!("{p}.call_id"),
                        format!(
                            "'{p}.call_id' (\"{call_id}\") matches no function_call item earlier in 'input' (this server stores no responses: send the call with its output)"
                        ),
                    ));
                };
                let output =
                    content_text(item.get("output"), &["input_text"], &format!("{p}.output"))?;
                out.push(
                    json!({"role": "tool", "tool_call_id": call_id, "name": name, "content": output}),
                    p,
                );
            }
            "item_reference" => {
                return Err(ApiError::not_supported(
                    format!("{p}.type"),
                    "this server stores no responses, so input items cannot be referenced by id; send the item itself",
                ));
            }
            other => {
                return Err(ApiError::not_supported(
                    format!("{p}.type"),
                    format!(
                        "input items of type \"{other}\" are not supported (supported: message, reasoning, function_call, function_call_output)"
                    ),
                ));
            }
        }
    }
    turn.flush(&mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn convert(input: Value) -> Result<ChatMessages, ApiError> {
        to_chat_messages(None, &input, &mut UnknownFields::strict())
    }

    #[test]
    fn a_string_is_one_user_message_after_the_instructions() {
        let out =
            to_chat_messages(Some("be brief"), &json!("hi"), &mut UnknownFields::strict()).unwrap();
        assert_eq!(
            out.messages,
            vec![
                json!({"role": "system", "content": "be brief"}),
                json!({"role": "user", "content": "hi"}),
            ]
        );
        assert_eq!(out.origins, vec!["instructions", "input"]);
    }

    #[test]
    fn output_items_reused_as_input_form_one_assistant_turn() {
        let out = convert(json!([
            {"role": "developer", "content": "d"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "think"}], "status": "completed"},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "let me look", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
             "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ]))
        .unwrap();
        assert_eq!(
            out.messages,
            vec![
                json!({"role": "developer", "content": "d"}),
                json!({"role": "user", "content": "a\nb"}),
                json!({"role": "assistant", "content": "let me look", "reasoning_content": "think",
                       "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}),
                json!({"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}),
                json!({"role": "assistant", "content": "It is sunny."}),
            ]
        );
        assert_eq!(
            out.origins,
            vec!["input[0]", "input[1]", "input[2]", "input[5]", "input[6]"]
        );
    }

    #[test]
    fn a_summary_stands_in_for_missing_reasoning_content() {
        let out = convert(json!([
            {"role": "user", "content": "q"},
            {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "s"}]},
            {"role": "assistant", "content": "a"},
        ]))
        .unwrap();
        assert_eq!(
            out.messages[1],
            json!({"role": "assistant", "content": "a", "reasoning_content": "s"})
        );
    }

    #[test]
    fn each_problem_names_its_item() {
        let cases = [
            (json!([]), "input", None),
            (json!(5), "input", None),
            (json!([{"content": "x"}]), "input[0].type", None),
            (
                json!([{"role": "user", "content": "x", "colour": 1}]),
                "input[0].colour",
                Some("unknown_field"),
            ),
            (
                json!([{"role": "tool", "content": "x"}]),
                "input[0].role",
                None,
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
                "input[0].content[0].image_url",
                Some("not_supported"),
            ),
            (
                json!([{"role": "system", "content": [{"type": "input_image", "image_url": "x"}]}]),
                "input[0].content[0].type",
                Some("not_supported"),
            ),
            (
                json!([{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]),
                "input[0].content[0].type",
                None,
            ),
            (
                json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]),
                "input[0].arguments",
                None,
            ),
            (
                json!([{"type": "function_call_output", "call_id": "zz", "output": "1"}]),
                "input[0].call_id",
                None,
            ),
            (
                json!([{"type": "item_reference", "id": "msg_1"}]),
                "input[0].type",
                Some("not_supported"),
            ),
            (
                json!([{"type": "web_search_call", "id": "ws"}]),
                "input[0].type",
                Some("not_supported"),
            ),
        ];
        for (input, param, code) in cases {
            let e = convert(input.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{input}: {}", e.message);
            assert_eq!(e.status(), 400);
            if let Some(code) = code {
                assert_eq!(e.code, Some(code), "{input}");
            }
        }
    }
}
