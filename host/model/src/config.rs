//! `config.json` → [`Config`], with validation. Every error names the offending field.

use serde_json::{Map, Value};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("config.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("config field `{0}` is missing")]
    Missing(String),
    #[error("config field `{field}`: {msg}")]
    Invalid { field: String, msg: String },
}

fn invalid(field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        msg: msg.into(),
    }
}

/// One config for every member of the K3 family (see docs/model-format.md).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub rms_norm_eps: f32,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
    pub max_position_embeddings: usize,
    pub situ_beta: f32,
    /// `None` = no soft cap on the up branch.
    pub situ_linear_beta: Option<f32>,
    pub attn_res_block_size: usize,
    pub first_k_dense_replace: usize,
    pub intermediate_size: usize,
    pub kda: KdaConfig,
    pub mla: MlaConfig,
    pub moe: MoeConfig,
    /// Per layer (0-based), which mixer it uses.
    pub layer_kinds: Vec<MixerKind>,
    /// The vision tower (`vision_config`); `None`: a text-only model.
    pub vision: Option<VisionConfig>,
}

/// `vision_config` and the media token ids (docs/vision.md).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// The tower's safetensors file, relative to the model directory.
    pub weights: String,
    pub patch_size: usize,
    pub merge_size: usize,
    /// The tower's width `W` (the decoder's width is the top-level `hidden_size`).
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub max_pixels: usize,
    pub min_pixels: usize,
    /// `<|kimi_image_placeholder|>`: the chat template's marker for one image.
    pub media_placeholder_token_id: u32,
    /// `<|media_pad|>`: one per image token, the rows the tower's output replaces.
    pub media_pad_token_id: u32,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
    /// Pixels per side of one image token (patch × merge).
    pub fn token_side(&self) -> usize {
        self.patch_size * self.merge_size
    }
    /// Image tokens of a `height × width` image (each side a multiple of [`Self::token_side`]).
    pub fn image_tokens(&self, height: usize, width: usize) -> usize {
        (height / self.token_side()) * (width / self.token_side())
    }

    fn parse(root: &Fields<'_>, vocab_size: usize) -> Result<Option<Self>, ConfigError> {
        if matches!(root.obj.get("vision_config"), None | Some(Value::Null)) {
            return Ok(None);
        }
        let f = root.object("vision_config")?;
        let v = VisionConfig {
            weights: f.str("weights")?.to_string(),
            patch_size: f.positive("patch_size")?,
            merge_size: f.positive("merge_size")?,
            hidden_size: f.positive("hidden_size")?,
            num_hidden_layers: f.positive("num_hidden_layers")?,
            num_attention_heads: f.positive("num_attention_heads")?,
            intermediate_size: f.positive("intermediate_size")?,
            rope_theta: f.f32("rope_theta")?,
            rms_norm_eps: f.f32("rms_norm_eps")?,
            max_pixels: f.positive("max_pixels")?,
            min_pixels: f.usize("min_pixels")?,
            media_placeholder_token_id: root.u32("media_placeholder_token_id")?,
            media_pad_token_id: root.u32("media_pad_token_id")?,
        };
        if !v.hidden_size.is_multiple_of(v.num_attention_heads) || !v.head_dim().is_multiple_of(4) {
            return Err(invalid(
                "vision_config.num_attention_heads",
                format!(
                    "width {} over {} heads must give a head size that is a multiple of 4 \
                     (2-D RoPE rotates each quarter pair)",
                    v.hidden_size, v.num_attention_heads
                ),
            ));
        }
        if v.rope_theta <= 0.0 || v.rms_norm_eps <= 0.0 {
            return Err(invalid(
                "vision_config.rope_theta",
                "rope_theta and rms_norm_eps must be > 0",
            ));
        }
        if v.min_pixels > v.max_pixels || v.max_pixels < v.token_side() * v.token_side() {
            return Err(invalid(
                "vision_config.max_pixels",
                format!(
                    "must be >= min_pixels and hold one {0}x{0} image token",
                    v.token_side()
                ),
            ));
        }
        if v.weights.is_empty() || v.weights.contains("..") || v.weights.starts_with('/') {
            return Err(invalid(
                "vision_config.weights",
                "must be a file name inside the model directory",
            ));
        }
        for (key, id) in [
            ("media_placeholder_token_id", v.media_placeholder_token_id),
            ("media_pad_token_id", v.media_pad_token_id),
        ] {
            if id as usize >= vocab_size {
                return Err(invalid(key, format!("{id} >= vocab_size {vocab_size}")));
            }
        }
        Ok(Some(v))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixerKind {
    Kda,
    Mla,
}

#[derive(Debug, Clone, PartialEq)]
pub struct KdaConfig {
    pub num_heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
    pub gate_lower_bound: f32,
    pub gate_low_rank_dim: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    pub num_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate: usize,
    pub shared_intermediate: usize,
    pub latent_dim: usize,
    pub latent_use_norm: bool,
    pub renormalize: bool,
    pub routed_scaling_factor: f32,
    pub group_size: usize,
}

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }
    fn get(&self, key: &str) -> Result<&'a Value, ConfigError> {
        self.obj
            .get(key)
            .ok_or_else(|| ConfigError::Missing(self.name(key)))
    }
    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        let v = self.get(key)?;
        v.as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| {
                invalid(
                    &self.name(key),
                    format!("expected a non-negative integer, got {v}"),
                )
            })
    }
    fn positive(&self, key: &str) -> Result<usize, ConfigError> {
        let x = self.usize(key)?;
        if x == 0 {
            return Err(invalid(&self.name(key), "must be > 0"));
        }
        Ok(x)
    }
    fn u32(&self, key: &str) -> Result<u32, ConfigError> {
        let x = self.usize(key)?;
        u32::try_from(x).map_err(|_| invalid(&self.name(key), "does not fit in u32"))
    }
    fn f32(&self, key: &str) -> Result<f32, ConfigError> {
        let v = self.get(key)?;
        let x = v
            .as_f64()
            .ok_or_else(|| invalid(&self.name(key), format!("expected a number, got {v}")))?;
        if !x.is_finite() {
            return Err(invalid(&self.name(key), "must be finite"));
        }
        Ok(x as f32)
    }
    fn opt_f32(&self, key: &str) -> Result<Option<f32>, ConfigError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.f32(key).map(Some),
        }
    }
    fn bool(&self, key: &str) -> Result<bool, ConfigError> {
        let v = self.get(key)?;
        v.as_bool()
            .ok_or_else(|| invalid(&self.name(key), format!("expected true/false, got {v}")))
    }
    fn str(&self, key: &str) -> Result<&'a str, ConfigError> {
        let v = self.get(key)?;
        v.as_str()
            .ok_or_else(|| invalid(&self.name(key), format!("expected a string, got {v}")))
    }
    fn expect_str(&self, key: &str, want: &str) -> Result<(), ConfigError> {
        let got = self.str(key)?;
        if got != want {
            return Err(invalid(
                &self.name(key),
                format!("unsupported value {got:?} (expected {want:?})"),
            ));
        }
        Ok(())
    }
    fn expect_true(&self, key: &str) -> Result<(), ConfigError> {
        if !self.bool(key)? {
            return Err(invalid(&self.name(key), "only `true` is supported"));
        }
        Ok(())
    }
    fn usize_list(&self, key: &str) -> Result<Vec<usize>, ConfigError> {
        let v = self.get(key)?;
        let arr = v
            .as_array()
            .ok_or_else(|| invalid(&self.name(key), "expected a list of integers"))?;
        arr.iter()
            .map(|x| {
                x.as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| invalid(&self.name(key), format!("expected integers, got {x}")))
            })
            .collect()
    }
    fn object(&self, key: &'a str) -> Result<Fields<'a>, ConfigError> {
        let v = self.get(key)?;
        let obj = v
            .as_object()
            .ok_or_else(|| invalid(&self.name(key), "expected an object"))?;
        Ok(Fields { obj, prefix: key })
    }
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json(&text)
    }

    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let root: Value = serde_json::from_str(text)?;
        let obj = root
            .as_object()
            .ok_or_else(|| invalid("<root>", "expected a JSON object"))?;
        let f = Fields { obj, prefix: "" };

        f.expect_str("model_type", "kimi_k3")?;
        f.expect_str("hidden_act", "situ")?;
        if f.obj.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true) {
            return Err(invalid(
                "tie_word_embeddings",
                "tied embeddings are not supported by K3",
            ));
        }
        let num_hidden_layers = f.positive("num_hidden_layers")?;

        let la = f.object("linear_attn_config")?;
        la.expect_true("use_full_rank_gate")?;
        let kda = KdaConfig {
            num_heads: la.positive("num_heads")?,
            head_dim: la.positive("head_dim")?,
            conv_kernel: la.positive("short_conv_kernel_size")?,
            gate_lower_bound: la.f32("gate_lower_bound")?,
            gate_low_rank_dim: la.positive("gate_low_rank_dim")?,
        };
        if kda.gate_lower_bound >= 0.0 {
            return Err(invalid(
                "linear_attn_config.gate_lower_bound",
                "must be negative",
            ));
        }
        let kda_layers = la.usize_list("kda_layers")?;
        let full_layers = la.usize_list("full_attn_layers")?;
        let mut layer_kinds = Vec::with_capacity(num_hidden_layers);
        for l in 0..num_hidden_layers {
            let is_kda = kda_layers.contains(&(l + 1));
            let is_mla = full_layers.contains(&(l + 1));
            match (is_kda, is_mla) {
                (true, false) => layer_kinds.push(MixerKind::Kda),
                (false, true) => layer_kinds.push(MixerKind::Mla),
                _ => {
                    return Err(invalid(
                        "linear_attn_config.kda_layers",
                        format!(
                            "layer {} (1-based) must be in exactly one of kda_layers / full_attn_layers",
                            l + 1
                        ),
                    ));
                }
            }
        }
        for (key, list) in [
            ("kda_layers", &kda_layers),
            ("full_attn_layers", &full_layers),
        ] {
            if let Some(bad) = list.iter().find(|&&x| x == 0 || x > num_hidden_layers) {
                return Err(invalid(
                    &format!("linear_attn_config.{key}"),
                    format!("layer {bad} is outside 1..={num_hidden_layers}"),
                ));
            }
        }

        f.expect_true("mla_use_nope")?;
        f.expect_true("mla_use_output_gate")?;
        let mla = MlaConfig {
            num_heads: f.positive("num_attention_heads")?,
            q_lora_rank: f.positive("q_lora_rank")?,
            kv_lora_rank: f.positive("kv_lora_rank")?,
            qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: f.usize("qk_rope_head_dim")?,
            v_head_dim: f.positive("v_head_dim")?,
        };

        f.expect_str("moe_router_activation_func", "sigmoid")?;
        f.expect_str("topk_method", "noaux_tc")?;
        // Group-limited selection only triggers with more than one group; K3 and k3-mini use 1/1.
        let groups = f
            .obj
            .get("num_expert_group")
            .and_then(Value::as_u64)
            .unwrap_or(1);
        if groups > 1 {
            return Err(invalid(
                "num_expert_group",
                "group-limited routing (> 1 group) is not supported",
            ));
        }
        let num_experts = f.positive("num_experts")?;
        let experts_per_token = f.positive("num_experts_per_token")?;
        if experts_per_token > num_experts {
            return Err(invalid(
                "num_experts_per_token",
                format!("{experts_per_token} > num_experts {num_experts}"),
            ));
        }
        let expert_intermediate = f.positive("moe_intermediate_size")?;
        let num_shared = f.usize("num_shared_experts")?;
        let shared_intermediate = if f.obj.contains_key("shared_expert_intermediate_size") {
            f.usize("shared_expert_intermediate_size")?
        } else {
            num_shared * expert_intermediate
        };
        if shared_intermediate == 0 {
            return Err(invalid(
                "num_shared_experts",
                "a shared expert is required (K3 always has one)",
            ));
        }
        let q = f.object("quantization_config")?;
        q.expect_str("format", "mxfp4-pack-quantized")?;
        let group_size = q.positive("group_size")?;
        if group_size != 32 {
            return Err(invalid(
                "quantization_config.group_size",
                "MXFP4 uses blocks of 32",
            ));
        }
        let moe = MoeConfig {
            num_experts,
            experts_per_token,
            expert_intermediate,
            shared_intermediate,
            latent_dim: f.positive("routed_expert_hidden_size")?,
            latent_use_norm: f.bool("latent_moe_use_norm")?,
            renormalize: f.bool("moe_renormalize")?,
            routed_scaling_factor: f.f32("routed_scaling_factor")?,
            group_size,
        };
        for (key, dim) in [
            ("routed_expert_hidden_size", moe.latent_dim),
            ("moe_intermediate_size", moe.expert_intermediate),
        ] {
            if dim % group_size != 0 {
                return Err(invalid(
                    key,
                    format!("{dim} is not a multiple of the MXFP4 group size {group_size}"),
                ));
            }
        }

        let cfg = Config {
            vocab_size: f.positive("vocab_size")?,
            hidden_size: f.positive("hidden_size")?,
            num_hidden_layers,
            rms_norm_eps: f.f32("rms_norm_eps")?,
            bos_token_id: f.u32("bos_token_id")?,
            eos_token_id: f.u32("eos_token_id")?,
            pad_token_id: f.u32("pad_token_id")?,
            max_position_embeddings: f.positive("max_position_embeddings")?,
            situ_beta: f.f32("activation_situ_beta")?,
            situ_linear_beta: f.opt_f32("activation_situ_linear_beta")?,
            attn_res_block_size: f.positive("attn_res_block_size")?,
            first_k_dense_replace: f.usize("first_k_dense_replace")?,
            intermediate_size: f.positive("intermediate_size")?,
            kda,
            mla,
            moe,
            layer_kinds,
            vision: None,
        };
        let cfg = Config {
            vision: VisionConfig::parse(&f, cfg.vocab_size)?,
            ..cfg
        };
        if cfg.rms_norm_eps <= 0.0 {
            return Err(invalid("rms_norm_eps", "must be > 0"));
        }
        if cfg.situ_beta <= 0.0 || cfg.situ_linear_beta.is_some_and(|b| b <= 0.0) {
            return Err(invalid("activation_situ_beta", "SiTU betas must be > 0"));
        }
        for (key, id) in [
            ("bos_token_id", cfg.bos_token_id),
            ("eos_token_id", cfg.eos_token_id),
        ] {
            if id as usize >= cfg.vocab_size {
                return Err(invalid(
                    key,
                    format!("{id} >= vocab_size {}", cfg.vocab_size),
                ));
            }
        }
        Ok(cfg)
    }

    pub fn is_dense(&self, layer: usize) -> bool {
        layer < self.first_k_dense_replace
    }
    pub fn kda_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_hidden_layers).filter(|&l| self.layer_kinds[l] == MixerKind::Kda)
    }
    pub fn mla_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_hidden_layers).filter(|&l| self.layer_kinds[l] == MixerKind::Mla)
    }
    /// f32 values of one KDA layer's state: conv windows (q, k, v) then the recurrent state.
    pub fn kda_layer_state_floats(&self) -> usize {
        let hk = self.kda.num_heads * self.kda.head_dim;
        3 * hk * (self.kda.conv_kernel - 1)
            + self.kda.num_heads * self.kda.head_dim * self.kda.head_dim
    }
    /// f32 values of one cached MLA latent row.
    pub fn mla_row_floats(&self) -> usize {
        self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
    }
}

