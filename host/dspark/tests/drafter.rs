//! Behaviour of the drafter beyond the golden values: non-causality inside the block, context
//! positions and gaps, the context window, sampled drafting, and errors on bad directories and
//! bad inputs.

mod common;

use k3_backend_cpu::CpuBackend;
use k3_dspark::{DsparkDrafter, DsparkError, DsparkModel};
use k3_speculative::{DraftSampling, DraftSource};
use rand::SeedableRng;
use std::sync::Arc;

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A drafter over a sequence of `len` tokens ending in `last`.
fn drafter_at(
    model: &Arc<DsparkModel<CpuBackend>>,
    len: usize,
    last: u32,
) -> DsparkDrafter<CpuBackend> {
    let mut d = DsparkDrafter::new(Arc::clone(model));
    let mut seq = vec![3u32; len - 1];
    seq.push(last);
    d.extend(&seq);
    d
}

/// The engine shares one model across threads and moves each sequence's drafter between them.
#[test]
fn the_model_is_shared_and_drafters_move() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<DsparkModel<CpuBackend>>();
    send::<DsparkDrafter<CpuBackend>>();
    send::<Box<dyn DraftSource>>();
    let model = common::load_tiny();
    let drafts: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let mut d = drafter_at(&model, 3, 5);
                s.spawn(move || d.propose(4, &mut DraftSampling::Greedy))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(drafts[0], drafts[1]);
    assert_eq!(drafts[0].tokens.len(), 4);
}

#[test]
fn every_block_row_sees_the_later_ones() {
    // The same weights with one mask row fewer: a causal block would leave row 0 unchanged.
    let (_tmp, dir, target) = common::scratch_dirs();
    let model = common::load_tiny();
    common::edit_json(&dir.join("config.json"), |c| {
        c["block_size"] = 3.into();
        c["confidence_temperatures"].as_array_mut().unwrap().pop();
    });
    let short = DsparkModel::load(&dir, &target, CpuBackend::new()).unwrap();
    let tw = model.tap_width();
    let feats = model.features(&common::taps(5, tw, 1), 5).unwrap();
    let ctx = model
        .context_from_features(&feats, &[0, 1, 2, 3, 4], 5)
        .unwrap();
    let v = model.config().vocab_size;
    let full = model.block_forward(&ctx.view_before(5), 7, 5).unwrap();
    let cut = short.block_forward(&ctx.view_before(5), 7, 5).unwrap();
    let diff = max_abs_diff(&full.base_logits[..v], &cut.base_logits[..v]);
    assert!(
        diff > 1e-3,
        "row 0 did not change with the mask rows after it ({diff})"
    );
}

#[test]
fn positions_are_kept_as_they_are() {
    let model = common::load_tiny();
    let tw = model.tap_width();
    let feats = model.features(&common::taps(5, tw, 2), 5).unwrap();
    let greedy = &mut DraftSampling::Greedy;
    let score = |pos: &[usize]| model.score_tokens(&feats, pos, 9, 20, &[], None).unwrap();
    let contiguous = score(&[0, 1, 2, 3, 4]);
    let gapped = score(&[0, 1, 2, 13, 14]);
    assert!(max_abs_diff(&contiguous.block.base_logits, &gapped.block.base_logits) > 1e-4);
    // Shifting everything (context and anchor) together changes nothing: RoPE is relative.
    let shifted = model.score_tokens(&feats, &[100, 101, 102, 113, 114], 9, 120, &[], None);
    let shifted = shifted.unwrap();
    assert!(max_abs_diff(&gapped.block.base_logits, &shifted.block.base_logits) < 1e-4);

    // A drafter fed the gapped runs drafts what draft_block drafts from those positions.
    let mut d = drafter_at(&model, 21, 9);
    let taps = common::taps(5, tw, 2);
    d.observe_taps(0, &taps[..3 * tw]);
    d.observe_taps(13, &taps[3 * tw..]);
    assert_eq!(
        d.context().positions().collect::<Vec<_>>(),
        [0, 1, 2, 13, 14]
    );
    let want = model
        .draft_block(&feats, &[0, 1, 2, 13, 14], 9, 20, 4, greedy)
        .unwrap();
    assert_eq!(d.propose(4, greedy), want);
}

