//! Shared by the subcommands: thread pool setup, device selection (`--device cuda|cpu`) and
//! loading a model onto the chosen backend as a type-erased executor.

use anyhow::{Context, bail};
use k3_backend_cpu::CpuBackend;
use k3_backend_cuda::{CudaBackend, CudaOptions, Dtype};
use k3_model::exec::{
    CacheLayout, ExecError, ForwardBatch, ForwardOutput, GraphCounts, LogitsWant,
};
use k3_model::{Backend, Config, Executor, Model, ModelExecutor};
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

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

impl Device {
    /// Parse a `--device` value (`None`/`auto`: decided by [`open_backend`] at load time).
    pub fn parse(s: Option<&str>) -> anyhow::Result<Option<Device>> {
        match s.map(str::to_ascii_lowercase).as_deref() {
            None | Some("auto") => Ok(None),
            Some("cpu") => Ok(Some(Device::Cpu)),
            Some("cuda") | Some("gpu") => Ok(Some(Device::Cuda)),
            Some(other) => bail!("--device {other} is not supported; use cuda, cpu or auto"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "CPU",
            Device::Cuda => "CUDA",
        }
    }
}

/// The CUDA backend's options as flags (`serve` and `bench`; `serve`'s TOML file takes the same
/// keys). Unset flags keep [`CudaOptions::default`], what the measured runs use.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct CudaArgs {
    /// Replay decode steps as CUDA graphs (`false`: every step eagerly) [default: true].
    #[arg(long, value_name = "BOOL")]
    pub cuda_graphs: Option<bool>,
    /// Routed-expert assignments (tokens x top-k) from which a step takes the many-assignment
    /// expert GEMMs instead of the few-token MXFP4 kernels [default: 4096].
    #[arg(long, value_name = "N")]
    pub moe_gemm_min_assignments: Option<usize>,
    /// Largest bf16 weight (elements) that decode rows multiply through the tensor-core GEMV;
    /// larger ones take cuBLAS (0: cuBLAS always) [default: 4194304].
    #[arg(long, value_name = "N")]
    pub gemv_max_weight_elems: Option<usize>,
    /// GPU precision, vLLM's `--dtype`: `bfloat16` (activations rounded to bf16 for the tensor
    /// cores, f32 accumulation and KDA state), `float32` (the CPU backend's results to ~1e-5 per
    /// op, slower) or `mxfp8` (bfloat16 with the routed experts' activations in MXFP8, K3's shipped
    /// precision); `auto` = bfloat16. The CPU backend always computes in f32 [default: auto].
    #[arg(long, value_name = "auto|bfloat16|float32|mxfp8")]
    pub dtype: Option<String>,
}

impl CudaArgs {
    /// The flags over `file` (a config file's values) over the defaults.
    pub fn resolve(&self, file: &CudaArgs) -> anyhow::Result<CudaOptions> {
        let d = CudaOptions::default();
        let dtype = match self.dtype.as_ref().or(file.dtype.as_ref()) {
            Some(p) => p
                .parse::<Dtype>()
                .map_err(|e| anyhow::anyhow!("--dtype: {e}"))?,
            None => d.dtype,
        };
        Ok(CudaOptions {
            cuda_graphs: self
                .cuda_graphs
                .or(file.cuda_graphs)
                .unwrap_or(d.cuda_graphs),
            moe_gemm_min_assignments: self
                .moe_gemm_min_assignments
                .or(file.moe_gemm_min_assignments)
                .unwrap_or(d.moe_gemm_min_assignments),
            gemv_max_weight_elems: self
                .gemv_max_weight_elems
                .or(file.gemv_max_weight_elems)
                .unwrap_or(d.gemv_max_weight_elems),
            dtype,
        })
    }
}

/// The backend for `wanted`: an explicit `cuda` must open GPU 0 (else a clear error); no choice
/// means CUDA when a driver is present and a device opens, else the CPU (logged either way).
pub fn open_backend(
    wanted: Option<Device>,
    cuda: &CudaOptions,
) -> anyhow::Result<Option<CudaBackend>> {
    match wanted {
        Some(Device::Cpu) => Ok(None),
        Some(Device::Cuda) => CudaBackend::with_options(0, cuda.clone())
            .map(Some)
            .context("--device cuda: no usable CUDA device (use --device cpu)"),
        None => {
            if !k3_backend_cuda::device::driver_present() {
                tracing::info!("no CUDA driver found: running on the CPU");
                super::say("device: cpu (no CUDA driver)");
                return Ok(None);
            }
            match CudaBackend::with_options(0, cuda.clone()) {
                Ok(b) => {
                    tracing::info!(arch = %b.limits.arch, "running on CUDA device 0");
                    super::say(&format!("device: cuda (GPU 0, {})", b.limits.arch));
                    Ok(Some(b))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "CUDA device unusable: running on the CPU");
                    super::say(&format!("device: cpu (CUDA unusable: {e})"));
                    Ok(None)
                }
            }
        }
    }
}

