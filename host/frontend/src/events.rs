//! What a running request streams back: typed events (text, reasoning, tool-call deltas,
//! logprobs, finish with usage) in order, and the [`Generation`] handle that owns the stream.

use futures::stream::BoxStream;
use serde::Serialize;

use crate::error::BackendError;
/// Defined once, beside the stop logic that decides it; the engine reports `Stop` and `Length`,
/// the request path adds stop strings and aborts.
pub use k3_engine::RequestTiming;
pub use k3_sampling::FinishReason;

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
///
/// The text and tool-call variants are the parser plugins' events (`k3_plugin_host::ParseEvent`,
/// the host's one reading of the WIT `parse-event`) as the request path passes them on: the
/// pipeline converts them in one place and adds what plugins do not see (logprobs, the finish
/// with usage, errors).
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
    /// its arguments are cut short (the parser closed their JSON). Responses still return it, as
    /// streaming already sent it, and finish with the reason the output stopped, not
    /// `tool_calls` (docs/k3-format.md §5).
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
    /// Queue and prefill time before the first token (absent when no token came).
    pub timing: Option<RequestTiming>,
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
