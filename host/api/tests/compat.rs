//! Drop-in compatibility over a small fake backend: unknown fields (lenient by default, strict on
//! request, counted in /metrics), several served names, /tokenize, /detokenize,
//! /v1/messages/count_tokens and Anthropic's error shape on every Anthropic path.

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

/// Tokens are characters: a chat prompt is its messages' contents (plus the tools' JSON and a
/// 2-token generation prompt when asked for), so counts are easy to predict.
#[derive(Default)]
struct CharBackend {
    last_chat: Mutex<Option<ChatGenRequest>>,
}

fn chat_prompt(req: &ChatGenRequest) -> String {
    let mut text: String = req
        .messages
        .iter()
        .map(|m| m["content"].as_str().unwrap_or(""))
        .collect();
    if !req.tools.is_empty() {
        text.push_str(&Value::Array(req.tools.clone()).to_string());
    }
    if req.template_kwargs.get("add_generation_prompt") != Some(&Value::Bool(false)) {
        text.push_str("A:");
    }
    text
}

impl ChatBackend for CharBackend {
    fn model(&self) -> ModelInfo {
        ModelInfo {
            id: "k3-mini".into(),
            aliases: vec![],
            max_model_len: 4096,
            created: 1,
        }
    }

    fn chat(&self, request: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move {
            *self.last_chat.lock().unwrap() = Some(request.clone());
            let prompt_tokens = chat_prompt(&request).chars().count() as u32;
            let events = vec![
                GenEvent::Content("hi".into()),
                GenEvent::Finished(FinishInfo {
                    reason: FinishReason::Stop,
                    prompt_tokens,
                    completion_tokens: 1,
                    cached_tokens: 0,
                    timing: None,
                }),
            ];
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

    fn tokenize_chat(
        &self,
        request: ChatGenRequest,
    ) -> BoxFuture<'_, Result<Vec<u32>, BackendError>> {
        Box::pin(async move { Ok(chat_prompt(&request).chars().map(|c| c as u32).collect()) })
    }

    fn tokenize_text(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, BackendError> {
        let bos = add_special_tokens.then_some(1u32);
        Ok(bos
            .into_iter()
            .chain(text.chars().map(|c| c as u32))
            .collect())
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, BackendError> {
        tokens
            .iter()
            .map(|&t| {
                char::from_u32(t).ok_or_else(|| BackendError::InvalidRequest {
                    message: format!("token id {t} is outside the vocabulary"),
                    param: Some("tokens".into()),
                })
            })
            .collect()
    }

    fn token_strings(&self, tokens: &[u32]) -> Vec<Option<String>> {
        tokens
            .iter()
            .map(|&t| char::from_u32(t).map(String::from))
            .collect()
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
        Box::pin(async { Err(BackendError::NotFound("no plugins here".into())) })
    }

    fn rollback_plugin(
        &self,
        _stage: String,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async { Err(BackendError::NotFound("no plugins here".into())) })
    }
}

fn app(config: ApiConfig) -> (Router, Arc<CharBackend>) {
    let backend = Arc::new(CharBackend::default());
    (
        build_router(AppState::new(backend.clone(), config)),
        backend,
    )
}

async fn send(app: &Router, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.map_or(Body::empty(), |b| Body::from(b.to_string())))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, value)
}

async fn post(app: &Router, path: &str, body: Value) -> (StatusCode, Value) {
    send(app, "POST", path, Some(body)).await
}