#[test]
fn the_window_keeps_the_most_recent_positions() {
    let model = common::load_tiny();
    let (tw, d) = (model.tap_width(), model.config().hidden_size);
    let window = model.config().context_window;
    let n = window + 7;
    let taps = common::taps(n, tw, 3);
    let feats = model.features(&taps, n).unwrap();
    let greedy = &mut DraftSampling::Greedy;
    // One prefill chunk, then the same taps again in two chunks (re-observed positions replace
    // the old ones), all ending before the anchor at position n.
    let mut drafter = drafter_at(&model, n + 1, 11);
    drafter.observe_taps(0, &taps);
    let first = drafter.propose(4, greedy);
    drafter.observe_taps(0, &taps[..5 * tw]);
    drafter.observe_taps(5, &taps[5 * tw..]);
    assert_eq!(drafter.context().len(), window);
    let positions: Vec<usize> = (n - window..n).collect();
    let want = model
        .draft_block(&feats[(n - window) * d..], &positions, 11, n, 4, greedy)
        .unwrap();
    assert_eq!(first, want);
    assert_eq!(drafter.propose(4, greedy), want);
    // The whole context would give another draft distribution: the window matters.
    let all: Vec<usize> = (0..n).collect();
    let a = model
        .score_tokens(&feats, &all, 11, n, &want.tokens, None)
        .unwrap();
    let w = model
        .score_tokens(
            &feats[(n - window) * d..],
            &positions,
            11,
            n,
            &want.tokens,
            None,
        )
        .unwrap();
    assert!(max_abs_diff(&a.block.base_logits, &w.block.base_logits) > 1e-5);
}

#[test]
fn proposals_follow_the_committed_sequence() {
    let model = common::load_tiny();
    let greedy = &mut DraftSampling::Greedy;
    let gamma = model.config().block_size;
    let mut d = DsparkDrafter::new(Arc::clone(&model));
    assert!(
        d.propose(4, greedy).tokens.is_empty(),
        "nothing committed yet"
    );
    d.extend(&[5, 6, 7]);
    // No context observed: it still drafts, from the block alone.
    let alone = d.propose(gamma + 3, greedy);
    assert_eq!(alone.tokens.len(), gamma, "at most a block");
    assert_eq!(alone.confidence.len(), gamma);
    assert!(alone.probs.is_none(), "greedy drafts are point masses");
    assert!(alone.confidence.iter().all(|c| (0.0..=1.0).contains(c)));
    assert_eq!(d.propose(2, greedy).tokens, alone.tokens[..2]);
    assert!(d.propose(0, greedy).tokens.is_empty());
    let want = model.draft_block(&[], &[], 7, 2, gamma, greedy).unwrap();
    assert_eq!(alone, want);
    // Taps of the processed prompt positions (0, 1) give it a context.
    d.observe_taps(0, &common::taps(2, model.tap_width(), 4));
    let with_ctx = d.propose(gamma, greedy);
    assert_ne!(with_ctx.confidence, alone.confidence);
    // The anchor moves with each commit.
    d.extend(&[8]);
    let feats = model
        .features(&common::taps(2, model.tap_width(), 4), 2)
        .unwrap();
    let want = model
        .draft_block(&feats, &[0, 1], 8, 3, gamma, greedy)
        .unwrap();
    assert_eq!(d.propose(gamma, greedy), want);
}

