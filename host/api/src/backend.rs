//! The seam to everything behind the HTTP layer, as `k3-frontend` defines it: the API validates a
//! request into one of these plain types, hands it to a [`ChatBackend`] and turns the
//! [`GenEvent`]s it streams into OpenAI or Anthropic JSON/SSE. Re-exported here so the protocol
//! modules (and the HTTP tests' fake backend) name one place.

pub use k3_frontend::{
    BackendError, BackendMetrics, ChatBackend, ChatGenRequest, CompletionGenRequest, FinishInfo,
    FinishReason, GenEvent, Generation, ModelInfo, OutputConstraint, PluginCounters,
    PluginStageInfo, PluginVersionInfo, PoolUsage, PromptInput, RequestTiming, SamplingOptions,
    SpecDecodeMetrics, TokenLogprob, ToolChoice, TopLogprob,
};
