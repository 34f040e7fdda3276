//! Branch-free `exp`, `sigmoid`, `tanh` that vectorise (libm's scalar calls were a quarter of
//! prefill time). `exp`: Cody–Waite range reduction + degree-6 polynomial, ≤ 2 ulp on the
//! clamped range; `tanh`: an odd polynomial near 0 (avoids cancellation), `1 − 2/(e^{2x}+1)` beyond.

#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    // Round to nearest via the 1.5·2^23 trick: branch-free and no libm call off the SIMD path.
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    // Taylor/minimax coefficients of e^r on |r| ≤ ln2/2 (Cephes expf).
    // Plain multiply-adds (not `mul_add`): without hardware FMA that would be a libm call.
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // 2^n for n in [-126, 128]: build the exponent bits; split to stay finite at the ends.
    let n = n as i32;
    let half = n / 2;
    let a = f32::from_bits(((half + 127) as u32) << 23);
    let b = f32::from_bits(((n - half + 127) as u32) << 23);
    e * a * b
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let ax = x.abs();
    let big = 1.0 - 2.0 / (exp(2.0 * ax) + 1.0);
    // tanh x = x − x³/3 + 2x⁵/15 − 17x⁷/315 + 62x⁹/2835 (error < 2e-8 for |x| < 0.125).
    let x2 = x * x;
    let mut p = 62.0f32 / 2835.0;
    p = p * x2 - 17.0 / 315.0;
    p = p * x2 + 2.0 / 15.0;
    p = p * x2 - 1.0 / 3.0;
    let small = p * x2 * ax + ax;
    let r = if ax < 0.125 { small } else { big };
    r.copysign(x)
}

/// `out[i] = situ(gate[i]) · cap(up[i])` (SiTU-GLU).
pub fn situ_glu_into(
    gate: &[f32],
    up: &[f32],
    beta: f32,
    linear_beta: f32,
    capped: bool,
    out: &mut [f32],
) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F detected; the slices have equal lengths (checked above).
        done = unsafe { avx512::situ_glu(gate, up, beta, linear_beta, capped, out) };
    }
    for i in done..out.len() {
        let (g, u) = (gate[i], up[i]);
        let a = beta * tanh(g / beta) * sigmoid(g);
        out[i] = a * if capped {
            linear_beta * tanh(u / linear_beta)
        } else {
            u
        };
    }
}

/// `x[i] = exp(x[i] − m)`, returning the sum (for softmax).
pub fn exp_shift_sum(x: &mut [f32], m: f32) -> f32 {
    let mut done = 0;
    let mut sum = 0f32;
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F detected.
        (done, sum) = unsafe { avx512::exp_shift_sum(x, m) };
    }
    for v in &mut x[done..] {
        *v = exp(*v - m);
        sum += *v;
    }
    sum
}

