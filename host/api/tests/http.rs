//! The HTTP layer end to end over a scripted fake backend: every route, streaming and
//! non-streaming, errors, auth, admin, metrics, disconnects and the concurrency limit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use k3_api::backend::*;
use k3_api::{ApiConfig, AppState, build_router};
use serde_json::{Value, json};
use tower::ServiceExt;

/// Counts live generations and those dropped before they finished.
#[derive(Default)]
struct Counters {
    live: AtomicI64,
    cancelled: AtomicU64,
}

struct LiveGuard {
    counters: Arc<Counters>,
    finished: bool,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.counters.live.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            self.counters.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[derive(Default)]
struct Plugins {
    /// stage -> (versions, active index, previous active indices)
    stages: HashMap<String, (Vec<PluginVersionInfo>, usize, Vec<usize>)>,
}

struct FakeBackend {
    counters: Arc<Counters>,
    seen_prompts: Mutex<HashMap<String, u32>>,
    plugins: Mutex<Plugins>,
    last_chat: Mutex<Option<ChatGenRequest>>,
}

const MAX_MODEL_LEN: u32 = 200;

impl FakeBackend {
    fn new() -> Arc<Self> {
        let mut plugins = Plugins::default();
        for stage in ["chat-template", "reasoning-parser", "tool-parser"] {
            plugins.stages.insert(
                stage.to_string(),
                (
                    vec![version(stage, "kimi-k3", "builtin", true)],
                    0,
                    Vec::new(),
                ),
            );
        }
        Arc::new(FakeBackend {
            counters: Arc::default(),
            seen_prompts: Mutex::default(),
            plugins: Mutex::new(plugins),
            last_chat: Mutex::default(),
        })
    }

    /// Token count of a prompt: one per 4 characters (rounded up).
    fn tokens(text: &str) -> u32 {
        text.chars().count().div_ceil(4) as u32
    }

    fn generation(
        &self,
        prompt: String,
        sampling: &SamplingOptions,
        events: Vec<GenEvent>,
        slow: bool,
    ) -> Result<Generation, BackendError> {
        let prompt_tokens = Self::tokens(&prompt);
        let budget = sampling
            .max_tokens
            .unwrap_or(MAX_MODEL_LEN.saturating_sub(prompt_tokens));
        if prompt_tokens + budget > MAX_MODEL_LEN {
            return Err(BackendError::ContextLengthExceeded(format!(
                "this model's maximum context length is {MAX_MODEL_LEN} tokens; the request has \
                 {prompt_tokens} prompt tokens and asks for {budget} more"
            )));
        }
        let cached = {
            let mut seen = self.seen_prompts.lock().unwrap();
            let n = seen.entry(prompt.clone()).or_default();
            *n += 1;
            if *n > 1 { prompt_tokens - 1 } else { 0 }
        };
        self.counters.live.fetch_add(1, Ordering::SeqCst);
        let guard = LiveGuard {
            counters: self.counters.clone(),
            finished: false,
        };
        let events = if slow {
            futures::stream::unfold(guard, |guard| async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Some((GenEvent::Content("x".into()), guard))
            })
            .boxed()
        } else {
            let script = shape(events, sampling, prompt_tokens, cached);
            futures::stream::unfold(
                (script.into_iter(), guard),
                |(mut it, mut guard)| async move {
                    tokio::task::yield_now().await;
                    let event = it.next()?;
                    if matches!(event, GenEvent::Finished(_)) {
                        guard.finished = true;
                    }
                    Some((event, (it, guard)))
                },
            )
            .boxed()
        };
        Ok(Generation {
            prompt_tokens,
            prompt_text: Some(prompt),
            events,
        })
    }
}

