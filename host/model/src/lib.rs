//! The Kimi K3 model: config, weights and the layer graph, written once over a `Backend`.

pub mod backend;
pub mod config;
mod dummy;
pub mod error;
pub mod exec;
mod expected;
pub mod flops;
pub mod model;
pub mod runner;
pub mod select;
pub mod vision;
pub mod weights;

pub use backend::Backend;
pub use config::{Config, ConfigError, MixerKind, VisionConfig};
pub use error::{BackendError, ExecError, OpResult};
pub use exec::{
    CacheLayout, Executor, ForwardBatch, ForwardOutput, ImagePixels, LogitsWant, MediaInput,
    PendingTokenMask, SeqInput, VerifiedBlock,
};
pub use model::{LoadError, Model};
pub use runner::{ModelExecutor, Session, argmax};
pub use select::top_k_of_row;
pub use vision::VisionTower;
pub use weights::{Tensors, WeightError, WeightFile};
