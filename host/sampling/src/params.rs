//! Per-request sampling parameters and their validation.

use serde::{Deserialize, Deserializer, Serialize};

/// Largest `logprobs` top-n a request may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Bounds on stop strings, so one request cannot make stop checking expensive.
pub const MAX_STOP_STRINGS: usize = 64;
pub const MAX_STOP_STRING_BYTES: usize = 1024;

/// What a request asks of the sampler and of the stop logic.
///
/// Field names follow the OpenAI / vLLM request bodies so the API layer can map them one to one.
/// Defaults are "off" for every filter and penalty, temperature 1, no token limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 or -1 = off.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's; 0 = off.
    pub min_p: f32,
    /// Multiplicative penalty on tokens seen in the prompt or output; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Seed of this request's random stream; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Most tokens to generate; `None` = until a stop condition or the context limit.
    pub max_tokens: Option<u32>,
    /// EOS and `stop_token_ids` are not sampled before this many tokens are out.
    pub min_tokens: u32,
    /// Generation stops when the text contains any of these (OpenAI accepts a string or a list).
    #[serde(deserialize_with = "string_or_list")]
    pub stop: Vec<String>,
    /// Generation stops when one of these tokens is sampled.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the end-of-sequence token.
    pub ignore_eos: bool,
    /// Emit the matched stop string (or stop/eos token text) as part of the output.
    pub include_stop_str_in_output: bool,
    /// `Some(n)`: return the sampled token's logprob and the `n` most likely alternatives (n ≤ 20).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: None,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            include_stop_str_in_output: false,
            logprobs: None,
        }
    }
}

/// Why a request's sampling parameters or the sampler's input were rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A parameter is out of range; `field` is the request's field name.
    #[error("invalid sampling parameter `{field}` = {value}: must be {expected}")]
    InvalidParam {
        field: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("vocabulary size must be positive")]
    EmptyVocab,
    #[error("logits have {got} entries but the vocabulary has {expected}")]
    LogitsLength { expected: usize, got: usize },
    /// Every logit is NaN or -inf (e.g. everything was masked), so nothing can be sampled.
    #[error("no token has a finite logit; nothing can be sampled")]
    NoFiniteLogits,
    /// Selected candidates were passed to a request that needs the whole row, or they are not a
    /// valid selection (too many, an id outside the vocabulary, a non-finite logit).
    #[error("the selected top-k candidates cannot be sampled from for this request")]
    CandidatesUnusable,
}

fn invalid(field: &'static str, value: impl ToString, expected: &'static str) -> SamplingError {
    SamplingError::InvalidParam {
        field,
        value: value.to_string(),
        expected,
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0 (tiny positive temperatures count as 0, as in vLLM).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// `top_k` as a count, `None` when off.
    pub fn top_k_limit(&self) -> Option<usize> {
        (self.top_k > 0).then_some(self.top_k as usize)
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), SamplingError> {
        // `!(x >= 0)` style comparisons also reject NaN.
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(invalid(
                "temperature",
                self.temperature,
                "a finite number >= 0",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", self.top_p, "in (0, 1]"));
        }
        if self.top_k < -1 {
            return Err(invalid("top_k", self.top_k, ">= 0 (0 or -1 disables it)"));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(invalid("min_p", self.min_p, "in [0, 1]"));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(invalid(
                "repetition_penalty",
                self.repetition_penalty,
                "a finite number > 0 (1 disables it)",
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(invalid(
                "presence_penalty",
                self.presence_penalty,
                "in [-2, 2]",
            ));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(invalid(
                "frequency_penalty",
                self.frequency_penalty,
                "in [-2, 2]",
            ));
        }
        if self.max_tokens == Some(0) {
            return Err(invalid("max_tokens", 0, "at least 1"));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(invalid(
                "stop",
                format!("{} strings", self.stop.len()),
                "at most 64 strings",
            ));
        }
        for s in &self.stop {
            if s.is_empty() {
                return Err(invalid("stop", "\"\"", "non-empty strings"));
            }
            if s.len() > MAX_STOP_STRING_BYTES {
                return Err(invalid(
                    "stop",
                    format!("a string of {} bytes", s.len()),
                    "strings of at most 1024 bytes",
                ));
            }
        }
        if let Some(n) = self.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(invalid("logprobs", n, "at most 20"));
        }
        Ok(())
    }
}

/// Temperatures below this are treated as greedy (dividing by them would overflow).
pub(crate) const GREEDY_TEMPERATURE: f32 = 1e-5;

/// OpenAI's `stop` is either one string or a list of strings (or null).
fn string_or_list<'de, D: Deserializer<'de>>(de: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Option::<OneOrMany>::deserialize(de)? {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s],
        Some(OneOrMany::Many(v)) => v,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(p: &SamplingParams) -> &'static str {
        match p.validate() {
            Err(SamplingError::InvalidParam { field, .. }) => field,
            other => panic!("expected InvalidParam, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid_and_off() {
        let p = SamplingParams::default();
        p.validate().unwrap();
        assert!(!p.is_greedy());
        assert_eq!(p.top_k_limit(), None);
    }

    #[test]
    fn each_bad_field_is_named() {
        let base = SamplingParams::default();
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: -0.1,
                    ..base.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..base.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..base.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.01,
                    ..base.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_k: -2,
                    ..base.clone()
                },
                "top_k",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..base.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: f32::NAN,
                    ..base.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..base.clone()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..base.clone()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -2.5,
                    ..base.clone()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NAN,
                    ..base.clone()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    max_tokens: Some(0),
                    ..base.clone()
                },
                "max_tokens",
            ),
            (
                SamplingParams {
                    stop: vec![String::new()],
                    ..base.clone()
                },
                "stop",
            ),
            (
                SamplingParams {
                    logprobs: Some(21),
                    ..base.clone()
                },
                "logprobs",
            ),
        ];
        for (p, field) in cases {
            assert_eq!(field_of(&p), field, "{p:?}");
        }
    }

    #[test]
    fn edge_values_are_accepted() {
        let p = SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 1.0,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logprobs: Some(20),
            ..Default::default()
        };
        p.validate().unwrap();
        assert!(p.is_greedy());
        assert_eq!(p.top_k_limit(), None);
    }

    #[test]
    fn deserializes_openai_style_bodies() {
        let p: SamplingParams =
            serde_json::from_str(r#"{"temperature":0.5,"stop":"END","seed":7,"top_k":40}"#)
                .unwrap();
        assert_eq!(p.stop, vec!["END".to_string()]);
        assert_eq!(p.seed, Some(7));
        assert_eq!(p.top_k_limit(), Some(40));
        assert_eq!(p.top_p, 1.0, "missing fields take defaults");
        let p: SamplingParams = serde_json::from_str(r#"{"stop":["a","b"]}"#).unwrap();
        assert_eq!(p.stop, vec!["a".to_string(), "b".to_string()]);
        let p: SamplingParams = serde_json::from_str(r#"{"stop":null}"#).unwrap();
        assert!(p.stop.is_empty());
        let round: SamplingParams =
            serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(round, p);
    }
}
