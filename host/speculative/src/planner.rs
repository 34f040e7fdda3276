//! The verify planner (docs/speculative-decoding.md, "Planner"): how many draft tokens each
//! running request verifies in the next step.
//!
//! A step costs time that grows with its token count; a verified draft token pays only if it is
//! accepted. With c_{r,j} the confidence that request r's j-th draft token is accepted given the
//! ones before it, the chance it commits is the prefix survival a_{r,j} = c_{r,1} ⋯ c_{r,j}. The
//! planner starts from one token per request (the step every decode makes), admits candidate
//! tokens in order of a_{r,j}, and keeps each while the expected committed tokens per second,
//! (R + Σ a) / seconds(B), still grows — stopping at the first token that does not pay. With a
//! large batch the step is already compute-bound, extra tokens cost their full price and none is
//! admitted: speculation switches itself off where it cannot win.

/// Seconds of one target step against its token count, from measured points; linear between
/// them and beyond the last at the last segment's slope.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCostProfile {
    /// (tokens, seconds), tokens strictly increasing, seconds positive.
    points: Vec<(usize, f64)>,
}

impl StepCostProfile {
    /// From measured (tokens, seconds) points; `None` without at least one point with positive
    /// time. Points are sorted; a later duplicate token count replaces an earlier one.
    pub fn new(mut points: Vec<(usize, f64)>) -> Option<Self> {
        points.retain(|&(t, s)| t > 0 && s.is_finite() && s > 0.0);
        points.sort_by_key(|&(t, _)| t);
        points.dedup_by(|later, earlier| {
            if later.0 == earlier.0 {
                earlier.1 = later.1;
                true
            } else {
                false
            }
        });
        (!points.is_empty()).then_some(StepCostProfile { points })
    }

    /// The measured points.
    pub fn points(&self) -> &[(usize, f64)] {
        &self.points
    }

    /// Estimated seconds of a step of `tokens` tokens.
    pub fn seconds(&self, tokens: usize) -> f64 {
        let p = &self.points;
        if p.len() == 1 {
            return p[0].1 * (tokens as f64 / p[0].0 as f64).max(1.0);
        }
        let i = p
            .partition_point(|&(t, _)| t < tokens)
            .clamp(1, p.len() - 1);
        let ((t0, s0), (t1, s1)) = (p[i - 1], p[i]);
        let slope = (s1 - s0) / (t1 - t0) as f64;
        // Never below the cheapest measured step: fewer tokens do not make a step free.
        (s0 + slope * (tokens as f64 - t0 as f64)).max(p[0].1)
    }
}

/// Draft tokens to verify per request (each ≤ its confidences' length), for requests whose
/// drafts carry per-token `confidences`, in a step that also runs `other_tokens` tokens of
/// requests that do not speculate (prefill chunks, plain decodes).
pub fn plan_verify_lengths(
    confidences: &[Vec<f32>],
    other_tokens: usize,
    cost: &StepCostProfile,
) -> Vec<usize> {
    let requests = confidences.len();
    let mut lengths = vec![0; requests];
    if requests == 0 {
        return lengths;
    }
    // Every (request, position) with its prefix survival; within a request survival never
    // grows, so sorting by it (ties by position) admits each request's tokens in order.
    let mut candidates: Vec<(f64, usize, usize)> = Vec::new();
    for (r, c) in confidences.iter().enumerate() {
        let mut survival = 1.0f64;
        for (j, &cj) in c.iter().enumerate() {
            survival *= f64::from(cj.clamp(0.0, 1.0));
            if survival <= 0.0 {
                break;
            }
            candidates.push((survival, j, r));
        }
    }
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    // The other tokens are useful work too: a draft token must not buy its place by making
    // the step look slower per speculating request.
    let mut tokens = requests + other_tokens;
    let mut expected = (requests + other_tokens) as f64;
    let mut rate = expected / cost.seconds(tokens);
    for (survival, j, r) in candidates {
        if lengths[r] != j {
            continue; // an earlier position of this request was not admitted
        }
        let next_rate = (expected + survival) / cost.seconds(tokens + 1);
        if next_rate <= rate {
            break;
        }
        lengths[r] = j + 1;
        tokens += 1;
        expected += survival;
        rate = next_rate;
    }
    lengths
}

/// What a speculating request has been getting lately, for [`drafting_pays`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftingRecord {
    /// Tokens committed per verify round (accepted drafts + 1).
    pub committed: f64,
    /// Draft tokens verified per round.
    pub verified: f64,
    /// Seconds of drafting per request and round (a model drafter's forward pass).
    pub draft_seconds: f64,
}

