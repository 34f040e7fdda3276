//! `config.json` of a DSpark drafter directory (docs/speculative-decoding.md, "DSpark drafter").

use crate::DsparkError;
use serde::Deserialize;
use std::path::Path;

/// The drafter's architecture and calibration, validated on its own; [`DsparkConfig::check_target`]
/// validates it against the target model.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct DsparkConfig {
    pub model_type: String,
    /// Target layers whose hidden states the drafter reads, in concatenation order: `l` in
    /// `1..L` is the input of layer `l`, `l = L` the final mix before the target's norm.
    pub target_taps: Vec<usize>,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    /// γ: rows of one block (the anchor and γ − 1 mask rows), so at most γ draft tokens.
    pub block_size: usize,
    pub markov_rank: usize,
    /// Most recent processed positions a block attends to.
    pub context_window: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub vocab_size: usize,
    /// Per block position, the temperature that calibrates its confidence logit.
    pub confidence_temperatures: Vec<f32>,
}

impl DsparkConfig {
    pub fn from_file(path: &Path) -> Result<Self, DsparkError> {
        let text = std::fs::read_to_string(path).map_err(|source| DsparkError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json(&text).map_err(|msg| DsparkError::Config {
            path: path.display().to_string(),
            msg,
        })
    }

    /// Parse and validate; the error names the offending field.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let c: DsparkConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), String> {
        if self.model_type != "k3_dspark" {
            return Err(format!(
                "model_type {:?} is not \"k3_dspark\"",
                self.model_type
            ));
        }
        for (field, v) in [
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("block_size", self.block_size),
            ("markov_rank", self.markov_rank),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(format!("{field} must be > 0"));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim {} must be even (rotate-half RoPE)",
                self.head_dim
            ));
        }
        if self.target_taps.is_empty() {
            return Err("target_taps must name at least one layer".into());
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err("rms_norm_eps must be a positive number".into());
        }
        if !(self.rope_theta > 1.0 && self.rope_theta.is_finite()) {
            return Err("rope_theta must be a number > 1".into());
        }
        if self.confidence_temperatures.len() != self.block_size {
            return Err(format!(
                "confidence_temperatures has {} entries, block_size is {}",
                self.confidence_temperatures.len(),
                self.block_size
            ));
        }
        if let Some(t) = self
            .confidence_temperatures
            .iter()
            .find(|t| !(**t > 0.0 && t.is_finite()))
        {
            return Err(format!("confidence temperature {t} must be > 0"));
        }
        Ok(())
    }

    /// The drafter shares the target's embedding and LM head and reads its layers' states.
    pub fn check_target(&self, target: &k3_model::Config) -> Result<(), DsparkError> {
        let mismatch = |m: String| Err(DsparkError::Mismatch(m));
        if self.hidden_size != target.hidden_size {
            return mismatch(format!(
                "hidden_size {} != the target's {}",
                self.hidden_size, target.hidden_size
            ));
        }
        if self.vocab_size != target.vocab_size {
            return mismatch(format!(
                "vocab_size {} != the target's {}",
                self.vocab_size, target.vocab_size
            ));
        }
        let layers = target.num_hidden_layers;
        if let Some(t) = self.target_taps.iter().find(|&&t| t == 0 || t > layers) {
            return mismatch(format!(
                "target tap {t} is outside 1..={layers} (the target has {layers} layers)"
            ));
        }
        Ok(())
    }

    /// Floats of one position's tap row: the taps concatenated.
    pub fn tap_width(&self) -> usize {
        self.target_taps.len() * self.hidden_size
    }

    /// Width of all heads of one attention projection.
    pub fn attn_width(&self) -> usize {
        self.num_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_json() -> serde_json::Value {
        serde_json::json!({"model_type": "k3_dspark", "target_taps": [2, 5, 8], "hidden_size": 256,
            "num_layers": 2, "num_heads": 4, "head_dim": 64, "intermediate_size": 768,
            "block_size": 7, "markov_rank": 64, "context_window": 512, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "vocab_size": 8192,
            "confidence_temperatures": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]})
    }

    #[test]
    fn parses_the_spec_config() {
        let c = DsparkConfig::from_json(&spec_json().to_string()).unwrap();
        assert_eq!(c.tap_width(), 768);
        assert_eq!(c.attn_width(), 256);
    }

    #[test]
    fn rejects_bad_fields_by_name() {
        let cases: [(&str, serde_json::Value, &str); 6] = [
            ("model_type", "kimi_k3".into(), "model_type"),
            ("head_dim", 63.into(), "head_dim"),
            ("block_size", 0.into(), "block_size"),
            ("target_taps", serde_json::json!([]), "target_taps"),
            (
                "confidence_temperatures",
                serde_json::json!([1.0, 1.0]),
                "confidence_temperatures",
            ),
            ("hidden_size", "wide".into(), "invalid type"),
        ];
        for (field, value, want) in cases {
            let mut j = spec_json();
            j[field] = value;
            let err = DsparkConfig::from_json(&j.to_string()).unwrap_err();
            assert!(err.contains(want), "{field}: {err}");
        }
        let mut j = spec_json();
        j.as_object_mut().unwrap().remove("markov_rank");
        let err = DsparkConfig::from_json(&j.to_string()).unwrap_err();
        assert!(err.contains("markov_rank"), "{err}");
    }
}
