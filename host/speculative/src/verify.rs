//! The acceptance rule (docs/speculative-decoding.md, "Lossless verification"). The target runs
//! once over the last committed token and the ℓ draft tokens and gives ℓ + 1 distributions,
//! already through the request's own sampling pipeline (temperature, top-k/p, penalties): the
//! rule is exact only over the distributions the request would have sampled from.
//!
//! Draft token k is accepted with probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection
//! the next token is drawn from the normalised residual max(0, p_k − q_k); if all are accepted, a
//! bonus token is drawn from p_{ℓ+1}. Every round commits accepted + 1 tokens, and the committed
//! sequence has exactly the distribution of sampling the target token by token.

use rand::Rng;

/// Residual mass below this is treated as none: the next token is drawn from p_k itself (the
/// draft matched the target everywhere that mattered; rounding left only dust).
const RESIDUAL_FLOOR: f64 = 1e-8;

/// What one verify round commits: `accepted` draft tokens, then `next` (the correction at the
/// first rejection, or the bonus token after a fully accepted draft).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    pub next: u32,
}

/// The draft's distributions, as the rule needs them.
#[derive(Debug, Clone, Copy)]
pub enum DraftProbs<'a> {
    /// Each draft token was chosen outright (prompt lookup): q_k is a point mass on x_k.
    Point,
    /// The drafter sampled x_k from q_k (one distribution per draft token).
    Dist(&'a [Vec<f32>]),
}

/// Greedy verification: accept while the draft equals the target's argmax; `target_argmax` has
/// one entry per draft token plus one for the bonus position.
pub fn verify_greedy(draft: &[u32], target_argmax: &[u32]) -> Verdict {
    assert_eq!(
        target_argmax.len(),
        draft.len() + 1,
        "one target choice per draft token, plus the bonus position"
    );
    let accepted = draft
        .iter()
        .zip(target_argmax)
        .take_while(|(d, t)| d == t)
        .count();
    Verdict {
        accepted,
        next: target_argmax[accepted],
    }
}

/// Rejection-sampling verification. `target` holds ℓ + 1 distributions over the vocabulary
/// (probabilities, each summing to 1), `draft` the ℓ draft tokens.
pub fn verify_sampled(
    draft: &[u32],
    draft_probs: DraftProbs<'_>,
    target: &[Vec<f32>],
    rng: &mut impl Rng,
) -> Verdict {
    assert_eq!(
        target.len(),
        draft.len() + 1,
        "one target distribution per draft token, plus the bonus position"
    );
    if let DraftProbs::Dist(q) = draft_probs {
        assert_eq!(
            q.len(),
            draft.len(),
            "one draft distribution per draft token"
        );
    }
    for (k, &x) in draft.iter().enumerate() {
        let q = match draft_probs {
            DraftProbs::Point => None,
            DraftProbs::Dist(q) => Some(q[k].as_slice()),
        };
        if let Some(next) = verify_token(&target[k], x, q, rng) {
            return Verdict { accepted: k, next };
        }
    }
    Verdict {
        accepted: draft.len(),
        next: sample(&target[draft.len()], rng),
    }
}

/// One position of [`verify_sampled`], for a caller that computes each target distribution
/// only once the tokens before it are accepted: `None` accepts draft token `x` (drawn from
/// `q`, or chosen outright when `q` is `None`) against the target's `p`; `Some(y)` rejects it,
/// `y` drawn from the residual.
pub fn verify_token(p: &[f32], x: u32, q: Option<&[f32]>, rng: &mut impl Rng) -> Option<u32> {
    let px = f64::from(p.get(x as usize).copied().unwrap_or(0.0));
    let qx = q.map_or(1.0, |q| {
        f64::from(q.get(x as usize).copied().unwrap_or(0.0))
    });
    // u < p/q without the division. A token drawn from q has q > 0; were it 0, p/q would be
    // infinite and the token accepted.
    let u: f64 = rng.random();
    if qx <= 0.0 || u * qx < px {
        return None;
    }
    Some(match q {
        None => sample_residual(p, |v| if v == x as usize { 1.0 } else { 0.0 }, rng),
        Some(q) => sample_residual(p, |v| f64::from(q.get(v).copied().unwrap_or(0.0)), rng),
    })
}

/// Draw from norm(max(0, p − q)); from p when that has (next to) no mass.
fn sample_residual(p: &[f32], q: impl Fn(usize) -> f64, rng: &mut impl Rng) -> u32 {
    let residual = |v: usize| (f64::from(p[v]) - q(v)).max(0.0);
    let mass: f64 = (0..p.len()).map(residual).sum();
    if mass <= RESIDUAL_FLOOR {
        return sample(p, rng);
    }
    draw(p.len(), residual, mass, rng)
}

/// Draw from `p` (probabilities summing to ~1).
fn sample(p: &[f32], rng: &mut impl Rng) -> u32 {
    let weight = |v: usize| f64::from(p[v].max(0.0));
    let total: f64 = (0..p.len()).map(weight).sum();
    draw(p.len(), weight, total, rng)
}

/// Draw index v with probability weight(v) / total (the last positive weight absorbs rounding).
fn draw(len: usize, weight: impl Fn(usize) -> f64, total: f64, rng: &mut impl Rng) -> u32 {
    let mut u = rng.random::<f64>() * total;
    let mut last = 0;
    for v in 0..len {
        let w = weight(v);
        if w > 0.0 {
            last = v;
            if u < w {
                return v as u32;
            }
            u -= w;
        }
    }
    last as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn greedy_accepts_the_common_prefix(
            draft in prop::collection::vec(0u32..3, 0..8),
            target in prop::collection::vec(0u32..3, 9),
        ) {
            let target = &target[..draft.len() + 1];
            let v = verify_greedy(&draft, target);
            let common = draft.iter().zip(target).take_while(|(a, b)| a == b).count();
            prop_assert_eq!(v.accepted, common);
            prop_assert_eq!(v.next, target[common]);
        }
    }

    #[test]
    fn a_draft_the_target_cannot_produce_is_always_rejected() {
        let mut rng = rand::rng();
        let target = vec![vec![0.0, 0.5, 0.5], vec![1.0, 0.0, 0.0]];
        for _ in 0..200 {
            let v = verify_sampled(&[0], DraftProbs::Point, &target, &mut rng);
            assert_eq!(v.accepted, 0);
            assert_ne!(v.next, 0, "the residual excludes the rejected point");
        }
    }

    #[test]
    fn a_draft_equal_to_the_target_is_always_accepted() {
        let mut rng = rand::rng();
        let p = vec![0.2, 0.3, 0.5];
        let target = vec![p.clone(), p.clone(), vec![0.0, 1.0, 0.0]];
        let q = vec![p.clone(), p.clone()];
        for _ in 0..200 {
            let v = verify_sampled(&[2, 0], DraftProbs::Dist(&q), &target, &mut rng);
            assert_eq!(
                v,
                Verdict {
                    accepted: 2,
                    next: 1
                }
            );
        }
    }
}