/// Apply max_tokens (one token per content character), stop strings and logprobs to a script,
/// and end it with `Finished`.
fn shape(
    events: Vec<GenEvent>,
    sampling: &SamplingOptions,
    prompt_tokens: u32,
    cached: u32,
) -> Vec<GenEvent> {
    let max = sampling.max_tokens.unwrap_or(u32::MAX);
    // Where the first stop string begins in the whole content: text from there on is never sent.
    let full: String = events
        .iter()
        .filter_map(|e| match e {
            GenEvent::Content(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let stop_at = sampling
        .stop
        .iter()
        .filter_map(|s| {
            full.find(s.as_str())
                .map(|i| (full[..i].chars().count(), s.clone()))
        })
        .min();
    let mut out = Vec::new();
    let mut used = 0u32;
    let mut sent_chars = 0usize;
    let mut reason = FinishReason::Stop;
    'outer: for event in events {
        match event {
            GenEvent::Content(text) => {
                for c in text.chars() {
                    if let Some((at, stop)) = &stop_at
                        && sent_chars == *at
                    {
                        reason = FinishReason::StopSequence(stop.clone());
                        break 'outer;
                    }
                    if used == max {
                        reason = FinishReason::Length;
                        break 'outer;
                    }
                    sent_chars += 1;
                    used += 1;
                    if let Some(k) = sampling.logprobs {
                        out.push(GenEvent::Logprobs(vec![TokenLogprob {
                            token: c.to_string(),
                            logprob: -0.5,
                            bytes: c.to_string().into_bytes(),
                            top: (0..k)
                                .map(|i| TopLogprob {
                                    token: format!("t{i}"),
                                    logprob: -1.0 - i as f32,
                                    bytes: vec![b't'],
                                })
                                .collect(),
                        }]));
                    }
                    out.push(GenEvent::Content(c.to_string()));
                }
            }
            other => {
                used += 1;
                if matches!(
                    other,
                    GenEvent::ToolCallEnd {
                        complete: false,
                        ..
                    }
                ) {
                    // A call cut short: the fake ran out of tokens inside it.
                    reason = FinishReason::Length;
                }
                out.push(other);
            }
        }
    }
    out.push(GenEvent::Finished(FinishInfo {
        reason,
        prompt_tokens,
        completion_tokens: used,
        cached_tokens: cached,
        // As an engine would report it: 2 ms queued, 30 ms to the first token.
        timing: Some(RequestTiming {
            queued: Duration::from_millis(2),
            prefill: Duration::from_millis(30),
        }),
    }));
    out
}

fn version(stage: &str, name: &str, digest: &str, active: bool) -> PluginVersionInfo {
    PluginVersionInfo {
        id: format!("{stage}@{digest}"),
        name: name.into(),
        version: "0.1.0".into(),
        digest: digest.into(),
        active,
        calls: 0,
        errors: 0,
    }
}

impl ChatBackend for FakeBackend {
    fn model(&self) -> ModelInfo {
        ModelInfo {
            id: "k3-mini".into(),
            aliases: vec!["models/k3-mini".into()],
            max_model_len: MAX_MODEL_LEN,
            created: 1,
        }
    }

    fn chat(&self, request: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move {
            *self.last_chat.lock().unwrap() = Some(request.clone());
            let prompt: String = request
                .messages
                .iter()
                .map(|m| m["content"].as_str().unwrap_or("").to_string())
                .collect::<Vec<_>>()
                .join("|");
            let last = request
                .messages
                .last()
                .and_then(|m| m["content"].as_str())
                .unwrap_or("")
                .to_string();
            match last.as_str() {
                "TEMPLATE_ERROR" => {
                    return Err(BackendError::Template("unknown thinking_effort".into()));
                }
                "OVERLOAD" => return Err(BackendError::Overloaded("queue is full".into())),
                _ => {}
            }
            let mut script = Vec::new();
            if request.thinking {
                script.push(GenEvent::Reasoning("Let me ".into()));
                script.push(GenEvent::Reasoning("think.".into()));
            }
            let tool = request.tools.first().map(|t| t["function"]["name"].clone());
            if let (Some(Value::String(name)), ToolChoice::Auto, true) =
                (tool, request.tool_choice, last.contains("weather"))
            {
                let calls = if last.contains("two") { 2 } else { 1 };
                let cut = last.contains("cut");
                for i in 0..calls {
                    script.push(GenEvent::ToolCallStart {
                        index: i,
                        id: format!("call_{i}"),
                        name: name.clone(),
                    });
                    script.push(GenEvent::ToolCallArguments {
                        index: i,
                        delta: "{\"city\": ".into(),
                    });
                    // Cut short, the parser closes the JSON of what came (docs/k3-format.md §5).
                    let rest = if cut { "\"Par\"}" } else { "\"Paris\"}" };
                    script.push(GenEvent::ToolCallArguments {
                        index: i,
                        delta: rest.into(),
                    });
                    script.push(GenEvent::ToolCallEnd {
                        index: i,
                        complete: !cut,
                    });
                }
            } else {
                script.push(GenEvent::Content(format!("echo: {last}")));
            }
            self.generation(prompt, &request.sampling, script, last.starts_with("slow"))
        })
    }

    fn complete(
        &self,
        request: CompletionGenRequest,
    ) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move {
            let prompt = match request.prompt {
                PromptInput::Text(t) => t,
                PromptInput::Tokens(ids) => ids
                    .iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(" "),
            };
            let slow = prompt.starts_with("slow");
            self.generation(
                prompt,
                &request.sampling,
                vec![GenEvent::Content(" and so on".into())],
                slow,
            )
        })
    }

    fn metrics(&self) -> BackendMetrics {
        let live = self.counters.live.load(Ordering::SeqCst).max(0) as u64;
        BackendMetrics {
            running: live,
            waiting: 0,
            prefix_cache_queried_tokens: 10,
            prefix_cache_hit_tokens: 4,
            pool: vec![PoolUsage {
                kind: "kv".into(),
                used_bytes: live * 1024,
                capacity_bytes: 1 << 20,
            }],
            preemptions: 0,
            plugins: vec![PluginCounters {
                stage: "tool-parser".into(),
                version: "kimi-k3@builtin".into(),
                calls: 7,
                errors: 1,
            }],
            plugin_instances_in_use: Some(3),
            plugin_capacity_refusals: 2,
            speculative: None,
        }
    }

    fn list_plugins(&self) -> Vec<PluginStageInfo> {
        let plugins = self.plugins.lock().unwrap();
        let mut stages: Vec<PluginStageInfo> = plugins
            .stages
            .iter()
            .map(|(stage, (versions, active, _))| PluginStageInfo {
                stage: stage.clone(),
                active: Some(versions[*active].id.clone()),
                versions: versions.clone(),
            })
            .collect();
        stages.sort_by(|a, b| a.stage.cmp(&b.stage));
        stages
    }

    fn load_plugin(
        &self,
        stage: String,
        component: Bytes,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async move {
            let mut plugins = self.plugins.lock().unwrap();
            let Some((versions, active, history)) = plugins.stages.get_mut(&stage) else {
                return Err(BackendError::NotFound(format!("no plugin stage '{stage}'")));
            };
            if !component.starts_with(b"\0asm") {
                return Err(BackendError::PluginRejected(
                    "not a wasm component (bad magic)".into(),
                ));
            }
            let digest = format!("d{}", component.len());
            versions[*active].active = false;
            versions.push(version(&stage, "uploaded", &digest, true));
            history.push(*active);
            *active = versions.len() - 1;
            Ok(versions[*active].clone())
        })
    }

    fn rollback_plugin(
        &self,
        stage: String,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async move {
            let mut plugins = self.plugins.lock().unwrap();
            let Some((versions, active, history)) = plugins.stages.get_mut(&stage) else {
                return Err(BackendError::NotFound(format!("no plugin stage '{stage}'")));
            };
            let Some(previous) = history.pop() else {
                return Err(BackendError::InvalidRequest {
                    message: format!("stage '{stage}' has no earlier version to roll back to"),
                    param: None,
                });
            };
            versions[*active].active = false;
            versions[previous].active = true;
            *active = previous;
            Ok(versions[previous].clone())
        })
    }
}

