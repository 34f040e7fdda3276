//! The block's attention on the host: γ queries over at most `context_window + γ` keys and a few
//! heads is far too small to be worth a device round trip of its own, and its RoPE runs at
//! absolute positions that the host knows.

use crate::context::ContextView;

/// Rotate-half (NeoX) RoPE frequencies over a whole head: `theta^(-2i/hd)` for `i < hd/2`.
/// Angles are formed in f64 so a position in the thousands keeps full f32 accuracy.
pub(crate) fn rope_inv_freq(head_dim: usize, theta: f32) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| f64::from(theta).powf(-2.0 * i as f64 / head_dim as f64))
        .collect()
}

/// Rotate each head of `row` (`heads · hd` values) to absolute position `pos`: pairs
/// `(i, i + hd/2)` turn by `pos · inv_freq_i` (the angles are shared by the heads).
pub(crate) fn rope_row(row: &mut [f32], head_dim: usize, pos: usize, inv_freq: &[f64]) {
    let half = head_dim / 2;
    let turns: Vec<(f64, f64)> = inv_freq
        .iter()
        .map(|f| (pos as f64 * f).sin_cos())
        .collect();
    for head in row.chunks_exact_mut(head_dim) {
        for (i, &(s, c)) in turns.iter().enumerate() {
            let (a, b) = (f64::from(head[i]), f64::from(head[i + half]));
            head[i] = (a * c - b * s) as f32;
            head[i + half] = (b * c + a * s) as f32;
        }
    }
}

/// Dot product with independent partial sums, so the compiler can vectorise it.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The two inner loops of the attention.
trait Kernels {
    /// `a · b`.
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `out = Σ_j p[j] · rows[j][off .. off + out.len()]`.
    fn weighted_sum(p: &[f32], rows: &[&[f32]], off: usize, out: &mut [f32]);
}

struct Portable;

impl Kernels for Portable {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot(a, b)
    }
    #[inline(always)]
    fn weighted_sum(p: &[f32], rows: &[&[f32]], off: usize, out: &mut [f32]) {
        let len = out.len();
        out.fill(0.0);
        for (&p, r) in p.iter().zip(rows) {
            for (o, &x) in out.iter_mut().zip(&r[off..off + len]) {
                *o += p * x;
            }
        }
    }
}

/// AVX2 + FMA kernels. Only [`block_attention`] instantiates [`attend`] with them, after checking
/// that the CPU has both features.
#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Kernels for Avx2 {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: reached only through `attend_avx2`, which runs after the feature check.
        unsafe { avx2::dot(a, b) }
    }
    #[inline(always)]
    fn weighted_sum(p: &[f32], rows: &[&[f32]], off: usize, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { avx2::weighted_sum(p, rows, off, out) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Four independent 8-lane FMA chains, so the additions' latency is hidden.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let whole = n - n % 32;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < whole {
            for (c, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i + 8c + 8 <= whole <= the length of both slices.
                let (x, y) = unsafe {
                    (
                        _mm256_loadu_ps(a.as_ptr().add(i + 8 * c)),
                        _mm256_loadu_ps(b.as_ptr().add(i + 8 * c)),
                    )
                };
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
            i += 32;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        let tail: f32 = a[whole..n]
            .iter()
            .zip(&b[whole..n])
            .map(|(x, y)| x * y)
            .sum();
        lanes.iter().sum::<f32>() + tail
    }

    /// 32 output lanes at a time stay in registers over all the rows.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum(p: &[f32], rows: &[&[f32]], off: usize, out: &mut [f32]) {
        let len = out.len();
        let whole = len - len % 32;
        let mut c = 0;
        while c < whole {
            let mut acc = [_mm256_setzero_ps(); 4];
            for (&p, r) in p.iter().zip(rows) {
                let r = &r[off + c..off + c + 32];
                let pv = _mm256_set1_ps(p);
                for (k, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: `r` holds 32 floats.
                    let x = unsafe { _mm256_loadu_ps(r.as_ptr().add(8 * k)) };
                    *acc = _mm256_fmadd_ps(pv, x, *acc);
                }
            }
            for (k, acc) in acc.iter().enumerate() {
                // SAFETY: c + 8k + 8 <= whole <= out.len().
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * k), *acc) };
            }
            c += 32;
        }
        let tail = &mut out[whole..];
        tail.fill(0.0);
        for (&p, r) in p.iter().zip(rows) {
            for (o, &x) in tail.iter_mut().zip(&r[off + whole..off + len]) {
                *o += p * x;
            }
        }
    }
}

