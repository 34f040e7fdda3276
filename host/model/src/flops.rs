//! The FLOP count of a forward pass, for stating prefill throughput against a tensor-core rate
//! (docs/performance.md, "Prefill FLOPs"), and the bytes of a decode step, for stating TPOT
//! against the memory rate ([`decode_step_bytes`]). FLOPs counted: every weight product (2 FLOPs
//! per weight per row that uses it), MLA's attention over its causal keys as the expanded form
//! computes it (the key/value expansion of `kv_b` once per key, then 2·(qk + v) per head per
//! (query, key) pair), and KDA's chunked recurrence. Not counted: norms, activations, AttnRes mixing,
//! routing top-k, softmax: element-wise work that moves bytes rather than using tensor cores.

use crate::config::{Config, MixerKind};

/// KDA's chunk length in the FLOP model (the chunked prefill's block of tokens).
pub const KDA_FLOP_CHUNK: usize = 64;

/// FLOPs of one prefill, split by where they are spent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillFlops {
    /// KDA layers' projections (q, k, v, g, the low-rank gate, beta, o).
    pub kda_proj: f64,
    /// KDA's chunked recurrence (intra-chunk products and the state updates).
    pub kda_scan: f64,
    /// MLA layers' projections (q_a, q_b, kv_a, g, o) and the per-key kv_b expansion.
    pub mla_proj: f64,
    /// MLA attention: QKᵀ and PV over each query's causal keys.
    pub mla_attention: f64,
    /// The dense FFN layers (gate, up, down).
    pub dense_ffn: f64,
    /// MoE layers outside the routed experts: router, latent down/up, shared experts.
    pub moe_dense: f64,
    /// The routed experts (top-k of them per token, each gate, up and down).
    pub moe_experts: f64,
    /// The LM head over the rows that need logits.
    pub lm_head: f64,
}

impl PrefillFlops {
    pub fn total(&self) -> f64 {
        self.kda_proj
            + self.kda_scan
            + self.mla_proj
            + self.mla_attention
            + self.dense_ffn
            + self.moe_dense
            + self.moe_experts
            + self.lm_head
    }
}

/// FLOPs of prefilling `tokens` new tokens after `start` cached ones, with `logit_rows` rows of
/// the LM head (1 for a plain prefill, which needs only the last token's logits).
pub fn prefill_flops(c: &Config, tokens: usize, start: usize, logit_rows: usize) -> PrefillFlops {
    let (t, d) = (tokens as f64, c.hidden_size as f64);
    let mut f = PrefillFlops::default();
    for l in 0..c.num_hidden_layers {
        match c.layer_kinds[l] {
            MixerKind::Kda => {
                let k = &c.kda;
                let (h, dk) = (k.num_heads as f64, k.head_dim as f64);
                let (hk, r) = (h * dk, k.gate_low_rank_dim as f64);
                // q, k, v, g and o are hk × d; the gate's low rank pair; beta is h × d.
                let weights = 5.0 * hk * d + r * d + hk * r + h * d;
                f.kda_proj += 2.0 * weights * t;
                // Per head and token: intra-chunk QKᵀ and AV over the chunk (2·C·(dk + dv)),
                // then the state's read, key product and rank-1 update (3 × 2·dk·dv).
                let chunk = KDA_FLOP_CHUNK as f64;
                f.kda_scan += h * t * (2.0 * chunk * 2.0 * dk + 6.0 * dk * dk);
            }
            MixerKind::Mla => {
                let m = &c.mla;
                let heads = m.num_heads as f64;
                let (qk, v) = (
                    (m.qk_nope_head_dim + m.qk_rope_head_dim) as f64,
                    m.v_head_dim as f64,
                );
                let (ql, kvl) = (m.q_lora_rank as f64, m.kv_lora_rank as f64);
                let rope = m.qk_rope_head_dim as f64;
                let per_token = ql * d + heads * qk * ql + (kvl + rope) * d + 2.0 * heads * v * d;
                // kv_b expands every key, cached or new, once per call.
                let keys = (start + tokens) as f64;
                let expand = heads * (m.qk_nope_head_dim as f64 + v) * kvl;
                f.mla_proj += 2.0 * per_token * t + 2.0 * expand * keys;
                // Query i (0-based) sees start + i + 1 keys.
                let pairs = t * start as f64 + t * (t + 1.0) / 2.0;
                f.mla_attention += 2.0 * heads * (qk + v) * pairs;
            }
        }
        if c.is_dense(l) {
            f.dense_ffn += 2.0 * 3.0 * d * c.intermediate_size as f64 * t;
        } else {
            let m = &c.moe;
            let (lt, ie) = (m.latent_dim as f64, m.expert_intermediate as f64);
            let dense =
                m.num_experts as f64 * d + 2.0 * lt * d + 3.0 * d * m.shared_intermediate as f64;
            f.moe_dense += 2.0 * dense * t;
            f.moe_experts += 2.0 * m.experts_per_token as f64 * 3.0 * ie * lt * t;
        }
    }
    f.lm_head = 2.0 * c.vocab_size as f64 * d * logit_rows as f64;
    f
}

/// Bytes a decode step must move, split by what they are (docs/performance.md, "Decode bytes").
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DecodeBytes {
    /// Every weight matrix outside the routed experts and the embedding table (bf16), the LM
    /// head included: read once per step whatever the batch.
    pub dense_weights: f64,
    /// The routed experts the step's tokens touch (MXFP4 codes and E8M0 scales).
    pub experts: f64,
    /// Routed experts touched per MoE layer, expected under uniform routing.
    pub experts_per_layer: f64,
    /// KDA recurrent states (f32), read and written once per sequence.
    pub kda_state: f64,
    /// MLA's latent cache (f32 rows of kv_lora + rope) read over each sequence's context.
    pub mla_cache: f64,
}