/// Any executor behind a box, usable where an `E: Executor` is expected (`Session`).
pub struct DynExecutor(pub Box<dyn Executor>);

impl Executor for DynExecutor {
    fn layout(&self) -> CacheLayout {
        self.0.layout()
    }
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn arena_copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), ExecError> {
        self.0.arena_copy(src, dst, len)
    }
    fn arena_zero(&mut self, offset: usize, len: usize) -> Result<(), ExecError> {
        self.0.arena_zero(offset, len)
    }
    fn arena_read(&self, offset: usize, len: usize) -> Result<Vec<u8>, ExecError> {
        self.0.arena_read(offset, len)
    }
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<ForwardOutput, ExecError> {
        self.0.forward(batch)
    }
    fn graph_counts(&self) -> Option<GraphCounts> {
        self.0.graph_counts()
    }
}

/// An executor whose logits rows are cut to the first `vocab` ids: for a model whose embedding is
/// wider than its tokenizer (padded vocabularies, or `--load-format dummy` with a borrowed
/// tokenizer), so that no id the tokenizer cannot decode is ever sampled.
pub struct VocabLimited {
    inner: Box<dyn Executor>,
    vocab: usize,
}

/// `exec` itself when its vocabulary fits `tokenizer_vocab`, else wrapped in [`VocabLimited`].
pub fn limit_vocab(exec: Box<dyn Executor>, tokenizer_vocab: usize) -> Box<dyn Executor> {
    if tokenizer_vocab == 0 || exec.vocab_size() <= tokenizer_vocab {
        return exec;
    }
    tracing::warn!(
        model_vocab = exec.vocab_size(),
        tokenizer_vocab,
        "the model's vocabulary is wider than the tokenizer's: sampling only the tokenizer's ids"
    );
    Box::new(VocabLimited {
        inner: exec,
        vocab: tokenizer_vocab,
    })
}

impl Executor for VocabLimited {
    fn layout(&self) -> CacheLayout {
        self.inner.layout()
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn arena_copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), ExecError> {
        self.inner.arena_copy(src, dst, len)
    }
    fn arena_zero(&mut self, offset: usize, len: usize) -> Result<(), ExecError> {
        self.inner.arena_zero(offset, len)
    }
    fn arena_read(&self, offset: usize, len: usize) -> Result<Vec<u8>, ExecError> {
        self.inner.arena_read(offset, len)
    }
    fn graph_counts(&self) -> Option<GraphCounts> {
        self.inner.graph_counts()
    }
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<ForwardOutput, ExecError> {
        // Candidates must come from the tokenizer's ids only, so the inner executor returns
        // whole rows and the selection runs here on the cut rows.
        let mut inner_batch = batch.clone();
        for s in &mut inner_batch.seqs {
            if let LogitsWant::LastTopK(_) = s.logits {
                s.logits = LogitsWant::Last;
            }
        }
        let mut out = self.inner.forward(&inner_batch)?;
        // Compact the rows in place: row r's first `vocab` values move to r * vocab.
        let (wide, narrow) = (out.vocab, self.vocab);
        let rows = out.logits.len() / wide.max(1);
        for r in 1..rows {
            out.logits
                .copy_within(r * wide..r * wide + narrow, r * narrow);
        }
        out.logits.truncate(rows * narrow);
        out.vocab = narrow;
        let wants: Vec<LogitsWant> = batch.seqs.iter().map(|s| s.logits).collect();
        out.apply_masks(&wants, &batch.wait_masks()?);
        out.select_candidates(&wants);
        Ok(out)
    }
}

/// A model loaded on some backend, before its executor (arena) is built.
// One per process, moved once into its executor: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum LoadedModel {
    Cpu(Model<CpuBackend>),
    Cuda(Model<CudaBackend>),
}

impl LoadedModel {
    /// Free and total device memory (a GPU backend only; `None` on the CPU or if the driver
    /// cannot say).
    pub fn device_memory(&self) -> Option<super::cache_budget::DeviceMemory> {
        match self {
            LoadedModel::Cpu(_) => None,
            LoadedModel::Cuda(m) => m
                .backend
                .memory_info()
                .ok()
                .map(|(free, total)| super::cache_budget::DeviceMemory { free, total }),
        }
    }

