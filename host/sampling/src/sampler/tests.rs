use proptest::prelude::*;

use super::*;

fn sampler(params: SamplingParams, vocab: usize) -> Sampler {
    Sampler::new(&params, vocab).unwrap()
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&l| l as f64 - lse).collect()
}

/// Token ids ordered most likely first, ties to the lower id.
fn ranked(logits: &[f32]) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    ids
}

/// Straightforward reference of the allowed set: full sorts, f64 probabilities.
fn allowed_set(logits: &[f32], temperature: f32, top_k: usize, top_p: f64, min_p: f64) -> Vec<u32> {
    let mut ids = ranked(logits);
    if top_k > 0 {
        ids.truncate(top_k);
    }
    let scaled: Vec<f64> = logits
        .iter()
        .map(|&l| l as f64 / temperature as f64)
        .collect();
    let max = scaled[ids[0] as usize];
    let weight = |t: u32| (scaled[t as usize] - max).exp();
    let total: f64 = ids.iter().map(|&t| weight(t)).sum();
    let mut cumulative = 0.0;
    let mut keep = ids.len();
    for (i, &t) in ids.iter().enumerate() {
        cumulative += weight(t);
        if cumulative >= top_p * total {
            keep = i + 1;
            break;
        }
    }
    ids.truncate(keep);
    ids.retain(|&t| weight(t) >= min_p);
    ids
}

#[test]
fn greedy_takes_argmax_with_ties_to_lower_id() {
    let mut s = sampler(
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        6,
    );
    let h = SeqHistory::default();
    let logits = [0.1, 3.0, f32::NAN, 3.0, -1.0, 3.0];
    assert_eq!(s.sample(&logits, &h).unwrap().token, 1);
    let logits = [
        f32::NEG_INFINITY,
        f32::NAN,
        0.0,
        0.0,
        0.0,
        f32::NEG_INFINITY,
    ];
    assert_eq!(s.sample(&logits, &h).unwrap().token, 2);
}

#[test]
fn penalties_match_hand_computation() {
    let params = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..Default::default()
    };
    let mut s = sampler(params, 5);
    let mut h = SeqHistory::new(&[0, 0, 4]);
    h.extend(&[1, 1, 2, 4]);
    s.work = vec![2.0, -1.0, 0.5, 1.0, 3.0];
    s.apply_penalties(&h);
    // 0: prompt only → 2/2. 1: output ×2 → -1·2 - 0.5 - 2·0.25. 2: output ×1 → 0.5/2 - 0.5 - 0.25.
    // 3: unseen. 4: prompt and output ×1, repetition applied once → 3/2 - 0.5 - 0.25.
    assert_eq!(s.work, vec![1.0, -3.0, -0.5, 1.0, 0.75]);
}

#[test]
fn penalties_change_the_greedy_choice_but_not_the_raw_logprob() {
    let params = SamplingParams {
        temperature: 0.0,
        frequency_penalty: 2.0,
        logprobs: Some(2),
        ..Default::default()
    };
    let mut s = sampler(params, 3);
    let mut h = SeqHistory::new(&[]);
    let logits = [1.0, 2.0, 0.5];
    let first = s.sample(&logits, &h).unwrap();
    assert_eq!(first.token, 1);
    h.push(1);
    let second = s.sample(&logits, &h).unwrap();
    assert_eq!(second.token, 0, "2 - 2·1 < 1");
    let expected = log_softmax(&logits);
    assert!((second.logprob.unwrap() as f64 - expected[0]).abs() < 1e-6);
    assert_eq!(
        second
            .top_logprobs
            .iter()
            .map(|&(t, _)| t)
            .collect::<Vec<_>>(),
        vec![1, 0]
    );
    assert!((second.top_logprobs[0].1 as f64 - expected[1]).abs() < 1e-6);
}

