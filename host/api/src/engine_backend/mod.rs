//! The real [`ChatBackend`]: chat-template plugin → tokenizer → engine → detokenizer → stop
//! strings → reasoning plugin → tool plugin. The HTTP layer only sees the `backend` seam; the
//! engine never sees HTTP or wasm.

#[cfg(test)]
mod forgery_tests;
mod request_path;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use k3_engine::{EngineHandle, Request, SubmitError};
use k3_frontend::{
    IncrementalDetokenizer, Segment, Tokenizer, encode_segments, special_token_spellings,
};
use k3_plugin_host::{
    PluginError, PluginHost, ReasoningOptions, RenderOptions, Stage, TemplateError, ToolOptions,
    VersionInfo,
};
use k3_sampling::{SamplingParams, StopChecker};
use serde_json::{Map, Value};
use tokio::sync::mpsc;

use crate::backend::{
    BackendError, BackendMetrics, ChatBackend, ChatGenRequest, CompletionGenRequest, GenEvent,
    Generation, ModelInfo, PluginCounters, PluginStageInfo, PluginVersionInfo, PoolUsage,
    PromptInput, SamplingOptions, ToolChoice,
};
use request_path::{Parsers, RequestPath};

/// Sampling defaults for fields a request leaves out (from the model's `generation_config.json`
/// when it has one, else OpenAI's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        SamplingDefaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingDefaults {
    /// Read `generation_config.json` (HF style); missing file or fields keep the defaults.
    pub fn from_generation_config(json: &Value) -> Self {
        let mut d = SamplingDefaults::default();
        let f = |k: &str| json.get(k).and_then(Value::as_f64).map(|v| v as f32);
        if let Some(v) = f("temperature") {
            d.temperature = v;
        }
        if let Some(v) = f("top_p") {
            d.top_p = v;
        }
        if let Some(v) = json.get("top_k").and_then(Value::as_i64) {
            d.top_k = v.clamp(0, i32::MAX as i64) as i32;
        }
        if let Some(v) = f("min_p") {
            d.min_p = v;
        }
        if let Some(v) = f("repetition_penalty") {
            d.repetition_penalty = v;
        }
        d
    }
}

/// Everything the backend is built from.
pub struct EngineBackendParts {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub plugins: PluginHost,
    /// The model's Jinja chat template (from tokenizer_config.json).
    pub chat_template: String,
    pub model: ModelInfo,
    /// Token ids that end a turn (the engine was configured with the same ones).
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    pub defaults: SamplingDefaults,
    /// Bytes of one KV page and one state block: to tell the prefix cache's share of the pool.
    pub kv_page_bytes: usize,
    pub state_block_bytes: usize,
}

pub struct EngineBackend {
    parts: EngineBackendParts,
    next_id: AtomicU64,
}

impl EngineBackend {
    pub fn new(parts: EngineBackendParts) -> Self {
        EngineBackend {
            parts,
            next_id: AtomicU64::new(1),
        }
    }

    /// The chat prompt's ids: the template renders markup and client-text segments, and only
    /// the template's own special-token spellings become special tokens, so text a client sends
    /// (content, names, arguments, tool results, tool definitions, kwargs) cannot forge a turn.
    /// (Raw `/v1/completions` prompts are encoded with special tokens recognised, as before.)
    fn prompt_ids(&self, req: &ChatGenRequest) -> Result<Vec<u32>, BackendError> {
        let segments = self.render(req)?;
        encode_segments(&self.parts.tokenizer, &segments)
            .map_err(|e| BackendError::Internal(format!("tokenizing the prompt failed: {e}")))
    }

