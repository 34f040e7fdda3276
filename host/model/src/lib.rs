//! The Kimi K3 model: config, weights and the layer graph, written once over a `Backend`.

pub mod backend;
pub mod config;
mod dummy;
pub mod exec;
pub mod flops;
pub mod model;
pub mod runner;
pub mod vision;
pub mod weights;

pub use backend::{Backend, BackendError};
pub use config::{Config, ConfigError, MixerKind, VisionConfig};
pub use exec::{
    CacheLayout, ExecError, Executor, ForwardBatch, ForwardOutput, ImagePixels, LogitsWant,
    MediaInput, PendingTokenMask, SeqInput, VerifiedBlock, top_k_of_row,
};
pub use model::{LoadError, Model};
pub use runner::{ModelExecutor, Session, argmax};
pub use vision::VisionTower;
pub use weights::{Tensors, WeightError, WeightFile};
