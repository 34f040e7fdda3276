//! Shared by the subcommands: thread pool setup and loading a model onto the CPU backend.

use anyhow::Context;
use k3_backend_cpu::CpuBackend;
use k3_model::{Model, ModelExecutor};
use std::path::Path;

/// Size rayon's global pool (0 = one thread per core).
pub fn init_threads(threads: usize) -> anyhow::Result<()> {
    if threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .context("configuring the thread pool")?;
    }
    Ok(())
}

/// Load `dir` on the CPU with an arena for one sequence of up to `max_tokens`.
pub fn load_cpu(dir: &Path, max_tokens: usize) -> anyhow::Result<ModelExecutor<CpuBackend>> {
    let model = Model::load_dir(dir, CpuBackend::new())
        .with_context(|| format!("loading model from {}", dir.display()))?;
    Ok(ModelExecutor::with_capacity(model, 64, 1, max_tokens, 0)?)
}
