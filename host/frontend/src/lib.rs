//! The request path: [`Frontend`] takes a validated, protocol-neutral request
//! ([`ChatGenRequest`], [`CompletionGenRequest`]) and returns a [`Generation`], a stream of typed
//! [`GenEvent`]s (text, reasoning, tool-call deltas, logprobs, finish with usage).
//!
//! Inside: chat-template plugin → tokenizer → engine → incremental detokenizer → stop strings →
//! reasoning plugin → tool plugin. The HTTP layer (`k3-api`) depends on this crate alone and
//! calls it through [`ChatBackend`]; metrics, health and plugin admin go through the same trait,
//! so the protocols never see the engine or the plugin host.
//!
//! Modules: [`request`] (the neutral requests and the one token-limit check), [`events`] (what
//! a generation streams), [`error`], [`status`] (model, metrics, plugin versions), [`backend`]
//! (the trait), `frontend` ([`Frontend`]), `output_grammar` ([`Frontend::output_grammar`]), `prompt` (render → tokenize), `pipeline` (one
//! request's per-token path), `plugin_admin`, [`sampling_defaults`], and the tokenizer and
//! detokenizer.

mod admission;
pub mod backend;
mod bpe;
mod constrain;
mod detokenizer;
pub mod error;
pub mod events;
#[cfg(test)]
mod forgery_tests;
mod frontend;
mod media;
mod output_grammar;
mod pipeline;
pub mod plugin_admin;
mod prompt;
pub mod request;
pub mod sampling_defaults;
mod segments;
pub mod status;
#[cfg(test)]
mod tests;
pub mod text_cache;
mod tokenizer;

pub use backend::{CacheEventReceiver, ChatBackend};
pub use detokenizer::IncrementalDetokenizer;
pub use error::{BackendError, FrontendError};
pub use events::{
    FinishInfo, FinishReason, GenEvent, Generation, RequestTiming, TokenLogprob, TopLogprob,
};
pub use frontend::{Frontend, FrontendParts};
pub use k3_structured::{ConstraintError, OutputConstraint};
pub use media::{MediaFetcher, MediaSettings, VisionGeometry};
pub use output_grammar::OutputGrammar;
pub use prompt::PromptRenderer;
pub use request::{
    ChatGenRequest, CompletionGenRequest, PromptInput, SamplingOptions, ToolChoice, token_budget,
};
pub use sampling_defaults::SamplingDefaults;
pub use segments::{Segment, encode_segments, special_token_spellings};
pub use status::{
    BackendMetrics, ModelInfo, PluginCounters, PluginStageInfo, PluginVersionInfo, PoolUsage,
    SpecDecodeMetrics,
};
pub use tokenizer::{NamedToken, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer, TokenizerError};
