//! The acceptance rule is lossless: generating with drafts and verification gives sequences with
//! exactly the target's distribution. A toy target and drafter (first-order Markov chains over 4
//! tokens, deliberately different) generate 3 tokens many times; the 64 sequence frequencies must
//! pass a chi-square test against the target's exact sequence probabilities. Seeded, so the test
//! is deterministic; a biased rule (e.g. accepting every draft) fails it by orders of magnitude.

use k3_speculative::{DraftProbs, verify_sampled};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const V: usize = 4;
const LEN: usize = 3;
const SAMPLES: usize = 40_000;
/// Chi-square critical value for 63 degrees of freedom at p = 0.001.
const CRITICAL: f64 = 103.4;

fn target(prev: u32) -> Vec<f32> {
    [
        vec![0.1, 0.2, 0.3, 0.4],
        vec![0.5, 0.1, 0.1, 0.3],
        vec![0.25, 0.25, 0.25, 0.25],
        vec![0.7, 0.1, 0.1, 0.1],
    ][prev as usize]
        .clone()
}

fn drafter(prev: u32) -> Vec<f32> {
    [
        vec![0.4, 0.3, 0.2, 0.1],
        vec![0.1, 0.6, 0.2, 0.1],
        vec![0.3, 0.1, 0.5, 0.1],
        vec![0.25, 0.25, 0.25, 0.25],
    ][prev as usize]
        .clone()
}

fn draw(p: &[f32], rng: &mut impl Rng) -> u32 {
    let mut u: f32 = rng.random();
    for (v, &x) in p.iter().enumerate() {
        if u < x {
            return v as u32;
        }
        u -= x;
    }
    (p.len() - 1) as u32
}

/// One sequence of LEN tokens after the start token 0, by rounds of `block` drafts.
fn generate(block: usize, point: bool, rng: &mut impl Rng) -> Vec<u32> {
    let mut out = vec![0u32];
    while out.len() < LEN + 1 {
        let mut draft = Vec::new();
        let mut q = Vec::new();
        let mut prev = *out.last().unwrap();
        for _ in 0..block {
            let dist = drafter(prev);
            // A point-mass source picks its token outright (here: the drafter's favourite).
            let x = if point {
                dist.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .unwrap()
                    .0 as u32
            } else {
                draw(&dist, rng)
            };
            draft.push(x);
            q.push(dist);
            prev = x;
        }
        // The target's distributions after the committed tokens and each draft prefix.
        let mut ctx = *out.last().unwrap();
        let mut p = vec![target(ctx)];
        for &x in &draft {
            ctx = x;
            p.push(target(ctx));
        }
        let probs = if point {
            DraftProbs::Point
        } else {
            DraftProbs::Dist(&q)
        };
        let v = verify_sampled(&draft, probs, &p, rng);
        out.extend_from_slice(&draft[..v.accepted]);
        out.push(v.next);
    }
    out[1..=LEN].to_vec()
}

fn chi_square(block: usize, point: bool, seed: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut counts = vec![0usize; V.pow(LEN as u32)];
    for _ in 0..SAMPLES {
        let seq = generate(block, point, &mut rng);
        let idx = seq.iter().fold(0, |acc, &t| acc * V + t as usize);
        counts[idx] += 1;
    }
    chi_square_against_target(&counts)
}

/// Pearson's statistic of sequence counts (indexed base V) against the target's probabilities.
fn chi_square_against_target(counts: &[usize]) -> f64 {
    let mut chi = 0.0;
    for (idx, &count) in counts.iter().enumerate() {
        let seq = [idx / 16, (idx / 4) % 4, idx % 4];
        let mut prob = 1.0f64;
        let mut prev = 0u32;
        for &t in &seq {
            prob *= f64::from(target(prev)[t]);
            prev = t as u32;
        }
        let expected = prob * SAMPLES as f64;
        chi += (count as f64 - expected).powi(2) / expected;
    }
    chi
}

#[test]
fn sampled_drafts_keep_the_target_distribution() {
    for block in [1, 2, 4] {
        let chi = chi_square(block, false, 11 + block as u64);
        assert!(
            chi < CRITICAL,
            "block {block}: chi-square {chi:.1} ≥ {CRITICAL}"
        );
    }
}

#[test]
fn point_drafts_keep_the_target_distribution() {
    for block in [1, 3] {
        let chi = chi_square(block, true, 29 + block as u64);
        assert!(
            chi < CRITICAL,
            "block {block}: chi-square {chi:.1} ≥ {CRITICAL}"
        );
    }
}

/// The test has power: a rule that accepts every draft token is far off.
#[test]
fn a_biased_rule_fails_the_same_test() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut counts = vec![0usize; 64];
    for _ in 0..SAMPLES {
        let mut prev = 0u32;
        let mut idx = 0;
        for _ in 0..LEN {
            let x = draw(&drafter(prev), &mut rng);
            idx = idx * V + x as usize;
            prev = x;
        }
        counts[idx] += 1;
    }
    let chi = chi_square_against_target(&counts);
    assert!(chi > 10.0 * CRITICAL, "chi-square {chi:.1}");
}
