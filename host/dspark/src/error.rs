//! The one error type of the drafter: loading, validation against the target, and running.

use k3_model::{BackendError, ConfigError, WeightError};

#[derive(Debug, thiserror::Error)]
pub enum DsparkError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// The drafter's `config.json` is malformed or has an out-of-range field.
    #[error("drafter config {path}: {msg}")]
    Config { path: String, msg: String },
    /// The target model's `config.json` (read for the shapes the drafter must match).
    #[error("target model config: {0}")]
    TargetConfig(#[from] ConfigError),
    #[error("drafter weights: {0}")]
    DrafterWeights(#[source] WeightError),
    /// The shared embedding and LM head read from the target's checkpoint.
    #[error("target weights (shared embedding / LM head): {0}")]
    TargetWeights(#[source] WeightError),
    /// The drafter was trained for a different target (width, vocabulary, layer count).
    #[error("drafter does not fit the target model: {0}")]
    Mismatch(String),
    /// A call with arguments the forward pass cannot take (wrong lengths, ids, positions).
    #[error("invalid drafter input: {0}")]
    Input(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A golden file without the tensors [`crate::golden`] expects.
    #[error("golden file: {0}")]
    Golden(String),
}
