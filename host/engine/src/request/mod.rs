//! What a caller hands the engine and what comes back.
//!
//! The engine is token-level: it stops on EOS, stop token ids, `max_tokens` and the context
//! length. Stop *strings* need detokenized text, so the caller (the frontend, which detokenizes
//! incrementally) checks them and calls [`EngineHandle::cancel`](crate::EngineHandle::cancel) (or
//! drops the stream) once one matches.

mod stream;

pub use stream::RequestStream;

use crate::sampling::TokenSampler;

/// Caller-chosen request id (unique among live requests).
pub type RequestId = u64;

/// Token-level generation limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerationParams {
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// Token ids that end generation (the token is emitted with `finish = Stop`).
    pub stop_token_ids: Vec<u32>,
    /// Do not stop on the engine's EOS ids.
    pub ignore_eos: bool,
    /// How many top alternatives to report per token (0 = none).
    pub top_logprobs: usize,
}

impl Default for GenerationParams {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            top_logprobs: 0,
        }
    }
}

/// One submission.
pub struct Request {
    pub id: RequestId,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    pub params: GenerationParams,
    /// How tokens are picked; `None` = greedy argmax.
    pub sampler: Option<Box<dyn TokenSampler>>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("id", &self.id)
            .field("prompt_len", &self.prompt.len())
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token id was generated.
    Stop,
    /// `max_tokens` reached, or the context length.
    Length,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub token: u32,
    pub logprob: f32,
    /// `(token, logprob)` alternatives, best first (`params.top_logprobs` of them).
    pub top_logprobs: Vec<(u32, f32)>,
    /// Set on the last event of the request.
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache; `Some` in the first event only.
    pub cached_tokens: Option<usize>,
}

/// A request that ended without finishing normally.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the request cannot fit in the cache memory even alone")]
    OutOfMemory,
    #[error("model execution failed: {0}")]
    Execution(String),
    #[error("the engine shut down before the request finished")]
    Shutdown,
    #[error("the engine refused the request: {0}")]
    Rejected(String),
}

/// Why a submission was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Maps to OpenAI's `context_length_exceeded`.
    /// (Generation itself is clipped at the context length with `FinishReason::Length`.)
    #[error("prompt of {prompt} tokens leaves no room to generate in the context length {limit}")]
    ContextLengthExceeded { prompt: usize, limit: usize },
    #[error("the prompt would need more cache memory than the engine has")]
    PromptTooLargeForMemory,
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("token id {token} is outside the vocabulary ({vocab})")]
    InvalidToken { token: u32, vocab: usize },
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
    /// The waiting queue is full; retry later (HTTP 503/429).
    #[error("the engine is overloaded ({waiting} requests waiting)")]
    Overloaded { waiting: usize },
    #[error("the engine is shutting down")]
    ShuttingDown,
}
