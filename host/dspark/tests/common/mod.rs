//! Shared by the integration tests: the tiny golden drafter of `tests/make_golden.py`.

#![allow(dead_code)]

use k3_backend_cpu::CpuBackend;
use k3_dspark::DsparkModel;
use std::path::PathBuf;
use std::sync::Arc;

pub fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

pub fn load_tiny() -> Arc<DsparkModel<CpuBackend>> {
    let g = golden_dir();
    Arc::new(
        DsparkModel::load(&g.join("drafter"), &g.join("target"), CpuBackend::new())
            .expect("tests/golden holds the tiny drafter (run tests/make_golden.py)"),
    )
}

/// A copy of the golden drafter and target directories that a test may edit.
pub fn scratch_dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    for sub in ["drafter", "target"] {
        std::fs::create_dir(tmp.path().join(sub)).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(golden_dir().join(sub).join(f), tmp.path().join(sub).join(f)).unwrap();
        }
    }
    let (d, t) = (tmp.path().join("drafter"), tmp.path().join("target"));
    (tmp, d, t)
}

/// Edit a JSON file in place.
pub fn edit_json(path: &std::path::Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

/// Seeded taps rows of the tiny drafter's width.
pub fn taps(rows: usize, width: usize, seed: u32) -> Vec<f32> {
    (0..rows * width)
        .map(|i| (i as f32 * 0.618 + seed as f32 * 1.37).sin() * 1.7)
        .collect()
}