/// `out[i] = lb · σ(a · (f[i] + bias[i]))` (the KDA safe gate).
pub fn safe_gate_into(f: &[f32], bias: &[f32], a: f32, lb: f32, out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512() {
        // SAFETY: AVX-512F detected.
        done = unsafe { avx512::safe_gate(f, bias, a, lb, out) };
    }
    for i in done..out.len() {
        out[i] = lb * sigmoid(a * (f[i] + bias[i]));
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Same range reduction and polynomial as the scalar `exp`, with `scalef` for 2^n.
    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        // SAFETY: register-only AVX-512F arithmetic.
        unsafe {
            let x = _mm512_min_ps(
                _mm512_max_ps(x, _mm512_set1_ps(-87.3)),
                _mm512_set1_ps(88.7),
            );
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
            let mut p = _mm512_set1_ps(1.987_569_1e-4);
            for c in [
                1.398_199_9e-3,
                8.333_452e-3,
                4.166_579_6e-2,
                1.666_666_5e-1,
                0.5,
            ] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
            }
            let e = _mm512_add_ps(
                _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
                _mm512_set1_ps(1.0),
            );
            _mm512_scalef_ps(e, n)
        }
    }

    #[inline(always)]
    unsafe fn sigmoid16(x: __m512) -> __m512 {
        // SAFETY: register-only arithmetic.
        unsafe {
            let one = _mm512_set1_ps(1.0);
            _mm512_div_ps(
                one,
                _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))),
            )
        }
    }

    #[inline(always)]
    unsafe fn tanh16(x: __m512) -> __m512 {
        // SAFETY: register-only arithmetic.
        unsafe {
            let sign = _mm512_set1_ps(-0.0);
            let ax = _mm512_andnot_ps(sign, x);
            let one = _mm512_set1_ps(1.0);
            let e = exp16(_mm512_add_ps(ax, ax));
            let big = _mm512_sub_ps(
                one,
                _mm512_div_ps(_mm512_set1_ps(2.0), _mm512_add_ps(e, one)),
            );
            let x2 = _mm512_mul_ps(x, x);
            let mut p = _mm512_set1_ps(62.0 / 2835.0);
            p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-17.0 / 315.0));
            p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.0 / 15.0));
            p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.0 / 3.0));
            let small = _mm512_fmadd_ps(_mm512_mul_ps(p, x2), ax, ax);
            let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(ax, _mm512_set1_ps(0.125));
            let r = _mm512_mask_blend_ps(is_small, big, small);
            _mm512_or_ps(r, _mm512_and_ps(x, sign))
        }
    }

    /// Returns how many leading elements were written (a multiple of 16).
    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub unsafe fn situ_glu(
        gate: &[f32],
        up: &[f32],
        beta: f32,
        lb: f32,
        capped: bool,
        out: &mut [f32],
    ) -> usize {
        let n = out.len() / 16 * 16;
        let (b, ib, l, il) = (
            _mm512_set1_ps(beta),
            _mm512_set1_ps(1.0 / beta),
            _mm512_set1_ps(lb),
            _mm512_set1_ps(1.0 / lb),
        );
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= len of all three slices.
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                let a = _mm512_mul_ps(_mm512_mul_ps(b, tanh16(_mm512_mul_ps(g, ib))), sigmoid16(g));
                let c = if capped {
                    _mm512_mul_ps(l, tanh16(_mm512_mul_ps(u, il)))
                } else {
                    u
                };
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(a, c));
            }
            i += 16;
        }
        n
    }

    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub unsafe fn exp_shift_sum(x: &mut [f32], m: f32) -> (usize, f32) {
        let n = x.len() / 16 * 16;
        let mv = _mm512_set1_ps(m);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= x.len().
            unsafe {
                let v = exp16(_mm512_sub_ps(_mm512_loadu_ps(x.as_ptr().add(i)), mv));
                _mm512_storeu_ps(x.as_mut_ptr().add(i), v);
                acc = _mm512_add_ps(acc, v);
            }
            i += 16;
        }
        (n, _mm512_reduce_add_ps(acc))
    }

    #[target_feature(enable = "avx512f,avx512dq,fma")]
    pub unsafe fn safe_gate(f: &[f32], bias: &[f32], a: f32, lb: f32, out: &mut [f32]) -> usize {
        let n = out.len().min(f.len()).min(bias.len()) / 16 * 16;
        let (av, lv) = (_mm512_set1_ps(a), _mm512_set1_ps(lb));
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= every slice's length.
            unsafe {
                let x = _mm512_add_ps(
                    _mm512_loadu_ps(f.as_ptr().add(i)),
                    _mm512_loadu_ps(bias.as_ptr().add(i)),
                );
                _mm512_storeu_ps(
                    out.as_mut_ptr().add(i),
                    _mm512_mul_ps(lv, sigmoid16(_mm512_mul_ps(av, x))),
                );
            }
            i += 16;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_to_libm() {
        let mut x = -90.0f32;
        while x < 90.0 {
            let (e, want) = (exp(x), x.exp());
            if want.is_normal() && (-87.3..88.7).contains(&x) {
                assert!(((e - want) / want).abs() < 3e-7, "exp({x}) = {e} vs {want}");
            }
            assert!((tanh(x) - x.tanh()).abs() < 3e-7, "tanh({x})");
            assert!(
                (sigmoid(x) - 1.0 / (1.0 + (-x).exp())).abs() < 3e-7,
                "sigmoid({x})"
            );
            x += 0.0137;
        }
        // The SIMD paths agree with the scalar ones.
        let g: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 0.37).collect();
        let u: Vec<f32> = (0..100).map(|i| (i as f32 - 30.0) * 1.9).collect();
        let mut out = vec![0f32; 100];
        situ_glu_into(&g, &u, 4.0, 25.0, true, &mut out);
        for i in 0..100 {
            let want =
                4.0 * (g[i] / 4.0).tanh() / (1.0 + (-g[i]).exp()) * 25.0 * (u[i] / 25.0).tanh();
            assert!(
                (out[i] - want).abs() < 1e-5 * want.abs().max(1.0),
                "situ {i}: {} vs {want}",
                out[i]
            );
        }
        let mut e = g.clone();
        let s = exp_shift_sum(&mut e, 3.0);
        let want: f32 = g.iter().map(|x| (x - 3.0).exp()).sum();
        assert!((s - want).abs() < 1e-5 * want);
        let mut gate = vec![0f32; 100];
        safe_gate_into(&g, &u, 0.7, -5.0, &mut gate);
        assert!((gate[77] - -5.0 / (1.0 + (-0.7 * (g[77] + u[77])).exp())).abs() < 1e-5);
        for x in [1e-6f32, -3e-4, 0.1249, 0.1251] {
            assert!(
                ((tanh(x) - x.tanh()) / x.tanh()).abs() < 1e-6,
                "tanh({x}) relative"
            );
        }
    }
}
