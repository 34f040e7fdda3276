//! `k3serve serve`: load a model (CUDA or CPU), start the engine and the plugin host, and serve the
//! OpenAI / Anthropic HTTP API until SIGINT/SIGTERM (then drain with a deadline).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k3_api::{ApiConfig, AppState};
use k3_engine::{Engine, EngineConfig, EngineHandle, Request, SamplingParams};
use k3_frontend::{
    Frontend, FrontendParts, MediaFetcher, MediaSettings, ModelInfo, SamplingDefaults, Tokenizer,
    VisionGeometry,
};
use k3_model::model::CacheOffsets;
use k3_plugin_host::{PluginHost, PluginHostConfig, Stage, default_plugin_dir};

use super::model_loading::LoadFormat;
use super::plugin_install::install_file;
use super::say;

pub use super::serve_config::Args;
use super::serve_config::{LogFormat, ServeConfig};

use super::cache_budget::{PAGE_TOKENS, arena_bytes_for, fit_arena};

pub fn run(args: Args) -> anyhow::Result<()> {
    let cfg = ServeConfig::resolve(args)?;
    init_logging(cfg.log_level.as_deref(), cfg.log_format);
    for note in &cfg.notes {
        say(note);
    }
    super::model_loading::init_threads(cfg.threads)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("k3serve-http")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve(cfg))
}

/// Logs go to stderr: colour only when it is a terminal (never into a redirected file).
pub(super) fn init_logging(level: Option<&str>, format: LogFormat) {
    let filter = match level {
        Some(l) => tracing_subscriber::EnvFilter::new(l),
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => {
            super::JSON_LOGS.store(true, Ordering::Relaxed);
            builder
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .try_init()
        }
    };
}

/// One line of start-up progress: `[step/total] what ... done in 0.3 s`.
struct Progress {
    step: usize,
    total: usize,
}

impl Progress {
    fn run<T>(&mut self, what: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        self.step += 1;
        say(&format!("[{}/{}] {what} ...", self.step, self.total));
        let t = Instant::now();
        let out = f()?;
        say(&format!(
            "[{}/{}] {what}: done in {:.2} s",
            self.step,
            self.total,
            t.elapsed().as_secs_f64()
        ));
        Ok(out)
    }
}

/// `--chat-template`: a Jinja file, or (as vLLM allows) the template itself written inline.
fn chat_template_source(spec: &Path) -> anyhow::Result<String> {
    let text = spec.to_string_lossy();
    if !spec.exists() && (text.contains("{{") || text.contains("{%")) {
        return Ok(text.into_owned());
    }
    std::fs::read_to_string(spec)
        .with_context(|| format!("reading the chat template {}", spec.display()))
}

/// A plugin given by path, or by name: `<name><suffix>` in the plugin directory, with vLLM's
/// spellings (`kimi-k3`, `Kimi_K3`) taken as ours (`kimi_k3`). An unknown name is an error that
/// lists the names the directory has.
fn plugin_path(dir: &Path, spec: &str, suffix: &str, flag: &str) -> anyhow::Result<PathBuf> {
    if spec.ends_with(".wasm") || spec.contains('/') {
        return Ok(PathBuf::from(spec));
    }
    let name = spec.to_ascii_lowercase().replace('-', "_");
    let path = dir.join(format!("{name}{suffix}"));
    if path.exists() {
        return Ok(path);
    }
    let mut known: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter_map(|f| f.strip_suffix(suffix).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    known.sort();
    if known.is_empty() {
        bail!(
            "--{flag} {spec}: no {suffix} plugins in {} (build them with scripts/build-plugins, \
             or point --plugin-dir at them)",
            dir.display()
        );
    }
    bail!(
        "--{flag} {spec}: unknown name; {} has {} (or give a path to a .wasm component)",
        dir.display(),
        known.join(", ")
    )
}

fn plugin_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("k3serve").join("plugins"))
}

