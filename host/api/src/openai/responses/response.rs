//! The `response` object and its output items, shared by the non-streaming answer and the
//! streamed lifecycle events (`response.created`, `response.completed`, ...).

use serde_json::{Map, Value, json};

use crate::backend::{FinishInfo, FinishReason, TokenLogprob};
use crate::generation::ChoiceResult;
use crate::openai::chat_logprobs;
use crate::random_id;

/// One output item as it was produced.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputItem {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// An item's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemStatus {
    InProgress,
    Completed,
    /// Cut short (`max_output_tokens`).
    Incomplete,
}

impl ItemStatus {
    fn as_str(self) -> &'static str {
        match self {
            ItemStatus::InProgress => "in_progress",
            ItemStatus::Completed => "completed",
            ItemStatus::Incomplete => "incomplete",
        }
    }
}

impl OutputItem {
    pub fn id(&self) -> &str {
        match self {
            OutputItem::Reasoning { id, .. }
            | OutputItem::Message { id, .. }
            | OutputItem::FunctionCall { id, .. } => id,
        }
    }

    /// The item's content part (reasoning text or output text); `None` for a call.
    pub fn content_part(&self, with_logprobs: bool) -> Option<Value> {
        match self {
            OutputItem::Reasoning { text, .. } => {
                Some(json!({"type": "reasoning_text", "text": text}))
            }
            OutputItem::Message { text, logprobs, .. } => {
                let mut part = json!({"type": "output_text", "text": text, "annotations": []});
                if with_logprobs {
                    part["logprobs"] = chat_logprobs(logprobs);
                }
                Some(part)
            }
            OutputItem::FunctionCall { .. } => None,
        }
    }

    /// The item as JSON. An item still in progress has no content parts yet (they are announced
    /// by their own events).
    pub fn to_json(&self, status: ItemStatus, with_logprobs: bool) -> Value {
        let parts: Vec<Value> = if status == ItemStatus::InProgress {
            Vec::new()
        } else {
            self.content_part(with_logprobs).into_iter().collect()
        };
        match self {
            // The raw reasoning goes in `content`; no summary is generated.
            OutputItem::Reasoning { id, .. } => json!({
                "type": "reasoning", "id": id, "summary": [], "content": parts,
                "status": status.as_str(),
            }),
            OutputItem::Message { id, .. } => json!({
                "type": "message", "id": id, "role": "assistant", "content": parts,
                "status": status.as_str(),
            }),
            OutputItem::FunctionCall {
                id,
                call_id,
                name,
                arguments,
            } => json!({
                "type": "function_call", "id": id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": status.as_str(),
            }),
        }
    }
}

/// The output items of a finished generation, in order: reasoning, the message, the calls.
/// The message is present when there is text, or when nothing else was produced.
pub fn output_items(result: &ChoiceResult) -> Vec<OutputItem> {
    let mut items = Vec::new();
    if !result.reasoning.is_empty() {
        items.push(OutputItem::Reasoning {
            id: random_id("rs_"),
            text: result.reasoning.clone(),
        });
    }
    if !result.content.is_empty() || result.tool_calls.is_empty() {
        items.push(OutputItem::Message {
            id: random_id("msg_"),
            text: result.content.clone(),
            logprobs: result.logprobs.clone(),
        });
    }
    for call in &result.tool_calls {
        items.push(OutputItem::FunctionCall {
            id: random_id("fc_"),
            call_id: call.id.clone(),
            name: call.name.clone(),
            arguments: call.arguments.clone(),
        });
    }
    items
}

/// Whether a finish means the output was cut by `max_output_tokens`.
pub fn cut_short(finish: &FinishInfo) -> bool {
    finish.reason == FinishReason::Length
}

/// The `usage` object.
pub fn usage(finish: &FinishInfo) -> Value {
    json!({
        "input_tokens": finish.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finish.cached_tokens},
        "output_tokens": finish.completion_tokens,
        // Not counted separately yet: the generated tokens are not attributed to reasoning.
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": finish.prompt_tokens as u64 + finish.completion_tokens as u64,
    })
}

/// What every response object of one request shares.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    /// The request settings the object repeats.
    pub echo: Map<String, Value>,
    pub logprobs: bool,
}

