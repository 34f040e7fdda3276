//! Kimi Delta Attention (docs/k3-model.md §3): short conv, gates, and the delta rule in
//! its recurrent (decode) and chunked WY/UT (prefill) forms, from an initial state.
//!
//! State layout of one layer (docs/model-format.md): conv windows for q, k, v, each
//! `[H·K, W−1]` (per channel, oldest first, **pre-conv** inputs), then `S [H, K, V]` f32.

use crate::simd::{axpy, simd_fn};
use rayon::prelude::*;

/// Tokens per chunk in the WY form. With the safe gate (g ≥ −5 per token) the in-chunk decay
/// spread is at most 5·16 = 80 nats, so `exp(±Γ)` stays inside f32 and needs no rescaling.
pub const CHUNK: usize = 16;

#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub heads: usize,
    pub k: usize,
    pub conv: usize,
    pub lower_bound: f32,
}

impl Dims {
    pub fn hk(&self) -> usize {
        self.heads * self.k
    }
    pub fn window_floats(&self) -> usize {
        self.hk() * (self.conv - 1)
    }
    pub fn state_floats(&self) -> usize {
        3 * self.window_floats() + self.heads * self.k * self.k
    }
}

pub use crate::fastmath::sigmoid;

simd_fn! {
    /// Causal depthwise conv + SiLU of `x` `[T, C]` with `w` `[C, W]`, continuing from `window`
    /// `[C, W−1]`. Returns `y` `[T, C]`; [`window_at`] gives the window after `n` tokens.
    pub fn conv_silu(x: &[f32], t: usize, c: usize, w: &[f32], kw: usize, window: &[f32]) -> Vec<f32> {
        let hist = kw - 1;
        // Token-major extended input `window ++ x` and tap-major weights, so the inner loop runs
        // over contiguous channels.
        let mut ext = vec![0f32; (hist + t) * c];
        for ch in 0..c {
            for j in 0..hist {
                ext[j * c + ch] = window[ch * hist + j];
            }
        }
        ext[hist * c..].copy_from_slice(&x[..t * c]);
        let mut wt = vec![0f32; kw * c];
        for ch in 0..c {
            for j in 0..kw {
                wt[j * c + ch] = w[ch * kw + j];
            }
        }
        let mut y = vec![0f32; t * c];
        for tt in 0..t {
            let yr = &mut y[tt * c..(tt + 1) * c];
            for j in 0..kw {
                let er = &ext[(tt + j) * c..(tt + j + 1) * c];
                let wr = &wt[j * c..(j + 1) * c];
                for ((yv, &e), &wv) in yr.iter_mut().zip(er).zip(wr) {
                    *yv += wv * e;
                }
            }
            for v in yr.iter_mut() {
                *v *= crate::fastmath::sigmoid(*v);
            }
        }
        y
    }
}

/// The conv window after the first `n` of the `t` new inputs `x` `[T, C]`.
pub fn window_at(x: &[f32], c: usize, kw: usize, window: &[f32], n: usize) -> Vec<f32> {
    let hist = kw - 1;
    let mut out = vec![0f32; c * hist];
    for ch in 0..c {
        for j in 0..hist {
            // Last `hist` elements of `window ++ x[..n]`: extended index n + j.
            let e = n + j;
            out[ch * hist + j] = if e < hist {
                window[ch * hist + e]
            } else {
                x[(e - hist) * c + ch]
            };
        }
    }
    out
}

/// Per-head, token-major inputs of the delta rule (already normalised and gated).
pub struct HeadInputs {
    /// `[T, K]` each: q̂ (with the K^-½ scale), k̂, log-decay g.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub g: Vec<f32>,
    /// `[T, V]`.
    pub v: Vec<f32>,
    /// `[T]`.
    pub beta: Vec<f32>,
}