/// Shapes of one layer's attention.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnGeom {
    pub heads: usize,
    pub head_dim: usize,
}

impl AttnGeom {
    fn width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// One layer's attention of the block. `qkv` is `[γ, 3·H·hd]` (q, k, v of the block rows, no
/// RoPE yet; row j sits at `first_pos + j`); `ctx` holds the context's keys (RoPE applied) and
/// values. Every block row attends to every context row and every block row (non-causal).
/// Returns `o` `[γ, H·hd]`, heads concatenated.
pub(crate) fn block_attention(
    qkv: &mut [f32],
    rows: usize,
    geom: AttnGeom,
    first_pos: usize,
    inv_freq: &[f64],
    ctx: &ContextView<'_>,
    layer: usize,
) -> Vec<f32> {
    let w = geom.width();
    for (j, row) in qkv.chunks_exact_mut(3 * w).enumerate() {
        rope_row(&mut row[..2 * w], geom.head_dim, first_pos + j, inv_freq);
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { attend_avx2(qkv, rows, geom, ctx, layer) };
    }
    attend::<Portable>(qkv, rows, geom, ctx, layer)
}

/// [`attend`] with the AVX2 kernels, compiled for AVX2 + FMA so that they inline.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(
    qkv: &[f32],
    rows: usize,
    geom: AttnGeom,
    ctx: &ContextView<'_>,
    layer: usize,
) -> Vec<f32> {
    attend::<Avx2>(qkv, rows, geom, ctx, layer)
}