/// The early exit: whether drafting for `requests` speculating requests can pay in a step that
/// also runs `other_tokens` other tokens. With drafts, each request commits `committed` tokens
/// per round for `1 + verified` tokens of target step plus its drafting time; without, one
/// token for one. A large batch makes the step compute-bound and a slow drafter adds its own
/// time: then drafting is skipped before it is paid for.
pub fn drafting_pays(
    requests: usize,
    other_tokens: usize,
    record: &DraftingRecord,
    cost: &StepCostProfile,
) -> bool {
    if requests == 0 {
        return false;
    }
    let (r, o) = (requests as f64, other_tokens as f64);
    let plain = (r + o) / cost.seconds(requests + other_tokens);
    let tokens = (r * (1.0 + record.verified)).round() as usize + other_tokens;
    let seconds = cost.seconds(tokens) + r * record.draft_seconds;
    (r * record.committed + o) / seconds > plain
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A memory-bound step up to 64 tokens (flat), then compute-bound (linear).
    fn plan_verify_lengths_0(c: &[Vec<f32>], cost: &StepCostProfile) -> Vec<usize> {
        plan_verify_lengths(c, 0, cost)
    }

    fn hopper_like() -> StepCostProfile {
        StepCostProfile::new(vec![(1, 0.010), (64, 0.011), (128, 0.022), (256, 0.044)]).unwrap()
    }

    #[test]
    fn drafting_pays_where_the_step_is_memory_bound_and_the_drafter_cheap() {
        let p = hopper_like();
        let good = DraftingRecord {
            committed: 4.0,
            verified: 6.0,
            draft_seconds: 0.001,
        };
        assert!(drafting_pays(1, 0, &good, &p));
        assert!(drafting_pays(8, 0, &good, &p));
        // 64 requests × 7 tokens: compute-bound, four tokens for seven do not pay.
        assert!(!drafting_pays(64, 0, &good, &p));
        // A drafter as slow as the step itself does not pay even alone.
        let slow = DraftingRecord {
            draft_seconds: 0.05,
            ..good
        };
        assert!(!drafting_pays(1, 0, &slow, &p));
        // Drafts that are never accepted never pay.
        let useless = DraftingRecord {
            committed: 1.0,
            ..good
        };
        assert!(!drafting_pays(1, 0, &useless, &p));
        assert!(!drafting_pays(0, 10, &good, &p));
    }

    #[test]
    fn profile_interpolates_and_extrapolates() {
        let p = hopper_like();
        assert!((p.seconds(1) - 0.010).abs() < 1e-12);
        assert!((p.seconds(96) - 0.0165).abs() < 1e-9);
        assert!((p.seconds(512) - 0.088).abs() < 1e-9);
        assert!(StepCostProfile::new(vec![(0, 1.0), (4, -1.0)]).is_none());
    }

    #[test]
    fn small_batches_verify_confident_drafts_large_ones_do_not() {
        let p = hopper_like();
        let confident = vec![0.9f32; 7];
        let small = plan_verify_lengths_0(&vec![confident.clone(); 4], &p);
        assert!(small.iter().all(|&l| l == 7), "{small:?}");
        // 256 requests already fill a compute-bound step: no draft token pays.
        let large = plan_verify_lengths_0(&vec![confident; 256], &p);
        assert!(large.iter().all(|&l| l == 0), "{large:?}");
    }

    #[test]
    fn unlikely_tokens_are_cut() {
        let p = StepCostProfile::new(vec![(1, 0.010), (8, 0.012), (64, 0.040)]).unwrap();
        let lengths = plan_verify_lengths_0(&[vec![0.95, 0.9, 0.05, 0.9], vec![0.1]], &p);
        assert_eq!(lengths, vec![2, 0]);
    }

    proptest! {
        /// Lengths never exceed the drafts, and the chosen plan's rate is at least the no-draft
        /// rate (the planner never makes a step worse by its own estimate).
        #[test]
        fn plans_are_bounded_and_never_worse(
            confs in prop::collection::vec(prop::collection::vec(0.0f32..1.0, 0..8), 0..40),
        ) {
            let p = hopper_like();
            let lengths = plan_verify_lengths_0(&confs, &p);
            prop_assert_eq!(lengths.len(), confs.len());
            let mut expected = confs.len() as f64;
            let mut tokens = confs.len();
            for (l, c) in lengths.iter().zip(&confs) {
                prop_assert!(*l <= c.len());
                let mut s = 1.0f64;
                for &cj in &c[..*l] {
                    s *= f64::from(cj);
                    expected += s;
                }
                tokens += l;
            }
            if !confs.is_empty() {
                let base = confs.len() as f64 / p.seconds(confs.len());
                prop_assert!(expected / p.seconds(tokens) >= base - 1e-9);
            }
        }
    }
}
