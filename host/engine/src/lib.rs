//! # k3-engine: the serving engine core
//!
//! Continuous batching over a model [`Executor`](k3_model::Executor), with one byte arena for
//! MLA KV pages and KDA state blocks and a prefix cache that keeps sparse KDA state checkpoints.
//!
//! ```text
//! Engine::start(executor: Box<dyn Executor>, EngineConfig) -> Result<EngineHandle, EngineConfigError>
//! EngineHandle (Clone + Send + Sync):
//!   submit(Request::new(id, prompt_ids, SamplingParams)) -> Result<RequestStream, SubmitError>
//!   cancel(id) · metrics() -> EngineMetrics · flush_prefix_cache() · shutdown(deadline)
//! RequestStream: futures::Stream<Item = Result<TokenEvent, RequestError>>
//!   (+ async next(), blocking_next(), blocking_collect()); dropping it cancels the request
//! TokenEvent { token, logprob: Option<f32>, top_logprobs, finish: Option<FinishReason>,
//!              cached_tokens: Option<usize>, timing: Option<RequestTiming> /* first event only */ }
//! ```
//!
//! The engine runs on its own thread and the executor on another (a forward is blocking and
//! CPU-heavy); with `overlap` the next step is planned while the current forward runs.
//! [`EngineCore`] is the same engine, synchronous, for tests and tools.
//!
//! The engine is **token-level**: it stops on EOS ids ([`EngineConfig::eos_token_ids`]), stop
//! token ids, `max_tokens` and the context length. Stop *strings* need detokenized text: the
//! caller checks them on its incremental detokenizer (`k3_sampling::StopChecker::push_text`) and
//! cancels the request (or drops the stream) when one matches.
//!
//! Cancelling frees everything the request holds at once; KV and checkpoints it already donated
//! to the prefix cache stay there as evictable cache entries.
//!
//! Layout (a folder per concept):
//! - [`memory`]: the arena allocator (unified two-ended pool with compaction, or two fixed pools);
//! - [`cache`]: the radix tree with KV pages, checkpoints, tombstones, branch points;
//! - [`scheduler`]: [`EngineCore`] — admission, budgets, chunked prefill, preemption, state
//!   transitions (restore / snapshot / donate), sampling and events;
//! - [`engine`]: threads and the [`EngineHandle`];
//! - [`request`], [`sampling`], [`metrics`] (with Prometheus text), [`config`];
//! - `testing` (cargo feature `testing`): a deterministic toy executor (real bytes, real
//!   recurrence) for tests and the benchmark (`examples/engine_bench.rs`).

pub mod cache;
pub mod config;
pub mod engine;
pub mod memory;
pub mod metrics;
pub mod request;
pub mod sampling;
pub mod scheduler;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use config::{EngineConfig, EngineConfigError, SpeculationConfig};
pub use engine::{Engine, EngineHandle};
pub use k3_model::{ImagePixels, MediaInput};
pub use k3_sampling::{SampledToken, SamplingParams};
pub use memory::PoolMode;
pub use metrics::EngineMetrics;
pub use request::{
    FinishReason, Request, RequestError, RequestId, RequestStream, RequestTiming, SubmitError,
    TokenEvent,
};
pub use sampling::{Greedy, RequestSampler, SpecMode, TokenSampler};
pub use scheduler::EngineCore;
