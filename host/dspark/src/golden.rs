//! Comparison of a [`DsparkModel`] with golden vectors of an independent implementation of the
//! drafter (docs/speculative-decoding.md, "DSpark drafter": the file layout is documented there).
//!
//! A golden safetensors file holds cases; case `c` is every tensor named `c.*`:
//! - `c.anchor` (int `[2]`): the anchor token and its position P;
//! - `c.taps` (f32 `[n, tap_width]`) and `c.positions` (int `[n]`, increasing, each < P), the
//!   observed positions (both absent when there is no context); the block attends to the last
//!   `context_window` of them, as the drafter keeps them;
//! - `c.features` (`[n, d]`): c_p of every observed row;
//! - `c.hidden` (`[γ, d]`, y) and `c.base_logits` (`[γ, V]`, U) of the block pass;
//! - `c.greedy_tokens` (int `[γ]`), `c.greedy_logits` (`[γ, V]`, Markov-adjusted) and
//!   `c.greedy_confidence` (`[γ]`) of greedy drafting;
//! - `c.forced_tokens` (int `[γ]`), `c.forced_temperature` (`[1]`), `c.forced_probs` (`[γ, V]`)
//!   and `c.forced_confidence` (`[γ]`): the draft distributions along given tokens.
//!
//! The trainer's export (`dspark-golden.safetensors` of `reference/k3ref/dspark_train.py`) has
//! its own layout, also read here: case `c` has `c.anchor_token` and `c.anchor_position` (P = the
//! prompt's length), `c.prompt_ids`, `c.features` of every prompt position (the block attends to
//! the last `context_window`), optionally `c.taps`, `c.y`, `c.base_logits_top5_{ids,values}`,
//! `c.greedy_tokens`, `c.greedy_logits_top5_{ids,values}` and `c.confidence`; logits are compared
//! at the listed ids only.

use crate::{DsparkDrafter, DsparkError, DsparkModel};
use k3_model::{Backend, Tensors, WeightFile};
use k3_speculative::{DraftSampling, DraftSource};
use std::path::Path;
use std::sync::Arc;

/// How far one case is from its golden values: per compared tensor, the largest over rows of
/// `max|got − want| / max|want|` of the row (confidences: each value is its own row).
#[derive(Debug, Clone, PartialEq)]
pub struct CaseReport {
    pub case: String,
    pub errors: Vec<(&'static str, f64)>,
    /// Greedy tokens of [`DsparkModel::draft_block`] equal the golden ones.
    pub block_tokens_match: bool,
    /// Greedy tokens of a [`DsparkDrafter`] fed the case's taps equal the golden ones (`None`:
    /// the case has no taps).
    pub drafter_tokens_match: Option<bool>,
}

impl CaseReport {
    pub fn worst(&self) -> f64 {
        self.errors.iter().fold(0.0, |m, (_, e)| m.max(*e))
    }
}

/// Row-relative error (see [`CaseReport`]).
pub fn rel_err(got: &[f32], want: &[f32], width: usize) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut worst = 0f64;
    for (a, b) in got.chunks(width.max(1)).zip(want.chunks(width.max(1))) {
        let scale = b
            .iter()
            .fold(0f64, |m, x| m.max(f64::from(x.abs())))
            .max(1e-6);
        let diff = a.iter().zip(b).fold(0f64, |m, (x, y)| {
            m.max((f64::from(*x) - f64::from(*y)).abs())
        });
        worst = worst.max(diff / scale);
    }
    worst
}

fn golden_err(e: impl std::fmt::Display) -> DsparkError {
    DsparkError::Golden(e.to_string())
}

fn f32s(t: &Tensors<'_>, name: &str) -> Result<Vec<f32>, DsparkError> {
    Ok(t.any_f32(name).map_err(golden_err)?.1)
}

fn ints(t: &Tensors<'_>, name: &str) -> Result<Vec<i64>, DsparkError> {
    t.ints(name).map_err(golden_err)
}

fn tokens(t: &Tensors<'_>, name: &str) -> Result<Vec<u32>, DsparkError> {
    ints(t, name)?
        .into_iter()
        .map(|x| u32::try_from(x).map_err(|_| golden_err(format!("{name}: token {x}"))))
        .collect()
}

/// The two layouts of golden files (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `tests/make_golden.py`: full rows, draft distributions along given tokens.
    Full,
    /// `reference/k3ref/dspark_train.py`: a real prompt, top-5 logits.
    TrainerExport,
}

/// The cases of a golden file (every `c` with a `c.anchor` or a `c.anchor_token`), sorted.
pub fn cases(golden: &Tensors<'_>) -> Vec<(String, Layout)> {
    let mut found: Vec<(String, Layout)> = golden
        .names()
        .into_iter()
        .filter_map(|n| {
            if let Some(c) = n.strip_suffix(".anchor") {
                Some((c.to_string(), Layout::Full))
            } else {
                n.strip_suffix(".anchor_token")
                    .map(|c| (c.to_string(), Layout::TrainerExport))
            }
        })
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    found
}

