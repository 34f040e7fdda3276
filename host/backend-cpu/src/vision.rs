//! The vision tower's own ops (docs/vision.md): bias add, GELU (tanh form), the 2-D RoPE
//! attention over one image's patches and the 2×2 patch merge.

use crate::linalg::dot;
use k3_model::backend::VisionAttnGeom;
use rayon::prelude::*;

/// `√(2/π)`, the tanh-GELU's inner scale.
const GELU_K: f32 = 0.797_884_6;

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, as torch's `gelu(approximate="tanh")`.
pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (GELU_K * (x + 0.044_715 * x * x * x)).tanh())
}

/// `cos`/`sin` of `pos · θ^(−i/quarter)` for `pos < n`, `i < quarter`, `[pos][i]`; angles in f64
/// as the reference computes them.
fn rope_table(n: usize, quarter: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(n * quarter);
    let mut sin = Vec::with_capacity(n * quarter);
    for pos in 0..n {
        for i in 0..quarter {
            let a = pos as f64 * (theta as f64).powf(-(i as f64) / quarter as f64);
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

/// Rotate one head's vector in place: the first half by `row`, the second by `col`, each half
/// in rotate-half pairs `(x[i], x[i + quarter])`.
fn rotate(x: &mut [f32], row: usize, col: usize, cos: &[f32], sin: &[f32]) {
    let quarter = x.len() / 4;
    for (half, pos) in [(0, row), (1, col)] {
        let part = &mut x[half * 2 * quarter..(half + 1) * 2 * quarter];
        let (c, s) = (
            &cos[pos * quarter..(pos + 1) * quarter],
            &sin[pos * quarter..(pos + 1) * quarter],
        );
        for i in 0..quarter {
            let (x1, x2) = (part[i], part[i + quarter]);
            part[i] = x1 * c[i] - x2 * s[i];
            part[i + quarter] = x2 * c[i] + x1 * s[i];
        }
    }
}

/// See `Backend::vision_attention`. `qkv` is `[n, 3·H·hd]`, checked by the caller.
pub fn attention(qkv: &[f32], g: VisionAttnGeom) -> Vec<f32> {
    let (h, hd) = (g.heads, g.head_dim);
    let n = g.grid_h * g.grid_w;
    let w = h * hd;
    let (cos, sin) = rope_table(g.grid_h.max(g.grid_w), hd / 4, g.rope_theta);
    // Per head, contiguous [n, hd] blocks of rotated q, k and of v.
    let mut q = vec![0f32; h * n * hd];
    let mut k = vec![0f32; h * n * hd];
    let mut v = vec![0f32; h * n * hd];
    for i in 0..n {
        let (row, col) = (i / g.grid_w, i % g.grid_w);
        let src = &qkv[i * 3 * w..(i + 1) * 3 * w];
        for head in 0..h {
            let at = (head * n + i) * hd;
            for (dst, part) in [(&mut q, 0), (&mut k, 1), (&mut v, 2)] {
                let s = &src[part * w + head * hd..part * w + (head + 1) * hd];
                dst[at..at + hd].copy_from_slice(s);
                if part < 2 {
                    rotate(&mut dst[at..at + hd], row, col, &cos, &sin);
                }
            }
        }
    }
    let scale = 1.0 / (hd as f32).sqrt();
    // One task per query row: its output row over all heads.
    let mut out = vec![0f32; n * w];
    out.par_chunks_mut(w).enumerate().for_each(|(i, o)| {
        let mut p = vec![0f32; n];
        for head in 0..h {
            let base = head * n * hd;
            let qi = &q[base + i * hd..base + (i + 1) * hd];
            let mut m = f32::NEG_INFINITY;
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = dot(qi, &k[base + j * hd..base + (j + 1) * hd]) * scale;
                m = m.max(*pj);
            }
            let mut z = 0f32;
            for pj in p.iter_mut() {
                *pj = (*pj - m).exp();
                z += *pj;
            }
            let oh = &mut o[head * hd..(head + 1) * hd];
            for (j, pj) in p.iter().enumerate() {
                let a = pj / z;
                for (y, x) in oh.iter_mut().zip(&v[base + j * hd..base + (j + 1) * hd]) {
                    *y += a * x;
                }
            }
        }
    });
    out
}

/// See `Backend::merge_patches`; the shape was checked by the caller.
pub fn merge(x: &[f32], cols: usize, grid_h: usize, grid_w: usize, merge: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for bi in 0..grid_h / merge {
        for bj in 0..grid_w / merge {
            for dr in 0..merge {
                for dc in 0..merge {
                    let p = (bi * merge + dr) * grid_w + bj * merge + dc;
                    out.extend_from_slice(&x[p * cols..(p + 1) * cols]);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_matches_known_values() {
        // torch.nn.functional.gelu(x, approximate="tanh") at 1, -1, 3.
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
        assert!((gelu_tanh(-1.0) + 0.158_808).abs() < 1e-6);
        assert!((gelu_tanh(3.0) - 2.996_363).abs() < 1e-6);
        assert_eq!(gelu_tanh(0.0), 0.0);
    }

    #[test]
    fn rope_at_the_origin_is_identity_and_preserves_norms() {
        let (cos, sin) = rope_table(4, 2, 10000.0);
        let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let mut y = x.clone();
        rotate(&mut y, 0, 0, &cos, &sin);
        assert_eq!(x, y);
        rotate(&mut y, 3, 1, &cos, &sin);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x[..4]) - norm(&y[..4])).abs() < 1e-4);
        assert!((norm(&x[4..]) - norm(&y[4..])).abs() < 1e-4);
        // Frequency 0 of the row half turns by exactly `row` radians.
        assert!((y[0] - (x[0] * 3f32.cos() - x[2] * 3f32.sin())).abs() < 1e-5);
    }

    #[test]
    fn merge_takes_each_block_row_major() {
        // A 2x4 grid of one-column patches numbered in row-major order.
        let x: Vec<f32> = (0..8).map(|i| i as f32).collect();
        assert_eq!(
            merge(&x, 1, 2, 4, 2),
            vec![0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0]
        );
    }
}
