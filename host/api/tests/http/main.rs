//! The HTTP layer end to end over a scripted fake backend: every route, streaming and
//! non-streaming, errors, auth, admin, metrics, disconnects and the concurrency limit.
//!
//! The fake backend and the request helpers live here; the tests in `openai` (chat and text
//! completions) and `service` (auth, admin, Anthropic, metrics, disconnects, limits).

mod openai;
mod service;

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
