//! `/v1/responses` over HTTP with a scripted backend: the chat request it becomes, the response
//! object, the streamed events, and its errors in OpenAI's shape.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use futures::StreamExt;
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use k3_api::backend::*;
use k3_api::{ApiConfig, AppState, build_router};
use serde_json::{Value, json};
use tower::ServiceExt;

const MAX_MODEL_LEN: u32 = 100;

/// Answers from the last message: a weather question with tools → one call; "FAIL" → an error
/// after some text; else "echo: <text>", one token per character up to `max_tokens`. Thinking
/// adds a reasoning event first.
#[derive(Default)]
struct ScriptedBackend {
    last_chat: Mutex<Option<ChatGenRequest>>,
}

impl ChatBackend for ScriptedBackend {
    fn model(&self) -> ModelInfo {
        ModelInfo {
            id: "k3-mini".into(),
            aliases: Vec::new(),
            max_model_len: MAX_MODEL_LEN,
            created: 1,
        }
    }

    fn chat(&self, request: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move {
            *self.last_chat.lock().unwrap() = Some(request.clone());
            let prompt_tokens = request.messages.len() as u32 * 10;
            if prompt_tokens >= MAX_MODEL_LEN {
                return Err(BackendError::ContextLengthExceeded("too long".into()));
            }
            let last = request.messages.last().unwrap()["content"]
                .as_str()
                .unwrap_or("")
                .to_string();
            let mut events = Vec::new();
            if request.thinking {
                events.push(GenEvent::Reasoning("Let me think.".into()));
            }
            let max = request.sampling.max_tokens.unwrap_or(u32::MAX) as usize;
            let mut reason = FinishReason::Stop;
            let mut used = 1;
            if last.contains("weather") && !request.tools.is_empty() {
                let name = request.tools[0]["function"]["name"].as_str().unwrap();
                events.push(GenEvent::ToolCallStart {
                    index: 0,
                    id: "call_0".into(),
                    name: name.into(),
                });
                for delta in ["{\"city\": ", "\"Paris\"}"] {
                    events.push(GenEvent::ToolCallArguments {
                        index: 0,
                        delta: delta.into(),
                    });
                }
                events.push(GenEvent::ToolCallEnd {
                    index: 0,
                    complete: true,
                });
            } else {
                let text = format!("echo: {last}");
                used = text.chars().count().min(max);
                if used < text.chars().count() {
                    reason = FinishReason::Length;
                }
                events.extend(
                    text.chars()
                        .take(max)
                        .map(|c| GenEvent::Content(c.to_string())),
                );
            }
            if last == "FAIL" {
                events.push(GenEvent::Error(BackendError::Plugin(
                    "the tool parser trapped".into(),
                )));
            } else {
                events.push(GenEvent::Finished(FinishInfo {
                    reason,
                    prompt_tokens,
                    completion_tokens: used as u32,
                    cached_tokens: 0,
                    timing: None,
                }));
            }
            Ok(Generation {
                prompt_tokens,
                prompt_text: None,
                events: futures::stream::iter(events).boxed(),
            })
        })
    }

    fn complete(
        &self,
        _request: CompletionGenRequest,
    ) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async { Err(BackendError::Internal("not scripted".into())) })
    }

    fn metrics(&self) -> BackendMetrics {
        BackendMetrics::default()
    }

    fn list_plugins(&self) -> Vec<PluginStageInfo> {
        Vec::new()
    }

    fn load_plugin(
        &self,
        _stage: String,
        _component: bytes::Bytes,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async { Err(BackendError::Internal("not scripted".into())) })
    }

    fn rollback_plugin(
        &self,
        _stage: String,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async { Err(BackendError::Internal("not scripted".into())) })
    }
}

fn app() -> (Router, Arc<ScriptedBackend>) {
    let backend = Arc::new(ScriptedBackend::default());
    let state = AppState::new(backend.clone(), ApiConfig::default());
    (build_router(state), backend)
}

async fn post(app: &Router, body: Value) -> (StatusCode, String) {
    let req = Request::post("/v1/responses")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// (event name, data) of each SSE frame; checks `type` and the sequence numbers.
fn events(text: &str) -> Vec<(String, Value)> {
    let out: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|frame| {
            let mut lines = frame.lines();
            let name = lines.next().unwrap().strip_prefix("event: ").unwrap();
            let data = lines.next().unwrap().strip_prefix("data: ").unwrap();
            let data: Value = serde_json::from_str(data).unwrap();
            assert_eq!(data["type"], name);
            (name.to_string(), data)
        })
        .collect();
    for (i, (_, data)) in out.iter().enumerate() {
        assert_eq!(data["sequence_number"], i as u64);
    }
    out
}

fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather", "strict": true,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}})
}