impl DecodeBytes {
    pub fn total(&self) -> f64 {
        self.dense_weights + self.experts + self.kda_state + self.mla_cache
    }
}

/// Bytes of one decode step of `batch` sequences whose contexts hold `context` tokens each.
/// Routing is taken as uniform: each token picks k of E experts, so an expert stays untouched
/// with probability (1 - k / E)^batch. Norm weights, conv states and biases (< 0.1 %) are left out.
pub fn decode_step_bytes(c: &Config, batch: usize, context: usize) -> DecodeBytes {
    let f = prefill_flops(c, 1, 0, 1);
    // One row: every weight product is 2 FLOPs per weight, kv_b's expansion counted once.
    let weights = (f.total() - f.kda_scan - f.mla_attention - f.moe_experts) / 2.0;
    let m = &c.moe;
    let moe_layers = (0..c.num_hidden_layers).filter(|&l| !c.is_dense(l)).count() as f64;
    let (e, k) = (m.num_experts as f64, m.experts_per_token as f64);
    let per_layer = e * (1.0 - (1.0 - k / e).powi(batch as i32));
    // Three matrices of inter x latent at 4 bits, plus one scale byte per 32 values.
    let expert = 3.0 * (m.expert_intermediate * m.latent_dim) as f64 * (0.5 + 1.0 / 32.0);
    let kda_layers = c.kda_layers().count() as f64;
    let head_state = (c.kda.head_dim * c.kda.head_dim * 4) as f64;
    let mla_layers = c.num_hidden_layers as f64 - kda_layers;
    let mla_row = ((c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) * 4) as f64;
    let b = batch as f64;
    DecodeBytes {
        dense_weights: 2.0 * weights,
        experts: moe_layers * per_layer * expert,
        experts_per_layer: per_layer,
        kda_state: 2.0 * b * kda_layers * c.kda.num_heads as f64 * head_state,
        mla_cache: b * mla_layers * context as f64 * mla_row,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn slice() -> Config {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-slice");
        Config::from_file(&dir.join("config.json")).expect("models/k3-slice/config.json")
    }

    /// Hand-counted from K3's shapes (docs/performance.md, "Prefill FLOPs"): a KDA layer's
    /// projections are 443,580,416 weights; the routed experts 16 × 3 × 3072 × 3584.
    #[test]
    fn k3_slice_layers_count_as_by_hand() {
        let c = slice();
        let f = prefill_flops(&c, 1, 0, 0);
        let kda_layers = c.kda_layers().count() as f64;
        assert_eq!(f.kda_proj, 2.0 * 443_580_416.0 * kda_layers);
        let moe_layers = (c.num_hidden_layers - c.first_k_dense_replace) as f64;
        assert_eq!(
            f.moe_experts,
            2.0 * 16.0 * 3.0 * 3072.0 * 3584.0 * moe_layers
        );
        assert_eq!(f.lm_head, 0.0);
    }

    #[test]
    fn attention_grows_with_the_causal_pairs() {
        let c = slice();
        let a = prefill_flops(&c, 2048, 0, 1);
        let b = prefill_flops(&c, 4096, 0, 1);
        // Twice the tokens: projections double, attention pairs grow ~4×.
        assert!((b.kda_proj / a.kda_proj - 2.0).abs() < 1e-12);
        let r = b.mla_attention / a.mla_attention;
        assert!((3.99..4.01).contains(&r), "{r}");
        // Cached keys cost attention and expansion but no projections of their own.
        let after = prefill_flops(&c, 2048, 2048, 1);
        assert_eq!(after.kda_proj, a.kda_proj);
        assert!(after.mla_attention > 2.9 * a.mla_attention);
        assert_eq!(a.lm_head, 2.0 * 163_840.0 * 7168.0);
    }

    /// k3-slice by hand (docs/performance.md, "Decode bytes"): 6.317G dense weights in bf16,
    /// 17.55 MB per expert, 37.7 MB of KDA state per sequence read and written.
    #[test]
    fn k3_slice_decode_bytes_count_as_by_hand() {
        let c = slice();
        let one = decode_step_bytes(&c, 1, 0);
        assert!((one.dense_weights / 1e9 - 12.634).abs() < 0.01, "{one:?}");
        assert!((one.experts_per_layer - 16.0).abs() < 1e-9);
        let expert = 3.0 * 3072.0 * 3584.0 * 17.0 / 32.0;
        assert!((one.experts - 7.0 * 16.0 * expert).abs() < 1.0);
        assert_eq!(one.kda_state, 2.0 * 6.0 * 96.0 * 128.0 * 128.0 * 4.0);
        assert_eq!(one.mla_cache, 0.0);
        // Batch 16: ~113 of 128 experts per layer; batch 64: all but ~0.03 of one.
        let b16 = decode_step_bytes(&c, 16, 96);
        assert!((b16.experts_per_layer - 112.9).abs() < 0.1, "{b16:?}");
        assert!((128.0 - decode_step_bytes(&c, 64, 96).experts_per_layer) < 0.05);
        assert_eq!(b16.mla_cache, 16.0 * 2.0 * 96.0 * 576.0 * 4.0);
        // The step moves more with every sequence, never less.
        let mut last = 0.0;
        for b in [1, 2, 4, 8, 16, 32, 64, 128] {
            let t = decode_step_bytes(&c, b, 96).total();
            assert!(t > last, "{b}: {t} after {last}");
            last = t;
        }
    }
}
