//! # k3-engine: the serving engine core
//!
//! Continuous batching over a model [`Executor`](k3_model::Executor), with one byte arena for
//! MLA KV pages and KDA state blocks and a prefix cache that keeps sparse KDA state checkpoints.
//!
//! ```text
//! Engine::start(executor, EngineConfig) -> EngineHandle
//! EngineHandle::submit(Request { id, prompt, sampling: SamplingParams, sampler: None }) -> Result<RequestStream, SubmitError>
//!     RequestStream: futures::Stream<Item = Result<TokenEvent, RequestError>>  (drop = cancel)
//!     TokenEvent { token, logprob, top_logprobs, finish: Option<FinishReason>, cached_tokens }
//! EngineHandle::cancel(id) / metrics() -> EngineMetrics / flush_prefix_cache() / shutdown(deadline)
//! ```
//!
//! The engine is **token-level**: it stops on EOS ids, stop token ids, `max_tokens` and the
//! context length. Stop *strings* need detokenized text: the caller checks them on its
//! incremental detokenizer and cancels the request (or drops the stream) when one matches.
//!
//! Layout (a folder per concept):
//! - [`memory`]: the arena allocator (unified two-ended pool with compaction, or two fixed pools);
//! - [`cache`]: the radix tree with KV pages, checkpoints, tombstones, branch points;
//! - [`scheduler`]: [`EngineCore`] — admission, budgets, chunked prefill, preemption, state
//!   transitions (restore / snapshot / donate), sampling and events;
//! - [`engine`]: threads and the [`EngineHandle`];
//! - [`request`], [`sampling`], [`metrics`], [`config`];
//! - [`testing`]: a deterministic toy executor (real bytes, real recurrence) for tests and the
//!   benchmark.

pub mod cache;
pub mod config;
pub mod engine;
pub mod memory;
pub mod metrics;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod testing;

pub use config::{ConfigError, EngineConfig};
pub use engine::{Engine, EngineHandle};
pub use k3_sampling::{SampledToken, SamplingParams};
pub use memory::PoolMode;
pub use metrics::EngineMetrics;
pub use request::{
    FinishReason, Request, RequestError, RequestId, RequestStream, SubmitError, TokenEvent,
};
pub use sampling::{Greedy, RequestSampler, TokenSampler};
pub use scheduler::EngineCore;