    pub fn config(&self) -> &Config {
        match self {
            LoadedModel::Cpu(m) => &m.config,
            LoadedModel::Cuda(m) => &m.config,
        }
    }

    pub fn device(&self) -> Device {
        match self {
            LoadedModel::Cpu(_) => Device::Cpu,
            LoadedModel::Cuda(_) => Device::Cuda,
        }
    }

    /// The executor with an arena of `arena_bytes` and `page_tokens` tokens per KV page.
    pub fn executor(
        self,
        page_tokens: usize,
        arena_bytes: usize,
    ) -> anyhow::Result<Box<dyn Executor>> {
        fn build<B: Backend>(
            m: Model<B>,
            page_tokens: usize,
            arena_bytes: usize,
        ) -> anyhow::Result<Box<dyn Executor>> {
            let exec = ModelExecutor::new(m, page_tokens, arena_bytes)
                .with_context(|| format!("allocating the {arena_bytes}-byte cache arena"))?;
            Ok(Box::new(exec))
        }
        match self {
            LoadedModel::Cpu(m) => build(m, page_tokens, arena_bytes),
            LoadedModel::Cuda(m) => build(m, page_tokens, arena_bytes),
        }
    }
}

/// How weights are obtained (`--load-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadFormat {
    /// `model.safetensors` in the model directory.
    Safetensors,
    /// Seeded random weights of the config's shapes (benchmarks at real K3 shapes: `models/k3-slice`).
    Dummy { seed: u64 },
}

impl LoadFormat {
    pub fn parse(s: &str, seed: u64) -> anyhow::Result<Self> {
        match s {
            "auto" | "safetensors" => Ok(LoadFormat::Safetensors),
            "dummy" => Ok(LoadFormat::Dummy { seed }),
            other => bail!("--load-format {other} is not supported; use safetensors or dummy"),
        }
    }
}

fn load_on<B: Backend>(dir: &Path, be: B, format: LoadFormat) -> anyhow::Result<Model<B>> {
    let ctx = || format!("loading the model from {}", dir.display());
    Ok(match format {
        LoadFormat::Safetensors => Model::load_dir(dir, be).with_context(ctx)?,
        LoadFormat::Dummy { seed } => Model::load_dir_dummy(dir, be, seed).with_context(ctx)?,
    })
}

/// Load `dir` on the device `wanted` (or the automatic choice), weights from `format`.
pub fn load_model(
    dir: &Path,
    wanted: Option<Device>,
    format: LoadFormat,
    cuda: &CudaOptions,
) -> anyhow::Result<LoadedModel> {
    Ok(match open_backend(wanted, cuda)? {
        None => LoadedModel::Cpu(load_on(dir, CpuBackend::new(), format)?),
        Some(cuda) => {
            super::say(&startup_line(&cuda.startup));
            let t = std::time::Instant::now();
            let model = load_on(dir, cuda, format)?;
            let how = match format {
                LoadFormat::Safetensors => "read",
                LoadFormat::Dummy { .. } => "generated",
            };
            super::say(&format!(
                "      weights {how} and uploaded in {:.2} s",
                t.elapsed().as_secs_f64()
            ));
            LoadedModel::Cuda(model)
        }
    })
}

/// Where opening the GPU spent its time, as one indented progress line.
fn startup_line(t: &k3_backend_cuda::StartupTimes) -> String {
    format!(
        "      CUDA context {:.2} s; kernels: {}; modules loaded in {:.2} s; cuBLAS {:.2} s",
        t.context_s, t.kernels, t.modules_s, t.cublas_s
    )
}

/// Load `dir` with an arena for one sequence of up to `max_tokens` (generate, bench).
pub fn load_single(
    dir: &Path,
    max_tokens: usize,
    wanted: Option<Device>,
    format: LoadFormat,
) -> anyhow::Result<(DynExecutor, Config, Device)> {
    load_for(dir, 1, max_tokens, wanted, format, &CudaOptions::default())
}

