//! `POST /v1/messages` (Anthropic Messages API): responses and streaming events.
//!
//! Streaming: `message_start`, then per content block `content_block_start` / `_delta`
//! (`thinking_delta`, `text_delta`, `input_json_delta`) / `content_block_stop`, then
//! `message_delta` (stop_reason, usage) and `message_stop`. Errors mid-stream are an `error` event.

use std::time::Instant;

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};

use crate::backend::{FinishInfo, FinishReason, GenEvent};
use crate::body::{parse_json, read_body};
use crate::error::{ApiError, ErrorStyle};
use crate::generation::{self, ChoiceResult, StreamFormat};
use crate::{AppState, random_id, sse};

use super::request::MessagesRequest;

pub async fn messages(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match handle(state, body).await {
        Ok(resp) => resp,
        Err(err) => err.styled(ErrorStyle::Anthropic).into_response(),
    }
}

async fn handle(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let start = Instant::now();
    let style = ErrorStyle::Anthropic;
    let body = read_body(body, style)?;
    let mut unknown = state.unknown_fields();
    let request: MessagesRequest = parse_json(&body, style, &mut unknown)?;
    state.check_model(&request.model, style)?;
    let id = random_id("msg_");
    let valid = request.validate(id.clone(), &mut unknown)?;
    let permit = state.admit(style, 1)?;
    let gens = generation::start_chat(&state, valid.request, 1, style).await?;
    let prompt_tokens = gens[0].prompt_tokens;
    let model = state.model_name();
    if valid.stream {
        let format = MessageStream {
            id,
            model,
            prompt_tokens,
            block: None,
            next_block: 0,
            calls_started: 0,
            calls_incomplete: 0,
        };
        return Ok(generation::stream_response(
            state,
            permit,
            gens,
            start,
            valid.parallel_tool_calls,
            format,
        ));
    }
    let results =
        generation::collect(&state, gens, start, valid.parallel_tool_calls, style).await?;
    drop(permit);
    Ok(axum::Json(response_body(&id, &model, &results[0])).into_response())
}

fn stop_reason(info: &FinishInfo, had_tool_use: bool) -> (&'static str, Value) {
    if had_tool_use {
        return ("tool_use", Value::Null);
    }
    match &info.reason {
        FinishReason::StopSequence(s) => ("stop_sequence", json!(s)),
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::Stop | FinishReason::Abort => ("end_turn", Value::Null),
    }
}

fn usage(info: &FinishInfo) -> Value {
    json!({
        "input_tokens": info.prompt_tokens.saturating_sub(info.cached_tokens),
        "output_tokens": info.completion_tokens,
        "cache_read_input_tokens": info.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// Parse a call's arguments back into an object for `tool_use.input`.
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

pub fn response_body(id: &str, model: &str, r: &ChoiceResult) -> Value {
    let mut content = Vec::new();
    if !r.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": r.reasoning, "signature": ""}));
    }
    if !r.content.is_empty() {
        content.push(json!({"type": "text", "text": r.content}));
    }
    for c in &r.tool_calls {
        content.push(json!({"type": "tool_use", "id": c.id, "name": c.name,
            "input": tool_input(&c.arguments)}));
    }
    let finish = r
        .finish
        .as_ref()
        .expect("collect() checks every choice finished");
    let (reason, sequence) = stop_reason(finish, r.ends_in_tool_calls());
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(finish),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
    ToolUse(u32),
}

struct MessageStream {
    id: String,
    model: String,
    prompt_tokens: u32,
    /// The open content block and its index.
    block: Option<(BlockKind, usize)>,
    next_block: usize,
    calls_started: u32,
    calls_incomplete: u32,
}

impl MessageStream {
    fn close_block(&mut self, out: &mut Vec<Bytes>) {
        if let Some((_, index)) = self.block.take() {
            out.push(sse::event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    /// Make `kind` the open block (opening it with `start` if it is not), returning its index.
    fn ensure_block(&mut self, kind: BlockKind, start: Value, out: &mut Vec<Bytes>) -> usize {
        if let Some((open, index)) = self.block
            && open == kind
        {
            return index;
        }
        self.close_block(out);
        let index = self.next_block;
        self.next_block += 1;
        self.block = Some((kind, index));
        out.push(sse::event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        index
    }

    fn delta(index: usize, delta: Value) -> Bytes {
        sse::event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        )
    }
}

impl StreamFormat for MessageStream {
    fn start(&mut self) -> Vec<Bytes> {
        vec![sse::event(
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
            }}),
        )]
    }

    fn event(&mut self, _choice: usize, event: GenEvent) -> Vec<Bytes> {
        let mut out = Vec::new();
        match event {
            GenEvent::Reasoning(t) => {
                let start = json!({"type": "thinking", "thinking": "", "signature": ""});
                let i = self.ensure_block(BlockKind::Thinking, start, &mut out);
                out.push(Self::delta(
                    i,
                    json!({"type": "thinking_delta", "thinking": t}),
                ));
            }
            GenEvent::Content(t) => {
                let start = json!({"type": "text", "text": ""});
                let i = self.ensure_block(BlockKind::Text, start, &mut out);
                out.push(Self::delta(i, json!({"type": "text_delta", "text": t})));
            }
            GenEvent::ToolCallStart { index, id, name } => {
                self.calls_started += 1;
                let start = json!({"type": "tool_use", "id": id, "name": name, "input": {}});
                self.ensure_block(BlockKind::ToolUse(index), start, &mut out);
            }
            GenEvent::ToolCallArguments { index, delta } => {
                if let Some((BlockKind::ToolUse(open), i)) = self.block
                    && open == index
                {
                    out.push(Self::delta(
                        i,
                        json!({"type": "input_json_delta", "partial_json": delta}),
                    ));
                }
            }
            GenEvent::ToolCallEnd { complete, .. } => {
                // A call cut short was already streamed; it just stops counting as a tool use.
                self.calls_incomplete += u32::from(!complete);
                self.close_block(&mut out)
            }
            GenEvent::Logprobs(_) | GenEvent::Error(_) => {}
            GenEvent::Finished(info) => {
                self.close_block(&mut out);
                let had_tool_use = self.calls_started > 0 && self.calls_incomplete == 0;
                let (reason, sequence) = stop_reason(&info, had_tool_use);
                out.push(sse::event(
                    "message_delta",
                    &json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage(&info)}),
                ));
            }
        }
        out
    }

    fn end(&mut self) -> Vec<Bytes> {
        vec![sse::event("message_stop", &json!({"type": "message_stop"}))]
    }

    fn error(&mut self, error: ApiError) -> Vec<Bytes> {
        vec![sse::event(
            "error",
            &error.styled(ErrorStyle::Anthropic).body(),
        )]
    }
}
