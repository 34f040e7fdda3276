//! Dense `y = x Wᵀ` over weights packed once into 16-column panels (`[k][16]` per panel).
//!
//! Every output `y[i][j]` is one fused multiply-add chain over `k = 0..K` in order, whatever
//! the tile shape, row count or thread split: a sequence's results never depend on what it
//! is batched with (the engine's batch-invariance contract), which a general GEMM that picks
//! blockings by problem size does not promise. The register tiles are the classic broadcast ×
//! panel outer product, so no horizontal sums are needed.

use rayon::prelude::*;

pub const LANES: usize = 16;

/// `W [n, k]` repacked as `ceil(n/16)` panels of `[k][16]` (zero-padded columns).
#[derive(Debug, Clone)]
pub struct Packed {
    pub n: usize,
    pub k: usize,
    pub panels: Vec<f32>,
    /// The same panels as bf16 bits, present when every value is exactly a bf16 (checkpoint
    /// weights). Single-row products (decode) read these: half the memory traffic, and
    /// bit-identical results since the widening is exact and the FMA order is unchanged.
    pub bf16: Option<Vec<u16>>,
}

impl Packed {
    pub fn new(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weight data does not match its shape");
        let np = n.div_ceil(LANES);
        let mut panels = vec![0f32; np * k * LANES];
        for j in 0..n {
            let (p, l) = (j / LANES, j % LANES);
            let dst = &mut panels[p * k * LANES..(p + 1) * k * LANES];
            for (kk, &v) in w[j * k..(j + 1) * k].iter().enumerate() {
                dst[kk * LANES + l] = v;
            }
        }
        Self {
            n,
            k,
            panels,
            bf16: None,
        }
    }

    /// Panels of the matrix whose *transpose* is `data` (`[k, n]` row-major): `y = x · data`.
    pub fn from_kn(data: &[f32], k: usize, n: usize) -> Self {
        assert_eq!(data.len(), n * k, "data does not match its shape");
        let np = n.div_ceil(LANES);
        let mut panels = vec![0f32; np * k * LANES];
        for p in 0..np {
            let cols = (n - p * LANES).min(LANES);
            for kk in 0..k {
                let dst = (p * k + kk) * LANES;
                panels[dst..dst + cols]
                    .copy_from_slice(&data[kk * n + p * LANES..kk * n + p * LANES + cols]);
            }
        }
        Self {
            n,
            k,
            panels,
            bf16: None,
        }
    }

    /// Also keep bf16 panels when the values allow it exactly (weights loaded from bf16).
    pub fn with_bf16(mut self) -> Self {
        if self.panels.iter().all(|v| v.to_bits() & 0xFFFF == 0) {
            self.bf16 = Some(
                self.panels
                    .iter()
                    .map(|v| (v.to_bits() >> 16) as u16)
                    .collect(),
            );
        }
        self
    }

    pub fn num_panels(&self) -> usize {
        self.n.div_ceil(LANES)
    }

    /// Row `j` of the original matrix (tests, reference paths).
    pub fn row(&self, j: usize) -> Vec<f32> {
        let (p, l) = (j / LANES, j % LANES);
        (0..self.k)
            .map(|kk| self.panels[(p * self.k + kk) * LANES + l])
            .collect()
    }
}