#[test]
fn sampled_drafts_are_draws_from_their_distributions() {
    let model = common::load_tiny();
    let tw = model.tap_width();
    let v = model.config().vocab_size;
    let mut d = drafter_at(&model, 6, 13);
    d.observe_taps(0, &common::taps(5, tw, 5));
    let feats = model.features(&common::taps(5, tw, 5), 5).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
    let temperature = 1.5;
    let trials = 4000;
    let mut counts = vec![0usize; v];
    let mut q1: Option<Vec<f32>> = None;
    for trial in 0..trials {
        let draft = d.propose(
            4,
            &mut DraftSampling::Sample {
                temperature,
                rng: &mut rng,
            },
        );
        let probs = draft
            .probs
            .as_ref()
            .expect("a sampled draft carries its distributions");
        assert_eq!((draft.tokens.len(), probs.len()), (4, 4));
        for (q, &t) in probs.iter().zip(&draft.tokens) {
            let sum: f64 = q.iter().map(|&x| f64::from(x)).sum();
            assert!((sum - 1.0).abs() < 1e-5, "q sums to {sum}");
            assert!(q[t as usize] > 0.0, "token {t} has no mass");
        }
        if trial < 3 {
            // The rows are the drafter's distributions along its own tokens.
            let s = model
                .score_tokens(
                    &feats,
                    &[0, 1, 2, 3, 4],
                    13,
                    5,
                    &draft.tokens,
                    Some(temperature),
                )
                .unwrap();
            assert_eq!(&s.rows, probs);
            assert_eq!(s.confidence, draft.confidence);
        }
        // Position 1 always follows the anchor: one fixed distribution.
        let q = q1.get_or_insert_with(|| probs[0].clone());
        assert_eq!(&probs[0], q);
        counts[draft.tokens[0] as usize] += 1;
    }
    // Chi-square of position 1's tokens against q1, bins of expectation < 5 pooled.
    let q1 = q1.unwrap();
    let (mut chi2, mut bins, mut pooled_e, mut pooled_o) = (0f64, 0usize, 0f64, 0f64);
    for (t, &c) in counts.iter().enumerate() {
        let e = f64::from(q1[t]) * trials as f64;
        if e >= 5.0 {
            chi2 += (c as f64 - e).powi(2) / e;
            bins += 1;
        } else {
            pooled_e += e;
            pooled_o += c as f64;
        }
    }
    if pooled_e > 0.0 {
        chi2 += (pooled_o - pooled_e).powi(2) / pooled_e;
        bins += 1;
    }
    let dof = (bins - 1) as f64;
    assert!(bins > 10, "too peaked a distribution to test ({bins} bins)");
    // About 5 standard deviations above the mean of a chi-square with `dof` degrees.
    let bound = dof + 5.0 * (2.0 * dof).sqrt();
    assert!(chi2 < bound, "chi2 {chi2:.1} > {bound:.1} with {dof} dof");

    // Temperature 0 is greedy drafting.
    let zero = d.propose(
        4,
        &mut DraftSampling::Sample {
            temperature: 0.0,
            rng: &mut rng,
        },
    );
    assert!(zero.probs.is_none());
    assert_eq!(zero, d.propose(4, &mut DraftSampling::Greedy));
}

fn load(dir: &std::path::Path, target: &std::path::Path) -> DsparkError {
    match DsparkModel::load(dir, target, CpuBackend::new()) {
        Ok(_) => panic!("loaded a bad drafter"),
        Err(e) => e,
    }
}

