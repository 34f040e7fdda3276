//! `POST /v1/chat/completions`: non-streaming responses and SSE chunks.
//!
//! Streaming shape (per choice): a role chunk (`{"role":"assistant","content":""}`), then deltas
//! of `content`, of `reasoning_content` + `reasoning` (both names carry the same text), and of
//! `tool_calls` (the first delta of a call carries `index`, `id`, `type` and `name` with empty
//! arguments; later deltas carry only `index` and argument text), then a chunk with an empty
//! delta and `finish_reason`. With `stream_options.include_usage` a last chunk with no choices
//! carries `usage`. The stream ends with `data: [DONE]`.

use std::time::Instant;

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Map, Value, json};

use crate::backend::{FinishInfo, GenEvent, TokenLogprob};
use crate::body::{parse_json, read_body};
use crate::error::{ApiError, ErrorStyle};
use crate::generation::{self, ChoiceResult, StreamFormat};
use crate::openai::chat_request::ChatCompletionRequest;
use crate::openai::{chat_logprobs, finish_reason, usage};
use crate::{AppState, random_id, sse, unix_now};

pub async fn chat_completions(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match handle(state, body).await {
        Ok(resp) => resp,
        Err(err) => err.into_response(),
    }
}

async fn handle(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let start = Instant::now();
    let style = ErrorStyle::OpenAi;
    let body = read_body(body, style)?;
    let mut unknown = state.unknown_fields();
    let request: ChatCompletionRequest = parse_json(&body, style, &mut unknown)?;
    state.check_model(&request.model, style)?;
    let id = random_id("chatcmpl-");
    let valid = request.validate(id.clone(), &mut unknown)?;
    let permit = state.admit(style, valid.n)?;
    let gens = generation::start_chat(&state, valid.request, valid.n, style).await?;
    let model = state.model_name();
    let created = unix_now();
    if valid.stream {
        let format = ChatStream {
            id,
            created,
            model,
            include_usage: valid.include_usage,
            logprobs: valid.logprobs,
            choices: vec![ChoiceStreamState::default(); valid.n],
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
    Ok(axum::Json(response_body(
        &id,
        created,
        &model,
        &results,
        valid.logprobs,
    ))
    .into_response())
}

/// The non-streaming `chat.completion` object.
pub fn response_body(
    id: &str,
    created: u64,
    model: &str,
    results: &[ChoiceResult],
    logprobs: bool,
) -> Value {
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut message = Map::new();
            message.insert("role".into(), json!("assistant"));
            let has_calls = !r.tool_calls.is_empty();
            let content = if r.content.is_empty() && has_calls {
                Value::Null
            } else {
                Value::String(r.content.clone())
            };
            message.insert("content".into(), content);
            if !r.reasoning.is_empty() {
                message.insert("reasoning_content".into(), json!(r.reasoning));
                message.insert("reasoning".into(), json!(r.reasoning));
            }
            if has_calls {
                let calls: Vec<Value> = r
                    .tool_calls
                    .iter()
                    .map(|c| {
                        json!({
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        })
                    })
                    .collect();
                message.insert("tool_calls".into(), Value::Array(calls));
            }
            let finish = r.finish.as_ref().expect("collect() checks every choice finished");
            json!({
                "index": i,
                "message": Value::Object(message),
                "logprobs": if logprobs { json!({"content": chat_logprobs(&r.logprobs)}) } else { Value::Null },
                "finish_reason": finish_reason(finish, r.ends_in_tool_calls()),
            })
        })
        .collect();
    let finishes: Vec<&FinishInfo> = results.iter().filter_map(|r| r.finish.as_ref()).collect();
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(&finishes),
    })
}

#[derive(Debug, Default, Clone)]
struct ChoiceStreamState {
    started_calls: u32,
    incomplete_calls: u32,
    pending_logprobs: Vec<TokenLogprob>,
    finish: Option<FinishInfo>,
}

/// SSE chunk writer for chat completions.
struct ChatStream {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    choices: Vec<ChoiceStreamState>,
}

impl ChatStream {
    fn chunk(&mut self, choice: usize, delta: Value, finish: Option<&str>) -> Bytes {
        let state = &mut self.choices[choice];
        let logprobs = if self.logprobs && !state.pending_logprobs.is_empty() {
            let lp = json!({"content": chat_logprobs(&state.pending_logprobs)});
            state.pending_logprobs.clear();
            lp
        } else {
            Value::Null
        };
        let mut obj = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": choice,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
            }],
        });
        if self.include_usage {
            obj["usage"] = Value::Null;
        }
        sse::data(&obj)
    }
}

impl StreamFormat for ChatStream {
    fn start(&mut self) -> Vec<Bytes> {
        (0..self.choices.len())
            .map(|i| self.chunk(i, json!({"role": "assistant", "content": ""}), None))
            .collect()
    }

    fn event(&mut self, choice: usize, event: GenEvent) -> Vec<Bytes> {
        let delta = match event {
            GenEvent::Content(t) => json!({"content": t}),
            GenEvent::Reasoning(t) => json!({"reasoning_content": t, "reasoning": t}),
            GenEvent::ToolCallStart { index, id, name } => {
                let state = &mut self.choices[choice];
                state.started_calls += 1;
                json!({"tool_calls": [{
                    "index": index, "id": id, "type": "function",
                    "function": {"name": name, "arguments": ""},
                }]})
            }
            GenEvent::ToolCallArguments { index, delta } => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]})
            }
            GenEvent::ToolCallEnd { complete, .. } => {
                let state = &mut self.choices[choice];
                // A call cut short was already streamed and cannot be taken back (non-streaming
                // responses return it too); the finish reason then says the output was cut.
                state.incomplete_calls += u32::from(!complete);
                return Vec::new();
            }
            GenEvent::Error(_) => return Vec::new(),
            GenEvent::Logprobs(lp) => {
                self.choices[choice].pending_logprobs.extend(lp);
                return Vec::new();
            }
            GenEvent::Finished(info) => {
                let state = &self.choices[choice];
                let ends_in_calls = state.started_calls > 0 && state.incomplete_calls == 0;
                let reason = finish_reason(&info, ends_in_calls);
                self.choices[choice].finish = Some(info);
                return vec![self.chunk(choice, json!({}), Some(reason))];
            }
        };
        vec![self.chunk(choice, delta, None)]
    }

    fn end(&mut self) -> Vec<Bytes> {
        let mut out = Vec::new();
        if self.include_usage {
            let finishes: Vec<&FinishInfo> = self
                .choices
                .iter()
                .filter_map(|c| c.finish.as_ref())
                .collect();
            out.push(sse::data(&json!({
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(&finishes),
            })));
        }
        out.push(sse::done());
        out
    }

    fn error(&mut self, error: ApiError) -> Vec<Bytes> {
        vec![sse::data(&error.body()), sse::done()]
    }
}