/// The four plugins' stages, names (or paths), file suffixes and flags.
fn plugin_specs(cfg: &ServeConfig) -> [(Stage, String, &'static str, &'static str); 4] {
    [
        (
            Stage::ChatTemplate,
            cfg.chat_template_plugin
                .clone()
                .unwrap_or_else(|| "kimi_k3".into()),
            "_template.wasm",
            "chat-template-plugin",
        ),
        (
            Stage::ReasoningParser,
            cfg.reasoning_parser.clone(),
            "_reasoning.wasm",
            "reasoning-parser",
        ),
        (
            Stage::ToolParser,
            cfg.tool_call_parser.clone(),
            "_tools.wasm",
            "tool-call-parser",
        ),
        (
            Stage::Media,
            cfg.media.media_plugin.clone(),
            "_media.wasm",
            "media-plugin",
        ),
    ]
}

fn load_plugins(cfg: &ServeConfig) -> anyhow::Result<PluginHost> {
    let defaults = PluginHostConfig::default();
    let mut host_cfg = PluginHostConfig {
        // Every admitted generation may hold its parser instances at once.
        max_instances: defaults.instances_for(cfg.max_num_seqs + cfg.max_waiting_requests),
        ..defaults
    };
    if let Some(dir) = plugin_cache_dir()
        && std::fs::create_dir_all(&dir).is_ok()
    {
        host_cfg = host_cfg.with_cache_dir(dir);
    }
    let host = PluginHost::new(host_cfg).context("starting the plugin host")?;
    let dir = cfg.plugin_dir.clone().unwrap_or_else(default_plugin_dir);
    for (stage, spec, suffix, flag) in plugin_specs(cfg) {
        let path = plugin_path(&dir, &spec, suffix, flag)?;
        install_file(&host, stage, &path, &format!("--plugin-dir / --{flag}"))?;
    }
    Ok(host)
}