#[inline(always)]
fn attend<K: Kernels>(
    qkv: &[f32],
    rows: usize,
    geom: AttnGeom,
    ctx: &ContextView<'_>,
    layer: usize,
) -> Vec<f32> {
    let (hd, w) = (geom.head_dim, geom.width());
    let keys = ctx.len() + rows;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; rows * w];
    let mut scores = vec![0f32; rows * keys];
    for h in 0..geom.heads {
        // This head's key and value rows: the context's, then the block's.
        let block = |off: usize| {
            qkv.chunks_exact(3 * w)
                .map(move |r| &r[off + h * hd..][..hd])
        };
        let key_rows: Vec<&[f32]> = ctx.rows(layer, false, h).chain(block(w)).collect();
        let value_rows: Vec<&[f32]> = ctx.rows(layer, true, h).chain(block(2 * w)).collect();
        for (j, k) in key_rows.iter().enumerate() {
            for i in 0..rows {
                scores[i * keys + j] = K::dot(&qkv[i * 3 * w + h * hd..][..hd], k) * scale;
            }
        }
        for s in scores.chunks_exact_mut(keys) {
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for x in s.iter_mut() {
                *x = (*x - max).exp();
                sum += *x;
            }
            s.iter_mut().for_each(|x| *x /= sum);
        }
        for i in 0..rows {
            K::weighted_sum(
                &scores[i * keys..(i + 1) * keys],
                &value_rows,
                0,
                &mut out[i * w + h * hd..][..hd],
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_is_a_rotation_by_relative_position() {
        // q·k after RoPE depends only on the positions' difference.
        let inv = rope_inv_freq(8, 10000.0);
        let (q0, k0): (Vec<f32>, Vec<f32>) = (0..8)
            .map(|i| ((i as f32 * 0.37).sin(), (i as f32 * 0.91).cos()))
            .unzip();
        let at = |pq: usize, pk: usize| {
            let (mut q, mut k) = (q0.clone(), k0.clone());
            rope_row(&mut q, 8, pq, &inv);
            rope_row(&mut k, 8, pk, &inv);
            dot(&q, &k)
        };
        assert!((at(7, 3) - at(104, 100)).abs() < 1e-5);
        assert!((at(7, 3) - at(3, 7)).abs() > 1e-3);
        let mut q = q0.clone();
        rope_row(&mut q, 8, 0, &inv);
        assert_eq!(q, q0);
    }

    /// The attention written out plainly, from the spec, in f64.
    fn naive(qkv: &[f32], rows: usize, geom: AttnGeom, ctx: &[Vec<f32>], layer: usize) -> Vec<f64> {
        let (hd, w) = (geom.head_dim, geom.width());
        let mut out = vec![0f64; rows * w];
        for h in 0..geom.heads {
            let hs = h * hd..(h + 1) * hd;
            let mut keys: Vec<(&[f32], &[f32])> = ctx
                .iter()
                .map(|r| {
                    (
                        &r[layer * 2 * w..][hs.clone()],
                        &r[layer * 2 * w + w..][hs.clone()],
                    )
                })
                .collect();
            for r in qkv.chunks_exact(3 * w) {
                keys.push((&r[w..][hs.clone()], &r[2 * w..][hs.clone()]));
            }
            for i in 0..rows {
                let q = &qkv[i * 3 * w..][hs.clone()];
                let s: Vec<f64> = keys
                    .iter()
                    .map(|(k, _)| {
                        q.iter()
                            .zip(*k)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for ((_, v), e) in keys.iter().zip(&e) {
                    for (o, x) in out[i * w..][hs.clone()].iter_mut().zip(*v) {
                        *o += e / sum * f64::from(*x);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_the_plain_formula() {
        use crate::context::{ContextCache, ContextShape};
        // Head sizes below, at and past the 32-lane chunks of the vector kernels.
        for head_dim in [16, 40, 64] {
            let geom = AttnGeom { heads: 2, head_dim };
            let shape = ContextShape {
                layers: 2,
                heads: 2,
                head_dim,
            };
            let (w, rows, n) = (geom.width(), 3, 11);
            let val = |i: usize, salt: f32| (i as f32 * 0.7548 + salt).sin() * 1.3;
            let ctx: Vec<Vec<f32>> = (0..n)
                .map(|p| {
                    (0..shape.row_width())
                        .map(|j| val(p * 977 + j, 0.3))
                        .collect()
                })
                .collect();
            let mut cache = ContextCache::new(shape, 8); // wraps: 3 of the 11 leave
            for (p, r) in ctx.iter().enumerate() {
                cache.insert(p, r);
            }
            let qkv: Vec<f32> = (0..rows * 3 * w).map(|i| val(i, 1.1)).collect();
            for layer in 0..2 {
                // Positions 0 with no rotation, so the plain formula needs no RoPE.
                let mut rotated = qkv.clone();
                let got = block_attention(
                    &mut rotated,
                    rows,
                    geom,
                    0,
                    &[],
                    &cache.view_before(n),
                    layer,
                );
                let portable = attend::<Portable>(&qkv, rows, geom, &cache.view_before(n), layer);
                let want = naive(&qkv, rows, geom, &ctx[n - 8..], layer);
                for (g, (p, w)) in got.iter().zip(portable.iter().zip(&want)) {
                    assert!(
                        (f64::from(*g) - w).abs() < 1e-5,
                        "hd {head_dim}: {g} vs {w}"
                    );
                    assert!(
                        (f64::from(*p) - w).abs() < 1e-5,
                        "hd {head_dim}: {p} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn dot_matches_the_plain_sum() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - plain).abs() < 1e-4);
    }
}
