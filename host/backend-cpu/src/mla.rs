//! Gated NoPE MLA attention over a paged latent cache (docs/k3-model.md §4).
//! Prefill: the expanded ("naive") form — k_nope and v rebuilt from the cached latents, then
//! per-head causal attention as two row-invariant matmuls. Decode: the absorbed form — the
//! query is folded into the 576-style latent space (here `kv_lora + rope`) and attends MQA-style.

use crate::gemm::{Packed, gemm_serial};
use crate::linalg::dot;
use crate::simd::{axpy, simd_fn};
use rayon::prelude::*;

#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub kv_lora: usize,
}

impl Dims {
    pub fn row(&self) -> usize {
        self.kv_lora + self.rope
    }
    pub fn qk(&self) -> usize {
        self.nope + self.rope
    }
}

/// Float offsets of cached rows: position `j` lives at `page_floats[j / pt] + (j % pt) * row`.
pub struct Pages<'a> {
    /// Per page: float offset of this layer's first row.
    pub starts: &'a [usize],
    pub page_tokens: usize,
}

impl Pages<'_> {
    pub fn row_offset(&self, j: usize, row: usize) -> usize {
        self.starts[j / self.page_tokens] + (j % self.page_tokens) * row
    }
}

/// Contiguous copy of cached rows `0..end`, `[end, row]`.
pub fn gather(arena: &[f32], pages: &Pages<'_>, end: usize, row: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(end * row);
    let mut j = 0;
    while j < end {
        let n = (pages.page_tokens - j % pages.page_tokens).min(end - j);
        let o = pages.row_offset(j, row);
        out.extend_from_slice(&arena[o..o + n * row]);
        j += n;
    }
    out
}