#[test]
fn bad_directories_are_clear_errors() {
    let (tmp, dir, target) = common::scratch_dirs();
    let e = load(&tmp.path().join("nowhere"), &target);
    assert!(matches!(e, DsparkError::Io { .. }), "{e}");

    let edit = |f: &dyn Fn(&mut serde_json::Value), file: &std::path::Path| -> DsparkError {
        let saved = std::fs::read(file).unwrap();
        common::edit_json(file, f);
        let e = load(&dir, &target);
        std::fs::write(file, saved).unwrap();
        e
    };
    let cfg = dir.join("config.json");
    let e = edit(&|c| c["model_type"] = "kimi_k3".into(), &cfg);
    assert!(
        matches!(e, DsparkError::Config { .. }) && e.to_string().contains("model_type"),
        "{e}"
    );
    let e = edit(&|c| c["target_taps"] = serde_json::json!([1, 2, 4]), &cfg);
    assert!(
        matches!(e, DsparkError::Mismatch(_)) && e.to_string().contains("tap 4"),
        "{e}"
    );
    let e = edit(&|c| c["hidden_size"] = 48.into(), &cfg);
    assert!(
        matches!(e, DsparkError::Mismatch(_)) && e.to_string().contains("hidden_size"),
        "{e}"
    );
    let e = edit(&|c| c["intermediate_size"] = 48.into(), &cfg);
    assert!(
        matches!(e, DsparkError::DrafterWeights(_)) && e.to_string().contains("gate_proj"),
        "{e}"
    );
    let e = edit(
        &|c| c["vocab_size"] = 65.into(),
        &target.join("config.json"),
    );
    assert!(
        matches!(e, DsparkError::Mismatch(_)) && e.to_string().contains("vocab_size"),
        "{e}"
    );
    let e = edit(
        &|c| c["hidden_act"] = "gelu".into(),
        &target.join("config.json"),
    );
    assert!(matches!(e, DsparkError::TargetConfig(_)), "{e}");

    // The target's checkpoint as the drafter's: the drafter's tensors are missing.
    let weights = dir.join("model.safetensors");
    let saved = std::fs::read(&weights).unwrap();
    std::fs::copy(target.join("model.safetensors"), &weights).unwrap();
    let e = load(&dir, &target);
    assert!(
        matches!(e, DsparkError::DrafterWeights(_)) && e.to_string().contains("missing"),
        "{e}"
    );
    std::fs::write(&weights, &saved).unwrap();
    // A truncated shared checkpoint.
    let shared = target.join("model.safetensors");
    let bytes = std::fs::read(&shared).unwrap();
    std::fs::write(&shared, &bytes[..bytes.len() / 2]).unwrap();
    let e = load(&dir, &target);
    assert!(matches!(e, DsparkError::TargetWeights(_)), "{e}");
    std::fs::write(&shared, &bytes).unwrap();
    DsparkModel::load(&dir, &target, CpuBackend::new()).expect("restored files load");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let model = common::load_tiny();
    let (tw, d, v) = (
        model.tap_width(),
        model.config().hidden_size,
        model.config().vocab_size,
    );
    let greedy = &mut DraftSampling::Greedy;
    let input = |r: Result<k3_speculative::Draft, DsparkError>| match r {
        Err(DsparkError::Input(m)) => m,
        other => panic!("expected an input error, got {other:?}"),
    };
    assert!(matches!(
        model.features(&vec![0.0; tw + 1], 1),
        Err(DsparkError::Input(_))
    ));
    let m = input(model.draft_block(&[], &[], v as u32, 3, 4, greedy));
    assert!(m.contains("vocabulary"), "{m}");
    let m = input(model.draft_block(&vec![0.5; d], &[3], 1, 3, 4, greedy));
    assert!(m.contains("not before"), "{m}");
    let m = input(model.draft_block(&vec![0.5; d], &[0, 1], 1, 3, 4, greedy));
    assert!(m.contains("feature values"), "{m}");

    // Taps of the wrong width: kept out of the context, reported, and drafting goes on.
    let mut drafter = drafter_at(&model, 4, 2);
    drafter.observe_taps(0, &vec![0.1; tw + 3]);
    assert!(matches!(drafter.take_error(), Some(DsparkError::Input(_))));
    assert!(drafter.context().is_empty());
    assert_eq!(drafter.propose(4, greedy).tokens.len(), 4);
    assert!(drafter.take_error().is_none());
}
