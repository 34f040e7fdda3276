//! Small pointwise / row-wise ops: RMSNorm, AttnRes, SiTU-GLU, gates, router.

use crate::fastmath::{self, sigmoid};

/// `x · rsqrt(mean(x²) + eps) · w` per row of width `w.len()`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    let mut out = vec![0f32; x.len()];
    for (xr, yr) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let inv = rms_inv(xr, eps);
        for ((y, v), g) in yr.iter_mut().zip(xr).zip(w) {
            *y = v * inv * g;
        }
    }
    out
}

fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let ss = crate::linalg::dot(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// Block AttnRes over `sources` (each `[T, d]`): per token, softmax over sources of
/// `Σ_d V_i[d]·rsqrt(mean(V_i²)+eps)·w[d]`, output `Σ α_i V_i` (raw values).
pub fn attn_res(sources: &[&[f32]], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let t = sources[0].len() / d;
    let n = sources.len();
    let mut out = vec![0f32; t * d];
    let mut s = vec![0f32; n];
    for tt in 0..t {
        for (i, src) in sources.iter().enumerate() {
            let v = &src[tt * d..(tt + 1) * d];
            let dotw = crate::linalg::dot(v, w);
            s[i] = dotw * rms_inv(v, eps);
        }
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for v in s.iter_mut() {
            *v = (*v - m).exp();
            z += *v;
        }
        let o = &mut out[tt * d..(tt + 1) * d];
        for (i, src) in sources.iter().enumerate() {
            let a = s[i] / z;
            for (y, v) in o.iter_mut().zip(&src[tt * d..(tt + 1) * d]) {
                *y += a * v;
            }
        }
    }
    out
}

/// SiTU-GLU: `β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)` (no cap on `u` without `β_lin`).
pub fn situ_glu(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    fastmath::situ_glu_into(
        gate,
        up,
        beta,
        linear_beta.unwrap_or(1.0),
        linear_beta.is_some(),
        &mut out,
    );
    out
}

/// Per head of width `hd`: `RMSNorm(o_h)·w ⊙ σ(gate_h)`.
pub fn gated_head_norm(o: &[f32], gate: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let hd = w.len();
    let mut out = rms_norm(o, w, eps);
    for (y, g) in out.iter_mut().zip(gate) {
        *y *= sigmoid(*g);
    }
    debug_assert_eq!(o.len() % hd, 0);
    out
}

/// Sigmoid router with selection bias (noaux_tc, one group): per token, the top-k experts of
/// `σ(logit) + bias` (ties to the lower index), weighted by `σ(logit)` renormalised and scaled.
pub fn route(
    logits: &[f32],
    bias: &[f32],
    k: usize,
    renormalize: bool,
    scaling: f32,
) -> (Vec<usize>, Vec<f32>) {
    let e = bias.len();
    let t = logits.len() / e;
    let mut idx = Vec::with_capacity(t * k);
    let mut wts = Vec::with_capacity(t * k);
    let mut order: Vec<usize> = Vec::with_capacity(e);
    for tt in 0..t {
        let s: Vec<f32> = logits[tt * e..(tt + 1) * e]
            .iter()
            .map(|&x| 1.0 / (1.0 + (-x).exp()))
            .collect();
        let sel: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
        order.clear();
        order.extend(0..e);
        // Stable sort by descending score keeps lower indices first among equals.
        order.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]));
        let chosen = &order[..k];
        let sum: f32 = chosen.iter().map(|&i| s[i]).sum();
        for &i in chosen {
            let mut w = s[i];
            if renormalize {
                w /= sum + 1e-20;
            }
            idx.push(i);
            wts.push(w * scaling);
        }
    }
    (idx, wts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_picks_biased_top_k_and_renormalises() {
        // Scores σ(0)=0.5 for all; bias makes 3 then 1 win; tie between 0 and 2 → lower index 0.
        let logits = [0.0, 0.0, 0.0, 0.0];
        let bias = [0.1, 0.2, 0.1, 0.5];
        let (idx, w) = route(&logits, &bias, 3, true, 2.0);
        assert_eq!(idx, vec![3, 1, 0]);
        for x in w {
            assert!((x - 2.0 / 3.0).abs() < 1e-6);
        }
    }

    #[test]
    fn situ_matches_formula() {
        let y = situ_glu(&[1.0, -30.0], &[2.0, 100.0], 4.0, Some(25.0));
        let s1 = 4.0 * (0.25f32).tanh() * sigmoid(1.0) * 25.0 * (2.0f32 / 25.0).tanh();
        assert!((y[0] - s1).abs() < 1e-6);
        assert!(y[1].abs() < 1e-9 * 100.0 + 1e-6);
        assert_eq!(
            situ_glu(&[1.0], &[3.0], 4.0, None)[0],
            4.0 * (0.25f32).tanh() * sigmoid(1.0) * 3.0
        );
    }

    #[test]
    fn attn_res_weights_sources() {
        // Two sources; w = 0 gives uniform weights → the mean.
        let a = [1.0, 2.0];
        let b = [3.0, -2.0];
        let y = attn_res(&[&a, &b], &[0.0, 0.0], 1e-5);
        assert_eq!(y, vec![2.0, 0.0]);
        // Large w along dim 0 favours the source with the bigger normalised first entry.
        let y = attn_res(&[&a, &b], &[50.0, 0.0], 1e-5);
        assert!((y[0] - 3.0).abs() < 1e-3);
    }
}
