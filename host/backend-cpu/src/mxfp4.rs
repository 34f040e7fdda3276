//! MXFP4 (OCP MX v1.0, E2M1 codes + E8M0 block scales of 32) matrix kernels, decoded on the fly
//! through a 16-entry lookup table (held in one AVX-512 register on x86).
//!
//! Inputs are pre-split into even and odd elements per 32-block so each packed byte's low
//! nibble (element 2j) and high nibble (element 2j+1) meet their inputs without a shuffle.

/// E2M1 code → value (bit 3 = sign).
pub const FP4_LUT: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E8M0 byte → scale `2^(s-127)` (255 is NaN).
pub fn e8m0(s: u8) -> f32 {
    if s == 255 {
        f32::NAN
    } else {
        2f64.powi(s as i32 - 127) as f32
    }
}

/// A matrix `[rows, cols]` in MXFP4: `packed [rows, cols/2]`, `scales [rows, cols/32]`.
#[derive(Debug, Clone)]
pub struct MxMatrix {
    pub rows: usize,
    pub cols: usize,
    pub packed: Vec<u8>,
    pub scales: Vec<f32>,
}

impl MxMatrix {
    pub fn new(rows: usize, cols: usize, packed: Vec<u8>, scales: &[u8]) -> Self {
        assert_eq!(cols % 32, 0, "MXFP4 columns must be a multiple of 32");
        assert_eq!(packed.len(), rows * cols / 2);
        assert_eq!(scales.len(), rows * cols / 32);
        Self {
            rows,
            cols,
            packed,
            scales: scales.iter().map(|&s| e8m0(s)).collect(),
        }
    }

    /// Row `r` decoded to f32 (tests, reference paths).
    pub fn dequant_row(&self, r: usize) -> Vec<f32> {
        let bytes = &self.packed[r * self.cols / 2..(r + 1) * self.cols / 2];
        let mut out = Vec::with_capacity(self.cols);
        for (j, &b) in bytes.iter().enumerate() {
            let s = self.scales[r * self.cols / 32 + j / 16];
            out.push(FP4_LUT[(b & 15) as usize] * s);
            out.push(FP4_LUT[(b >> 4) as usize] * s);
        }
        out
    }
}

impl MxMatrix {
    /// The whole matrix decoded into [`crate::gemm::Packed`] panels (exact: every fp4·2^k is an f32).
    pub fn to_packed(&self) -> crate::gemm::Packed {
        use crate::gemm::LANES;
        let (n, k) = (self.rows, self.cols);
        let mut panels = vec![0f32; n.div_ceil(LANES) * k * LANES];
        for j in 0..n {
            let (p, l) = (j / LANES, j % LANES);
            let dst = &mut panels[p * k * LANES..(p + 1) * k * LANES];
            let bytes = &self.packed[j * k / 2..(j + 1) * k / 2];
            for (b, &byte) in bytes.iter().enumerate() {
                let s = self.scales[j * k / 32 + b / 16];
                dst[(2 * b) * LANES + l] = FP4_LUT[(byte & 15) as usize] * s;
                dst[(2 * b + 1) * LANES + l] = FP4_LUT[(byte >> 4) as usize] * s;
            }
        }
        crate::gemm::Packed {
            n,
            k,
            panels,
            bf16: None,
        }
    }
}

/// Split each row of `x` (`m × k`) into per-block `[16 even | 16 odd]` order.
pub fn split_even_odd(x: &[f32], k: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
        for j in 0..16 {
            dst[j] = src[2 * j];
            dst[16 + j] = src[2 * j + 1];
        }
    }
    debug_assert_eq!(x.len() % k, 0);
    out
}