/// Load a drafter (`drafter_dir`, sharing `target_dir`'s embedding and LM head) and compare it
/// with every case of the golden file at `golden`, e.g. `models/k3-mini-dspark`,
/// `models/k3-mini` and the trainer's `dspark-golden.safetensors`.
pub fn check_files<B: Backend>(
    drafter_dir: &Path,
    target_dir: &Path,
    golden: &Path,
    backend: B,
) -> Result<Vec<CaseReport>, DsparkError> {
    let model = Arc::new(DsparkModel::load(drafter_dir, target_dir, backend)?);
    let file = WeightFile::open(golden).map_err(golden_err)?;
    let reports = check(&model, &file.tensors())?;
    if reports.is_empty() {
        return Err(golden_err(format!(
            "{} holds no case (no `<case>.anchor` or `<case>.anchor_token` tensor)",
            golden.display()
        )));
    }
    Ok(reports)
}

/// Compare `model` with every case of `golden`.
pub fn check<B: Backend>(
    model: &Arc<DsparkModel<B>>,
    golden: &Tensors<'_>,
) -> Result<Vec<CaseReport>, DsparkError> {
    cases(golden)
        .into_iter()
        .map(|(c, layout)| match layout {
            Layout::Full => check_case(model, golden, &c),
            Layout::TrainerExport => check_export_case(model, golden, &c),
        })
        .collect()
}

fn check_case<B: Backend>(
    model: &Arc<DsparkModel<B>>,
    g: &Tensors<'_>,
    case: &str,
) -> Result<CaseReport, DsparkError> {
    let cfg = model.config();
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    let name = |field: &str| format!("{case}.{field}");
    let anchor = ints(g, &name("anchor"))?;
    let [anchor, anchor_pos] = anchor[..] else {
        return Err(golden_err(format!("{case}.anchor must hold 2 values")));
    };
    let anchor = u32::try_from(anchor).map_err(golden_err)?;
    let anchor_pos = usize::try_from(anchor_pos).map_err(golden_err)?;
    let (taps, positions) = if g.contains(&name("taps")) {
        let p = ints(g, &name("positions"))?
            .into_iter()
            .map(|p| usize::try_from(p).map_err(golden_err))
            .collect::<Result<Vec<_>, _>>()?;
        (f32s(g, &name("taps"))?, p)
    } else {
        (Vec::new(), Vec::new())
    };
    let n = positions.len();
    let mut errors = Vec::new();

    let features = model.features(&taps, n)?;
    errors.push((
        "features",
        rel_err(&features, &f32s(g, &name("features"))?, d),
    ));
    // The block attends to the most recent `context_window` observed rows.
    let used = n - n.min(cfg.context_window);
    let (ctx, ctx_pos) = (&features[used * d..], &positions[used..]);

    let greedy = tokens(g, &name("greedy_tokens"))?;
    let scores = model.score_tokens(ctx, ctx_pos, anchor, anchor_pos, &greedy, None)?;
    errors.push((
        "hidden",
        rel_err(&scores.block.hidden, &f32s(g, &name("hidden"))?, d),
    ));
    errors.push((
        "base_logits",
        rel_err(
            &scores.block.base_logits,
            &f32s(g, &name("base_logits"))?,
            v,
        ),
    ));
    errors.push((
        "greedy_logits",
        rel_err(&scores.rows.concat(), &f32s(g, &name("greedy_logits"))?, v),
    ));
    errors.push((
        "greedy_confidence",
        rel_err(&scores.confidence, &f32s(g, &name("greedy_confidence"))?, 1),
    ));
    let block = model.draft_block(
        ctx,
        ctx_pos,
        anchor,
        anchor_pos,
        greedy.len(),
        &mut DraftSampling::Greedy,
    )?;
    let block_tokens_match = block.tokens == greedy;

    let forced = tokens(g, &name("forced_tokens"))?;
    let temperature = f32s(g, &name("forced_temperature"))?
        .first()
        .copied()
        .ok_or_else(|| golden_err(format!("{case}.forced_temperature is empty")))?;
    let scores =
        model.score_tokens(ctx, ctx_pos, anchor, anchor_pos, &forced, Some(temperature))?;
    errors.push((
        "forced_probs",
        rel_err(&scores.rows.concat(), &f32s(g, &name("forced_probs"))?, v),
    ));
    errors.push((
        "forced_confidence",
        rel_err(&scores.confidence, &f32s(g, &name("forced_confidence"))?, 1),
    ));

    // The same case through a drafter: the sequence so far ends in the anchor at `anchor_pos`,
    // and the observed positions arrive in runs of consecutive positions.
    let mut drafter = DsparkDrafter::new(Arc::clone(model));
    let mut seq = vec![0u32; anchor_pos];
    seq.push(anchor);
    drafter.extend(&seq);
    let tw = model.tap_width();
    let mut run = 0;
    while run < n {
        let mut end = run + 1;
        while end < n && positions[end] == positions[end - 1] + 1 {
            end += 1;
        }
        drafter.observe_taps(positions[run], &taps[run * tw..end * tw]);
        run = end;
    }
    let drafted = drafter.propose(greedy.len(), &mut DraftSampling::Greedy);
    if let Some(e) = drafter.take_error() {
        return Err(e);
    }
    Ok(CaseReport {
        case: case.to_string(),
        errors,
        block_tokens_match,
        drafter_tokens_match: Some(drafted.tokens == greedy),
    })
}