#[tokio::test]
async fn text_with_reasoning_and_the_chat_request_it_became() {
    let (app, backend) = app();
    let (status, body) = post(
        &app,
        json!({"model": "k3-mini", "instructions": "Be brief.", "input": "hi",
               "max_output_tokens": 50, "metadata": {"k": "v"}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["model"], "k3-mini");
    assert_eq!(r["metadata"], json!({"k": "v"}));
    assert_eq!(r["output"][0]["type"], "reasoning");
    assert_eq!(r["output"][0]["content"][0]["text"], "Let me think.");
    assert_eq!(r["output"][1]["type"], "message");
    assert_eq!(r["output"][1]["content"][0]["text"], "echo: hi");
    assert_eq!(r["usage"]["input_tokens"], 20);
    assert_eq!(r["usage"]["output_tokens"], 8);
    assert_eq!(r["usage"]["total_tokens"], 28);
    let chat = backend.last_chat.lock().unwrap().clone().unwrap();
    assert_eq!(chat.request_id, r["id"].as_str().unwrap());
    assert_eq!(
        chat.messages,
        vec![
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "hi"}),
        ]
    );
    assert_eq!(chat.sampling.max_tokens, Some(50));

    let (_, body) = post(
        &app,
        json!({"model": "k3-mini", "input": "a long question", "max_output_tokens": 3,
               "reasoning": {"effort": "none"}}),
    )
    .await;
    let r: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(r["output"].as_array().unwrap().len(), 1);
    assert_eq!(r["output"][0]["content"][0]["text"], "ech");
    assert_eq!(r["output"][0]["status"], "incomplete");
}

#[tokio::test]
async fn a_function_call_round_trip() {
    let (app, backend) = app();
    let input = json!([{"role": "user", "content": "weather in Paris?"}]);
    let (status, body) = post(
        &app,
        json!({"model": "k3-mini", "input": input, "tools": [weather_tool()],
               "reasoning": {"effort": "none"}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    let call = &r["output"][0];
    assert_eq!(call["type"], "function_call");
    assert_eq!(call["call_id"], "call_0");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["arguments"], "{\"city\": \"Paris\"}");
    assert_eq!(r["tools"][0]["name"], "get_weather");
    assert_eq!(r["tool_choice"], "auto");
    let chat = backend.last_chat.lock().unwrap().clone().unwrap();
    assert_eq!(chat.tools[0]["function"]["name"], "get_weather");
    assert_eq!(chat.tool_choice, ToolChoice::Auto);

    // The output goes back as input, with the call's output.
    let mut items = input.as_array().unwrap().clone();
    items.extend(r["output"].as_array().unwrap().iter().cloned());
    items.push(json!({"type": "function_call_output", "call_id": "call_0", "output": "sunny"}));
    let (status, body) = post(
        &app,
        json!({"model": "k3-mini", "input": items, "tools": [weather_tool()]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let chat = backend.last_chat.lock().unwrap().clone().unwrap();
    assert_eq!(
        chat.messages[1],
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_0",
               "type": "function", "function": {"name": "get_weather",
               "arguments": "{\"city\": \"Paris\"}"}}]})
    );
    assert_eq!(
        chat.messages[2],
        json!({"role": "tool", "name": "get_weather", "content": "sunny", "tool_call_id": "call_0"})
    );
}

#[tokio::test]
async fn streaming_events_carry_the_same_items_as_the_final_response() {
    let (app, _) = app();
    let (status, body) = post(
        &app,
        json!({"model": "k3-mini", "input": "weather?", "tools": [weather_tool()],
               "stream": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let events = events(&body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let added: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "response.output_item.added")
        .map(|(_, d)| &d["item"]["id"])
        .collect();
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["status"], "completed");
    let final_ids: Vec<&Value> = done["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| &i["id"])
        .collect();
    assert_eq!(added, final_ids);
    assert_eq!(done["output"][1]["arguments"], "{\"city\": \"Paris\"}");
    assert_eq!(events[0].1["response"]["id"], done["id"]);
}

#[tokio::test]
async fn a_failure_mid_stream_is_an_error_event() {
    let (app, _) = app();
    let (status, body) = post(
        &app,
        json!({"model": "k3-mini", "input": "FAIL", "stream": true,
               "reasoning": {"effort": "none"}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let events = events(&body);
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error");
    assert_eq!(data["code"], "plugin_failed");
    assert!(data["message"].as_str().unwrap().contains("trapped"));
    assert!(!events.iter().any(|(n, _)| n == "response.completed"));
}

#[tokio::test]
async fn errors_are_400s_in_openai_shape_naming_the_responses_field() {
    let (app, _) = app();
    let long: Vec<Value> = (0..12)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    let cases = [
        (
            json!({"model": "k3-mini", "input": "x", "previous_response_id": "resp_1"}),
            StatusCode::BAD_REQUEST,
            Some("previous_response_id"),
        ),
        (
            json!({"model": "k3-mini", "input": [{"type": "reasoning", "content": 1}]}),
            StatusCode::BAD_REQUEST,
            Some("input[0].content"),
        ),
        (
            json!({"model": "k3-mini", "input": long}),
            StatusCode::BAD_REQUEST,
            Some("input"),
        ),
        (
            json!({"model": "gpt-9", "input": "x"}),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
        (
            json!({"model": "k3-mini", "input": "x", "tools": [{"type": "function"}]}),
            StatusCode::BAD_REQUEST,
            Some("tools[0].name"),
        ),
    ];
    for (body, status, param) in cases {
        let (got, text) = post(&app, body.clone()).await;
        assert_eq!(got, status, "{body}: {text}");
        let err: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(err["error"]["param"].as_str(), param, "{text}");
        assert!(err["error"]["type"].is_string() && err["error"]["message"].is_string());
    }
}
