//! Branch-free `exp`, `sigmoid`, `tanh` that vectorise (libm's scalar calls were a quarter of
//! prefill time). `exp`: Cody–Waite range reduction + degree-6 polynomial, ≤ 2 ulp on the
//! clamped range; `tanh`: an odd polynomial near 0 (avoids cancellation), `1 − 2/(e^{2x}+1)` beyond.

use crate::simd::simd_fn;

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

simd_fn! {
    /// `out[i] = situ(gate[i]) · cap(up[i])` (SiTU-GLU).
    pub fn situ_glu_into(gate: &[f32], up: &[f32], beta: f32, linear_beta: f32, capped: bool, out: &mut [f32]) {
        let inv_b = 1.0 / beta;
        let inv_lb = 1.0 / linear_beta;
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            let a = beta * tanh(g * inv_b) * sigmoid(g);
            let c = if capped { linear_beta * tanh(u * inv_lb) } else { u };
            *o = a * c;
        }
    }
}

simd_fn! {
    /// `x[i] = sigmoid(x[i])`.
    pub fn sigmoid_in_place(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = sigmoid(*v);
        }
    }
}

simd_fn! {
    /// `x[i] = exp(x[i] - m)`, returning the sum (for softmax).
    pub fn exp_shift_sum(x: &mut [f32], m: f32) -> f32 {
        let mut acc = [0f32; 16];
        for c in x.chunks_mut(16) {
            for (l, v) in c.iter_mut().enumerate() {
                *v = exp(*v - m);
                acc[l] += *v;
            }
        }
        acc.iter().sum()
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
            assert!((sigmoid(x) - 1.0 / (1.0 + (-x).exp())).abs() < 3e-7, "sigmoid({x})");
            x += 0.0137;
        }
        for x in [1e-6f32, -3e-4, 0.1249, 0.1251] {
            assert!(((tanh(x) - x.tanh()) / x.tanh()).abs() < 1e-6, "tanh({x}) relative");
        }
    }
}