    fn render(&self, req: &ChatGenRequest) -> Result<Vec<Segment>, BackendError> {
        let mut kwargs: Map<String, Value> = req.template_kwargs.clone();
        let take_str = |kwargs: &mut Map<String, Value>, k: &str| match kwargs.remove(k) {
            Some(Value::String(s)) => Some(s),
            Some(Value::Null) | None => None,
            Some(other) => Some(other.to_string()),
        };
        let add_generation_prompt = match kwargs.remove("add_generation_prompt") {
            Some(Value::Bool(b)) => b,
            _ => true,
        };
        kwargs.remove("thinking");
        let thinking_effort = take_str(&mut kwargs, "thinking_effort");
        let tool_choice_json = kwargs
            .remove("tool_choice")
            .filter(|v| !v.is_null())
            .map(|v| v.to_string());
        let response_format_json = kwargs
            .remove("response_format")
            .filter(|v| !v.is_null())
            .map(|v| v.to_string());
        let tk = &self.parts.tokenizer;
        let options = RenderOptions {
            add_generation_prompt,
            thinking: Some(req.thinking),
            thinking_effort,
            tool_choice_json,
            response_format_json,
            extra_kwargs_json: (!kwargs.is_empty()).then(|| Value::Object(kwargs).to_string()),
            bos_token: tk.bos_token().map(|t| t.text.clone()),
            eos_token: tk.eos_token().map(|t| t.text.clone()),
            special_tokens: special_token_spellings(tk),
        };
        let messages = Value::Array(req.messages.clone()).to_string();
        let tools = (!req.tools.is_empty()).then(|| Value::Array(req.tools.clone()).to_string());
        self.parts
            .plugins
            .chat_template()
            .render_segments(
                &self.parts.chat_template,
                &messages,
                tools.as_deref(),
                &options,
            )
            .map_err(|e| match e {
                PluginError::Template(t) if t.is_client_error() => {
                    BackendError::Template(match t {
                        TemplateError::Raised(m) | TemplateError::InvalidInput(m) => m,
                        other => other.to_string(),
                    })
                }
                other => BackendError::Plugin(other.to_string()),
            })
    }

    fn sampling_params(
        &self,
        s: &SamplingOptions,
        max_tokens: usize,
    ) -> Result<SamplingParams, BackendError> {
        if s.min_tokens > 0 {
            return Err(BackendError::NotSupported {
                message: "'min_tokens' is not supported yet".into(),
                param: Some("min_tokens".into()),
            });
        }
        let d = &self.parts.defaults;
        let params = SamplingParams {
            temperature: s.temperature.unwrap_or(d.temperature),
            top_p: s.top_p.unwrap_or(d.top_p),
            top_k: s.top_k.map_or(d.top_k, |k| k.min(i32::MAX as u32) as i32),
            min_p: s.min_p.unwrap_or(d.min_p),
            repetition_penalty: s.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            seed: s.seed,
            max_tokens: Some(max_tokens),
            stop: s.stop.clone(),
            stop_token_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos,
            include_stop_str_in_output: false,
            logprobs: s.logprobs.map(|k| k as usize),
        };
        params
            .validate()
            .map_err(|e| BackendError::InvalidRequest {
                message: e.to_string(),
                param: None,
            })?;
        Ok(params)
    }

    /// Check the length, submit to the engine and start the request's path task.
    fn submit(
        &self,
        prompt: Vec<u32>,
        sampling: &SamplingOptions,
        parsers: Option<Parsers>,
        prompt_text: Option<String>,
        prompt_param: &str,
    ) -> Result<Generation, BackendError> {
        let limit = self.parts.model.max_model_len as usize;
        let n = prompt.len();
        if n == 0 {
            return Err(BackendError::InvalidRequest {
                message: "the prompt is empty".into(),
                param: Some(prompt_param.into()),
            });
        }
        let too_long = |asked: usize| {
            BackendError::ContextLengthExceeded(format!(
                "this model's maximum context length is {limit} tokens; the request has {n} prompt \
                 tokens and asks for {asked} more (reduce the prompt or max_tokens)"
            ))
        };
        if n >= limit {
            return Err(too_long(1));
        }
        let max_tokens = match sampling.max_tokens {
            Some(m) if n + m as usize > limit => return Err(too_long(m as usize)),
            Some(m) => m as usize,
            None => limit - n,
        };
        let params = self.sampling_params(sampling, max_tokens)?;
        let detok = IncrementalDetokenizer::with_prompt(self.parts.tokenizer.clone(), &prompt)
            .map_err(|e| BackendError::InvalidRequest {
                message: format!("the prompt cannot be decoded: {e}"),
                param: Some(prompt_param.into()),
            })?;
        let stop = StopChecker::new(&params, &self.parts.eos_token_ids);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let request = Request::new(id, prompt.clone(), params);
        let stream = self
            .parts
            .engine
            .submit(request)
            .map_err(|e| submit_error(e, prompt_param))?;
        let path = RequestPath {
            tokenizer: self.parts.tokenizer.clone(),
            detok,
            stop,
            parsers,
            logprobs: sampling.logprobs.is_some(),
            prompt_tokens: n as u32,
        };
        let (tx, rx) = mpsc::channel::<GenEvent>(256);
        tokio::spawn(path.run(stream, tx));
        let events = futures::stream::unfold(rx, |mut rx| async move {
            let e = rx.recv().await?;
            Some((e, rx))
        })
        .boxed();
        Ok(Generation {
            prompt_tokens: n as u32,
            prompt_text,
            events,
        })
    }

