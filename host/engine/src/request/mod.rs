//! What a caller hands the engine and what comes back.
//!
//! The engine is token-level: it stops on EOS, stop token ids, `max_tokens` and the context
//! length. Stop *strings* need detokenized text, so the caller (the frontend, which detokenizes
//! incrementally) checks them and calls [`EngineHandle::cancel`](crate::EngineHandle::cancel) (or
//! drops the stream) once one matches.

mod stream;

pub use stream::RequestStream;

use crate::sampling::TokenSampler;
use k3_model::MediaInput;
use k3_sampling::SamplingParams;

/// Caller-chosen request id (unique among live requests).
pub type RequestId = u64;

/// One submission.
pub struct Request {
    pub id: RequestId,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Sampling and token-level stop settings. The engine uses `max_tokens`, `stop_token_ids`,
    /// `ignore_eos`, `logprobs` and the sampler fields; `stop` strings are the caller's job.
    pub sampling: SamplingParams,
    /// Replaces the `k3-sampling` sampler built from `sampling` (e.g. constrained decoding).
    pub sampler: Option<Box<dyn TokenSampler>>,
    /// The prompt's images, in position order: spans of prompt positions whose rows take the
    /// vision tower's output. The prefix cache keys those positions by the image's content.
    pub media: Vec<MediaInput>,
    /// Where the conversation ends and the template's per-request tail begins (e.g. the end of
    /// the last user message): the next turn diverges there, so prefill leaves a KDA checkpoint
    /// at the last interval boundary at or below it (docs/routing.md).
    pub checkpoint_hint: Option<usize>,
}

impl Request {
    pub fn new(id: RequestId, prompt: Vec<u32>, sampling: SamplingParams) -> Self {
        Self {
            id,
            prompt,
            sampling,
            sampler: None,
            media: Vec::new(),
            checkpoint_hint: None,
        }
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("id", &self.id)
            .field("prompt_len", &self.prompt.len())
            .field("images", &self.media.len())
            .field("sampling", &self.sampling)
            .finish_non_exhaustive()
    }
}

/// Why a request ended: the engine emits `Stop` (EOS / stop token id) and `Length`
/// (`max_tokens` / context length); aborts end the stream with a [`RequestError`] or by closing.
pub use k3_sampling::FinishReason;

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub token: u32,
    /// Log-probability of `token` (raw logits), when the request asked for logprobs.
    pub logprob: Option<f32>,
    /// `(token, logprob)` alternatives, best first (`params.top_logprobs` of them).
    pub top_logprobs: Vec<(u32, f32)>,
    /// Set on the last event of the request.
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache; `Some` in the first event only.
    pub cached_tokens: Option<usize>,
    /// Where the time to this first token went; `Some` in the first event only.
    pub timing: Option<RequestTiming>,
}

/// A request's time before its first token, as the engine saw it (vLLM's queue and prefill
/// times): waiting from submission to its first admission, then from there to the first
/// token (prefill, and any preemption in between).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTiming {
    pub queued: std::time::Duration,
    pub prefill: std::time::Duration,
}

/// A request that ended without finishing normally.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the request cannot fit in the cache memory even alone")]
    OutOfMemory,
    #[error("model execution failed: {0}")]
    Execution(String),
    #[error("sampling failed: {0}")]
    Sampling(String),
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
    /// Maps to OpenAI's `invalid_request_error`.
    #[error("{0}")]
    InvalidSampling(String),
    #[error("token id {token} is outside the vocabulary ({vocab})")]
    InvalidToken { token: u32, vocab: usize },
    /// An image span outside the prompt, empty, or overlapping another (a frontend bug).
    #[error("invalid image span: {0}")]
    InvalidMedia(String),
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
    /// The waiting queue is full; retry later (HTTP 503/429).
    #[error("the engine is overloaded ({waiting} requests waiting)")]
    Overloaded { waiting: usize },
    #[error("the engine is shutting down")]
    ShuttingDown,
}
