//! The Rust forward pass against the independent NumPy implementation in `tests/make_golden.py`
//! (float64, the spec's formulas): features, the block pass, greedy drafting, draft
//! distributions along given tokens and confidences, both through `DsparkModel::draft_block` and
//! through a `DsparkDrafter` fed the same taps. Nothing here hard-codes values.

mod common;

use k3_backend_cpu::CpuBackend;
use k3_dspark::golden;

/// Row-relative tolerance for f32 against float64: measured errors are at most 5e-6 (the "ctx"
/// case's draft distributions); the margin covers other SIMD paths of the CPU backend.
const TOL: f64 = 2e-5;

#[test]
fn matches_the_numpy_reference() {
    let g = common::golden_dir();
    let reports = golden::check_files(
        &g.join("drafter"),
        &g.join("target"),
        &g.join("golden.safetensors"),
        CpuBackend::new(),
    )
    .unwrap();
    let names: Vec<&str> = reports.iter().map(|r| r.case.as_str()).collect();
    assert_eq!(names, ["ctx", "far", "none"]);
    assert_all_match(&reports);
}

fn assert_all_match(reports: &[golden::CaseReport]) {
    for r in reports {
        eprintln!("{}: {:?}", r.case, r.errors);
        assert!(r.worst() <= TOL, "{}: {:?}", r.case, r.errors);
        assert!(
            r.block_tokens_match,
            "{}: draft_block tokens differ",
            r.case
        );
        assert_eq!(
            r.drafter_tokens_match,
            Some(true),
            "{}: drafter tokens",
            r.case
        );
    }
}

/// The same NumPy reference written in the layout of the trainer's export
/// (`reference/k3ref/dspark_train.py`: a prompt, top-5 logits), read by the same entry point.
#[test]
fn reads_the_trainer_export_layout() {
    let g = common::golden_dir();
    let reports = golden::check_files(
        &g.join("drafter"),
        &g.join("target"),
        &g.join("golden-export-layout.safetensors"),
        CpuBackend::new(),
    )
    .unwrap();
    let names: Vec<&str> = reports.iter().map(|r| r.case.as_str()).collect();
    assert_eq!(names, ["short"]);
    assert_all_match(&reports);
    let kinds: Vec<&str> = reports[0].errors.iter().map(|(k, _)| *k).collect();
    assert!(kinds.contains(&"greedy_logits_top5") && kinds.contains(&"features"));
}

#[test]
fn a_file_without_cases_is_an_error() {
    let g = common::golden_dir();
    // The drafter's own weights are a valid safetensors file with no golden case in it.
    let e = golden::check_files(
        &g.join("drafter"),
        &g.join("target"),
        &g.join("drafter/model.safetensors"),
        CpuBackend::new(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("no case"), "{e}");
}

/// The trained drafter in `models/k3-mini-dspark` against the trainer's own golden vectors
/// (PyTorch, float32 on the CPU; `tests/golden/trained-golden.safetensors`): the "short" case
/// from k3-mini's real taps, the "long" one past the 512-row window.
#[test]
fn the_trained_drafter_matches_its_trainer() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let reports = golden::check_files(
        &root.join("models/k3-mini-dspark"),
        &root.join("models/k3-mini"),
        &common::golden_dir().join("trained-golden.safetensors"),
        CpuBackend::new(),
    )
    .unwrap();
    assert_eq!(reports.len(), 2, "{reports:?}");
    for r in &reports {
        eprintln!("{}: {:?}", r.case, r.errors);
        assert!(r.worst() <= TOL, "{}: {:?}", r.case, r.errors);
        assert!(r.block_tokens_match, "{}: greedy draft differs", r.case);
    }
}