    fn chat_now(&self, req: ChatGenRequest) -> Result<Generation, BackendError> {
        let ids = self.prompt_ids(&req)?;
        let plugins = &self.parts.plugins;
        let reasoning = plugins
            .reasoning_stream(&ReasoningOptions {
                thinking: req.thinking,
                prompt_opens_reasoning: req.thinking,
                extra_json: None,
            })
            .map_err(|e| BackendError::Plugin(e.to_string()))?;
        let tools = plugins
            .tool_stream(&ToolOptions {
                tools_json: (!req.tools.is_empty())
                    .then(|| Value::Array(req.tools.clone()).to_string()),
                id_prefix: format!("call_{}_", short_id(&req.request_id)),
                extra_json: None,
            })
            .map_err(|e| BackendError::Plugin(e.to_string()))?;
        let parsers = Parsers {
            reasoning,
            tools,
            emit_tool_calls: !req.tools.is_empty() && req.tool_choice == ToolChoice::Auto,
        };
        self.submit(ids, &req.sampling, Some(parsers), None, "messages")
    }

    fn complete_now(&self, req: CompletionGenRequest) -> Result<Generation, BackendError> {
        let tk = &self.parts.tokenizer;
        let (ids, text) = match req.prompt {
            PromptInput::Text(t) => {
                let ids = tk.encode(&t).map_err(|e| {
                    BackendError::Internal(format!("tokenizing the prompt failed: {e}"))
                })?;
                (ids, t)
            }
            PromptInput::Tokens(ids) => {
                let text = tk.decode(&ids).map_err(|e| BackendError::InvalidRequest {
                    message: format!("'prompt' holds an invalid token id: {e}"),
                    param: Some("prompt".into()),
                })?;
                (ids, text)
            }
        };
        let echo = req.echo.then_some(text);
        self.submit(ids, &req.sampling, None, echo, "prompt")
    }
}

/// Run CPU work (a wasm template render, ~0.1-1 ms; tokenizing) without stalling the other
/// tasks of this worker thread: `block_in_place` hands them to another worker. A current-thread
/// runtime (tests) has no other worker, so there it simply runs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// A short, filesystem/label-safe suffix of a request id for tool-call ids.
fn short_id(request_id: &str) -> String {
    let tail: String = request_id
        .chars()
        .rev()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect();
    tail.chars().rev().collect()
}

fn submit_error(e: SubmitError, param: &str) -> BackendError {
    match e {
        SubmitError::ContextLengthExceeded { prompt, limit } => {
            BackendError::ContextLengthExceeded(format!(
                "this model's maximum context length is {limit} tokens, and the prompt has {prompt}"
            ))
        }
        SubmitError::PromptTooLargeForMemory => BackendError::ContextLengthExceeded(
            "the prompt needs more cache memory than this server has".into(),
        ),
        SubmitError::EmptyPrompt => BackendError::InvalidRequest {
            message: "the prompt is empty".into(),
            param: Some(param.into()),
        },
        SubmitError::InvalidSampling(message) => BackendError::InvalidRequest {
            message,
            param: None,
        },
        SubmitError::ZeroMaxTokens => BackendError::InvalidRequest {
            message: "max_tokens must be at least 1".into(),
            param: Some("max_tokens".into()),
        },
        SubmitError::InvalidToken { token, vocab } => BackendError::InvalidRequest {
            message: format!("token id {token} is outside the vocabulary ({vocab} tokens)"),
            param: Some(param.into()),
        },
        SubmitError::Overloaded { waiting } => BackendError::Overloaded(format!(
            "the server is overloaded ({waiting} requests waiting); retry later"
        )),
        SubmitError::ShuttingDown => {
            BackendError::Unavailable("the server is shutting down".into())
        }
        SubmitError::DuplicateId(id) => {
            BackendError::Internal(format!("duplicate request id {id}"))
        }
    }
}

fn load_error(e: PluginError) -> BackendError {
    match e {
        PluginError::InvalidComponent(_)
        | PluginError::WrongWorld { .. }
        | PluginError::UnsupportedWitVersion { .. }
        | PluginError::MetadataMismatch { .. }
        | PluginError::SelfTestFailed { .. } => BackendError::PluginRejected(e.to_string()),
        PluginError::NothingToRollBack(_) => BackendError::InvalidRequest {
            message: e.to_string(),
            param: None,
        },
        other => BackendError::Internal(other.to_string()),
    }
}