struct Harness {
    app: Router,
    fake: Arc<FakeBackend>,
}

fn harness_with(config: ApiConfig) -> Harness {
    let fake = FakeBackend::new();
    let state = AppState::new(fake.clone(), config);
    Harness {
        app: build_router(state),
        fake,
    }
}

fn harness() -> Harness {
    harness_with(ApiConfig {
        admin_token: Some("admintok".into()),
        max_request_body_bytes: 4096,
        ..Default::default()
    })
}

impl Harness {
    async fn send(&self, req: Request<Body>) -> (StatusCode, Bytes) {
        let resp = self.app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, body)
    }

    async fn post_raw(&self, path: &str, body: impl Into<Body>) -> (StatusCode, Bytes) {
        self.send(
            Request::post(path)
                .header("content-type", "application/json")
                .body(body.into())
                .unwrap(),
        )
        .await
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let (status, bytes) = self.post_raw(path, body.to_string()).await;
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    async fn get(&self, path: &str) -> (StatusCode, Bytes) {
        self.send(Request::get(path).body(Body::empty()).unwrap())
            .await
    }

    /// POST a streaming request; returns the `data:` payloads (`[DONE]` kept as a string).
    async fn stream(&self, path: &str, body: Value) -> Vec<Value> {
        let (status, bytes) = self.post_raw(path, body.to_string()).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&bytes)
        );
        sse_data(&bytes)
    }
}