async fn serve(cfg: ServeConfig) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut progress = Progress { step: 0, total: 5 };
    let model_dir = cfg.model.clone();
    if !model_dir.is_dir() {
        bail!(
            "model directory {} does not exist (pass --model DIR)",
            model_dir.display()
        );
    }

    // Bad plugin names fail here, before minutes of weight loading.
    let plugin_dir = cfg.plugin_dir.clone().unwrap_or_else(default_plugin_dir);
    for (_, spec, suffix, flag) in plugin_specs(&cfg) {
        plugin_path(&plugin_dir, &spec, suffix, flag)?;
    }

    let tokenizer_dir = cfg.tokenizer.clone().unwrap_or_else(|| model_dir.clone());
    let tokenizer = progress.run("loading the tokenizer", || {
        Tokenizer::from_dir(&tokenizer_dir)
            .map(Arc::new)
            .with_context(|| format!("loading the tokenizer from {}", tokenizer_dir.display()))
    })?;
    let chat_template = match &cfg.chat_template {
        Some(path) => chat_template_source(path)?,
        None => tokenizer.chat_template().map(str::to_string).context(
            "the model has no chat_template in tokenizer_config.json; pass --chat-template FILE",
        )?,
    };

    let weights = match cfg.load_format {
        LoadFormat::Safetensors => {
            let file = model_dir.join("model.safetensors");
            let mb = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
            format!("{mb:.1} MB")
        }
        LoadFormat::Dummy { seed } => format!("dummy, seed {seed}"),
    };
    let model = progress.run(
        &format!(
            "loading the model weights ({weights}, {})",
            cfg.device.map_or("device: auto", |d| d.name())
        ),
        || super::model_loading::load_model(&model_dir, cfg.device, cfg.load_format, &cfg.cuda),
    )?;
    tracing::info!(device = model.device().name(), "model loaded");
    let device = model.device();
    let config = model.config().clone();
    let max_model_len = cfg.max_model_len.unwrap_or(config.max_position_embeddings);

    let plugins = progress.run("loading the plugins", || load_plugins(&cfg))?;

    let (engine, layout, vocab_size) = progress.run("starting the engine", || {
        let offsets = CacheOffsets::new(model.config(), PAGE_TOKENS);
        let arena = match cfg.kv_cache_memory_bytes {
            Some(bytes) => bytes,
            None => {
                let (page, block) = (offsets.kv_page_bytes, offsets.state_block_bytes);
                let wanted = arena_bytes_for(page, block, cfg.max_num_seqs, max_model_len);
                match model.device_memory() {
                    Some(mem) => fit_arena(
                        wanted,
                        arena_bytes_for(page, block, 1, max_model_len),
                        mem,
                        cfg.gpu_memory_utilization,
                    )
                    .map_err(anyhow::Error::msg)?,
                    None => wanted,
                }
            }
        };
        let mut exec = super::model_loading::limit_vocab(
            model.executor(PAGE_TOKENS, arena)?,
            tokenizer.vocab_size(),
        );
        let speculation = match &cfg.speculative {
            Some(settings) => {
                let (spec, line) = super::speculative::build(
                    settings,
                    &model_dir,
                    exec.as_mut(),
                    cfg.max_num_seqs,
                )?;
                say(&line);
                Some(spec)
            }
            None => None,
        };
        let layout = exec.layout();
        let vocab = exec.vocab_size();
        let mut eos = vec![config.eos_token_id];
        eos.extend(tokenizer.eos_token_id());
        eos.dedup();
        let engine_cfg = EngineConfig {
            prefix_cache: cfg.enable_prefix_caching,
            max_running: cfg.max_num_seqs,
            // The API admits max_num_seqs + max_waiting_requests generations; a burst of them all
            // lands in the queue before the next step schedules any, so the queue holds them all
            // and admission stays the one gate (a 429 there, never an engine refusal after it).
            max_waiting: cfg.max_num_seqs + cfg.max_waiting_requests,
            step_tokens: cfg.max_num_batched_tokens,
            max_step_tokens: cfg
                .max_num_batched_tokens
                .max(EngineConfig::default().max_step_tokens),
            max_context: max_model_len,
            eos_token_ids: eos,
            speculation,
            ..EngineConfig::default()
        };
        tracing::info!(
            arena_mb = arena as f64 / 1e6,
            max_model_len,
            max_num_seqs = cfg.max_num_seqs,
            "cache arena"
        );
        let engine = Engine::start(exec, engine_cfg).context("starting the engine")?;
        Ok((engine, layout, vocab))
    })?;

    let warmup = cfg.warmup_tokens.unwrap_or(match device {
        super::model_loading::Device::Cuda => cfg.max_num_batched_tokens,
        super::model_loading::Device::Cpu => 0,
    });
    if warmup > 0 {
        let t = Instant::now();
        let n = warm_up(&engine, warmup, vocab_size, max_model_len)
            .await
            .context("the start-up warm-up request")?;
        say(&format!(
            "warm-up: one {n}-token request in {:.2} s (--warmup-tokens 0 skips it)",
            t.elapsed().as_secs_f64()
        ));
    }

    let defaults = match std::fs::read_to_string(model_dir.join("generation_config.json")) {
        Ok(text) => SamplingDefaults::from_generation_config(
            &serde_json::from_str(&text).context("parsing generation_config.json")?,
        ),
        Err(_) => SamplingDefaults::default(),
    };
    let dir_name = model_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let names = if cfg.served_model_names.is_empty() {
        vec![dir_name]
    } else {
        cfg.served_model_names.clone()
    };
    let name = names[0].clone();
    let mut eos_ids = vec![config.eos_token_id];
    eos_ids.extend(tokenizer.eos_token_id());
    eos_ids.dedup();
    let grace = Duration::from_secs_f64(cfg.shutdown_timeout);
    let frontend = Frontend::new(FrontendParts {
        engine,
        tokenizer,
        plugins,
        chat_template,
        model: ModelInfo {
            id: name.clone(),
            aliases: vec![model_dir.display().to_string()],
            max_model_len: max_model_len.min(u32::MAX as usize) as u32,
            created: k3_api::unix_now(),
        },
        eos_token_ids: eos_ids,
        vocab_size,
        defaults,
        kv_page_bytes: layout.kv_page_bytes,
        state_block_bytes: layout.state_block_bytes,
        media: MediaFetcher::new(MediaSettings {
            vision: config.vision.as_ref().map(|v| VisionGeometry {
                patch_size: v.patch_size as u32,
                merge_size: v.merge_size as u32,
                max_pixels: v.max_pixels as u64,
                min_pixels: v.min_pixels as u64,
                placeholder_token: v.media_placeholder_token_id,
                pad_token: v.media_pad_token_id,
            }),
            max_images_per_prompt: cfg.media.max_images_per_prompt,
            allowed_domains: cfg.media.allowed_domains.clone(),
            fetch_timeout: cfg.media.fetch_timeout,
            max_image_bytes: cfg.media.max_image_bytes,
        })?,
    });
    let state = AppState::new(
        Arc::new(frontend),
        ApiConfig {
            served_model_names: names.clone(),
            api_key: cfg.api_key.clone(),
            admin_token: cfg.admin_token.clone(),
            max_request_body_bytes: cfg.max_request_body_bytes,
            max_concurrent_requests: cfg.max_num_seqs + cfg.max_waiting_requests,
            strict_request_fields: cfg.strict_request_fields,
            log_requests: cfg.log_requests,
            connections: connection_limits(&cfg),
            ..ApiConfig::default()
        },
    );

    let listener = progress.run("binding the listener", || {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let std_listener = std::net::TcpListener::bind(&addr)
            .with_context(|| format!("cannot listen on {addr}"))?;
        std_listener.set_nonblocking(true)?;
        Ok(tokio::net::TcpListener::from_std(std_listener)?)
    })?;
    let addr = listener.local_addr()?;
    say(&format!(
        "k3serve: serving '{}' on http://{addr} (OpenAI: /v1/chat/completions, /v1/completions, \
         /v1/models; Anthropic: /v1/messages, /v1/messages/count_tokens; /tokenize, /detokenize, \
         /health, /metrics{}){} — ready in {:.1} s",
        names.join("', '"),
        if cfg.admin_token.is_some() {
            ", /admin/plugins"
        } else {
            ""
        },
        match &cfg.speculative {
            Some(s) => format!(
                "; speculative decoding: {}, up to {} draft tokens",
                s.method, s.num_speculative_tokens
            ),
            None => String::new(),
        },
        started.elapsed().as_secs_f64()
    ));
    k3_api::serve(listener, state, shutdown_signal(), grace)
        .await
        .context("serving HTTP")?;
    say("k3serve: stopped");
    Ok(())
}