/// `y[i][r] = Σ_c x_i[c] · W[r][c]` for `xs` already in [`split_even_odd`] order; `y` is `m × rows`.
pub fn mx_matmul(xs_split: &[f32], m: usize, w: &MxMatrix, y: &mut [f32]) {
    let k = w.cols;
    debug_assert_eq!(xs_split.len(), m * k);
    debug_assert_eq!(y.len(), m * w.rows);
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: avx512f detected.
        unsafe { avx512::mx_matmul(xs_split, m, w, y) };
        return;
    }
    for i in 0..m {
        let x = &xs_split[i * k..(i + 1) * k];
        for r in 0..w.rows {
            let bytes = &w.packed[r * k / 2..(r + 1) * k / 2];
            let mut acc = [0f32; 16];
            for b in 0..k / 32 {
                let s = w.scales[r * k / 32 + b];
                for j in 0..16 {
                    let byte = bytes[b * 16 + j];
                    let blk = FP4_LUT[(byte & 15) as usize] * x[b * 32 + j]
                        + FP4_LUT[(byte >> 4) as usize] * x[b * 32 + 16 + j];
                    acc[j] = blk.mul_add(s, acc[j]);
                }
            }
            let mut width = 16;
            while width > 1 {
                width /= 2;
                for l in 0..width {
                    acc[l] += acc[l + width];
                }
            }
            y[i * w.rows + r] = acc[0];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{FP4_LUT, MxMatrix};
    use std::arch::x86_64::*;

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
    unsafe fn rows<const MR: usize>(
        xs: &[f32],
        k: usize,
        w: &MxMatrix,
        r: usize,
        y: &mut [f32],
        ldy: usize,
    ) {
        // SAFETY (whole block): indices stay inside row `r` of `w` and rows `0..MR` of `xs`.
        unsafe {
            let lut = _mm512_loadu_ps(FP4_LUT.as_ptr());
            let nib = _mm512_set1_epi32(15);
            let mut acc = [_mm512_setzero_ps(); MR];
            let bytes = w.packed.as_ptr().add(r * k / 2);
            let scales = w.scales.as_ptr().add(r * k / 32);
            for b in 0..k / 32 {
                let codes =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.add(b * 16) as *const __m128i));
                let lo = _mm512_permutexvar_ps(_mm512_and_si512(codes, nib), lut);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(codes), lut);
                let s = _mm512_set1_ps(*scales.add(b));
                for i in 0..MR {
                    let xe = _mm512_loadu_ps(xs.as_ptr().add(i * k + b * 32));
                    let xo = _mm512_loadu_ps(xs.as_ptr().add(i * k + b * 32 + 16));
                    let blk = _mm512_add_ps(_mm512_mul_ps(lo, xe), _mm512_mul_ps(hi, xo));
                    acc[i] = _mm512_fmadd_ps(blk, s, acc[i]);
                }
            }
            for i in 0..MR {
                y[i * ldy] = hsum(acc[i]);
            }
        }
    }

    /// # Safety
    /// AVX-512F must be available; shapes as in `super::mx_matmul`.
    #[target_feature(enable = "avx512f,avx512dq,avx,sse3")]
    pub unsafe fn mx_matmul(xs: &[f32], m: usize, w: &MxMatrix, y: &mut [f32]) {
        let k = w.cols;
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(4);
            let x = &xs[i * k..];
            for r in 0..w.rows {
                let yy = &mut y[i * w.rows + r..];
                // SAFETY: same contract.
                unsafe {
                    match mr {
                        4 => rows::<4>(x, k, w, r, yy, w.rows),
                        3 => rows::<3>(x, k, w, r, yy, w.rows),
                        2 => rows::<2>(x, k, w, r, yy, w.rows),
                        _ => rows::<1>(x, k, w, r, yy, w.rows),
                    }
                }
            }
            i += mr;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_known_bytes() {
        // Row of 32: bytes 0x21 → elements (1: 0.5, 2: 1.0); 0xF8 → (8: -0.0, 15: -6.0); scale 2^(128-127)=2.
        let mut packed = vec![0u8; 16];
        packed[0] = 0x21;
        packed[1] = 0xF8;
        packed[2] = 0x7A; // low 0xA = -1.0, high 0x7 = 6.0
        let m = MxMatrix::new(1, 32, packed, &[128]);
        let row = m.dequant_row(0);
        assert_eq!(&row[..6], &[1.0, 2.0, -0.0, -12.0, -2.0, 12.0]);
        assert!(row[6..].iter().all(|&v| v == 0.0));
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(0), 2f32.powi(-127));
        assert!(e8m0(255).is_nan());
    }

    #[test]
    fn matmul_matches_dequantised() {
        let (rows, cols, m) = (6, 96, 5);
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 % 251) as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 120 + (i % 9) as u8).collect();
        let w = MxMatrix::new(rows, cols, packed, &scales);
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
            .collect();
        let mut y = vec![0f32; m * rows];
        mx_matmul(&split_even_odd(&x, cols), m, &w, &mut y);
        for i in 0..m {
            for r in 0..rows {
                let wr = w.dequant_row(r);
                let want: f64 = (0..cols)
                    .map(|c| x[i * cols + c] as f64 * wr[c] as f64)
                    .sum();
                assert!(
                    (y[i * rows + r] as f64 - want).abs() < 1e-4,
                    "{} vs {want}",
                    y[i * rows + r]
                );
            }
        }
        // The packed decode computes the same products.
        let mut y2 = vec![0f32; m * rows];
        crate::gemm::gemm_serial(&x, m, &w.to_packed(), &mut y2);
        for (a, b) in y.iter().zip(&y2) {
            assert!((a - b).abs() < 1e-4);
        }
        // Row invariance: one token alone gives the same bits.
        let mut y1 = vec![0f32; rows];
        mx_matmul(
            &split_even_odd(&x[2 * cols..3 * cols], cols),
            1,
            &w,
            &mut y1,
        );
        assert_eq!(&y1[..], &y[2 * rows..3 * rows]);
    }
}