/// A chat body as litellm and current OpenAI clients send it, unknown fields at several levels.
fn chat_with_unknown_fields() -> Value {
    json!({
        "model": "k3-mini",
        "prompt_cache_key": "abc", "safety_identifier": "u1", "verbosity": "low",
        "stream_options": null,
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "provider_specific_fields": {"x": 1},
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "user", "content": "thanks", "provider_specific_fields": null},
        ],
        "tools": [{"type": "function", "cache_control": {"type": "ephemeral"},
                   "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    })
}

#[tokio::test]
async fn unknown_fields_are_ignored_warned_once_and_counted() {
    let (app, backend) = app(ApiConfig::default());
    for _ in 0..2 {
        let (status, body) = post(&app, "/v1/chat/completions", chat_with_unknown_fields()).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["choices"][0]["message"]["content"], "hi");
    }
    // The ignored fields never reach the template.
    let seen = backend.last_chat.lock().unwrap().clone().unwrap();
    assert!(seen.messages[1].get("provider_specific_fields").is_none());
    let (status, body) = post(
        &app,
        "/v1/messages",
        json!({"model": "k3-mini", "max_tokens": 5, "container": "x",
               "messages": [{"role": "user", "content": "hi", "id": "m1"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let (_, metrics) = send(&app, "GET", "/metrics", None).await;
    let metrics = metrics.as_str().unwrap();
    for (field, n) in [
        ("prompt_cache_key", 2),
        ("verbosity", 2),
        ("messages[].provider_specific_fields", 4),
        ("tools[].cache_control", 2),
        ("container", 1),
        ("messages[].id", 1),
    ] {
        let line = format!("k3serve_ignored_request_fields_total{{field=\"{field}\"}} {n}");
        assert!(metrics.contains(&line), "{line} missing in:\n{metrics}");
    }
}

#[tokio::test]
async fn strict_mode_names_the_unknown_field_in_each_protocol() {
    let (app, _) = app(ApiConfig {
        strict_request_fields: true,
        ..Default::default()
    });
    let (status, body) = post(&app, "/v1/chat/completions", chat_with_unknown_fields()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["code"], "unknown_field");
    assert_eq!(body["error"]["param"], "prompt_cache_key");
    let mut nested = chat_with_unknown_fields();
    for key in ["prompt_cache_key", "safety_identifier", "verbosity"] {
        nested.as_object_mut().unwrap().remove(key);
    }
    let (_, body) = post(&app, "/v1/chat/completions", nested).await;
    assert_eq!(
        body["error"]["param"], "messages[1].provider_specific_fields",
        "{body}"
    );
    let (status, body) = post(
        &app,
        "/v1/messages",
        json!({"model": "k3-mini", "max_tokens": 5,
               "messages": [{"role": "user", "content": "hi", "id": "m1"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["type"], "error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages[0].id"),
        "{body}"
    );
    let (status, body) = post(
        &app,
        "/v1/completions",
        json!({"model": "k3-mini", "prompt": "x", "max_token": 3}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["param"], "max_token");
}

#[tokio::test]
async fn every_served_name_is_listed_and_accepted() {
    let (app, _) = app(ApiConfig {
        served_model_names: vec!["k3".into(), "kimi-k3-mini".into()],
        ..Default::default()
    });
    let (_, list) = send(&app, "GET", "/v1/models", None).await;
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["k3", "kimi-k3-mini"]);
    for name in ["k3", "kimi-k3-mini", "k3-mini"] {
        let (status, body) = post(
            &app,
            "/v1/chat/completions",
            json!({"model": name, "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
        assert_eq!(body["model"], "k3", "responses carry the first name");
    }
    let (_, one) = send(&app, "GET", "/v1/models/kimi-k3-mini", None).await;
    assert_eq!(one["id"], "kimi-k3-mini");
    let (status, _) = post(
        &app,
        "/v1/chat/completions",
        json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn tokenize_and_detokenize_in_vllm_shapes() {
    let (app, _) = app(ApiConfig::default());
    let (status, body) = post(&app, "/tokenize", json!({"prompt": "abc"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({"count": 4, "max_model_len": 4096, "tokens": [1, 97, 98, 99], "token_strs": null})
    );
    let (_, body) = post(
        &app,
        "/tokenize",
        json!({"model": "k3-mini", "prompt": "ab", "add_special_tokens": false, "return_token_strs": true}),
    )
    .await;
    assert_eq!(body["tokens"], json!([97, 98]));
    assert_eq!(body["token_strs"], json!(["a", "b"]));

    // Chat messages: rendered as the chat route would (generation prompt by default; tools count).
    let messages = json!([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]);
    let (_, body) = post(&app, "/tokenize", json!({"messages": messages})).await;
    assert_eq!(body["count"], 5, "{body}");
    let (_, body) = post(
        &app,
        "/tokenize",
        json!({"messages": messages, "add_generation_prompt": false}),
    )
    .await;
    assert_eq!(body["count"], 3);
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    let (_, body) = post(
        &app,
        "/tokenize",
        json!({"messages": messages, "tools": tools}),
    )
    .await;
    assert!(body["count"].as_u64().unwrap() > 5, "{body}");

    let (status, body) = post(&app, "/detokenize", json!({"tokens": [104, 105]})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, json!({"prompt": "hi"}));

    for (bad, param) in [
        (json!({}), "prompt"),
        (json!({"prompt": "a", "messages": messages}), "prompt"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"prompt": "a", "chat_template": "{{ x }}"}),
            "chat_template",
        ),
        (json!({"prompt": "a", "model": "gpt-9"}), "model"),
    ] {
        let (status, body) = post(&app, "/tokenize", bad.clone()).await;
        assert!(status.is_client_error(), "{bad} -> {status}");
        assert_eq!(body["error"]["param"], param, "{bad} -> {body}");
    }
    let (status, body) = post(&app, "/detokenize", json!({"tokens": [-1]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["param"], "tokens[0]", "{body}");
    let (status, body) = post(&app, "/detokenize", json!({"tokens": [0xD800]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["param"], "tokens", "{body}");
}

#[tokio::test]
async fn count_tokens_in_anthropic_shape() {
    let (app, _) = app(ApiConfig::default());
    let body = json!({"model": "k3-mini", "system": "SYS",
        "messages": [{"role": "user", "content": "hello"}]});
    let (status, resp) = post(&app, "/v1/messages/count_tokens", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    // system + message + the generation prompt: what /v1/messages reports as input tokens.
    assert_eq!(resp, json!({"input_tokens": 3 + 5 + 2}));
    let mut with_tools = body.clone();
    with_tools["tools"] = json!([{"name": "f", "input_schema": {"type": "object"}}]);
    let (_, resp) = post(&app, "/v1/messages/count_tokens", with_tools).await;
    assert!(resp["input_tokens"].as_u64().unwrap() > 10, "{resp}");
    let mut sent = body.clone();
    sent["max_tokens"] = json!(4);
    let (_, message) = post(&app, "/v1/messages", sent).await;
    assert_eq!(message["usage"]["input_tokens"], 10);

    let (status, resp) = post(
        &app,
        "/v1/messages/count_tokens",
        json!({"model": "k3-mini", "messages": []}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(resp["type"], "error");
    assert_eq!(resp["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn anthropic_paths_answer_anthropic_errors() {
    let (app, _) = app(ApiConfig::default());
    for (method, path, status) in [
        ("GET", "/v1/messages", StatusCode::METHOD_NOT_ALLOWED),
        (
            "GET",
            "/v1/messages/count_tokens",
            StatusCode::METHOD_NOT_ALLOWED,
        ),
        ("POST", "/v1/messages/batches", StatusCode::NOT_FOUND),
        ("GET", "/v1/messages/msg_123", StatusCode::NOT_FOUND),
    ] {
        let (got, body) = send(&app, method, path, Some(json!({}))).await;
        assert_eq!(got, status, "{method} {path}: {body}");
        assert_eq!(body["type"], "error", "{method} {path}: {body}");
        assert!(body["error"]["type"].is_string(), "{body}");
        assert!(body["error"]["message"].is_string(), "{body}");
    }
    // Elsewhere the OpenAI shape stays.
    let (_, body) = send(&app, "POST", "/v1/messagesx", Some(json!({}))).await;
    assert_eq!(body["error"]["code"], "unknown_route", "{body}");
    let (status, body) = post(
        &app,
        "/v1/messages",
        json!({"model": "k3-mini", "messages": []}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["type"], "error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"),
        "{body}"
    );
}

#[tokio::test]
async fn min_tokens_is_checked_and_passed_on() {
    let (app, backend) = app(ApiConfig::default());
    let (status, _) = post(
        &app,
        "/v1/chat/completions",
        json!({"model": "k3-mini", "messages": [{"role": "user", "content": "x"}],
               "min_tokens": 3, "max_tokens": 8}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let seen = backend.last_chat.lock().unwrap().clone().unwrap();
    assert_eq!(seen.sampling.min_tokens, 3);
    let (status, body) = post(
        &app,
        "/v1/chat/completions",
        json!({"model": "k3-mini", "messages": [{"role": "user", "content": "x"}],
               "min_tokens": 9, "max_tokens": 8}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["param"], "min_tokens");
}