/// The connection limits, after raising the soft open-files limit to the hard one (each
/// connection is a file descriptor; the cap derived from the limit keeps headroom so the server
/// never runs out and spins on `accept`).
fn connection_limits(cfg: &ServeConfig) -> k3_api::connections::ConnectionLimits {
    let fd_limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!("could not raise the open-files limit: {e}");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
        }
    };
    let limits = cfg.connection_limits(fd_limit);
    if limits.max_connections as u64 + 64 > fd_limit {
        tracing::warn!(
            max_connections = limits.max_connections,
            fd_limit,
            "--max-connections leaves under 64 file descriptors for everything else"
        );
    }
    tracing::info!(
        max_connections = limits.max_connections,
        fd_limit,
        header_timeout_s = limits.request_header_timeout.as_secs_f64(),
        keep_alive_timeout_s = limits.keep_alive_timeout.as_secs_f64(),
        body_timeout_s = limits.request_body_timeout.as_secs_f64(),
        "connection limits"
    );
    limits
}

/// Run one throwaway request (a `tokens`-token prompt, clamped to the context, and two greedy
/// tokens) straight through the engine, then drop what the prefix cache kept of it, so the pools
/// are empty again. Its id is outside the API's range (those count up from 1); the request and
/// token counters of /metrics never see it, the prefix-cache lookup counter does. Returns the
/// prompt length used.
async fn warm_up(
    engine: &EngineHandle,
    tokens: usize,
    vocab: usize,
    max_model_len: usize,
) -> anyhow::Result<usize> {
    let n = tokens.min(max_model_len.saturating_sub(2)).max(1);
    // Distinct ids, none of them 0 (often a special token).
    let prompt: Vec<u32> = (0..n)
        .map(|i| 1 + (i % vocab.saturating_sub(1).max(1)) as u32)
        .collect();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(2),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut stream = engine.submit(Request::new(u64::MAX, prompt, params))?;
    while let Some(event) = stream.next().await {
        if event?.finish.is_some() {
            break;
        }
    }
    engine.flush_prefix_cache();
    Ok(n)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    say("k3serve: shutting down (waiting for running requests)");
}
