//! Seeded random weights for `--load-format dummy`: K3's real per-layer shapes (`models/k3-slice`)
//! can be benchmarked without a checkpoint. Values are scaled so activations stay O(1) through the
//! layers (uniform with variance 1/fan-in for matrices, ≈1 for norm weights, K3-like gate parameters),
//! and MXFP4 experts get random codes with E8M0 scales of 2⁻⁹…2⁻⁵. Deterministic per (seed, name);
//! large tensors are generated in parallel blocks with the same result on any core count. Matrices
//! are rounded to bf16 values, as in K3's bf16 checkpoints (a backend may then store them as bf16
//! without losing anything).

const BLOCK: usize = 1 << 16;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_seed(seed: u64, name: &str) -> u64 {
    // FNV-1a of the name, mixed with the seed.
    let h = name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01B3)
    });
    h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Fill `out` block by block (each block seeded by its index), in parallel for large tensors.
fn fill<T: Send>(out: &mut [T], base: u64, value: impl Fn(&mut u64) -> T + Sync) {
    let fill_block = |(i, chunk): (usize, &mut [T])| {
        let mut s = base ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        for v in chunk {
            *v = value(&mut s);
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if out.len() < 4 * BLOCK || threads == 1 {
        out.chunks_mut(BLOCK).enumerate().for_each(fill_block);
        return;
    }
    let blocks: Vec<(usize, &mut [T])> = out.chunks_mut(BLOCK).enumerate().collect();
    let per = blocks.len().div_ceil(threads);
    let mut groups: Vec<Vec<(usize, &mut [T])>> = Vec::new();
    let mut it = blocks.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per).collect());
    }
    std::thread::scope(|s| {
        for g in groups {
            s.spawn(|| g.into_iter().for_each(fill_block));
        }
    });
}

/// Uniform in [-1, 1).
fn unit(s: &mut u64) -> f32 {
    ((splitmix(s) >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// `x` rounded to the nearest bf16 value (ties to even), as an f32.
pub(crate) fn round_bf16(x: f32) -> f32 {
    let u = x.to_bits();
    f32::from_bits((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF_0000)
}

/// A float tensor named `name` of `shape`.
pub(crate) fn floats(seed: u64, name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let mut out = vec![0f32; n];
    let base = name_seed(seed, name);
    if name.ends_with("e_score_correction_bias") {
        return out;
    }
    // The vision tower names its norm weights without `.weight` (docs/vision.md).
    let vision_norm = ["norm1", "norm2", "merge_norm"]
        .iter()
        .any(|n| name.ends_with(&format!(".{n}")));
    if name.ends_with("norm.weight") || vision_norm {
        fill(&mut out, base, |s| 1.0 + 0.02 * unit(s));
    } else if name.ends_with("A_log") {
        // A = exp(A_log) in [1, 16], as K3 initialises its decay rates.
        fill(&mut out, base, |s| (1.0 + 7.5 * (unit(s) + 1.0)).ln());
    } else if name.ends_with("dt_bias") {
        fill(&mut out, base, |s| 0.5 * unit(s));
    } else if shape.len() >= 2 && shape[0] > 1 {
        // Variance 1/fan-in (fan-in = the product of the trailing dims), so y = x Wᵀ keeps scale.
        let fan_in: usize = shape[1..].iter().product();
        let a = (3.0 / fan_in as f32).sqrt();
        fill(&mut out, base, |s| round_bf16(a * unit(s)));
    } else {
        fill(&mut out, base, |s| 0.02 * unit(s));
    }
    out
}

/// A u8 tensor: MXFP4 codes (`weight_packed`) or E8M0 scales (`weight_scale`).
pub(crate) fn bytes(seed: u64, name: &str, shape: &[usize]) -> Vec<u8> {
    let n: usize = shape.iter().product();
    let mut out = vec![0u8; n];
    let base = name_seed(seed, name);
    if name.ends_with("weight_scale") {
        fill(&mut out, base, |s| 118 + (splitmix(s) % 5) as u8);
    } else {
        fill(&mut out, base, |s| splitmix(s) as u8);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_per_seed_and_name_and_scaled() {
        let a = floats(7, "model.layers.0.mlp.up_proj.weight", &[300, 400]);
        assert_eq!(
            a,
            floats(7, "model.layers.0.mlp.up_proj.weight", &[300, 400])
        );
        assert_ne!(
            a,
            floats(8, "model.layers.0.mlp.up_proj.weight", &[300, 400])
        );
        assert_ne!(
            a,
            floats(7, "model.layers.0.mlp.gate_proj.weight", &[300, 400])
        );
        let var = a.iter().map(|x| (x * x) as f64).sum::<f64>() / a.len() as f64;
        assert!(
            (var * 400.0 - 1.0).abs() < 0.05,
            "variance × fan-in = {}",
            var * 400.0
        );
        let norm = floats(7, "model.norm.weight", &[64]);
        assert!(norm.iter().all(|x| (x - 1.0).abs() <= 0.02));
        assert!(
            a.iter().all(|x| x.to_bits() & 0xFFFF == 0),
            "matrices are bf16 values"
        );
        assert_eq!(
            round_bf16(1.0 + 2f32.powi(-8)),
            1.0,
            "a tie goes to the even neighbour"
        );
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(round_bf16(-0.1), f32::from_bits(0xBDCD_0000));
        let scales = bytes(7, "x.experts.0.w1.weight_scale", &[8, 4]);
        assert!(scales.iter().all(|s| (118..=122).contains(s)));
    }

    #[test]
    fn parallel_fill_matches_the_serial_order() {
        // Large enough for the threaded path; each block's values depend only on its index.
        let big = floats(3, "w", &[5 * BLOCK, 2]);
        let mut serial = vec![0f32; big.len()];
        let base = name_seed(3, "w");
        let a = (3.0f32 / 2.0).sqrt();
        serial.chunks_mut(BLOCK).enumerate().for_each(|(i, c)| {
            let mut s = base ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            c.iter_mut().for_each(|v| *v = round_bf16(a * unit(&mut s)));
        });
        assert_eq!(big, serial);
    }
}