fn sse_data(bytes: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(bytes)
        .split("\n\n")
        .filter_map(|frame| {
            frame
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .map(|d| {
                    if d == "[DONE]" {
                        Value::String(d.into())
                    } else {
                        serde_json::from_str(d).unwrap()
                    }
                })
        })
        .collect()
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

#[tokio::test]
async fn chat_non_streaming_with_and_without_thinking() {
    let h = harness();
    let (status, body) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("hi")]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "chat.completion");
    let msg = &body["choices"][0]["message"];
    assert_eq!(msg["content"], "echo: hi");
    assert_eq!(msg["reasoning_content"], "Let me think.");
    assert_eq!(msg["reasoning"], "Let me think.");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["completion_tokens"], 10);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let (_, body) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "models/k3-mini", "messages": [user("hi")], "reasoning_effort": "none"}),
        )
        .await;
    let msg = &body["choices"][0]["message"];
    assert!(msg.get("reasoning_content").is_none(), "{msg}");
    let last = h.fake.last_chat.lock().unwrap().clone().unwrap();
    assert_eq!(last.template_kwargs["thinking"], false);

    // A repeated prompt is served (partly) from the cache.
    let long = json!({"model": "k3-mini", "messages": [user("a longer prompt to cache")]});
    let (_, body) = h.post("/v1/chat/completions", long.clone()).await;
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, body) = h.post("/v1/chat/completions", long).await;
    assert!(body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
}

#[tokio::test]
async fn chat_streaming_chunks_follow_the_openai_shape() {
    let h = harness();
    let chunks = h
        .stream(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("yo")], "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let first = &chunks[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut finish = None;
    for c in &chunks[1..chunks.len() - 2] {
        let d = &c["choices"][0]["delta"];
        if let Some(r) = d["reasoning_content"].as_str() {
            assert_eq!(d["reasoning"], d["reasoning_content"]);
            reasoning.push_str(r);
        }
        content.push_str(d["content"].as_str().unwrap_or(""));
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        assert!(c["usage"].is_null());
    }
    assert_eq!(reasoning, "Let me think.");
    assert_eq!(content, "echo: yo");
    assert_eq!(finish.as_deref(), Some("stop"));
    let usage_chunk = &chunks[chunks.len() - 2];
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 10);
}

