//! The Kimi K3 model: config, weights and the layer graph, written once over a `Backend`.

pub mod exec;

pub use exec::{CacheLayout, ExecError, Executor, ForwardBatch, ForwardOutput, LogitsWant, SeqInput};