/// Columns `[p0·16, p1·16) ∩ [0, n)` of `y = x Wᵀ` for the `m` rows of `x`, into `y` (row stride `ldy`,
/// column 0 of `y` = column `p0·16`).
fn gemm_block(x: &[f32], m: usize, w: &Packed, p0: usize, p1: usize, y: &mut [f32], ldy: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F and FMA were detected at run time.
        unsafe { avx512::block(x, m, w, p0, p1, y, ldy) };
        return;
    }
    let k = w.k;
    for i in 0..m {
        for p in p0..p1 {
            let panel = &w.panels[p * k * LANES..(p + 1) * k * LANES];
            let mut acc = [0f32; LANES];
            for kk in 0..k {
                let xv = x[i * k + kk];
                for l in 0..LANES {
                    acc[l] = xv.mul_add(panel[kk * LANES + l], acc[l]);
                }
            }
            let cols = (w.n - p * LANES).min(LANES);
            let base = i * ldy + (p - p0) * LANES;
            y[base..base + cols].copy_from_slice(&acc[..cols]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{LANES, Packed};
    use std::arch::x86_64::*;

    /// `MR` rows × `NP` panels register tile over the full k range.
    #[inline(always)]
    unsafe fn micro<const MR: usize, const NP: usize>(
        x: *const f32,
        k: usize,
        panels: *const f32,
        y: *mut f32,
        ldy: usize,
        last_cols: usize,
    ) {
        // SAFETY (whole block): the caller guarantees MR rows of x (stride k), NP panels of
        // k·16 floats, and MR rows of y with NP·16 columns (the last panel masked to `last_cols`).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NP]; MR];
            for kk in 0..k {
                let mut wv = [_mm512_setzero_ps(); NP];
                for p in 0..NP {
                    wv[p] = _mm512_loadu_ps(panels.add((p * k + kk) * LANES));
                }
                for i in 0..MR {
                    let xv = _mm512_set1_ps(*x.add(i * k + kk));
                    for p in 0..NP {
                        acc[i][p] = _mm512_fmadd_ps(xv, wv[p], acc[i][p]);
                    }
                }
            }
            let mask: __mmask16 = if last_cols >= LANES {
                0xFFFF
            } else {
                ((1u32 << last_cols) - 1) as __mmask16
            };
            for i in 0..MR {
                for p in 0..NP {
                    let dst = y.add(i * ldy + p * LANES);
                    if p + 1 == NP {
                        _mm512_mask_storeu_ps(dst, mask, acc[i][p]);
                    } else {
                        _mm512_storeu_ps(dst, acc[i][p]);
                    }
                }
            }
        }
    }

    /// One row × `NP` panels reading bf16 panels (exactly widened to f32).
    #[inline(always)]
    unsafe fn micro_bf16<const NP: usize>(
        x: *const f32,
        k: usize,
        panels: *const u16,
        y: *mut f32,
        last_cols: usize,
    ) {
        // SAFETY (whole block): as `micro` with MR = 1, over the bf16 copy of the same panels.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); NP];
            for kk in 0..k {
                let xv = _mm512_set1_ps(*x.add(kk));
                for p in 0..NP {
                    let raw =
                        _mm256_loadu_si256(panels.add((p * k + kk) * LANES) as *const __m256i);
                    let wv =
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)));
                    acc[p] = _mm512_fmadd_ps(xv, wv, acc[p]);
                }
            }
            let mask: __mmask16 = if last_cols >= LANES {
                0xFFFF
            } else {
                ((1u32 << last_cols) - 1) as __mmask16
            };
            for p in 0..NP {
                let dst = y.add(p * LANES);
                if p + 1 == NP {
                    _mm512_mask_storeu_ps(dst, mask, acc[p]);
                } else {
                    _mm512_storeu_ps(dst, acc[p]);
                }
            }
        }
    }

    macro_rules! rows_dispatch {
        ($mr:expr, $np:literal, $($args:expr),*) => {
            match $mr {
                6 => micro::<6, $np>($($args),*),
                5 => micro::<5, $np>($($args),*),
                4 => micro::<4, $np>($($args),*),
                3 => micro::<3, $np>($($args),*),
                2 => micro::<2, $np>($($args),*),
                _ => micro::<1, $np>($($args),*),
            }
        };
    }

    /// # Safety
    /// AVX-512F + FMA must be available; `y` holds `m` rows of stride `ldy` ≥ (p1−p0)·16 (the
    /// last panel may be narrower when it is the matrix's last).
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    pub unsafe fn block(
        x: &[f32],
        m: usize,
        w: &Packed,
        p0: usize,
        p1: usize,
        y: &mut [f32],
        ldy: usize,
    ) {
        let k = w.k;
        let np_total = w.num_panels();
        assert!(x.len() >= m * k && p1 <= np_total);
        // Panels in groups that stay in L2 while every row block passes over them.
        const GROUP: usize = 32;
        let mut g0 = p0;
        while g0 < p1 {
            let g1 = (g0 + GROUP).min(p1);
            let mut i = 0;
            while i < m {
                let mr = (m - i).min(6);
                let mut p = g0;
                while p < g1 {
                    let np = if mr == 1 && g1 - p >= 8 {
                        8
                    } else {
                        (g1 - p).min(4)
                    };
                    let last_cols = if p + np == np_total {
                        w.n - (np_total - 1) * LANES
                    } else {
                        LANES
                    };
                    let yrow = i * ldy + (p - p0) * LANES;
                    // Bounds of the unchecked stores below.
                    assert!(y.len() >= (i + mr - 1) * ldy + (p - p0 + np - 1) * LANES + last_cols);
                    let (xp, wp, yp) = (
                        x[i * k..].as_ptr(),
                        w.panels[p * k * LANES..].as_ptr(),
                        y[yrow..].as_mut_ptr(),
                    );
                    if let (1, Some(h)) = (mr, &w.bf16) {
                        let hp = h[p * k * LANES..].as_ptr();
                        // SAFETY: checked above (the bf16 copy has the panels' layout).
                        unsafe {
                            match np {
                                8 => micro_bf16::<8>(xp, k, hp, yp, last_cols),
                                4 => micro_bf16::<4>(xp, k, hp, yp, last_cols),
                                3 => micro_bf16::<3>(xp, k, hp, yp, last_cols),
                                2 => micro_bf16::<2>(xp, k, hp, yp, last_cols),
                                _ => micro_bf16::<1>(xp, k, hp, yp, last_cols),
                            }
                        }
                        p += np;
                        continue;
                    }
                    // SAFETY: checked above.
                    unsafe {
                        match np {
                            8 => micro::<1, 8>(xp, k, wp, yp, ldy, last_cols),
                            4 => rows_dispatch!(mr, 4, xp, k, wp, yp, ldy, last_cols),
                            3 => rows_dispatch!(mr, 3, xp, k, wp, yp, ldy, last_cols),
                            2 => rows_dispatch!(mr, 2, xp, k, wp, yp, ldy, last_cols),
                            _ => rows_dispatch!(mr, 1, xp, k, wp, yp, ldy, last_cols),
                        }
                    }
                    p += np;
                }
                i += mr;
            }
            g0 = g1;
        }
    }
}

