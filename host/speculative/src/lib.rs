//! The parts of speculative decoding that do not touch the model (docs/speculative-decoding.md):
//!
//! - [`draft`]: where draft tokens come from, behind one trait ([`DraftSource`]), and
//!   [`NgramDrafter`], prompt lookup: the continuation of the latest earlier occurrence of the
//!   sequence's last n tokens (free, and strong on traffic that repeats its context).
//! - [`verify`]: the acceptance rule that makes a verify pass lossless — exact match for greedy
//!   requests, rejection sampling against the target's final distributions for sampled ones.
//! - [`planner`]: how many draft tokens each running request verifies in a step, from the
//!   drafts' confidences and the measured cost of a target step by token count.

pub mod draft;
pub mod planner;
pub mod verify;

pub use draft::{Draft, DraftSampling, DraftSource, DraftSourceFactory, NgramDrafter, NgramParams};
pub use planner::{DraftingRecord, StepCostProfile, drafting_pays, plan_verify_lengths};
pub use verify::{DraftProbs, Verdict, verify_greedy, verify_sampled, verify_token};
