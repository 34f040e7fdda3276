//! The seam between the HTTP layer and everything behind it.
//!
//! The API validates a request into one of the plain data types here and hands it to a
//! [`ChatBackend`]; the backend runs the request path (chat template, tokenizer, engine,
//! detokenizer, stop strings, reasoning and tool parsers) and streams [`GenEvent`]s back. The API
//! turns those events into OpenAI or Anthropic JSON/SSE. Nothing here knows about HTTP, wasm or
//! devices, so the HTTP layer is tested with a fake backend and the real one lives elsewhere.

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use serde::Serialize;
use serde_json::{Map, Value};

/// Sampling options after validation. `None` means "the backend's default".
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingOptions {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// `None` or 0 disables top-k.
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// Stop strings; generation ends before the matched string, which is not returned.
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// `None`: up to the model's context length.
    pub max_tokens: Option<u32>,
    pub min_tokens: u32,
    pub ignore_eos: bool,
    /// `Some(k)`: return the chosen token's logprob and the top `k` alternatives.
    pub logprobs: Option<u32>,
}

/// How the model may use the declared tools. Only the modes the request path supports exist here;
/// the API rejects the rest with a clear 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolChoice {
    Auto,
    None,
}

/// A validated chat request. `messages` and `tools` are OpenAI-shaped JSON (Anthropic requests
/// are converted to this shape), normalised so the template sees one form:
/// - every message has a string `role` among system/user/assistant/tool;
/// - `content` is a string (text parts joined) or absent;
/// - assistant `tool_calls[*].function.arguments` is a string holding a JSON object;
/// - tool messages carry `name` (resolved from the matching assistant call) and `tool_call_id`;
/// - assistant reasoning is in `reasoning_content`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatGenRequest {
    pub request_id: String,
    pub messages: Vec<Value>,
    /// OpenAI function tools: `{"type":"function","function":{"name","description","parameters"}}`.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// Whether the model is prompted to think first (the reasoning parser starts in reasoning).
    pub thinking: bool,
    /// Everything the chat template receives besides messages and tools: `thinking`,
    /// `thinking_effort`, `tool_choice`, `response_format`, plus the request's `chat_template_kwargs`.
    pub template_kwargs: Map<String, Value>,
    pub sampling: SamplingOptions,
}

/// The prompt of a raw completion request.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// A validated raw completion request: no template, no parsers; the text comes back as content.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionGenRequest {
    pub request_id: String,
    pub prompt: PromptInput,
    pub sampling: SamplingOptions,
    /// Whether the caller wants the prompt text back (filled into [`Generation::prompt_text`]).
    pub echo: bool,
}

/// One running generation. Dropping it (or its `events`) must abort the request in the engine and
/// free its memory: that is how a client disconnect propagates.
pub struct Generation {
    pub prompt_tokens: u32,
    /// The prompt as text, when the request asked for an echo.
    pub prompt_text: Option<String>,
    pub events: BoxStream<'static, GenEvent>,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("prompt_tokens", &self.prompt_tokens)
            .finish_non_exhaustive()
    }
}

/// What a generation produces, in order. The stream ends after `Finished` or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// Answer text (markers stripped).
    Content(String),
    /// Thinking text.
    Reasoning(String),
    /// A tool call begins; `index` is 0-based within this response.
    ToolCallStart {
        index: u32,
        id: String,
        name: String,
    },
    /// More of the call's arguments (JSON text; concatenated they form a JSON object).
    ToolCallArguments {
        index: u32,
        delta: String,
    },
    /// The call ended; `complete: false` means the output stopped inside it (e.g. `max_tokens`):
    /// its arguments are cut short, so non-streaming responses drop it.
    ToolCallEnd {
        index: u32,
        complete: bool,
    },
    /// Log-probabilities of tokens sampled since the previous event.
    Logprobs(Vec<TokenLogprob>),
    Finished(FinishInfo),
    /// The request failed after it started (a plugin trap, an engine error).
    Error(BackendError),
}

#[derive(Debug, Clone, PartialEq)]
pub struct FinishInfo {
    pub reason: FinishReason,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// End of turn / EOS / a stop token.
    Stop,
    /// A stop string matched (the string itself).
    StopSequence(String),
    /// `max_tokens` or the context length was reached.
    Length,
    /// Aborted by the server (e.g. shutdown).
    Abort,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// Failures the backend reports; the API maps each to one HTTP status and error type.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    #[error("{0}")]
    ContextLengthExceeded(String),
    /// The chat template rejected the conversation.
    #[error("{0}")]
    Template(String),
    #[error("{message}")]
    NotSupported {
        message: String,
        param: Option<String>,
    },
    /// Too much queued work: try again later.
    #[error("{0}")]
    Overloaded(String),
    /// Shutting down or not ready.
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    NotFound(String),
    /// A plugin failed (trap, timeout, bad output) while serving this request.
    #[error("{0}")]
    Plugin(String),
    /// A plugin upload was rejected (does not type-check, fails its self-test, wrong stage).
    #[error("{0}")]
    PluginRejected(String),
    #[error("{0}")]
    Internal(String),
}

/// What `/v1/models` lists.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub id: String,
    /// Other names a request's `model` may use (e.g. the model directory path).
    pub aliases: Vec<String>,
    pub max_model_len: u32,
    pub created: u64,
}

/// Engine and plugin numbers for `/metrics`, read at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BackendMetrics {
    pub running: u64,
    pub waiting: u64,
    /// Prompt tokens looked up in the prefix cache, and how many of them hit.
    pub prefix_cache_queried_tokens: u64,
    pub prefix_cache_hit_tokens: u64,
    pub pool: Vec<PoolUsage>,
    pub preemptions: u64,
    pub plugins: Vec<PluginCounters>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PoolUsage {
    /// e.g. "kv", "state".
    pub kind: String,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PluginCounters {
    pub stage: String,
    pub version: String,
    pub calls: u64,
    pub errors: u64,
}

/// One stage's plugins as the admin API shows them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PluginStageInfo {
    pub stage: String,
    /// The active version's id, if any.
    pub active: Option<String>,
    pub versions: Vec<PluginVersionInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PluginVersionInfo {
    /// Stable id of this loaded version (content digest based).
    pub id: String,
    /// Name and version the plugin declares in its metadata.
    pub name: String,
    pub version: String,
    pub digest: String,
    pub active: bool,
    pub calls: u64,
    pub errors: u64,
}

/// Everything the HTTP layer needs from the rest of the server.
pub trait ChatBackend: Send + Sync + 'static {
    fn model(&self) -> ModelInfo;

    /// Render, tokenize and submit a chat request. Errors here are request errors (bad template
    /// input, prompt too long, overloaded); errors after the start arrive as [`GenEvent::Error`].
    fn chat(&self, request: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>>;

    fn complete(
        &self,
        request: CompletionGenRequest,
    ) -> BoxFuture<'_, Result<Generation, BackendError>>;

    fn metrics(&self) -> BackendMetrics;

    /// `Ok` when the server can take requests; the error says why not.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }

    fn list_plugins(&self) -> Vec<PluginStageInfo>;

    /// Validate a component for `stage` and make it the active version.
    fn load_plugin(
        &self,
        stage: String,
        component: bytes::Bytes,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>>;

    /// Re-activate the version that was active before the current one.
    fn rollback_plugin(
        &self,
        stage: String,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>>;

    /// Stop taking work and finish (or abort) what runs; called once at shutdown.
    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}
