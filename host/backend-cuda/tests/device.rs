//! GPU correctness of the CUDA backend against the CPU backend (the ground truth), in f32 on
//! both sides. Every test returns early ("skipped: no CUDA device") where no GPU opens, so it
//! passes on CI. On a GPU (`--nocapture --test-threads=1` for readable output):
//!   ops_match_cpu          every Backend op on fresh random inputs: `op=<name> rel_err=<x> tol=<y>`
//!   k3_mini_matches_cpu    models/k3-mini on the golden prompts: logits and greedy tokens
//!   engine_matches_cpu     ModelExecutor<CudaBackend> inside k3_engine, concurrent requests
//!   kda_replay_*           ReplaySSM verify/commit against plain decoding (device/kda_replay.rs)
//!   vision_*               the vision tower's ops, the tower and an image prompt (device/vision.rs)
//! The seed is printed; `K3_SEED=<n>` repeats a run. `K3_ROOT` points at the repository root
//! when the test binary runs outside the source tree (default: the current directory if it has
//! models/, else the crate's source location).

use k3_backend_cpu::CpuBackend;
use k3_backend_cuda::{CudaBackend, CudaOptions, Dtype};
use k3_model::backend::{
    Backend, Glu, KdaGeom, KdaInputs, KdaParams, KdaStateLoc, MlaCacheLoc, MlaGeom, MxExpertsHost,
    MxMatrixHost, RouterParams, SituParams, glu,
};
use k3_model::{Executor, LogitsWant, Model, ModelExecutor, Session};
use std::path::PathBuf;

#[path = "device/experts.rs"]
mod experts;
#[path = "device/kda_replay.rs"]
mod kda_replay;
#[path = "device/model.rs"]
mod model;
#[path = "device/ops.rs"]
mod ops;
#[path = "device/precision.rs"]
mod precision;
#[path = "device/vision.rs"]
mod vision;

use model::{LOGITS_TOL, compare_engine, compare_model, near_tie, prompt_file, top2};

/// The GPU in float32 mode: the f32-level tolerances below hold only for it. [`cuda_bf16`] is
/// the default, served mode.
fn cuda() -> Option<CudaBackend> {
    cuda_with(Dtype::F32)
}

/// The GPU in bfloat16 mode (`Dtype::Bf16`, the serving default).
fn cuda_bf16() -> Option<CudaBackend> {
    cuda_with(Dtype::Bf16)
}