fn l2norm(x: &mut [f32], scale: f32) {
    let ss = crate::linalg::dot(x, x);
    let inv = scale / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Split conv outputs and gate logits of all heads into per-head inputs.
pub fn head_inputs(
    d: &Dims,
    t: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    f: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
) -> Vec<HeadInputs> {
    let (hk, kd) = (d.hk(), d.k);
    let qscale = 1.0 / (kd as f32).sqrt();
    (0..d.heads)
        .map(|h| {
            let mut hi = HeadInputs {
                q: vec![0.0; t * kd],
                k: vec![0.0; t * kd],
                g: vec![0.0; t * kd],
                v: vec![0.0; t * kd],
                beta: vec![0.0; t],
            };
            let a = a_log[h].exp();
            for tt in 0..t {
                let src = tt * hk + h * kd;
                let dst = tt * kd..(tt + 1) * kd;
                hi.q[dst.clone()].copy_from_slice(&q[src..src + kd]);
                l2norm(&mut hi.q[dst.clone()], qscale);
                hi.k[dst.clone()].copy_from_slice(&k[src..src + kd]);
                l2norm(&mut hi.k[dst.clone()], 1.0);
                hi.v[dst.clone()].copy_from_slice(&v[src..src + kd]);
                crate::fastmath::safe_gate_into(
                    &f[src..src + kd],
                    &dt_bias[h * kd..(h + 1) * kd],
                    a,
                    d.lower_bound,
                    &mut hi.g[tt * kd..(tt + 1) * kd],
                );
                hi.beta[tt] = sigmoid(b[tt * d.heads + h]);
            }
            hi
        })
        .collect()
}

/// The short convolution + SiLU of q, k and v over `t` tokens from their `windows` (the three
/// windows, concatenated). Each output row depends only on its own inputs, so the bits do not
/// depend on how the three run on the pool; decode (`kda_layer`) and verify (`kda_replay`) share
/// it.
pub(crate) fn conv_qkv(
    d: &Dims,
    t: usize,
    qkv: [&[f32]; 3],
    conv_w: [&[f32]; 3],
    windows: &[f32],
) -> Vec<Vec<f32>> {
    let (hk, wf) = (d.hk(), d.window_floats());
    (0..3usize)
        .into_par_iter()
        .with_max_len(if t > 1 { 1 } else { 3 })
        .map(|i| {
            conv_silu(
                qkv[i],
                t,
                hk,
                conv_w[i],
                d.conv,
                &windows[i * wf..(i + 1) * wf],
            )
        })
        .collect()
}

/// The first half of one delta-rule token on `s` `[K, V]`: decays `s` in place and returns the
/// correction `u = β(v − Sᵀk̂)`. Shared by [`recurrent_step`] and the ReplaySSM commit
/// (`kda_replay`), so that a replayed state is bit-identical to a decoded one by construction.
/// `inline(always)` so that it is compiled with the caller's SIMD target features.
#[inline(always)]
pub(crate) fn decay_and_correct(
    s: &mut [f32],
    kd: usize,
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
) -> Vec<f32> {
    let vd = v.len();
    let mut ks = vec![0f32; vd];
    for r in 0..kd {
        let row = &mut s[r * vd..(r + 1) * vd];
        let a = crate::fastmath::exp(g[r]);
        row.iter_mut().for_each(|x| *x *= a);
        axpy(k[r], row, &mut ks);
    }
    let mut u = vec![0f32; vd];
    for c in 0..vd {
        u[c] = beta * (v[c] - ks[c]);
    }
    u
}

simd_fn! {
    /// One token of the delta rule on `s` `[K, V]`: decay, correct, update; returns `o = Sᵀq̂`.
    pub fn recurrent_step(s: &mut [f32], kd: usize, q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: f32, o: &mut [f32]) {
        let vd = v.len();
        let u = decay_and_correct(s, kd, k, v, g, beta);
        o.fill(0.0);
        for r in 0..kd {
            let row = &mut s[r * vd..(r + 1) * vd];
            axpy(k[r], &u, row);
            axpy(q[r], row, o);
        }
    }
}

#[inline(always)]
fn dotf(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (ca, cb) in a.chunks(16).zip(b.chunks(16)) {
        for l in 0..ca.len() {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    acc.iter().sum()
}

simd_fn! {
    /// One chunk (≤ CHUNK tokens) of the WY/UT form (docs/k3-model.md §3, chunked form) on `s` `[K, V]`; writes `o` `[C, V]`.
    pub fn chunk_step(s: &mut [f32], kd: usize, vd: usize, q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], o: &mut [f32]) {
        let c = beta.len();
        // Γ, exp(Γ) and exp(−Γ) per row.
        let mut gam = vec![0f32; c * kd];
        for r in 0..c {
            for d in 0..kd {
                gam[r * kd + d] = g[r * kd + d] + if r > 0 { gam[(r - 1) * kd + d] } else { 0.0 };
            }
        }
        // Plain loops: closures would not inherit this function's SIMD target features.
        let mut eg = vec![0f32; c * kd];
        let mut kdec = vec![0f32; c * kd];
        let mut kinv = vec![0f32; c * kd];
        let mut qdec = vec![0f32; c * kd];
        for i in 0..c * kd {
            eg[i] = crate::fastmath::exp(gam[i]);
            kdec[i] = k[i] * eg[i];
            kinv[i] = k[i] * crate::fastmath::exp(-gam[i]);
            qdec[i] = q[i] * eg[i];
        }
        // Forward substitution: (I + L) [W | U] = Diag(β) [K̂⊙e^Γ | V].
        let mut wm = vec![0f32; c * kd];
        let mut um = vec![0f32; c * vd];
        for i in 0..c {
            let (bi, ki) = (beta[i], &kdec[i * kd..(i + 1) * kd]);
            let mut wi = vec![0f32; kd];
            let mut ui = vec![0f32; vd];
            axpy(bi, ki, &mut wi);
            axpy(bi, &v[i * vd..(i + 1) * vd], &mut ui);
            for j in 0..i {
                let lij = bi * dotf(ki, &kinv[j * kd..(j + 1) * kd]);
                axpy(-lij, &wm[j * kd..(j + 1) * kd], &mut wi);
                axpy(-lij, &um[j * vd..(j + 1) * vd], &mut ui);
            }
            wm[i * kd..(i + 1) * kd].copy_from_slice(&wi);
            um[i * vd..(i + 1) * vd].copy_from_slice(&ui);
        }
        // Ṽ = U − W S and (Q̂⊙e^Γ) S as one `[2C, K]·[K, V]` product over S's column panels.
        let sp = crate::gemm::Packed::from_kn(s, kd, vd);
        let mut xs = Vec::with_capacity(2 * c * kd);
        xs.extend_from_slice(&wm);
        xs.extend_from_slice(&qdec);
        let prod = crate::gemm::gemm_serial_vec(&xs, 2 * c, &sp);
        let mut vn = um;
        for i in 0..c * vd {
            vn[i] -= prod[i];
        }
        o[..c * vd].copy_from_slice(&prod[c * vd..2 * c * vd]);
        // O += A_qk Ṽ (causal, diagonal included).
        for i in 0..c {
            let qi = &qdec[i * kd..(i + 1) * kd];
            let oi = &mut o[i * vd..(i + 1) * vd];
            for j in 0..=i {
                let a = dotf(qi, &kinv[j * kd..(j + 1) * kd]);
                axpy(a, &vn[j * vd..(j + 1) * vd], oi);
            }
        }
        // S ← Diag(e^Γ_C) S + (e^{Γ_C−Γ} ⊙ K̂)ᵀ Ṽ, the second term as a `[K, C]·[C, V]` product.
        let last = &eg[(c - 1) * kd..c * kd];
        let mut kct = vec![0f32; kd * c];
        for j in 0..c {
            for r in 0..kd {
                kct[r * c + j] = last[r] * kinv[j * kd + r];
            }
        }
        let delta = crate::gemm::gemm_serial_vec(&kct, kd, &crate::gemm::Packed::from_kn(&vn, c, vd));
        for r in 0..kd {
            let a = last[r];
            for v in 0..vd {
                s[r * vd + v] = s[r * vd + v] * a + delta[r * vd + v];
            }
        }
    }
}

/// Run one head over `t` tokens from state `s`; `o` `[T, V]`. `cuts` are the token counts
/// after which the state is also snapshotted (returned in order). `chunked` selects the WY form.
pub fn run_head(
    s: &mut [f32],
    kd: usize,
    hi: &HeadInputs,
    t: usize,
    cuts: &[usize],
    chunked: bool,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let _ftz = crate::simd::FlushDenormals::new();
    let vd = hi.v.len() / t.max(1);
    let mut o = vec![0f32; t * vd];
    let mut snaps = Vec::with_capacity(cuts.len());
    let mut pos = 0;
    let mut cut_iter = cuts.iter().copied().peekable();
    while pos < t {
        while cut_iter.peek() == Some(&pos) {
            cut_iter.next();
            snaps.push(s.to_vec());
        }
        let limit = cut_iter.peek().copied().unwrap_or(t).min(t);
        let step = if chunked { CHUNK.min(limit - pos) } else { 1 };
        let (a, b) = (pos, pos + step);
        if chunked {
            chunk_step(
                s,
                kd,
                vd,
                &hi.q[a * kd..b * kd],
                &hi.k[a * kd..b * kd],
                &hi.v[a * vd..b * vd],
                &hi.g[a * kd..b * kd],
                &hi.beta[a..b],
                &mut o[a * vd..b * vd],
            );
        } else {
            recurrent_step(
                s,
                kd,
                &hi.q[a * kd..b * kd],
                &hi.k[a * kd..b * kd],
                &hi.v[a * vd..b * vd],
                &hi.g[a * kd..b * kd],
                hi.beta[a],
                &mut o[a * vd..b * vd],
            );
        }
        pos = b;
    }
    for c in cut_iter {
        debug_assert_eq!(c, t);
        snaps.push(s.to_vec());
    }
    (o, snaps)
}

/// A KDA layer over `t` new tokens. `state` is the layer's state region (read, then
/// overwritten); returns `o` `[T, H·V]` and, per entry of `cuts` (sorted, in 1..=t), the
/// layer's full state after that many tokens.
pub fn kda_layer(
    d: &Dims,
    t: usize,
    qkv: [&[f32]; 3],
    conv_w: [&[f32]; 3],
    f: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    cuts: &[usize],
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (hk, kd, wf) = (d.hk(), d.k, d.window_floats());
    let (windows, s) = state.split_at_mut(3 * wf);
    let conv = conv_qkv(d, t, qkv, conv_w, windows);
    let heads = head_inputs(d, t, &conv[0], &conv[1], &conv[2], f, b, a_log, dt_bias);
    let chunked = t > 1;
    // Heads in parallel for prefill; a decode step is too small to pay for a fork/join.
    let results: Vec<(Vec<f32>, Vec<Vec<f32>>)> = if chunked {
        s.par_chunks_mut(kd * kd)
            .zip(heads.par_iter())
            .map(|(sh, hi)| run_head(sh, kd, hi, t, cuts, chunked))
            .collect()
    } else {
        s.chunks_mut(kd * kd)
            .zip(heads.iter())
            .map(|(sh, hi)| run_head(sh, kd, hi, t, cuts, chunked))
            .collect()
    };
    let mut snaps: Vec<Vec<f32>> = Vec::with_capacity(cuts.len());
    for (ci, &n) in cuts.iter().enumerate() {
        let mut full = Vec::with_capacity(d.state_floats());
        for i in 0..3 {
            full.extend(window_at(
                qkv[i],
                hk,
                d.conv,
                &windows[i * wf..(i + 1) * wf],
                n,
            ));
        }
        for r in &results {
            full.extend_from_slice(&r.1[ci]);
        }
        snaps.push(full);
    }
    for i in 0..3 {
        let w = window_at(qkv[i], hk, d.conv, &windows[i * wf..(i + 1) * wf], t);
        windows[i * wf..(i + 1) * wf].copy_from_slice(&w);
    }
    let mut o = vec![0f32; t * hk];
    for (h, r) in results.iter().enumerate() {
        for tt in 0..t {
            o[tt * hk + h * kd..tt * hk + (h + 1) * kd]
                .copy_from_slice(&r.0[tt * kd..(tt + 1) * kd]);
        }
    }
    (o, snaps)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic uniform values in (−scale, scale) (an LCG; tests need no rand crate).
    pub(crate) fn rand(n: usize, seed: &mut u64, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Token recurrence in f64, straight from docs/k3-model.md §3 (recurrence).
    fn reference(s: &mut [f64], kd: usize, vd: usize, hi: &HeadInputs, t: usize) -> Vec<f64> {
        let mut o = vec![0f64; t * vd];
        for tt in 0..t {
            for r in 0..kd {
                let a = (hi.g[tt * kd + r] as f64).exp();
                for c in 0..vd {
                    s[r * vd + c] *= a;
                }
            }
            let mut u = vec![0f64; vd];
            for c in 0..vd {
                let ks: f64 = (0..kd)
                    .map(|r| hi.k[tt * kd + r] as f64 * s[r * vd + c])
                    .sum();
                u[c] = hi.beta[tt] as f64 * (hi.v[tt * vd + c] as f64 - ks);
            }
            for r in 0..kd {
                for c in 0..vd {
                    s[r * vd + c] += hi.k[tt * kd + r] as f64 * u[c];
                }
            }
            for c in 0..vd {
                o[tt * vd + c] = (0..kd)
                    .map(|r| hi.q[tt * kd + r] as f64 * s[r * vd + c])
                    .sum();
            }
        }
        o
    }

    fn inputs(t: usize, kd: usize, seed: &mut u64) -> HeadInputs {
        let d = Dims {
            heads: 1,
            k: kd,
            conv: 4,
            lower_bound: -5.0,
        };
        let (q, k, v, f) = (
            rand(t * kd, seed, 1.0),
            rand(t * kd, seed, 1.0),
            rand(t * kd, seed, 1.0),
            rand(t * kd, seed, 3.0),
        );
        let b = rand(t, seed, 2.0);
        head_inputs(&d, t, &q, &k, &v, &f, &b, &[0.3], &rand(kd, seed, 1.0))
            .pop()
            .unwrap()
    }

    #[test]
    fn chunked_and_recurrent_match_f64_reference_with_initial_state() {
        let (kd, t) = (32, 77);
        let mut seed = 7;
        let hi = inputs(t, kd, &mut seed);
        let s0 = rand(kd * kd, &mut seed, 0.5);
        let mut s64: Vec<f64> = s0.iter().map(|&x| x as f64).collect();
        let o64 = reference(&mut s64, kd, kd, &hi, t);
        for chunked in [false, true] {
            let mut s = s0.clone();
            let (o, snaps) = run_head(&mut s, kd, &hi, t, &[5, 16, 40, t], chunked);
            let err = o
                .iter()
                .zip(&o64)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(err < 1e-4, "chunked={chunked} max |Δo| {err}");
            let serr = s
                .iter()
                .zip(&s64)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(serr < 1e-4, "chunked={chunked} max |ΔS| {serr}");
            assert_eq!(snaps.len(), 4);
            assert_eq!(snaps[3], s);
            // A snapshot equals running only that prefix.
            let mut sp: Vec<f64> = s0.iter().map(|&x| x as f64).collect();
            reference(&mut sp, kd, kd, &hi, 40);
            let e = snaps[2]
                .iter()
                .zip(&sp)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(e < 1e-4, "snapshot error {e}");
        }
    }

    #[test]
    fn conv_window_continues_across_calls() {
        let (t, c, kw) = (9, 3, 4);
        let mut seed = 3;
        let x = rand(t * c, &mut seed, 1.0);
        let w = rand(c * kw, &mut seed, 1.0);
        let win0 = vec![0f32; c * (kw - 1)];
        let full = conv_silu(&x, t, c, &w, kw, &win0);
        let win = window_at(&x, c, kw, &win0, 5);
        let rest = conv_silu(&x[5 * c..], t - 5, c, &w, kw, &win);
        for (a, b) in full[5 * c..].iter().zip(&rest) {
            assert!((a - b).abs() < 1e-6);
        }
        // First output: only the current token contributes with an empty window.
        let y0 = w[kw - 1] * x[0];
        assert!((full[0] - y0 * sigmoid(y0)).abs() < 1e-6);
    }
}
