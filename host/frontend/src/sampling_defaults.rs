//! Sampling defaults for the fields a request leaves out, and the conversion of a request's
//! [`SamplingOptions`] into the engine's [`SamplingParams`].

use k3_sampling::SamplingParams;
use serde_json::Value;

use crate::error::BackendError;
use crate::request::SamplingOptions;

/// Sampling defaults for fields a request leaves out (from the model's `generation_config.json`
/// when it has one, else OpenAI's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        SamplingDefaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingDefaults {
    /// Read `generation_config.json` (HF style); missing file or fields keep the defaults.
    pub fn from_generation_config(json: &Value) -> Self {
        let mut d = SamplingDefaults::default();
        let f = |k: &str| json.get(k).and_then(Value::as_f64).map(|v| v as f32);
        if let Some(v) = f("temperature") {
            d.temperature = v;
        }
        if let Some(v) = f("top_p") {
            d.top_p = v;
        }
        if let Some(v) = json.get("top_k").and_then(Value::as_i64) {
            d.top_k = v.clamp(0, i32::MAX as i64) as i32;
        }
        if let Some(v) = f("min_p") {
            d.min_p = v;
        }
        if let Some(v) = f("repetition_penalty") {
            d.repetition_penalty = v;
        }
        d
    }

    /// The engine's parameters for one request; `max_tokens` is the budget [`crate::token_budget`]
    /// already checked.
    pub(crate) fn params(
        &self,
        s: &SamplingOptions,
        max_tokens: u32,
    ) -> Result<SamplingParams, BackendError> {
        let params = SamplingParams {
            temperature: s.temperature.unwrap_or(self.temperature),
            top_p: s.top_p.unwrap_or(self.top_p),
            top_k: s
                .top_k
                .map_or(self.top_k, |k| k.min(i32::MAX as u32) as i32),
            min_p: s.min_p.unwrap_or(self.min_p),
            repetition_penalty: s.repetition_penalty.unwrap_or(self.repetition_penalty),
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            seed: s.seed,
            max_tokens: Some(max_tokens),
            min_tokens: s.min_tokens,
            stop: s.stop.clone(),
            stop_token_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos,
            include_stop_str_in_output: false,
            logprobs: s.logprobs.map(|k| k as usize),
        };
        params
            .validate()
            .map_err(|e| BackendError::InvalidRequest {
                message: e.to_string(),
                param: None,
            })?;
        Ok(params)
    }
}