fn softmax_in_place(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = crate::fastmath::exp_shift_sum(x, m);
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Expanded form for `t` queries at positions `start..start+t` over `latents` `[start+t, row]`.
/// `q` `[T, H·qk]`, `kv_b` `[H·(nope+v), kv_lora]`. Returns `o` `[T, H·v]`.
pub fn attend_naive(
    d: &Dims,
    q: &[f32],
    t: usize,
    start: usize,
    latents: &[f32],
    kv_b: &[f32],
) -> Vec<f32> {
    let end = start + t;
    let (row, qk, hv) = (d.row(), d.qk(), d.nope + d.v_dim);
    let c: Vec<f32> = latents
        .chunks_exact(row)
        .flat_map(|r| r[..d.kv_lora].iter().copied())
        .collect();
    let scale = 1.0 / (qk as f32).sqrt();
    let per_head: Vec<Vec<f32>> = (0..d.heads)
        .into_par_iter()
        .map(|h| {
            // k_nope and v of every cached position for this head.
            let wk = &kv_b[h * hv * d.kv_lora..(h * hv + d.nope) * d.kv_lora];
            let wv = &kv_b[(h * hv + d.nope) * d.kv_lora..(h + 1) * hv * d.kv_lora];
            let cp = Packed::new(&c, end, d.kv_lora);
            let mut knope = vec![0f32; end * d.nope];
            gemm_serial(&c, end, &Packed::new(wk, d.nope, d.kv_lora), &mut knope);
            // Vᵀ `[v, end]` = W_UV · Cᵀ; transposed back to V `[end, v]` below.
            let mut vt = vec![0f32; d.v_dim * end];
            gemm_serial(wv, d.v_dim, &cp, &mut vt);
            let mut keys = vec![0f32; end * qk];
            for j in 0..end {
                keys[j * qk..j * qk + d.nope].copy_from_slice(&knope[j * d.nope..(j + 1) * d.nope]);
                keys[j * qk + d.nope..(j + 1) * qk]
                    .copy_from_slice(&latents[j * row + d.kv_lora..(j + 1) * row]);
            }
            let qh: Vec<f32> = (0..t)
                .flat_map(|i| {
                    q[i * d.heads * qk + h * qk..i * d.heads * qk + (h + 1) * qk]
                        .iter()
                        .copied()
                })
                .collect();
            let mut out = vec![0f32; t * d.v_dim];
            const QB: usize = 120;
            for i0 in (0..t).step_by(QB) {
                let i1 = (i0 + QB).min(t);
                let nq = i1 - i0;
                // Keys beyond the block's last query are masked for all its rows: skip them.
                let kend = start + i1;
                let mut sc = vec![0f32; nq * kend];
                gemm_serial(
                    &qh[i0 * qk..i1 * qk],
                    nq,
                    &Packed::new(&keys[..kend * qk], kend, qk),
                    &mut sc,
                );
                for r in 0..nq {
                    let lim = start + i0 + r + 1;
                    let srow = &mut sc[r * kend..(r + 1) * kend];
                    srow[..lim].iter_mut().for_each(|v| *v *= scale);
                    softmax_in_place(&mut srow[..lim]);
                    srow[lim..].fill(0.0);
                }
                let vt_k: Vec<f32> = vt
                    .chunks_exact(end)
                    .flat_map(|r| r[..kend].iter().copied())
                    .collect();
                gemm_serial(
                    &sc,
                    nq,
                    &Packed::new(&vt_k, d.v_dim, kend),
                    &mut out[i0 * d.v_dim..i1 * d.v_dim],
                );
            }
            out
        })
        .collect();
    interleave_heads(&per_head, t, d.v_dim)
}

fn interleave_heads(per_head: &[Vec<f32>], t: usize, w: usize) -> Vec<f32> {
    let h = per_head.len();
    let mut o = vec![0f32; t * h * w];
    for (hi, ph) in per_head.iter().enumerate() {
        for i in 0..t {
            o[i * h * w + hi * w..i * h * w + (hi + 1) * w]
                .copy_from_slice(&ph[i * w..(i + 1) * w]);
        }
    }
    o
}

/// Absorbed form for one query at position `end - 1`, reading rows `0..end` from the pages.
pub fn attend_absorbed(
    d: &Dims,
    q: &[f32],
    end: usize,
    arena: &[f32],
    pages: &Pages<'_>,
    kv_b: &[f32],
) -> Vec<f32> {
    let mut o = vec![0f32; d.heads * d.v_dim];
    for h in 0..d.heads {
        absorbed_head(
            d,
            h,
            q,
            end,
            arena,
            pages,
            kv_b,
            &mut o[h * d.v_dim..(h + 1) * d.v_dim],
        );
    }
    o
}

simd_fn! {
    /// One head of [`attend_absorbed`] (plain loops: closures would not get the SIMD features).
    fn absorbed_head(d: &Dims, h: usize, q: &[f32], end: usize, arena: &[f32], pages: &Pages<'_>, kv_b: &[f32], out: &mut [f32]) {
        let (row, qk, hv) = (d.row(), d.qk(), d.nope + d.v_dim);
        let scale = 1.0 / (qk as f32).sqrt();
        let qh = &q[h * qk..(h + 1) * qk];
        // q̃ = [W_UKᵀ q_nope ; q_r].
        let mut qt = vec![0f32; row];
        for p in 0..d.nope {
            let wrow = &kv_b[(h * hv + p) * d.kv_lora..(h * hv + p + 1) * d.kv_lora];
            axpy(qh[p], wrow, &mut qt[..d.kv_lora]);
        }
        qt[d.kv_lora..].copy_from_slice(&qh[d.nope..]);
        let mut s = vec![0f32; end];
        for j in 0..end {
            let o = pages.row_offset(j, row);
            s[j] = dot(&qt, &arena[o..o + row]) * scale;
        }
        softmax_in_place(&mut s);
        let mut lat = vec![0f32; d.kv_lora];
        for j in 0..end {
            let o = pages.row_offset(j, row);
            axpy(s[j], &arena[o..o + d.kv_lora], &mut lat);
        }
        for v in 0..d.v_dim {
            let r = (h * hv + d.nope + v) * d.kv_lora;
            out[v] = dot(&kv_b[r..r + d.kv_lora], &lat);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absorbed_equals_naive() {
        let d = Dims {
            heads: 3,
            nope: 16,
            rope: 8,
            v_dim: 12,
            kv_lora: 32,
        };
        let end = 23;
        let mut seed = 11u64;
        let mut rnd = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                })
                .collect()
        };
        let latents = rnd(end * d.row());
        let kv_b = rnd(d.heads * (d.nope + d.v_dim) * d.kv_lora);
        let q = rnd(4 * d.heads * d.qk());
        // Pages of 5 rows, scattered in an arena in reverse order.
        let pt = 5;
        let npages = end.div_ceil(pt);
        let starts: Vec<usize> = (0..npages)
            .map(|p| (npages - 1 - p) * pt * d.row() + 7)
            .collect();
        let mut arena = vec![0f32; npages * pt * d.row() + 7];
        for j in 0..end {
            let o = starts[j / pt] + (j % pt) * d.row();
            arena[o..o + d.row()].copy_from_slice(&latents[j * d.row()..(j + 1) * d.row()]);
        }
        let pages = Pages {
            starts: &starts,
            page_tokens: pt,
        };
        assert_eq!(gather(&arena, &pages, end, d.row()), latents);
        // Last 4 positions as a prefill chunk, vs each position decoded alone.
        let naive = attend_naive(&d, &q, 4, end - 4, &latents, &kv_b);
        for i in 0..4 {
            let qi = &q[i * d.heads * d.qk()..(i + 1) * d.heads * d.qk()];
            let abs = attend_absorbed(&d, qi, end - 3 + i, &arena, &pages, &kv_b);
            for (a, b) in abs
                .iter()
                .zip(&naive[i * d.heads * d.v_dim..(i + 1) * d.heads * d.v_dim])
            {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }
}