/// `rows` (`[γ, V]`) read at each row's listed ids, against the listed values.
fn top5_err(rows: &[f32], v: usize, ids: &[i64], values: &[f32]) -> Result<f64, DsparkError> {
    let width = ids.len() / (rows.len() / v).max(1);
    let got = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            let id = usize::try_from(id)
                .ok()
                .filter(|&id| id < v)
                .ok_or_else(|| golden_err(format!("top-5 id {id} outside the vocabulary")))?;
            Ok(rows[(i / width.max(1)) * v + id])
        })
        .collect::<Result<Vec<f32>, DsparkError>>()?;
    Ok(rel_err(&got, values, width))
}

/// A case of the trainer's export: a real prompt, its features (and for some cases taps), the
/// anchor the target chose after it, and top-5 logits.
fn check_export_case<B: Backend>(
    model: &Arc<DsparkModel<B>>,
    g: &Tensors<'_>,
    case: &str,
) -> Result<CaseReport, DsparkError> {
    let cfg = model.config();
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    let name = |field: &str| format!("{case}.{field}");
    let anchor = tokens(g, &name("anchor_token"))?;
    let anchor_pos = ints(g, &name("anchor_position"))?;
    let (&[anchor], &[anchor_pos]) = (&anchor[..], &anchor_pos[..]) else {
        return Err(golden_err(format!(
            "{case}.anchor_token and {case}.anchor_position must hold one value each"
        )));
    };
    let anchor_pos = usize::try_from(anchor_pos).map_err(golden_err)?;
    let features = f32s(g, &name("features"))?;
    let n = features.len() / d;
    if n != anchor_pos || features.len() != n * d {
        return Err(golden_err(format!(
            "{case}.features: {} values for the {anchor_pos} positions before the anchor",
            features.len()
        )));
    }
    let mut errors = Vec::new();
    let taps = if g.contains(&name("taps")) {
        let taps = f32s(g, &name("taps"))?;
        errors.push((
            "features",
            rel_err(&model.features(&taps, n)?, &features, d),
        ));
        Some(taps)
    } else {
        None
    };
    if g.contains("confidence_temperatures") {
        let t = f32s(g, "confidence_temperatures")?;
        errors.push((
            "confidence_temperatures",
            rel_err(&cfg.confidence_temperatures, &t, 1),
        ));
    }
    let lo = n - n.min(cfg.context_window);
    let positions: Vec<usize> = (lo..n).collect();
    let ctx = &features[lo * d..];
    let greedy = tokens(g, &name("greedy_tokens"))?;
    let scores = model.score_tokens(ctx, &positions, anchor, anchor_pos, &greedy, None)?;
    errors.push((
        "hidden",
        rel_err(&scores.block.hidden, &f32s(g, &name("y"))?, d),
    ));
    errors.push((
        "base_logits_top5",
        top5_err(
            &scores.block.base_logits,
            v,
            &ints(g, &name("base_logits_top5_ids"))?,
            &f32s(g, &name("base_logits_top5_values"))?,
        )?,
    ));
    errors.push((
        "greedy_logits_top5",
        top5_err(
            &scores.rows.concat(),
            v,
            &ints(g, &name("greedy_logits_top5_ids"))?,
            &f32s(g, &name("greedy_logits_top5_values"))?,
        )?,
    ));
    errors.push((
        "confidence",
        rel_err(&scores.confidence, &f32s(g, &name("confidence"))?, 1),
    ));
    let block = model.draft_block(
        ctx,
        &positions,
        anchor,
        anchor_pos,
        greedy.len(),
        &mut DraftSampling::Greedy,
    )?;
    let drafter_tokens_match = match taps {
        Some(taps) => {
            let mut drafter = DsparkDrafter::new(Arc::clone(model));
            drafter.extend(&tokens(g, &name("prompt_ids"))?);
            drafter.extend(&[anchor]);
            drafter.observe_taps(0, &taps);
            let drafted = drafter.propose(greedy.len(), &mut DraftSampling::Greedy);
            if let Some(e) = drafter.take_error() {
                return Err(e);
            }
            Some(drafted.tokens == greedy)
        }
        None => None,
    };
    Ok(CaseReport {
        case: case.to_string(),
        errors,
        block_tokens_match: block.tokens == greedy,
        drafter_tokens_match,
    })
}