#[test]
fn logprobs_ignore_temperature_and_list_ties_in_id_order() {
    let params = SamplingParams {
        temperature: 0.3,
        top_k: 2,
        logprobs: Some(3),
        seed: Some(1),
        ..Default::default()
    };
    let mut s = sampler(params, 5);
    let logits = [0.0, 1.0, 1.0, -2.0, 1.0];
    let out = s.sample(&logits, &SeqHistory::default()).unwrap();
    let expected = log_softmax(&logits);
    assert!([1, 2].contains(&out.token), "top-2 is ids 1 and 2");
    assert!((out.logprob.unwrap() as f64 - expected[out.token as usize]).abs() < 1e-6);
    let ids: Vec<u32> = out.top_logprobs.iter().map(|&(t, _)| t).collect();
    assert_eq!(ids, vec![1, 2, 4]);
    let none = sampler(SamplingParams::default(), 5)
        .sample(&logits, &SeqHistory::default())
        .unwrap();
    assert!(none.top_logprobs.is_empty() && none.logprob.is_none());
    // logprobs = 0: the sampled token's logprob only.
    let mut zero = sampler(
        SamplingParams {
            logprobs: Some(0),
            temperature: 0.0,
            ..Default::default()
        },
        5,
    );
    let only = zero.sample(&logits, &SeqHistory::default()).unwrap();
    assert!(only.top_logprobs.is_empty());
    assert!((only.logprob.unwrap() as f64 - expected[1]).abs() < 1e-6);
}

#[test]
fn same_seed_reproduces_and_different_seeds_differ() {
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 50.0).collect();
    let run = |seed| {
        let mut s = sampler(
            SamplingParams {
                seed: Some(seed),
                top_p: 0.95,
                ..Default::default()
            },
            1000,
        );
        let h = SeqHistory::default();
        (0..64)
            .map(|_| s.sample(&logits, &h).unwrap().token)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
    let unseeded = sampler(SamplingParams::default(), 10);
    let again = Sampler::new(
        &SamplingParams {
            seed: Some(unseeded.seed()),
            ..Default::default()
        },
        10,
    )
    .unwrap();
    assert_eq!(unseeded.seed(), again.seed());
}

#[test]
fn frequencies_follow_the_softmax() {
    let logits = [0.0f32, 1.0, 2.0, f32::NEG_INFINITY];
    let mut s = sampler(
        SamplingParams {
            seed: Some(7),
            temperature: 0.8,
            ..Default::default()
        },
        4,
    );
    let h = SeqHistory::default();
    let n = 20_000;
    let mut counts = [0usize; 4];
    for _ in 0..n {
        counts[s.sample(&logits, &h).unwrap().token as usize] += 1;
    }
    let scaled: Vec<f32> = logits.iter().map(|l| l / 0.8).collect();
    let p: Vec<f64> = log_softmax(&scaled).iter().map(|l| l.exp()).collect();
    for t in 0..3 {
        let freq = counts[t] as f64 / n as f64;
        // Five standard deviations of a binomial proportion.
        let tol = 5.0 * (p[t] * (1.0 - p[t]) / n as f64).sqrt();
        assert!((freq - p[t]).abs() < tol, "token {t}: {freq} vs {}", p[t]);
    }
    assert_eq!(counts[3], 0, "masked token is never drawn");
}