fn version_info(v: &VersionInfo) -> PluginVersionInfo {
    PluginVersionInfo {
        id: v.id.to_string(),
        name: v.metadata.name.clone(),
        version: v.metadata.version.clone(),
        digest: v.sha256.clone(),
        active: v.active,
        calls: v.stats.calls,
        errors: v.stats.errors + v.stats.faults,
    }
}

fn parse_stage(stage: &str) -> Result<Stage, BackendError> {
    stage.parse().map_err(BackendError::NotFound)
}

impl ChatBackend for EngineBackend {
    fn model(&self) -> ModelInfo {
        self.parts.model.clone()
    }

    fn chat(&self, request: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move { blocking(|| self.chat_now(request)) })
    }

    fn complete(
        &self,
        request: CompletionGenRequest,
    ) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move { blocking(|| self.complete_now(request)) })
    }

    fn metrics(&self) -> BackendMetrics {
        let m = self.parts.engine.metrics();
        let cache_bytes = m.cache_kv_pages * self.parts.kv_page_bytes
            + m.cache_checkpoints * self.parts.state_block_bytes;
        let used = m.pool.kv_bytes + m.pool.state_bytes;
        let cap = m.pool.capacity_bytes as u64;
        let kind = |kind: &str, used: usize| PoolUsage {
            kind: kind.into(),
            used_bytes: used as u64,
            capacity_bytes: cap,
        };
        let plugins = self
            .parts
            .plugins
            .list()
            .iter()
            .map(|v| PluginCounters {
                stage: v.stage.as_str().into(),
                version: format!("{}@{}#{}", v.metadata.name, v.metadata.version, v.id),
                calls: v.stats.calls,
                errors: v.stats.errors + v.stats.faults,
            })
            .collect();
        BackendMetrics {
            running: m.running as u64,
            waiting: m.waiting as u64,
            prefix_cache_queried_tokens: m.prompt_tokens,
            prefix_cache_hit_tokens: m.prefix_hit_tokens,
            pool: vec![
                kind("kv", m.pool.kv_bytes),
                kind("state", m.pool.state_bytes),
                kind("prefix_cache", cache_bytes),
                // What running requests hold: returns to 0 when the server is idle.
                kind("requests", used.saturating_sub(cache_bytes)),
            ],
            preemptions: m.preemptions,
            plugins,
        }
    }

    fn health(&self) -> Result<(), String> {
        for stage in [
            Stage::ChatTemplate,
            Stage::ReasoningParser,
            Stage::ToolParser,
        ] {
            if self.parts.plugins.active(stage).is_none() {
                return Err(format!("no active {stage} plugin"));
            }
        }
        Ok(())
    }

    fn list_plugins(&self) -> Vec<PluginStageInfo> {
        let all = self.parts.plugins.list();
        let mut stages: Vec<Stage> = all.iter().map(|v| v.stage).collect();
        stages.sort();
        stages.dedup();
        stages
            .into_iter()
            .map(|stage| {
                let versions: Vec<PluginVersionInfo> = all
                    .iter()
                    .filter(|v| v.stage == stage)
                    .map(version_info)
                    .collect();
                PluginStageInfo {
                    stage: stage.as_str().into(),
                    active: versions.iter().find(|v| v.active).map(|v| v.id.clone()),
                    versions,
                }
            })
            .collect()
    }

    fn load_plugin(
        &self,
        stage: String,
        component: Bytes,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async move {
            let stage = parse_stage(&stage)?;
            let host = self.parts.plugins.clone();
            // Compiling a component can take seconds: off the async threads.
            let info = tokio::task::spawn_blocking(move || host.install(stage, &component))
                .await
                .map_err(|e| BackendError::Internal(format!("plugin load task failed: {e}")))?
                .map_err(load_error)?;
            Ok(version_info(&info))
        })
    }

    fn rollback_plugin(
        &self,
        stage: String,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async move {
            let stage = parse_stage(&stage)?;
            let info = self.parts.plugins.rollback(stage).map_err(load_error)?;
            Ok(version_info(&info))
        })
    }

    /// The HTTP layer has already given running requests their grace period: end the rest now
    /// (their streams get a clear "shut down" error).
    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let engine = self.parts.engine.clone();
            let _ = tokio::task::spawn_blocking(move || engine.shutdown(Duration::ZERO)).await;
        })
    }
}