#[tokio::test]
async fn tool_calls_non_streaming_and_streaming() {
    let h = harness();
    let body = json!({"model": "k3-mini", "messages": [user("weather in two cities")],
        "tools": weather_tools()});
    let (status, resp) = h.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK);
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert!(choice["message"]["content"].is_null());
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    let mut single = body.clone();
    single["parallel_tool_calls"] = json!(false);
    let (_, resp) = h.post("/v1/chat/completions", single).await;
    assert_eq!(
        resp["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let chunks = h.stream("/v1/chat/completions", streaming).await;
    let mut calls: HashMap<u64, (String, String, String)> = HashMap::new();
    let mut finish = None;
    for c in chunks.iter().filter(|c| c.is_object()) {
        for tc in c["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let entry = calls.entry(tc["index"].as_u64().unwrap()).or_default();
            if let Some(id) = tc["id"].as_str() {
                assert!(entry.0.is_empty(), "id sent twice");
                entry.0 = id.to_string();
                entry.1 = tc["function"]["name"].as_str().unwrap().to_string();
            } else {
                assert!(tc["function"].get("name").is_none(), "name sent twice");
            }
            entry.2 += tc["function"]["arguments"].as_str().unwrap_or("");
        }
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[&1].0, "call_1");
    assert_eq!(calls[&1].2, "{\"city\": \"Paris\"}");

    // A call cut short by max_tokens: streamed as far as it came, so non-streaming returns it
    // too, identically; the finish reason is `length`, not `tool_calls`.
    let mut cut = body.clone();
    cut["messages"] = json!([user("weather, but cut")]);
    let (_, resp) = h.post("/v1/chat/completions", cut.clone()).await;
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{resp}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{resp}");
    assert_eq!(calls[0]["id"], "call_0");
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Par\"}");
    cut["stream"] = json!(true);
    let chunks = h.stream("/v1/chat/completions", cut).await;
    let streamed: String = chunks
        .iter()
        .filter(|c| c.is_object())
        .flat_map(|c| {
            c["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|tc| {
            tc["function"]["arguments"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(
        streamed,
        calls[0]["function"]["arguments"].as_str().unwrap()
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_string())
        .collect();
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");

    // tool_choice none: the model is told not to call tools and none are returned.
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    let (_, resp) = h.post("/v1/chat/completions", none).await;
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn n_choices_stop_strings_length_and_logprobs() {
    let h = harness();
    let (_, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("abc")], "n": 3, "seed": 5}),
        )
        .await;
    let choices = resp["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "echo: abc");
    }
    // 2 reasoning events + 9 content characters per choice.
    assert_eq!(resp["usage"]["completion_tokens"], 33);

    let chunks = h
        .stream(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("abc")], "n": 2, "stream": true}),
        )
        .await;
    let finishes: Vec<u64> = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_string())
        .map(|c| c["choices"][0]["index"].as_u64().unwrap())
        .collect();
    assert_eq!(finishes.len(), 2);

    let (_, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("abcdef")], "stop": ["cd"],
                   "reasoning_effort": "none"}),
        )
        .await;
    assert_eq!(resp["choices"][0]["message"]["content"], "echo: ab");
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");

    let (_, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("abcdef")], "max_tokens": 4,
                   "reasoning_effort": "none"}),
        )
        .await;
    assert_eq!(resp["choices"][0]["message"]["content"], "echo");
    assert_eq!(resp["choices"][0]["finish_reason"], "length");

    let (_, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("ab")], "logprobs": true,
                   "top_logprobs": 2, "reasoning_effort": "none"}),
        )
        .await;
    let lp = resp["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(lp.len(), 8);
    assert_eq!(lp[0]["token"], "e");
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn bad_input_gets_the_right_status_and_names_the_problem() {
    let h = harness();
    let (status, body) = h.post_raw("/v1/chat/completions", "{\"model\": ").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "invalid_json");

    let cases = [
        (
            json!({"model": "k3-mini", "messages": [user("x")], "temperature": "hot"}),
            "temperature",
        ),
        (json!({"model": "k3-mini", "messages": []}), "messages"),
        (json!({"model": "k3-mini"}), "messages"),
        (
            json!({"model": "k3-mini", "messages": [user("x")], "tools": [{"type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]}),
            "tools[0].function.parameters.properties.a.type",
        ),
        (
            json!({"model": "k3-mini", "messages": [user("x"), {"role": "tool", "tool_call_id": "nope", "content": "1"}]}),
            "messages[1].tool_call_id",
        ),
        (
            json!({"model": "k3-mini", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}),
            "messages[0].content[0].text",
        ),
    ];
    for (body, param) in cases {
        let (status, resp) = h.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {resp}");
        assert_eq!(resp["error"]["param"], param, "{resp}");
        assert!(
            resp["error"]["message"].as_str().unwrap().contains(param),
            "{resp}"
        );
    }

    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "gpt-9", "messages": [user("x")]}),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(resp["error"]["code"], "model_not_found");

    let long = "word ".repeat(200);
    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user(&long)]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(resp["error"]["code"], "context_length_exceeded");

    let (status, _) = h
        .post_raw(
            "/v1/chat/completions",
            format!(
                "{{\"model\":\"k3-mini\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
                "a".repeat(5000)
            ),
        )
        .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);

    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("TEMPLATE_ERROR")]}),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(resp["error"]["type"], "template_error");

    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("OVERLOAD")]}),
        )
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(resp["error"]["type"], "rate_limit_error");

    let (status, body) = h.get("/v2/nothing").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["type"], "not_found_error");

    let (status, _) = h.get("/v1/chat/completions").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    // Still serving.
    let (status, _) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("ok")]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn api_key_is_required_when_configured() {
    let h = harness_with(ApiConfig {
        api_key: Some("sekret".into()),
        ..Default::default()
    });
    let body = json!({"model": "k3-mini", "messages": [user("x")]}).to_string();
    let (status, resp) = h.post_raw("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let resp: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(resp["error"]["type"], "authentication_error");
    let (status, _) = h
        .send(
            Request::post("/v1/chat/completions")
                .header("authorization", "Bearer wrong")
                .body(Body::from(body.clone()))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = h
        .send(
            Request::post("/v1/chat/completions")
                .header("authorization", "Bearer sekret")
                .body(Body::from(body.clone()))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = h
        .send(
            Request::post("/v1/chat/completions")
                .header("x-api-key", "sekret")
                .body(Body::from(body))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(h.get("/health").await.0, StatusCode::OK);
    // No admin token configured: the admin API is off.
    assert_eq!(h.get("/admin/plugins").await.0, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn admin_lists_uploads_and_rolls_back() {
    let h = harness();
    assert_eq!(h.get("/admin/plugins").await.0, StatusCode::UNAUTHORIZED);
    let authed = |req: axum::http::request::Builder| req.header("authorization", "Bearer admintok");
    let (status, body) = h
        .send(
            authed(Request::get("/admin/plugins"))
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["stages"].as_array().unwrap().len(), 3);

    let upload = |bytes: &'static [u8]| {
        authed(Request::put("/admin/plugins/tool-parser"))
            .header("content-type", "application/wasm")
            .body(Body::from(bytes))
            .unwrap()
    };
    let (status, _) = h
        .send(
            Request::put("/admin/plugins/tool-parser")
                .body(Body::from(&b"\0asm"[..]))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, body) = h.send(upload(b"not wasm")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["code"], "plugin_rejected");
    let (status, body) = h.send(upload(b"\0asm\x0d\0\x01\0")).await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["activated"]["id"], "tool-parser@d8");
    let (status, body) = h
        .send(
            authed(Request::post("/admin/plugins/tool-parser/rollback"))
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["activated"]["id"], "tool-parser@builtin");
    let (status, _) = h
        .send(
            authed(Request::post("/admin/plugins/tool-parser/rollback"))
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = h
        .send(
            authed(Request::put("/admin/plugins/nope"))
                .body(Body::from(&b"\0asm"[..]))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn completions_text_tokens_echo_and_stream() {
    let h = harness();
    let (status, resp) = h
        .post(
            "/v1/completions",
            json!({"model": "k3-mini", "prompt": "Once", "echo": true, "logprobs": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["object"], "text_completion");
    assert_eq!(resp["choices"][0]["text"], "Once and so on");
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    let lp = &resp["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 10);
    assert_eq!(lp["text_offset"][0], 4);

    let (_, resp) = h
        .post(
            "/v1/completions",
            json!({"model": "k3-mini", "prompt": [[1, 2], [3]], "max_tokens": 50}),
        )
        .await;
    assert_eq!(resp["choices"].as_array().unwrap().len(), 2);
    assert_eq!(resp["choices"][1]["text"], " and so on");
    assert_eq!(resp["choices"][1]["finish_reason"], "stop");

    let chunks = h
        .stream(
            "/v1/completions",
            json!({"model": "k3-mini", "prompt": "Hi", "stream": true, "max_tokens": 3}),
        )
        .await;
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, " an");
    assert_eq!(chunks.last().unwrap(), "[DONE]");

    let (status, resp) = h
        .post(
            "/v1/completions",
            json!({"model": "k3-mini", "prompt": [1, -1]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(resp["error"]["param"], "prompt[1]");
}

#[tokio::test]
async fn models_health_and_metrics() {
    let h = harness();
    let (status, body) = h.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["data"][0]["id"], "k3-mini");
    assert_eq!(body["data"][0]["max_model_len"], MAX_MODEL_LEN);
    assert_eq!(h.get("/v1/models/k3-mini").await.0, StatusCode::OK);
    assert_eq!(h.get("/v1/models/other").await.0, StatusCode::NOT_FOUND);
    assert_eq!(h.get("/health").await.0, StatusCode::OK);

    h.post(
        "/v1/chat/completions",
        json!({"model": "k3-mini", "messages": [user("m")]}),
    )
    .await;
    h.post("/v1/chat/completions", json!({"model": "k3-mini"}))
        .await;
    let (status, text) = h.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(text.to_vec()).unwrap();
    for needle in [
        "k3serve_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 1",
        "k3serve_http_requests_total{route=\"/v1/chat/completions\",status=\"400\"} 1",
        "k3serve_time_to_first_token_seconds_count 1",
        "k3serve_e2e_request_latency_seconds_count 1",
        "k3serve_request_queue_time_seconds_bucket{le=\"0.001\"} 0",
        "k3serve_request_queue_time_seconds_bucket{le=\"0.005\"} 1",
        "k3serve_request_prefill_time_seconds_bucket{le=\"0.02\"} 0",
        "k3serve_request_prefill_time_seconds_bucket{le=\"0.04\"} 1",
        "k3serve_generation_tokens_total 9",
        "k3serve_prefix_cache_hit_rate 0.4",
        "k3serve_pool_used_bytes{kind=\"kv\"} 0",
        "k3serve_plugin_calls_total{stage=\"tool-parser\",version=\"kimi-k3@builtin\"} 7",
        "k3serve_plugin_instances_in_use 3",
        "k3serve_plugin_capacity_refusals_total 2",
        "k3serve_num_requests_running 0",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[tokio::test]
async fn anthropic_messages_plain_tools_and_streaming() {
    let h = harness();
    let (status, resp) = h
        .post(
            "/v1/messages",
            json!({"model": "k3-mini", "max_tokens": 100, "messages": [user("hey")]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["type"], "message");
    assert_eq!(
        resp["content"],
        json!([{"type": "text", "text": "echo: hey"}])
    );
    assert_eq!(resp["stop_reason"], "end_turn");
    assert_eq!(resp["usage"]["output_tokens"], 9);

    let (_, resp) = h
        .post(
            "/v1/messages",
            json!({"model": "k3-mini", "max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 50},
                "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                "messages": [user("weather?")]}),
        )
        .await;
    assert_eq!(resp["stop_reason"], "tool_use");
    assert_eq!(resp["content"][0]["type"], "thinking");
    assert_eq!(resp["content"][1]["type"], "tool_use");
    assert_eq!(resp["content"][1]["input"], json!({"city": "Paris"}));
    // cut by max_tokens: the partial tool_use is returned as streamed, stop_reason max_tokens
    let (_, resp) = h
        .post(
            "/v1/messages",
            json!({"model": "k3-mini", "max_tokens": 100,
                "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                "messages": [user("weather, cut")]}),
        )
        .await;
    assert_eq!(resp["stop_reason"], "max_tokens", "{resp}");
    assert_eq!(resp["content"][0]["type"], "tool_use");
    assert_eq!(resp["content"][0]["input"], json!({"city": "Par"}));

    let (status, bytes) = h
        .post_raw(
            "/v1/messages",
            json!({"model": "k3-mini", "max_tokens": 100, "stream": true, "stop_sequences": ["o"],
                   "thinking": {"type": "enabled", "budget_tokens": 50}, "messages": [user("hello")]})
            .to_string(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(events[0], "message_start");
    assert_eq!(events[1], "content_block_start");
    assert_eq!(*events.last().unwrap(), "message_stop");
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == "content_block_start")
            .count(),
        2
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == "content_block_stop")
            .count(),
        2
    );
    let data = sse_data(&bytes);
    let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence");
    assert_eq!(delta["delta"]["stop_sequence"], "o");

    let (status, resp) = h
        .post(
            "/v1/messages",
            json!({"model": "k3-mini", "messages": [user("x")]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(resp["type"], "error");
    assert_eq!(resp["error"]["type"], "invalid_request_error");
    assert!(
        resp["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens")
    );
}

#[tokio::test]
async fn a_client_that_disconnects_aborts_its_generation() {
    let h = harness();
    let resp = h
        .app
        .clone()
        .oneshot(
            Request::post("/v1/chat/completions")
                .body(Body::from(
                    json!({"model": "k3-mini", "messages": [user("slow please")], "stream": true})
                        .to_string(),
                ))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    for _ in 0..3 {
        body.next().await.unwrap().unwrap();
    }
    assert_eq!(h.fake.counters.live.load(Ordering::SeqCst), 1);
    drop(body);
    for _ in 0..100 {
        if h.fake.counters.live.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.fake.counters.live.load(Ordering::SeqCst), 0);
    assert_eq!(h.fake.counters.cancelled.load(Ordering::SeqCst), 1);
    let (_, text) = h.get("/metrics").await;
    assert!(String::from_utf8_lossy(&text).contains("k3serve_client_disconnects_total 1"));
}

#[tokio::test]
async fn requests_past_the_concurrency_limit_get_429() {
    let h = harness_with(ApiConfig {
        max_concurrent_requests: 2,
        ..Default::default()
    });
    // More generations than the server ever runs at once can never succeed: a 400.
    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("x")], "n": 3}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{resp}");
    assert_eq!(resp["error"]["param"], "n");
    let resp = h
        .app
        .clone()
        .oneshot(
            Request::post("/v1/completions")
                .body(Body::from(
                    json!({"model": "k3-mini", "prompt": "slow", "stream": true}).to_string(),
                ))
                .unwrap(),
        )
        .await
        .unwrap();
    let mut held = resp.into_body().into_data_stream();
    held.next().await.unwrap().unwrap();
    // One slot is taken; two choices do not fit now but will later: a 429 with Retry-After.
    let full = h
        .app
        .clone()
        .oneshot(
            Request::post("/v1/chat/completions")
                .body(Body::from(
                    json!({"model": "k3-mini", "messages": [user("x")], "n": 2}).to_string(),
                ))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(full.headers()["retry-after"], "1");
    let body = axum::body::to_bytes(full.into_body(), 1 << 20)
        .await
        .unwrap();
    let resp: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(resp["error"]["code"], "too_many_requests");
    drop(held);
    let mut status = StatusCode::TOO_MANY_REQUESTS;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        status = h
            .post(
                "/v1/chat/completions",
                json!({"model": "k3-mini", "messages": [user("x")], "n": 2}),
            )
            .await
            .0;
        if status == StatusCode::OK {
            break;
        }
    }
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_non_streaming_client_that_goes_away_aborts_too() {
    let h = harness();
    let req = Request::post("/v1/chat/completions")
        .body(Body::from(
            json!({"model": "k3-mini", "messages": [user("slow and quiet")]}).to_string(),
        ))
        .unwrap();
    // Hyper drops the handler's future when the connection closes; a timeout does the same here.
    let gone = tokio::time::timeout(Duration::from_millis(50), h.app.clone().oneshot(req)).await;
    assert!(gone.is_err(), "the slow request cannot have finished");
    assert_eq!(h.fake.counters.live.load(Ordering::SeqCst), 0);
    assert_eq!(h.fake.counters.cancelled.load(Ordering::SeqCst), 1);
    let (_, text) = h.get("/metrics").await;
    assert!(String::from_utf8_lossy(&text).contains("k3serve_client_disconnects_total 1"));
}