#[cfg(test)]
pub(crate) const MINI_CONFIG: &str = r#"{
  "model_type": "kimi_k3", "architectures": ["KimiK3ForCausalLM"],
  "vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 8, "rms_norm_eps": 1e-5,
  "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
  "max_position_embeddings": 4096, "hidden_act": "situ",
  "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
  "attn_res_block_size": 4, "first_k_dense_replace": 1, "intermediate_size": 768,
  "linear_attn_config": {"kda_layers": [1,2,3,5,6,7], "full_attn_layers": [4,8], "num_heads": 2,
    "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
    "use_full_rank_gate": true, "gate_low_rank_dim": 128},
  "num_attention_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128,
  "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
  "mla_use_nope": true, "mla_use_output_gate": true,
  "num_experts": 32, "num_experts_per_token": 4, "moe_intermediate_size": 256,
  "num_shared_experts": 1, "shared_expert_intermediate_size": 512,
  "routed_expert_hidden_size": 128, "latent_moe_use_norm": true,
  "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "routed_scaling_factor": 1.0,
  "topk_method": "noaux_tc", "num_expert_group": 1, "topk_group": 1,
  "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "group_size": 32, "targets": ["routed_experts"]}
}"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mini() {
        let c = Config::from_json(MINI_CONFIG).unwrap();
        assert_eq!(c.hidden_size, 256);
        assert_eq!(c.mla_layers().collect::<Vec<_>>(), vec![3, 7]);
        assert_eq!(c.kda_layers().count(), 6);
        assert_eq!(c.moe.shared_intermediate, 512);
        assert_eq!(c.situ_linear_beta, Some(25.0));
    }

    fn edited(f: impl FnOnce(&mut Map<String, Value>)) -> Result<Config, ConfigError> {
        let mut v: Value = serde_json::from_str(MINI_CONFIG).unwrap();
        f(v.as_object_mut().unwrap());
        Config::from_json(&v.to_string())
    }

    #[test]
    fn missing_field_is_named() {
        let e = edited(|o| {
            o.remove("kv_lora_rank");
        })
        .unwrap_err();
        assert!(e.to_string().contains("`kv_lora_rank`"), "{e}");
        let e = edited(|o| {
            o["linear_attn_config"]
                .as_object_mut()
                .unwrap()
                .remove("head_dim");
        })
        .unwrap_err();
        assert!(e.to_string().contains("linear_attn_config.head_dim"), "{e}");
    }

    #[test]
    fn wrong_field_is_named() {
        let e = edited(|o| {
            o.insert("hidden_size".into(), Value::from("big"));
        })
        .unwrap_err();
        assert!(e.to_string().contains("`hidden_size`"), "{e}");
        let e = edited(|o| {
            o["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 4, 5, 6, 7]);
        })
        .unwrap_err();
        assert!(e.to_string().contains("exactly one"), "{e}");
        let e = edited(|o| {
            o.insert("num_experts_per_token".into(), Value::from(64));
        })
        .unwrap_err();
        assert!(e.to_string().contains("num_experts_per_token"), "{e}");
        let e = edited(|o| {
            o.insert("activation_situ_linear_beta".into(), Value::Null);
        })
        .unwrap();
        assert_eq!(e.situ_linear_beta, None);
    }

    fn with_vision(f: impl FnOnce(&mut Map<String, Value>)) -> Result<Config, ConfigError> {
        edited(|o| {
            o.insert(
                "vision_config".into(),
                serde_json::json!({"weights": "vision.safetensors", "patch_size": 16,
                    "merge_size": 2, "hidden_size": 192, "num_hidden_layers": 4,
                    "num_attention_heads": 3, "intermediate_size": 768, "rope_theta": 10000.0,
                    "rms_norm_eps": 1e-5, "max_pixels": 65536, "min_pixels": 1024}),
            );
            o.insert("media_placeholder_token_id".into(), Value::from(6));
            o.insert("media_pad_token_id".into(), Value::from(7));
            f(o);
        })
    }

    #[test]
    fn vision_config_is_optional_and_checked() {
        assert_eq!(Config::from_json(MINI_CONFIG).unwrap().vision, None);
        let v = with_vision(|_| {}).unwrap().vision.unwrap();
        assert_eq!((v.head_dim(), v.token_side()), (64, 32));
        assert_eq!((v.media_placeholder_token_id, v.media_pad_token_id), (6, 7));
        assert_eq!(v.image_tokens(64, 96), 6);
        let e = with_vision(|o| {
            o.remove("media_pad_token_id");
        })
        .unwrap_err();
        assert!(e.to_string().contains("`media_pad_token_id`"), "{e}");
        let e = with_vision(|o| {
            o["vision_config"]["num_attention_heads"] = Value::from(5);
        })
        .unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        let e = with_vision(|o| {
            o["vision_config"]
                .as_object_mut()
                .unwrap()
                .remove("rope_theta");
        })
        .unwrap_err();
        assert!(e.to_string().contains("vision_config.rope_theta"), "{e}");
        let e = with_vision(|o| {
            o.insert("media_pad_token_id".into(), Value::from(9000));
        })
        .unwrap_err();
        assert!(e.to_string().contains("media_pad_token_id"), "{e}");
    }
}