/// Like [`load_single`], with an arena for `seqs` sequences of up to `max_tokens` each (state
/// blocks first, then KV pages; `k3serve bench --batch-sizes` lays them out itself).
pub fn load_for(
    dir: &Path,
    seqs: usize,
    max_tokens: usize,
    wanted: Option<Device>,
    format: LoadFormat,
    cuda: &CudaOptions,
) -> anyhow::Result<(DynExecutor, Config, Device)> {
    let model = load_model(dir, wanted, format, cuda)?;
    let (config, device) = (model.config().clone(), model.device());
    // Same sizing as ModelExecutor::with_capacity(model, 64, seqs, max_tokens, 0).
    let offs = k3_model::model::CacheOffsets::new(&config, PAGE_TOKENS);
    let block = offs.state_block_bytes.div_ceil(4) * 4;
    let pages = max_tokens.div_ceil(PAGE_TOKENS);
    let bytes = seqs.max(1) * (block + pages * offs.kv_page_bytes);
    let exec = model.executor(PAGE_TOKENS, bytes)?;
    Ok((DynExecutor(exec), config, device))
}

/// Tokens per KV page of the CLI's executors (`bench`, `generate`).
pub const PAGE_TOKENS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use k3_model::select::top_k_of_row;

    /// k3-mini on the CPU behind `limit_vocab(limit)`, one forward of 3 tokens asking `want`:
    /// (the model's vocabulary, the executor's, the output).
    fn forward_cut(limit: usize, want: LogitsWant) -> (usize, usize, ForwardOutput) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini");
        let fmt = LoadFormat::parse("safetensors", 0).unwrap();
        let (exec, _, _) = load_single(&dir, 64, Some(Device::Cpu), fmt).unwrap();
        let full = exec.vocab_size();
        let mut exec = limit_vocab(exec.0, limit);
        let lay = exec.layout();
        let pages: Vec<usize> = (0..2)
            .map(|i| lay.state_block_bytes.div_ceil(4) * 4 + i * lay.kv_page_bytes)
            .collect();
        let seq = k3_model::exec::SeqInput {
            tokens: &[5, 6, 7],
            start_pos: 0,
            kv_pages: &pages,
            state_block: 0,
            checkpoints: &[],
            logits: want,
        };
        let out = exec
            .forward(&ForwardBatch {
                seqs: vec![seq],
                ..Default::default()
            })
            .unwrap();
        (full, exec.vocab_size(), out)
    }

    #[test]
    fn vocab_limit_cuts_every_logits_row_and_only_when_needed() {
        let (full, v, whole) = forward_cut(usize::MAX, LogitsWant::All);
        assert_eq!(
            (v, whole.vocab),
            (full, full),
            "no cut when the tokenizer is wider"
        );
        let (_, v, cut) = forward_cut(100, LogitsWant::All);
        assert_eq!(
            (v, cut.vocab, cut.row_ranges.clone()),
            (100, 100, whole.row_ranges.clone())
        );
        for r in 0..3 {
            assert_eq!(cut.row(r), &whole.row(r)[..100]);
        }
    }

    /// Greedy / top-k requests through the cut: candidates only among the tokenizer's ids (the
    /// model's wider ids would fail the sampler), equal to selecting from the cut row.
    #[test]
    fn vocab_limit_selects_candidates_among_the_kept_ids() {
        let (_, _, row) = forward_cut(100, LogitsWant::Last);
        let (_, _, top) = forward_cut(100, LogitsWant::LastTopK(5));
        assert_eq!(top.vocab, 100);
        assert!(top.row_ranges.len() == 1 && top.row_ranges[0].is_empty());
        assert!(top.logits.is_empty());
        assert_eq!(top.top[0], top_k_of_row(row.row(0), 5));
        assert!(top.top[0].len() == 5 && top.top[0].iter().all(|&(t, _)| t < 100));
    }

    #[test]
    fn device_flag_values() {
        assert_eq!(Device::parse(None).unwrap(), None);
        assert_eq!(Device::parse(Some("auto")).unwrap(), None);
        assert_eq!(Device::parse(Some("cpu")).unwrap(), Some(Device::Cpu));
        assert_eq!(Device::parse(Some("CUDA")).unwrap(), Some(Device::Cuda));
        assert!(
            Device::parse(Some("tpu"))
                .unwrap_err()
                .to_string()
                .contains("tpu")
        );
    }

    #[test]
    fn explicit_cuda_without_a_gpu_is_an_error_not_a_panic() {
        if CudaBackend::try_new(0).is_ok() {
            return; // a GPU machine: nothing to check here
        }
        let err = open_backend(Some(Device::Cuda), &CudaOptions::default()).unwrap_err();
        assert!(format!("{err:#}").contains("--device cuda"), "{err:#}");
        assert!(
            open_backend(None, &CudaOptions::default())
                .unwrap()
                .is_none()
        );
    }
}
