//! Dot products in one fixed order (16 lanes over k, lane sums reduced pairwise), the same on
//! the AVX-512 and portable paths.

/// `a · b` in the fixed lane order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut out = [0f32; 1];
    tile_dispatch(&[a], &[b], &mut out, 1);
    out[0]
}

/// `y[i*ldy + j] = x_i · w_j` for the given row sets (all of length k).
fn tile_dispatch(xs: &[&[f32]], ws: &[&[f32]], y: &mut [f32], ldy: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: avx512f was detected at run time.
        unsafe { avx512::tile(xs, ws, y, ldy) };
        return;
    }
    portable_tile(xs, ws, y, ldy);
}

/// Same accumulation structure as the AVX-512 path (16 lanes, then a pairwise lane sum).
fn portable_tile(xs: &[&[f32]], ws: &[&[f32]], y: &mut [f32], ldy: usize) {
    for (i, x) in xs.iter().enumerate() {
        for (j, w) in ws.iter().enumerate() {
            let mut acc = [0f32; 16];
            let n = x.len();
            let full = n / 16 * 16;
            for c in (0..full).step_by(16) {
                for l in 0..16 {
                    acc[l] = x[c + l].mul_add(w[c + l], acc[l]);
                }
            }
            for l in 0..n - full {
                acc[l] = x[full + l].mul_add(w[full + l], acc[l]);
            }
            let mut width = 16;
            while width > 1 {
                width /= 2;
                for l in 0..width {
                    acc[l] += acc[l + width];
                }
            }
            y[i * ldy + j] = acc[0];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Pairwise lane sum in the same order as `portable_tile`.
    #[inline(always)]
    unsafe fn hsum(v: __m512) -> f32 {
        // SAFETY: only called from AVX-512 code paths.
        unsafe {
            let lo = _mm512_castps512_ps256(v);
            let hi = _mm512_extractf32x8_ps::<1>(v);
            let s8 = _mm256_add_ps(lo, hi);
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
            _mm_cvtss_f32(s1)
        }
    }

    #[inline(always)]
    unsafe fn micro<const MR: usize, const NR: usize>(
        xs: &[&[f32]],
        ws: &[&[f32]],
        y: &mut [f32],
        ldy: usize,
    ) {
        let n = xs[0].len();
        let full = n / 16 * 16;
        // SAFETY (whole block): every pointer offset stays below `n`, the common row length;
        // the tail uses a masked load that touches only the remaining `n - full` elements.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NR]; MR];
            let mut c = 0;
            while c < full {
                let mut wv = [_mm512_setzero_ps(); NR];
                for j in 0..NR {
                    wv[j] = _mm512_loadu_ps(ws[j].as_ptr().add(c));
                }
                for i in 0..MR {
                    let xv = _mm512_loadu_ps(xs[i].as_ptr().add(c));
                    for j in 0..NR {
                        acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
                    }
                }
                c += 16;
            }
            if full < n {
                let mask: __mmask16 = (1u32 << (n - full)).wrapping_sub(1) as __mmask16;
                let mut wv = [_mm512_setzero_ps(); NR];
                for j in 0..NR {
                    wv[j] = _mm512_maskz_loadu_ps(mask, ws[j].as_ptr().add(full));
                }
                for i in 0..MR {
                    let xv = _mm512_maskz_loadu_ps(mask, xs[i].as_ptr().add(full));
                    for j in 0..NR {
                        acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
                    }
                }
            }
            for i in 0..MR {
                for j in 0..NR {
                    y[i * ldy + j] = hsum(acc[i][j]);
                }
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F; all rows must have the same length.
    #[target_feature(enable = "avx512f,avx512dq,avx,sse3")]
    pub unsafe fn tile(xs: &[&[f32]], ws: &[&[f32]], y: &mut [f32], ldy: usize) {
        let mut i = 0;
        while i < xs.len() {
            let mr = (xs.len() - i).min(4);
            let mut j = 0;
            while j < ws.len() {
                let nr = (ws.len() - j).min(4);
                let xr = &xs[i..i + mr];
                let wr = &ws[j..j + nr];
                let yy = &mut y[i * ldy + j..];
                // SAFETY: same contract as this function.
                unsafe {
                    match (mr, nr) {
                        (4, 4) => micro::<4, 4>(xr, wr, yy, ldy),
                        (4, 3) => micro::<4, 3>(xr, wr, yy, ldy),
                        (4, 2) => micro::<4, 2>(xr, wr, yy, ldy),
                        (4, 1) => micro::<4, 1>(xr, wr, yy, ldy),
                        (3, 4) => micro::<3, 4>(xr, wr, yy, ldy),
                        (2, 4) => micro::<2, 4>(xr, wr, yy, ldy),
                        (1, 4) => micro::<1, 4>(xr, wr, yy, ldy),
                        (a, b) => {
                            for ii in 0..a {
                                for jj in 0..b {
                                    micro::<1, 1>(
                                        &xr[ii..ii + 1],
                                        &wr[jj..jj + 1],
                                        &mut yy[ii * ldy + jj..],
                                        ldy,
                                    );
                                }
                            }
                        }
                    }
                }
                j += nr;
            }
            i += mr;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn portable_matches_simd_bitwise() {
        let (x, w) = (data(77, 3), data(77, 4));
        let mut a = [0f32];
        portable_tile(&[&x], &[&w], &mut a, 1);
        assert_eq!(a[0], dot(&x, &w));
    }
}
