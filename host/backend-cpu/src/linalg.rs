//! Row-invariant dense kernels: every output element `y[i][j] = x_i · w_j` is accumulated in
//! one fixed order (16 lanes over k, lane sums reduced the same way) no matter how many rows
//! are computed together or how the work is split across threads. That is what makes a
//! sequence's results independent of its batch and of the thread count, which a general GEMM
//! (`gemm` picks blockings by problem size) does not promise. With K ≤ 1024 here, a 4×4
//! register tile of dot products keeps the FMA units busy without packing.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f"))
}

/// Work (multiply-adds) below which an op stays on the calling thread: a rayon fork/join costs
/// a few microseconds, about 50k FMAs on this hardware.
pub const PAR_MIN_WORK: usize = 1 << 16;

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
    if has_avx512() {
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
    unsafe fn micro<const MR: usize, const NR: usize>(xs: &[&[f32]], ws: &[&[f32]], y: &mut [f32], ldy: usize) {
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
                                    micro::<1, 1>(&xr[ii..ii + 1], &wr[jj..jj + 1], &mut yy[ii * ldy + jj..], ldy);
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

/// Serial `y = x Wᵀ` for rows `x` (`m × k`) and `w` (`n × k`), into `y` (`m × n`).
pub fn matmul_serial(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, y: &mut [f32]) {
    debug_assert_eq!(x.len(), m * k);
    debug_assert_eq!(w.len(), n * k);
    debug_assert_eq!(y.len(), m * n);
    if k == 0 {
        y.fill(0.0);
        return;
    }
    // Rows of W in blocks so a block stays in L1/L2 while all x rows pass over it.
    const WB: usize = 64;
    const XB: usize = 64;
    let xr: Vec<&[f32]> = x.chunks_exact(k).collect();
    let wr: Vec<&[f32]> = w.chunks_exact(k).collect();
    for i0 in (0..m).step_by(XB) {
        let i1 = (i0 + XB).min(m);
        for j0 in (0..n).step_by(WB) {
            let j1 = (j0 + WB).min(n);
            tile_dispatch(&xr[i0..i1], &wr[j0..j1], &mut y[i0 * n + j0..], n);
        }
    }
}

/// `y = x Wᵀ`, threaded over row blocks (prefill) or output columns (decode).
pub fn matmul(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    let work = m * n * k;
    let threads = rayon::current_num_threads();
    if work < PAR_MIN_WORK || threads == 1 {
        matmul_serial(x, m, w, n, k, &mut y);
    } else if m >= 4 * threads {
        let rows = m.div_ceil(threads * 4).max(4);
        y.par_chunks_mut(rows * n).zip(x.par_chunks(rows * k)).for_each(|(yc, xc)| {
            matmul_serial(xc, xc.len() / k, w, n, k, yc);
        });
    } else {
        let cols = n.div_ceil(threads * 2).div_ceil(4) * 4;
        let parts: Vec<(usize, Vec<f32>)> = w
            .par_chunks(cols * k)
            .enumerate()
            .map(|(b, wc)| {
                let nb = wc.len() / k;
                let mut yb = vec![0f32; m * nb];
                matmul_serial(x, m, wc, nb, k, &mut yb);
                (b * cols, yb)
            })
            .collect();
        for (j0, yb) in parts {
            let nb = yb.len() / m;
            for i in 0..m {
                y[i * n + j0..i * n + j0 + nb].copy_from_slice(&yb[i * nb..(i + 1) * nb]);
            }
        }
    }
    y
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
    fn matmul_matches_f64_and_is_row_invariant() {
        for &(m, n, k) in &[(1, 7, 5), (5, 9, 37), (33, 70, 256), (130, 260, 128)] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let y = matmul(&x, m, &w, n, k);
            for i in 0..m {
                for j in 0..n {
                    let r: f64 = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
                    assert!((y[i * n + j] as f64 - r).abs() < 1e-4 * (k as f64).sqrt(), "{m}x{n}x{k}");
                }
            }
            // Each row alone gives bit-identical results.
            for i in [0, m / 2, m - 1] {
                let yi = matmul(&x[i * k..(i + 1) * k], 1, &w, n, k);
                assert_eq!(&yi[..], &y[i * n..(i + 1) * n]);
                assert_eq!(dot(&x[i * k..(i + 1) * k], &w[..k]), y[i * n]);
            }
        }
    }

    #[test]
    fn portable_matches_simd_bitwise() {
        let (k, x, w) = (77, data(77, 3), data(77, 4));
        let mut a = [0f32];
        portable_tile(&[&x], &[&w], &mut a, 1);
        assert_eq!(a[0], dot(&x, &w));
    }
}