fn cuda_with(dtype: Dtype) -> Option<CudaBackend> {
    let options = CudaOptions {
        dtype,
        ..CudaOptions::default()
    };
    match CudaBackend::with_options(0, options) {
        Ok(b) => Some(b),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn root() -> PathBuf {
    if let Ok(r) = std::env::var("K3_ROOT") {
        return PathBuf::from(r);
    }
    let cwd = std::env::current_dir().unwrap_or_default();
    if cwd.join("models/k3-mini").is_dir() {
        return cwd;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// xorshift64*: reproducible inputs from a printed seed.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Self {
        let seed = std::env::var("K3_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        println!("{test}: seed {seed} (K3_SEED={seed} repeats it)");
        Rng(seed | 1)
    }
    fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-scale, scale).
    fn f(&mut self, scale: f32) -> f32 {
        ((self.u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f(scale)).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }
}

/// `max|a−b| / max|b|` over the whole tensor.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs() as f64)).max(1e-30);
    let diff = a.iter().zip(b).fold(0f64, |m, (x, y)| {
        let d = (*x as f64 - *y as f64).abs();
        match (x.is_nan(), y.is_nan()) {
            (true, true) => m, // same bytes reinterpreted (arena test)
            (false, false) if !d.is_nan() => m.max(d),
            _ => f64::INFINITY,
        }
    });
    diff / scale
}

fn bytes_to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Collects `op=… rel_err=… tol=…` lines; fails at the end if any is over its tolerance.
struct Table {
    /// Prefix of every line ("" on the GPU, "cpu-selfcheck " for the harness self-check).
    tag: &'static str,
    failed: Vec<String>,
    /// The least tolerance of any op: [`TOL_BF16_MODE`] in bf16 mode, else 0.
    floor: f64,
}

impl Table {
    /// A table whose lines start with `tag`, each op at its own tolerance (no floor).
    fn new(tag: &'static str) -> Self {
        Self {
            tag,
            failed: Vec::new(),
            floor: 0.0,
        }
    }
    fn check(&mut self, op: &str, cuda: &[f32], cpu: &[f32], tol: f64) {
        let tol = tol.max(self.floor);
        let e = rel_err(cuda, cpu);
        let ok = e <= tol;
        println!(
            "{}op={op} rel_err={e:.3e} tol={tol:.0e} n={} {}",
            self.tag,
            cpu.len(),
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            self.failed.push(format!("{op}: {e:.3e} > {tol:.0e}"));
        }
    }
    /// A second run of `op` on the same inputs must give the same bits.
    fn check_rerun(&mut self, op: &str, first: &[f32], again: &[f32]) {
        let same = first.len() == again.len()
            && first
                .iter()
                .zip(again)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        println!("{}op={op} rerun bitwise-equal={same}", self.tag);
        if !same {
            self.failed.push(format!("{op}: rerun differs"));
        }
    }
    fn finish(self) {
        assert!(
            self.failed.is_empty(),
            "ops over tolerance: {:?}",
            self.failed
        );
    }
}

/// k3-mini's MLA shape, and K3's per-head dims with 8 of its 96 heads (CPU time stays small).
const MLA_MINI: MlaGeom = MlaGeom {
    heads: 4,
    nope: 64,
    rope: 32,
    v_dim: 64,
    kv_lora: 128,
    eps: 1e-5,
};
const MLA_K3_DIMS: MlaGeom = MlaGeom {
    heads: 8,
    nope: 128,
    rope: 64,
    v_dim: 128,
    kv_lora: 512,
    eps: 1e-6,
};

const TOL_POINTWISE: f64 = 1e-5;
const TOL_GEMM: f64 = 1e-5;
const TOL_FUSED: f64 = 1e-4;
/// MLA decode in bf16 mode (wgmma or mma.sync): q~, the cache rows and P rounded to bf16 (8 significant
/// bits, 2^-9 relative each); ~2e-3 expected at these shapes, one decade of margin.
const TOL_MLA_BF16: f64 = 2e-2;
/// bf16 weights: the activation enters the tensor-core GEMM as two bf16 halves (~16 of its 24
/// mantissa bits), so one more digit than f32 SGEMM is given up.
const TOL_BF16_GEMM: f64 = 5e-5;
/// Any op in bf16 mode (`Dtype::Bf16`): activations rounded once to bf16 (2^-9 relative) before
/// each tensor-core product, TF32 (2^-11) for the f32 ones; summed over K with f32 accumulation
/// the relative error stays at a few 1e-3 at these shapes; one decade of margin.
const TOL_BF16_MODE: f64 = 2e-2;
/// The routed experts in mxfp8 mode: each activation rounded to E4M3 under its block's scale
/// (3 mantissa bits: up to 2^-4 relative per value) at the input and again at the intermediate;
/// the harness checks the kernels against float64 of the rounded activations to ~1e-7, so what
/// is left against the CPU's f32 is the format's own error, a few percent of the largest output.
const TOL_MXFP8: f64 = 1e-1;
/// `x` rounded to the nearest bf16 value (ties to even): weights of a bf16 checkpoint, which the
/// CUDA backend stores as bf16.
fn bf16_values(mut v: Vec<f32>) -> Vec<f32> {
    for x in &mut v {
        let u = x.to_bits();
        *x = f32::from_bits((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF_0000);
    }
    v
}