/// Serial `y = x Wᵀ` (`y` is `m × n`).
pub fn gemm_serial(x: &[f32], m: usize, w: &Packed, y: &mut [f32]) {
    assert_eq!(y.len(), m * w.n);
    if w.n == 0 || m == 0 {
        return;
    }
    gemm_block(x, m, w, 0, w.num_panels(), y, w.n);
}

/// Serial `x Wᵀ` into a new vector.
pub fn gemm_serial_vec(x: &[f32], m: usize, w: &Packed) -> Vec<f32> {
    let mut y = vec![0f32; m * w.n];
    gemm_serial(x, m, w, &mut y);
    y
}

/// Work (multiply-adds) below which an op stays on the calling thread. A fork/join costs a few
/// microseconds on an idle machine but can cost a scheduler time slice when the other core is
/// busy, so only big products (prefill, decode's lm_head) are split.
pub const PAR_MIN_WORK: usize = 1 << 19;

/// `y = x Wᵀ`, threaded over rows (prefill) or column panels (decode).
pub fn gemm(x: &[f32], m: usize, w: &Packed) -> Vec<f32> {
    let n = w.n;
    let mut y = vec![0f32; m * n];
    let threads = rayon::current_num_threads();
    if m * n * w.k < PAR_MIN_WORK || threads == 1 || n == 0 {
        gemm_serial(x, m, w, &mut y);
    } else if m >= 12 * threads {
        // Row blocks that are multiples of 6 keep the 6-row tile full.
        let rows = m.div_ceil(threads * 2).div_ceil(6) * 6;
        y.par_chunks_mut(rows * n)
            .zip(x.par_chunks(rows * w.k))
            .for_each(|(yc, xc)| {
                gemm_serial(xc, xc.len() / w.k, w, yc);
            });
    } else {
        let np = w.num_panels();
        let per = np.div_ceil(threads);
        let parts: Vec<(usize, Vec<f32>)> = (0..np)
            .step_by(per)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|p0| {
                let p1 = (p0 + per).min(np);
                let cols = (n - p0 * LANES).min((p1 - p0) * LANES);
                let mut yb = vec![0f32; m * cols];
                gemm_block(x, m, w, p0, p1, &mut yb, cols);
                (p0 * LANES, yb)
            })
            .collect();
        for (j0, yb) in parts {
            let cols = yb.len() / m;
            for i in 0..m {
                y[i * n + j0..i * n + j0 + cols].copy_from_slice(&yb[i * cols..(i + 1) * cols]);
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
    fn matches_f64_and_is_row_invariant() {
        for &(m, n, k) in &[
            (1, 7, 5),
            (5, 9, 37),
            (13, 70, 256),
            (130, 260, 128),
            (1, 300, 64),
            (40, 1000, 16),
        ] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let p = Packed::new(&w, n, k);
            assert_eq!(p.row(n - 1), w[(n - 1) * k..].to_vec());
            let wt: Vec<f32> = (0..k)
                .flat_map(|t| (0..n).map(move |j| (t, j)))
                .map(|(t, j)| w[j * k + t])
                .collect();
            assert_eq!(Packed::from_kn(&wt, k, n).panels, p.panels);
            let y = gemm(&x, m, &p);
            for i in 0..m {
                for j in 0..n {
                    let r: f64 = (0..k)
                        .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                        .sum();
                    assert!(
                        (y[i * n + j] as f64 - r).abs() < 1e-4 * (k as f64).sqrt(),
                        "{m}x{n}x{k}"
                    );
                }
            }
            // Any row alone, the serial path and the bf16 panels give bit-identical results.
            let wb: Vec<f32> = w
                .iter()
                .map(|v| f32::from_bits(v.to_bits() & 0xFFFF_0000))
                .collect();
            let pb = Packed::new(&wb, n, k);
            let pb16 = pb.clone().with_bf16();
            assert!(pb16.bf16.is_some() && p.clone().with_bf16().bf16.is_none());
            for i in [0, m - 1] {
                assert_eq!(
                    gemm(&x[i * k..(i + 1) * k], 1, &pb16),
                    gemm(&x[i * k..(i + 1) * k], 1, &pb)
                );
            }
            let mut ys = vec![0f32; m * n];
            gemm_serial(&x, m, &p, &mut ys);
            assert_eq!(ys, y);
            for i in [0, m / 2, m - 1] {
                let yi = gemm(&x[i * k..(i + 1) * k], 1, &p);
                assert_eq!(&yi[..], &y[i * n..(i + 1) * n]);
            }
        }
    }
}