impl ResponseMeta {
    /// The response object: `in_progress` without a finish; else `completed`, or `incomplete`
    /// (`incomplete_details.reason: max_output_tokens`) when the output was cut short. The last
    /// item of a cut-short response is `incomplete`.
    pub fn object(&self, items: &[(OutputItem, ItemStatus)], finish: Option<&FinishInfo>) -> Value {
        let (status, incomplete_details, usage) = match finish {
            None => ("in_progress", Value::Null, Value::Null),
            Some(f) if cut_short(f) => (
                "incomplete",
                json!({"reason": "max_output_tokens"}),
                usage(f),
            ),
            Some(f) => ("completed", Value::Null, usage(f)),
        };
        let output: Vec<Value> = items
            .iter()
            .map(|(item, status)| item.to_json(*status, self.logprobs))
            .collect();
        let mut object = Map::new();
        object.insert("id".into(), json!(self.id));
        object.insert("object".into(), json!("response"));
        object.insert("created_at".into(), json!(self.created_at));
        object.insert("status".into(), json!(status));
        object.insert("error".into(), Value::Null);
        object.insert("incomplete_details".into(), incomplete_details);
        object.insert("model".into(), json!(self.model));
        object.insert("output".into(), Value::Array(output));
        object.insert("usage".into(), usage);
        for (key, value) in &self.echo {
            object.insert(key.clone(), value.clone());
        }
        Value::Object(object)
    }

    /// The finished response object for a non-streaming request.
    pub fn finished(&self, result: &ChoiceResult) -> Value {
        let finish = result.finish.as_ref();
        let cut = finish.is_some_and(cut_short);
        let items = output_items(result);
        let last = items.len().saturating_sub(1);
        let items: Vec<(OutputItem, ItemStatus)> = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                let status = if cut && i == last {
                    ItemStatus::Incomplete
                } else {
                    ItemStatus::Completed
                };
                (item, status)
            })
            .collect();
        self.object(&items, finish)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::ToolCallResult;

    fn meta() -> ResponseMeta {
        let mut echo = Map::new();
        echo.insert("tool_choice".into(), json!("auto"));
        ResponseMeta {
            id: "resp_1".into(),
            created_at: 7,
            model: "k3-mini".into(),
            echo,
            logprobs: false,
        }
    }

    fn finish(reason: FinishReason) -> FinishInfo {
        FinishInfo {
            reason,
            prompt_tokens: 10,
            completion_tokens: 5,
            cached_tokens: 4,
            timing: None,
        }
    }

    #[test]
    fn reasoning_text_and_calls_become_items_in_order() {
        let result = ChoiceResult {
            content: "Let me check.".into(),
            reasoning: "Need weather.".into(),
            tool_calls: vec![ToolCallResult {
                index: 0,
                id: "call_0".into(),
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into(),
                complete: true,
            }],
            logprobs: Vec::new(),
            finish: Some(finish(FinishReason::Stop)),
        };
        let r = meta().finished(&result);
        assert_eq!(r["object"], "response");
        assert_eq!(r["status"], "completed");
        assert_eq!(r["created_at"], 7);
        assert_eq!(r["tool_choice"], "auto");
        let out = r["output"].as_array().unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(out[0]["type"], "reasoning");
        assert_eq!(out[0]["summary"], json!([]));
        assert_eq!(
            out[0]["content"],
            json!([{"type": "reasoning_text", "text": "Need weather."}])
        );
        assert!(out[0]["id"].as_str().unwrap().starts_with("rs_"));
        assert_eq!(out[1]["type"], "message");
        assert_eq!(out[1]["role"], "assistant");
        assert_eq!(
            out[1]["content"],
            json!([{"type": "output_text", "text": "Let me check.", "annotations": []}])
        );
        assert_eq!(out[2]["type"], "function_call");
        assert_eq!(out[2]["call_id"], "call_0");
        assert_eq!(out[2]["name"], "get_weather");
        assert_eq!(out[2]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(out[2]["status"], "completed");
        assert_eq!(
            r["usage"],
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                   "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": 15})
        );
    }

    #[test]
    fn a_cut_short_answer_is_incomplete() {
        let result = ChoiceResult {
            content: "The ans".into(),
            finish: Some(finish(FinishReason::Length)),
            ..Default::default()
        };
        let r = meta().finished(&result);
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert_eq!(r["output"][0]["content"][0]["text"], "The ans");
    }

    #[test]
    fn an_empty_answer_is_still_a_message() {
        let result = ChoiceResult {
            finish: Some(finish(FinishReason::Stop)),
            ..Default::default()
        };
        let out = &meta().finished(&result)["output"];
        assert_eq!(out.as_array().unwrap().len(), 1);
        assert_eq!(out[0]["content"][0]["text"], "");
    }
}
