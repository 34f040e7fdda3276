//! DSpark block drafting for k3-mini (docs/speculative-decoding.md, "DSpark drafter").
//!
//! A small model reads hidden-state taps of the target, and in one non-causal pass over the last
//! committed token (the anchor) and γ − 1 mask rows predicts a whole block; a low-rank Markov head
//! adds the previous token's bias left to right, and a calibrated confidence head estimates each
//! token's acceptance for the verify planner.
//!
//! - [`DsparkModel`]: the weights on a `k3_model::Backend` (loaded from a drafter directory plus
//!   the embedding and LM head shared with the target) and the forward pass.
//! - [`DsparkDrafter`]: one sequence's state, a `k3_speculative::DraftSource`.
//! - [`ContextCache`]: the per-sequence ring of recent positions' keys and values.
//! - [`golden`]: comparison against a golden file of the reference implementation.

mod attention;
mod config;
mod context;
mod drafter;
mod error;
pub mod golden;
mod model;

pub use config::DsparkConfig;
pub use context::{ContextCache, ContextShape, ContextView};
pub use drafter::DsparkDrafter;
pub use error::DsparkError;
pub use model::{BlockOutput, BlockScores, DsparkModel, argmax, softmax_at};
