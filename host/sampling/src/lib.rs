//! Sampling for k3serve: per-request parameters, the logits → token sampler, and the stop logic
//! (stop tokens, token limit, stop strings over streamed text) that decides a `FinishReason`.
//!
//! Typical decode step of one request:
//! ```
//! use k3_sampling::{Sampler, SamplingParams, SeqHistory, StopChecker, TokenVerdict};
//! let params = SamplingParams { temperature: 0.0, max_tokens: Some(8), ..Default::default() };
//! let mut sampler = Sampler::new(&params, 4).unwrap();
//! let mut history = SeqHistory::new(&[1, 2]);
//! let mut stop = StopChecker::new(&params, &[3]);
//! let logits = [0.0, 0.5, 0.1, 2.0];
//! let tok = sampler.sample(&logits, &history).unwrap();
//! history.push(tok.token);
//! assert_eq!(stop.on_token(tok.token), TokenVerdict::StopToken { emit_text: false });
//! assert_eq!(stop.finish_reason().unwrap().as_str(), "stop");
//! ```

mod history;
mod params;
mod sampler;
mod stop;

pub use history::SeqHistory;
pub use params::{
    MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, SamplingError, SamplingParams,
};
pub use sampler::{MAX_SELECTED_TOP_K, SampledToken, Sampler};
pub use stop::{FinishReason, StopChecker, StopReason, TextStep, TokenVerdict};