#[test]
fn small_top_p_is_greedy_and_min_p_one_keeps_only_the_maximum() {
    let logits: Vec<f32> = (0..500).map(|i| (i % 17) as f32 * 0.1).collect();
    let best = ranked(&logits)[0];
    let h = SeqHistory::default();
    let mut s = sampler(
        SamplingParams {
            top_p: 1e-6,
            seed: Some(3),
            ..Default::default()
        },
        500,
    );
    let mut m = sampler(
        SamplingParams {
            min_p: 1.0,
            seed: Some(3),
            ..Default::default()
        },
        500,
    );
    for _ in 0..20 {
        assert_eq!(s.sample(&logits, &h).unwrap().token, best);
        // min_p = 1 keeps every token tied for the maximum: ids ≡ 16 (mod 17).
        assert_eq!(m.sample(&logits, &h).unwrap().token % 17, 16);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut s = sampler(SamplingParams::default(), 3);
    let h = SeqHistory::default();
    assert_eq!(
        s.sample(&[0.0; 4], &h),
        Err(SamplingError::LogitsLength {
            expected: 3,
            got: 4
        })
    );
    assert_eq!(
        s.sample(&[f32::NAN; 3], &h),
        Err(SamplingError::NoFiniteLogits)
    );
    let mut g = sampler(
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        3,
    );
    assert_eq!(
        g.sample(&[f32::NEG_INFINITY; 3], &h),
        Err(SamplingError::NoFiniteLogits)
    );
    assert_eq!(
        Sampler::new(&SamplingParams::default(), 0).err(),
        Some(SamplingError::EmptyVocab)
    );
    let bad = SamplingParams {
        top_p: 0.0,
        ..Default::default()
    };
    assert!(matches!(
        Sampler::new(&bad, 3),
        Err(SamplingError::InvalidParam { field: "top_p", .. })
    ));
    // History ids outside the vocabulary are ignored, not a panic.
    let mut p = sampler(
        SamplingParams {
            repetition_penalty: 1.5,
            presence_penalty: 1.0,
            ..Default::default()
        },
        3,
    );
    let mut h = SeqHistory::new(&[99]);
    h.push(1000);
    p.sample(&[0.0; 3], &h).unwrap();
}

#[test]
fn large_vocab_top_p_uses_the_nucleus() {
    // A flat tail makes the nucleus large (thousands of tokens), forcing the growing selection.
    let vocab = 50_000;
    let logits: Vec<f32> = (0..vocab)
        .map(|i| {
            if i % 1000 == 0 {
                5.0
            } else {
                (i % 7) as f32 * 0.01
            }
        })
        .collect();
    let allowed = allowed_set(&logits, 1.0, 0, 0.9 + 1e-4, 0.0);
    let mut s = sampler(
        SamplingParams {
            top_p: 0.9,
            seed: Some(11),
            ..Default::default()
        },
        vocab,
    );
    let h = SeqHistory::default();
    let allowed: std::collections::HashSet<u32> = allowed.into_iter().collect();
    for _ in 0..50 {
        let t = s.sample(&logits, &h).unwrap().token;
        assert!(allowed.contains(&t), "token {t} outside the nucleus");
    }
}

#[test]
fn top_k_scan_with_many_ties_matches_the_reference() {
    // Thousands of tied values force several buffer prunes; ties must resolve to lower ids.
    let vocab = 3000;
    let logits: Vec<f32> = (0..vocab)
        .map(|i| ((i * 7919) % 13) as f32 * 0.25)
        .collect();
    for k in [1usize, 5, 40, 700] {
        let allowed = allowed_set(&logits, 10.0, k, 1.0, 0.0);
        assert_eq!(allowed.len(), k);
        let params = SamplingParams {
            top_k: k as i32,
            temperature: 10.0,
            seed: Some(k as u64),
            ..Default::default()
        };
        let mut s = sampler(params, vocab);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..400 {
            let t = s.sample(&logits, &SeqHistory::default()).unwrap().token;
            assert!(allowed.contains(&t), "k={k}: {t} outside the top k");
            seen.insert(t);
        }
        assert!(
            seen.len() >= k.min(100),
            "k={k}: only {} distinct tokens drawn",
            seen.len()
        );
    }
}

fn logits_strategy() -> impl Strategy<Value = Vec<f32>> {
    // Quarter steps: ties happen (exercising the id tie-break) but distinct values stay distinct after exp.
    prop::collection::vec((-40i32..40).prop_map(|q| q as f32 * 0.25), 1..300)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn filters_never_sample_outside_the_allowed_set(
        logits in logits_strategy(),
        temperature in 0.05f32..3.0,
        top_k in 0usize..40,
        top_p in 0.01f32..=1.0,
        min_p in prop_oneof![Just(0.0f32), 0.0f32..0.9],
        seed in any::<u64>(),
    ) {
        let params = SamplingParams {
            temperature, top_k: top_k as i32, top_p, min_p, seed: Some(seed), ..Default::default()
        };
        let mut s = sampler(params, logits.len());
        // Slack on the thresholds absorbs f32-vs-f64 rounding at the boundary; the slack only widens the set.
        let allowed = allowed_set(&logits, temperature, top_k, top_p as f64 + 1e-4, min_p as f64 * (1.0 - 1e-4));
        let h = SeqHistory::default();
        for _ in 0..8 {
            let t = s.sample(&logits, &h).unwrap().token;
            prop_assert!(allowed.contains(&t), "token {} not in {:?}", t, allowed);
        }
    }

    #[test]
    fn top_k_one_equals_greedy(logits in logits_strategy(), seed in any::<u64>()) {
        let mut k1 = sampler(SamplingParams { top_k: 1, seed: Some(seed), ..Default::default() }, logits.len());
        let mut g = sampler(SamplingParams { temperature: 0.0, ..Default::default() }, logits.len());
        let h = SeqHistory::default();
        prop_assert_eq!(k1.sample(&logits, &h).unwrap().token, g.sample(&logits, &h).unwrap().token);
    }
}

/// The executor's candidate selection (`k3_model::top_k_of_row`): the k largest finite logits,
/// largest first, ties to the lower id. Restated here (this crate does not depend on the model).
fn top_candidates(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = (0u32..)
        .zip(logits.iter().copied())
        .filter(|(_, l)| l.is_finite())
        .collect();
    c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    c.truncate(k);
    c
}

#[test]
fn top_k_need_only_when_candidates_decide_the_token() {
    let need = |p: SamplingParams| sampler(p, 2000).top_k_need();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    assert_eq!(need(greedy.clone()), Some(1));
    assert_eq!(
        need(SamplingParams {
            top_k: 40,
            top_p: 0.9,
            ..Default::default()
        }),
        Some(40)
    );
    // Whole rows: plain temperature / top-p, penalties, logprobs, a top-k beyond the limit.
    assert_eq!(need(SamplingParams::default()), None);
    assert_eq!(
        need(SamplingParams {
            top_p: 0.5,
            ..Default::default()
        }),
        None
    );
    assert_eq!(
        need(SamplingParams {
            presence_penalty: 0.5,
            ..greedy.clone()
        }),
        None
    );
    assert_eq!(
        need(SamplingParams {
            repetition_penalty: 1.1,
            top_k: 5,
            ..Default::default()
        }),
        None
    );
    assert_eq!(
        need(SamplingParams {
            logprobs: Some(2),
            ..greedy
        }),
        None
    );
    assert_eq!(
        need(SamplingParams {
            top_k: 1500,
            ..Default::default()
        }),
        None
    );
}

#[test]
fn sample_top_rejects_what_it_cannot_use() {
    let h = SeqHistory::default();
    let mut plain = sampler(SamplingParams::default(), 8);
    assert_eq!(
        plain.sample_top(&[(1, 0.5)]),
        Err(SamplingError::CandidatesUnusable)
    );
    let mut k2 = sampler(
        SamplingParams {
            top_k: 2,
            ..Default::default()
        },
        8,
    );
    let three = [(1, 3.0), (2, 2.0), (3, 1.0)];
    assert_eq!(
        k2.sample_top(&three),
        Err(SamplingError::CandidatesUnusable)
    );
    assert_eq!(
        k2.sample_top(&[(9, 1.0)]),
        Err(SamplingError::CandidatesUnusable)
    );
    assert_eq!(
        k2.sample_top(&[(1, f32::NAN)]),
        Err(SamplingError::CandidatesUnusable)
    );
    assert_eq!(k2.sample_top(&[]), Err(SamplingError::NoFiniteLogits));
    // A masked row selects nothing; the whole-row path agrees.
    let masked = [f32::NEG_INFINITY; 8];
    assert_eq!(k2.sample(&masked, &h), Err(SamplingError::NoFiniteLogits));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Selected candidates give the same tokens as the whole row, draw for draw (same seed), for
    /// greedy and top-k requests with any temperature / top-p / min-p; rows include ties, -0/+0
    /// and masked (non-finite) entries.
    #[test]
    fn sampling_from_selected_candidates_equals_the_whole_row(
        logits in prop::collection::vec(
            prop_oneof![
                8 => (-40i32..40).prop_map(|q| q as f32 * 0.25),
                1 => Just(-0.0f32),
                1 => prop_oneof![Just(f32::NAN), Just(f32::NEG_INFINITY), Just(f32::INFINITY)],
            ],
            1..300,
        ),
        greedy in any::<bool>(),
        temperature in 0.05f32..3.0,
        top_k in 1usize..60,
        // top-p 1 often: the nucleus sorts its candidates, so only without it does the draw
        // see the selection's own order.
        top_p in prop_oneof![Just(1.0f32), 0.01f32..=1.0],
        min_p in prop_oneof![Just(0.0f32), 0.0f32..0.9],
        seed in any::<u64>(),
    ) {
        let params = SamplingParams {
            temperature: if greedy { 0.0 } else { temperature },
            top_k: top_k as i32, top_p, min_p, seed: Some(seed), ..Default::default()
        };
        let (mut whole, mut selected) = (sampler(params.clone(), logits.len()), sampler(params, logits.len()));
        let h = SeqHistory::default();
        for _ in 0..6 {
            let a = whole.sample(&logits, &h);
            match selected.top_k_need() {
                Some(k) => {
                    let b = selected.sample_top(&top_candidates(&logits, k));
                    prop_assert_eq!(a.map(|t| t.token), b.map(|t| t.token));
                }
                // top_k at or above the vocabulary means no top-k at all: whole rows.
                None => prop_assert!(!greedy && top_k >= logits.len()),
            }
        }
    }
}

/// `distribution` is what `sample` draws from: empirical frequencies of 20,000 draws stay
/// within a few standard errors of it for every filter combination, and it sums to 1 on the
/// allowed set only.
#[test]
fn distribution_is_what_sample_draws_from() {
    let logits: Vec<f32> = (0..12)
        .map(|i| ((i * 7) % 5) as f32 * 0.6 - i as f32 * 0.1)
        .collect();
    let mut history = SeqHistory::new(&[3]);
    history.push(4);
    let cases = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.7,
            top_k: 5,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.8,
            min_p: 0.05,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.3,
            frequency_penalty: 0.8,
            repetition_penalty: 1.2,
            ..Default::default()
        },
    ];
    for (i, params) in cases.into_iter().enumerate() {
        let params = SamplingParams {
            seed: Some(i as u64),
            ..params
        };
        let mut s = sampler(params, logits.len());
        let p = s.distribution(&logits, &history).unwrap();
        let total: f32 = p.iter().sum();
        assert!((total - 1.0).abs() < 1e-5, "case {i}: sums to {total}");
        let n = 20_000;
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[s.sample(&logits, &history).unwrap().token as usize] += 1;
        }
        for (t, (&c, &pt)) in counts.iter().zip(&p).enumerate() {
            let f = c as f64 / n as f64;
            let se = (f64::from(pt) * (1.0 - f64::from(pt)) / n as f64).sqrt();
            assert!(
                (f - f64::from(pt)).abs() <= 5.0 * se + 1e-9,
                "case {i} token {t}: frequency {f} vs p {pt}"
            );
        }
    }
    let mut g = sampler(
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        logits.len(),
    );
    let p = g.distribution(&logits, &history).unwrap();
    let top = g.sample(&logits, &history).unwrap().token as usize;
    assert_eq!(p[top], 1.0);
    assert_eq!(p.iter().filter(|&&x| x > 0.0).count(), 1);
}
