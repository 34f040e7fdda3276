//! The block's attention on the host: γ queries over at most `context_window + γ` keys and a few
//! heads is far too small to be worth a device round trip of its own, and its RoPE runs at
//! absolute positions that the host knows.

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
/// RoPE yet; row j sits at `first_pos + j`). Each `ctx` row holds this layer's context key (RoPE
/// applied) at `ctx_off` and its value right after it. Every block row attends to every context
/// row and every block row (non-causal). Returns `o` `[γ, H·hd]`, heads concatenated.
pub(crate) fn block_attention(
    qkv: &mut [f32],
    rows: usize,
    geom: AttnGeom,
    first_pos: usize,
    inv_freq: &[f64],
    ctx: &[&[f32]],
    ctx_off: usize,
) -> Vec<f32> {
    let w = geom.width();
    for (j, row) in qkv.chunks_exact_mut(3 * w).enumerate() {
        rope_row(&mut row[..2 * w], geom.head_dim, first_pos + j, inv_freq);
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { attend_avx2(qkv, rows, geom, ctx, ctx_off) };
    }
    attend(qkv, rows, geom, ctx, ctx_off)
}

/// [`attend`] compiled for AVX2: the dot products and value sums run 8 lanes wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_avx2(
    qkv: &[f32],
    rows: usize,
    geom: AttnGeom,
    ctx: &[&[f32]],
    ctx_off: usize,
) -> Vec<f32> {
    attend(qkv, rows, geom, ctx, ctx_off)
}

#[inline(always)]
fn attend<'a>(
    qkv: &'a [f32],
    rows: usize,
    geom: AttnGeom,
    ctx: &[&'a [f32]],
    ctx_off: usize,
) -> Vec<f32> {
    let (hd, w) = (geom.head_dim, geom.width());
    let keys = ctx.len() + rows;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; rows * w];
    let mut scores = vec![0f32; rows * keys];
    for h in 0..geom.heads {
        let at = |row: &'a [f32], off: usize| -> &'a [f32] { &row[off + h * hd..][..hd] };
        let blocks = qkv.chunks_exact(3 * w);
        let k_rows: Vec<&[f32]> = ctx
            .iter()
            .map(|r| at(r, ctx_off))
            .chain(blocks.clone().map(|r| at(r, w)))
            .collect();
        let v_rows: Vec<&[f32]> = ctx
            .iter()
            .map(|r| at(r, ctx_off + w))
            .chain(blocks.map(|r| at(r, 2 * w)))
            .collect();
        for (j, k) in k_rows.iter().enumerate() {
            for i in 0..rows {
                scores[i * keys + j] = dot(&qkv[i * 3 * w + h * hd..][..hd], k) * scale;
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
        for (j, v) in v_rows.iter().enumerate() {
            for i in 0..rows {
                let p = scores[i * keys + j];
                let o = &mut out[i * w + h * hd..][..hd];
                o.iter_mut().zip(v.iter()).for_each(|(o, v)| *o += p * v);
            }
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

    #[test]
    fn dot_matches_the_plain_sum() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 / (i as f32 + 1.0)).collect();
        let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - plain).abs() < 1e-4);
    }
}
