//! vLLM flags that have no effect on k3serve, accepted so that a `vllm serve` command line runs
//! unchanged; each one given prints one note saying why it changes nothing (or what it maps to).

/// The accepted-and-noted flags, hidden from `--help` (host/api/README.md lists them).
#[derive(clap::Args, Debug, Default, Clone)]
pub struct VllmFlags {
    /// vLLM: run the model repository's code. k3serve runs no model code.
    #[arg(long, hide = true)]
    pub trust_remote_code: bool,
    /// vLLM: KV-cache dtype.
    #[arg(long, hide = true, value_name = "DTYPE")]
    pub kv_cache_dtype: Option<String>,
    /// vLLM: quantization method.
    #[arg(long, hide = true, value_name = "METHOD")]
    pub quantization: Option<String>,
    /// vLLM: GPUs to shard over; k3serve runs on one device (only 1 is accepted).
    #[arg(long, hide = true, value_name = "N")]
    pub tensor_parallel_size: Option<usize>,
    /// vLLM: pipeline stages; k3serve runs on one device (only 1 is accepted).
    #[arg(long, hide = true, value_name = "N")]
    pub pipeline_parallel_size: Option<usize>,
    /// vLLM (older): stop logging requests.
    #[arg(long, hide = true)]
    pub disable_log_requests: bool,
    /// vLLM: stop the periodic throughput log lines.
    #[arg(long, hide = true)]
    pub disable_log_stats: bool,
    /// vLLM: uvicorn's log level.
    #[arg(long, hide = true, value_name = "LEVEL")]
    pub uvicorn_log_level: Option<String>,
    /// vLLM: disable CUDA graphs (k3serve: `--cuda-graphs false`).
    #[arg(long, hide = true)]
    pub enforce_eager: bool,
    /// vLLM: random seed of the engine.
    #[arg(long, hide = true, value_name = "SEED")]
    pub seed: Option<u64>,
    /// vLLM: where to download weights.
    #[arg(long, hide = true, value_name = "DIR")]
    pub download_dir: Option<String>,
    /// vLLM: model revision on the hub.
    #[arg(long, hide = true, value_name = "REV")]
    pub revision: Option<String>,
    /// vLLM: KV block size in tokens.
    #[arg(long, hide = true, value_name = "N")]
    pub block_size: Option<usize>,
    /// vLLM: CPU swap space in GiB.
    #[arg(long, hide = true, value_name = "GIB")]
    pub swap_space: Option<f64>,
    /// vLLM: chunked prefill switch.
    #[arg(long, hide = true, overrides_with = "no_enable_chunked_prefill")]
    pub enable_chunked_prefill: bool,
    #[arg(long, hide = true)]
    pub no_enable_chunked_prefill: bool,
    /// vLLM: longest logged prompt.
    #[arg(long, hide = true, value_name = "N")]
    pub max_log_len: Option<usize>,
    /// vLLM: role name of generated messages.
    #[arg(long, hide = true, value_name = "ROLE")]
    pub response_role: Option<String>,
    /// vLLM: run the API server in the engine's process.
    #[arg(long, hide = true)]
    pub disable_frontend_multiprocessing: bool,
    /// vLLM: usage.prompt_tokens_details in responses (k3serve always sends it).
    #[arg(long, hide = true)]
    pub enable_prompt_tokens_details: bool,
    /// vLLM: the tokenizer implementation.
    #[arg(long, hide = true, value_name = "MODE")]
    pub tokenizer_mode: Option<String>,
}

impl VllmFlags {
    /// One note per flag given; an error for a value k3serve cannot honour.
    pub fn notes(&self) -> anyhow::Result<Vec<String>> {
        for (value, flag) in [
            (self.tensor_parallel_size, "--tensor-parallel-size"),
            (self.pipeline_parallel_size, "--pipeline-parallel-size"),
        ] {
            if let Some(n) = value
                && n != 1
            {
                anyhow::bail!("{flag} {n}: k3serve runs a model on one device; only 1 is accepted");
            }
        }
        let mut notes = Vec::new();
        let mut note = |given: bool, flag: &str, why: &str| {
            if given {
                notes.push(format!(
                    "note: {flag} is accepted for vLLM compatibility: {why}"
                ));
            }
        };
        note(
            self.trust_remote_code,
            "--trust-remote-code",
            "k3serve runs no code from the model directory",
        );
        note(
            self.kv_cache_dtype.is_some(),
            "--kv-cache-dtype",
            "the cache keeps its own format",
        );
        note(
            self.quantization.is_some(),
            "--quantization",
            "the checkpoint's own formats (MXFP4 experts) are used as stored",
        );
        note(
            self.tensor_parallel_size.is_some(),
            "--tensor-parallel-size 1",
            "one device is all k3serve uses",
        );
        note(
            self.pipeline_parallel_size.is_some(),
            "--pipeline-parallel-size 1",
            "one device is all k3serve uses",
        );
        note(
            self.disable_log_requests,
            "--disable-log-requests",
            "prompts are logged only with --log-requests; access lines stay",
        );
        note(
            self.disable_log_stats,
            "--disable-log-stats",
            "k3serve writes no periodic stats lines (see /metrics)",
        );
        note(
            self.uvicorn_log_level.is_some(),
            "--uvicorn-log-level",
            "use --log-level",
        );
        note(
            self.enforce_eager,
            "--enforce-eager",
            "ignored; on CUDA, --cuda-graphs false runs every step eagerly",
        );
        note(
            self.seed.is_some(),
            "--seed",
            "sampling is seeded per request (the request's `seed`)",
        );
        note(
            self.download_dir.is_some() || self.revision.is_some(),
            "--download-dir/--revision",
            "k3serve loads a local model directory and downloads nothing",
        );
        note(
            self.block_size.is_some(),
            "--block-size",
            "the cache's page size is fixed",
        );
        note(
            self.swap_space.is_some(),
            "--swap-space",
            "k3serve preempts by recomputation, without CPU swap",
        );
        note(
            self.enable_chunked_prefill || self.no_enable_chunked_prefill,
            "--[no-]enable-chunked-prefill",
            "prefill is always chunked by --max-num-batched-tokens",
        );
        note(
            self.max_log_len.is_some(),
            "--max-log-len",
            "--log-requests logs whole prompts",
        );
        note(
            self.response_role.is_some(),
            "--response-role",
            "responses always carry the role \"assistant\"",
        );
        note(
            self.disable_frontend_multiprocessing,
            "--disable-frontend-multiprocessing",
            "k3serve is one process",
        );
        note(
            self.enable_prompt_tokens_details,
            "--enable-prompt-tokens-details",
            "usage.prompt_tokens_details.cached_tokens is always sent",
        );
        note(
            self.tokenizer_mode.is_some(),
            "--tokenizer-mode",
            "the model's tokenizer.json is used",
        );
        Ok(notes)
    }
}
