//! `k3serve serve` settings: command-line flags (vLLM's names where vLLM has one) and an
//! optional TOML file (`--config k3serve.toml`, same keys as the flags, `-` or `_`); a flag given
//! on the command line wins over the file, the file over the defaults.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use k3_api::connections::ConnectionLimits;
use serde::Deserialize;

use super::media_config::{MediaArgs, MediaConfig, MediaFile};
use super::model_loading::{CudaArgs, Device, LoadFormat};
use super::speculative::SpeculativeSettings;
use super::vllm_flags::VllmFlags;
use k3_backend_cuda::CudaOptions;

/// The flags. Every field is optional so the TOML file can fill what the command line leaves out.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct Args {
    /// TOML file with any of the settings below (flags given here win).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model directory, as `vllm serve MODEL` takes it (the same as --model).
    #[arg(value_name = "MODEL")]
    pub model_positional: Option<PathBuf>,
    /// Model directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json).
    /// [default: models/k3-mini]
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Names the API serves the model under, all listed in /v1/models and accepted as `model`;
    /// responses carry the first (`--served-model-name a b`, or the flag repeated) [default: the
    /// model directory's name].
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub served_model_name: Vec<String>,
    /// Directory with tokenizer.json and tokenizer_config.json [default: the model directory].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// `safetensors`, or `dummy`: seeded random weights of config.json's shapes, for benchmarking
    /// shapes without a checkpoint (e.g. models/k3-slice with `--tokenizer models/k3-mini`)
    /// [default: safetensors].
    #[arg(long)]
    pub load_format: Option<String>,
    /// Address to listen on [default: 0.0.0.0].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on [default: 8000].
    #[arg(long)]
    pub port: Option<u16>,
    /// Device to run on: `cuda`, `cpu` or `auto` [default: auto = cuda when a GPU opens, else cpu].
    #[arg(long)]
    pub device: Option<String>,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1/* (also read from
    /// $K3SERVE_API_KEY, then $VLLM_API_KEY, so the key need not show in the process list).
    #[arg(long, env = "K3SERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Read the API key from this file (surrounding whitespace dropped).
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Enable /admin/* behind `Authorization: Bearer TOKEN` (also read from
    /// $K3SERVE_ADMIN_TOKEN).
    #[arg(long, env = "K3SERVE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file (surrounding whitespace dropped).
    #[arg(long, value_name = "FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Context length: prompt + generated tokens [default: the model's max_position_embeddings].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most requests in the running batch [default: 32].
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget of one engine step [default: 512].
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Most requests waiting for the batch before new ones get 429 [default: 1024].
    #[arg(long)]
    pub max_waiting_requests: Option<usize>,
    /// Prompt tokens of one throwaway request run before the server takes traffic, so that the
    /// first client does not pay the process's one-time GPU costs (cuBLAS loading kernels for new
    /// shapes, the memory pool growing, the first decode graphs); 0 turns it off [default:
    /// max-num-batched-tokens on CUDA, 0 on the CPU].
    #[arg(long)]
    pub warmup_tokens: Option<usize>,
    /// Bytes of the KV/state cache arena [default: enough for max-num-seqs full-length requests
    /// plus prefix-cache checkpoints, within --gpu-memory-utilization on a GPU].
    #[arg(long)]
    pub kv_cache_memory_bytes: Option<usize>,
    /// Share of the GPU's memory the server may use, weights included; caps the default cache
    /// arena [default: 0.9].
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Turn the prefix cache off.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Keep the prefix cache on (the default; as vLLM's flag).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Accepted as vLLM's flag: k3serve parses tool calls whenever a request declares tools.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// Reject request fields the server does not know with a 400 naming the field (by default
    /// they are ignored, warned about once and counted in /metrics).
    #[arg(long)]
    pub strict_request_fields: bool,
    /// Tool-call parser plugin: a name (`kimi_k3`, `kimi_k2`: `<name>_tools.wasm` in the plugin
    /// directory) or a path to a component [default: kimi_k3].
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Reasoning parser plugin: a name (`kimi_k3`, `think_tags`: `<name>_reasoning.wasm`) or a
    /// path to a component [default: kimi_k3].
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    /// Chat-template plugin: a name (`kimi_k3`: `<name>_template.wasm`) or a path to a component
    /// [default: kimi_k3].
    #[arg(long)]
    pub chat_template_plugin: Option<String>,
    /// A Jinja chat template file to use instead of the model's own.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Where the default plugins are [default: $K3_PLUGIN_DIR or the build's plugin directory].
    #[arg(long)]
    pub plugin_dir: Option<PathBuf>,
    /// Largest accepted request body in bytes [default: 8 MiB].
    #[arg(long)]
    pub max_request_body_bytes: Option<usize>,
    /// Seconds running requests may take to finish at shutdown [default: 30].
    #[arg(long)]
    pub shutdown_timeout: Option<f64>,
    /// Seconds a new connection has for its first request head, and any request for its head
    /// from its first byte [default: 20].
    #[arg(long, value_name = "SECS")]
    pub request_header_timeout: Option<f64>,
    /// Seconds a kept-alive connection may sit idle between requests [default: 30].
    #[arg(long, value_name = "SECS")]
    pub keep_alive_timeout: Option<f64>,
    /// Seconds a request body may deliver no bytes before the request gets a 408 [default: 30].
    #[arg(long, value_name = "SECS")]
    pub request_body_timeout: Option<f64>,
    /// Most connections open at once; at the cap the server stops accepting until one closes
    /// [default: the open-files limit less an eighth (at least 64), at most 32768].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// CPU worker threads for the model (0 = one per core) [default: 0].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Log filter (`info`, `debug`, `k3_api=debug`...) [default: $RUST_LOG or info].
    #[arg(long)]
    pub log_level: Option<String>,
    /// `text` or `json` (one JSON object per line) [default: text; colour only on a terminal].
    #[arg(long, value_name = "text|json")]
    pub log_format: Option<String>,
    /// Add the prompt (chat messages or completion prompt) to each request's access line.
    #[arg(long, alias = "enable-log-requests")]
    pub log_requests: bool,
    /// Speculative decoding, as vLLM takes it: JSON such as
    /// `{"method": "ngram", "num_speculative_tokens": 5}` or
    /// `{"method": "dspark", "model": "models/k3-mini-dspark", "num_speculative_tokens": 7}`;
    /// optional `prompt_lookup_min`/`prompt_lookup_max` (ngram) and `cost_profile` (a file the
    /// measured step costs are kept in) [default: off].
    #[arg(long, value_name = "JSON")]
    pub speculative_config: Option<String>,
    #[command(flatten)]
    pub media: MediaArgs,
    #[command(flatten)]
    pub vllm: VllmFlags,
    #[command(flatten)]
    pub cuda: CudaArgs,
}

/// The TOML file: the same settings.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileConfig {
    model: Option<PathBuf>,
    served_model_name: Option<ModelNames>,
    tokenizer: Option<PathBuf>,
    load_format: Option<String>,
    host: Option<String>,
    port: Option<u16>,
    device: Option<String>,
    api_key: Option<String>,
    api_key_file: Option<PathBuf>,
    admin_token: Option<String>,
    admin_token_file: Option<PathBuf>,
    max_model_len: Option<usize>,
    max_num_seqs: Option<usize>,
    max_num_batched_tokens: Option<usize>,
    max_waiting_requests: Option<usize>,
    warmup_tokens: Option<usize>,
    kv_cache_memory_bytes: Option<usize>,
    gpu_memory_utilization: Option<f64>,
    enable_prefix_caching: Option<bool>,
    tool_call_parser: Option<String>,
    reasoning_parser: Option<String>,
    chat_template_plugin: Option<String>,
    chat_template: Option<PathBuf>,
    plugin_dir: Option<PathBuf>,
    max_request_body_bytes: Option<usize>,
    shutdown_timeout: Option<f64>,
    request_header_timeout: Option<f64>,
    keep_alive_timeout: Option<f64>,
    request_body_timeout: Option<f64>,
    max_connections: Option<usize>,
    threads: Option<usize>,
    log_level: Option<String>,
    log_format: Option<String>,
    log_requests: Option<bool>,
    strict_request_fields: Option<bool>,
    cuda_graphs: Option<bool>,
    moe_gemm_min_assignments: Option<usize>,
    gemv_max_weight_elems: Option<usize>,
    dtype: Option<String>,
    speculative_config: Option<toml::Value>,
    limit_mm_per_prompt: Option<toml::Value>,
    allowed_media_domains: Option<Vec<String>>,
    media_fetch_timeout: Option<f64>,
    max_image_bytes: Option<usize>,
    media_plugin: Option<String>,
}

/// `served-model-name` in the file: one name or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ModelNames {
    One(String),
    Many(Vec<String>),
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    fn parse(s: Option<&str>) -> anyhow::Result<LogFormat> {
        match s {
            None | Some("text") => Ok(LogFormat::Text),
            Some("json") => Ok(LogFormat::Json),
            Some(other) => bail!("--log-format {other} is not supported; use text or json"),
        }
    }
}

/// Resolved settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeConfig {
    /// `None`: automatic (CUDA when a GPU opens, else the CPU).
    pub device: Option<Device>,
    pub model: PathBuf,
    /// Empty: the model directory's name.
    pub served_model_names: Vec<String>,
    /// `None`: the model directory.
    pub tokenizer: Option<PathBuf>,
    pub load_format: LoadFormat,
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub admin_token: Option<String>,
    /// `None`: from the model's config.
    pub max_model_len: Option<usize>,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_waiting_requests: usize,
    /// `None`: by device (see `Args::warmup_tokens`).
    pub warmup_tokens: Option<usize>,
    pub kv_cache_memory_bytes: Option<usize>,
    pub gpu_memory_utilization: f64,
    pub enable_prefix_caching: bool,
    pub tool_call_parser: String,
    pub reasoning_parser: String,
    pub chat_template_plugin: Option<String>,
    pub chat_template: Option<PathBuf>,
    /// Speculative decoding (`None`: off).
    pub speculative: Option<SpeculativeSettings>,
    /// Image limits and allowed URL domains.
    pub media: MediaConfig,
    pub plugin_dir: Option<PathBuf>,
    pub max_request_body_bytes: usize,
    pub shutdown_timeout: f64,
    /// Seconds (see `Args`).
    pub request_header_timeout: f64,
    pub keep_alive_timeout: f64,
    pub request_body_timeout: f64,
    /// `None`: derived from the open-files limit at start-up.
    pub max_connections: Option<usize>,
    pub threads: usize,
    pub log_level: Option<String>,
    pub log_format: LogFormat,
    pub log_requests: bool,
    pub strict_request_fields: bool,
    /// One line per vLLM flag given that changes nothing here, printed at start-up.
    pub notes: Vec<String>,
    /// The CUDA backend's options (used when the model runs on the GPU).
    pub cuda: CudaOptions,
}

fn parse_file(text: &str, path: &Path) -> anyhow::Result<FileConfig> {
    // Accept snake_case keys too: normalise them to the flags' kebab-case.
    let table: toml::Table =
        toml::from_str(text).with_context(|| format!("{} is not valid TOML", path.display()))?;
    let normalised: toml::Table = table
        .into_iter()
        .map(|(k, v)| (k.replace('_', "-"), v))
        .collect();
    normalised
        .try_into()
        .with_context(|| format!("in {}", path.display()))
}

impl ServeConfig {
    pub fn resolve(args: Args) -> anyhow::Result<ServeConfig> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the config file {}", path.display()))?;
                parse_file(&text, path)?
            }
            None => FileConfig::default(),
        };
        let device = Device::parse(args.device.or(file.device).as_deref())?;
        let mut notes = args.vllm.notes()?;
        if args.enable_auto_tool_choice {
            notes.push(
                "note: --enable-auto-tool-choice is accepted for vLLM compatibility: tool calls \
                 are parsed whenever a request declares tools"
                    .into(),
            );
        }
        let model = match (args.model_positional, args.model) {
            (Some(a), Some(b)) if a != b => bail!(
                "the model is given twice, as {} and as --model {}; give one",
                a.display(),
                b.display()
            ),
            (a, b) => a.or(b),
        };
        let served_model_names = if args.served_model_name.is_empty() {
            match file.served_model_name {
                None => Vec::new(),
                Some(ModelNames::One(n)) => vec![n],
                Some(ModelNames::Many(v)) => v,
            }
        } else {
            args.served_model_name
        };
        if served_model_names.iter().any(|n| n.trim().is_empty()) {
            bail!("--served-model-name must not be empty");
        }
        let cuda_file = CudaArgs {
            cuda_graphs: file.cuda_graphs,
            moe_gemm_min_assignments: file.moe_gemm_min_assignments,
            gemv_max_weight_elems: file.gemv_max_weight_elems,
            dtype: file.dtype,
        };

        let cuda = args.cuda.resolve(&cuda_file)?;
        let cfg = ServeConfig {
            device,
            model: model
                .or(file.model)
                .unwrap_or_else(|| PathBuf::from("models/k3-mini")),
            served_model_names,
            tokenizer: args.tokenizer.or(file.tokenizer),
            load_format: LoadFormat::parse(
                args.load_format
                    .or(file.load_format)
                    .as_deref()
                    .unwrap_or("safetensors"),
                0,
            )?,
            host: args.host.or(file.host).unwrap_or_else(|| "0.0.0.0".into()),
            port: args.port.or(file.port).unwrap_or(8000),
            api_key: secret([
                (
                    args.api_key,
                    args.api_key_file,
                    "--api-key (or $K3SERVE_API_KEY)",
                ),
                (
                    file.api_key,
                    file.api_key_file,
                    "api-key in the config file",
                ),
                (std::env::var("VLLM_API_KEY").ok(), None, "$VLLM_API_KEY"),
            ])?,
            admin_token: secret([
                (
                    args.admin_token,
                    args.admin_token_file,
                    "--admin-token (or $K3SERVE_ADMIN_TOKEN)",
                ),
                (
                    file.admin_token,
                    file.admin_token_file,
                    "admin-token in the config file",
                ),
            ])?,
            max_model_len: args.max_model_len.or(file.max_model_len),
            max_num_seqs: args.max_num_seqs.or(file.max_num_seqs).unwrap_or(32),
            max_num_batched_tokens: args
                .max_num_batched_tokens
                .or(file.max_num_batched_tokens)
                .unwrap_or(512),
            max_waiting_requests: args
                .max_waiting_requests
                .or(file.max_waiting_requests)
                .unwrap_or(1024),
            warmup_tokens: args.warmup_tokens.or(file.warmup_tokens),
            kv_cache_memory_bytes: args.kv_cache_memory_bytes.or(file.kv_cache_memory_bytes),
            gpu_memory_utilization: args
                .gpu_memory_utilization
                .or(file.gpu_memory_utilization)
                .unwrap_or(0.9),
            enable_prefix_caching: if args.no_enable_prefix_caching {
                false
            } else if args.enable_prefix_caching {
                true
            } else {
                file.enable_prefix_caching.unwrap_or(true)
            },
            tool_call_parser: args
                .tool_call_parser
                .or(file.tool_call_parser)
                .unwrap_or_else(|| "kimi_k3".into()),
            reasoning_parser: args
                .reasoning_parser
                .or(file.reasoning_parser)
                .unwrap_or_else(|| "kimi_k3".into()),
            chat_template_plugin: args.chat_template_plugin.or(file.chat_template_plugin),
            chat_template: args.chat_template.or(file.chat_template),
            speculative: match (args.speculative_config, file.speculative_config) {
                (Some(json), _) => Some(SpeculativeSettings::from_json(&json)?),
                (None, Some(value)) => Some(SpeculativeSettings::from_toml(value)?),
                (None, None) => None,
            },
            media: MediaConfig::resolve(
                args.media,
                MediaFile {
                    limit_mm_per_prompt: file.limit_mm_per_prompt,
                    allowed_media_domains: file.allowed_media_domains,
                    media_fetch_timeout: file.media_fetch_timeout,
                    max_image_bytes: file.max_image_bytes,
                    media_plugin: file.media_plugin,
                },
            )?,
            plugin_dir: args.plugin_dir.or(file.plugin_dir),
            max_request_body_bytes: args
                .max_request_body_bytes
                .or(file.max_request_body_bytes)
                .unwrap_or(8 * 1024 * 1024),
            shutdown_timeout: args
                .shutdown_timeout
                .or(file.shutdown_timeout)
                .unwrap_or(30.0),
            request_header_timeout: args
                .request_header_timeout
                .or(file.request_header_timeout)
                .unwrap_or(ConnectionLimits::DEFAULT_REQUEST_HEADER_TIMEOUT.as_secs_f64()),
            keep_alive_timeout: args
                .keep_alive_timeout
                .or(file.keep_alive_timeout)
                .unwrap_or(ConnectionLimits::DEFAULT_KEEP_ALIVE_TIMEOUT.as_secs_f64()),
            request_body_timeout: args
                .request_body_timeout
                .or(file.request_body_timeout)
                .unwrap_or(ConnectionLimits::DEFAULT_REQUEST_BODY_TIMEOUT.as_secs_f64()),
            max_connections: args.max_connections.or(file.max_connections),
            threads: args.threads.or(file.threads).unwrap_or(0),
            log_level: args.log_level.or(file.log_level),
            log_format: LogFormat::parse(args.log_format.or(file.log_format).as_deref())?,
            log_requests: args.log_requests || file.log_requests.unwrap_or(false),
            strict_request_fields: args.strict_request_fields
                || file.strict_request_fields.unwrap_or(false),
            notes,
            cuda,
        };
        for (value, name) in [
            (cfg.max_num_seqs, "max-num-seqs"),
            (cfg.max_num_batched_tokens, "max-num-batched-tokens"),
            (cfg.max_request_body_bytes, "max-request-body-bytes"),
        ] {
            if value == 0 {
                bail!("--{name} must be at least 1");
            }
        }
        if cfg.max_model_len == Some(0) {
            bail!("--max-model-len must be at least 1");
        }
        if !(cfg.gpu_memory_utilization > 0.0 && cfg.gpu_memory_utilization <= 1.0) {
            bail!("--gpu-memory-utilization must be in (0, 1]");
        }
        if !(cfg.shutdown_timeout.is_finite() && cfg.shutdown_timeout >= 0.0) {
            bail!("--shutdown-timeout must be a non-negative number of seconds");
        }
        for (value, name) in [
            (cfg.request_header_timeout, "request-header-timeout"),
            (cfg.keep_alive_timeout, "keep-alive-timeout"),
            (cfg.request_body_timeout, "request-body-timeout"),
        ] {
            // A day is far past any honest client; the bound keeps Duration conversion safe.
            if !(value > 0.0 && value <= 86_400.0) {
                bail!("--{name} must be a number of seconds in (0, 86400]");
            }
        }
        if cfg.max_connections == Some(0) {
            bail!("--max-connections must be at least 1");
        }
        Ok(cfg)
    }

    /// The connection limits, with `max_connections` derived from `fd_limit` (the process's
    /// open-files limit) unless set.
    pub fn connection_limits(&self, fd_limit: u64) -> ConnectionLimits {
        ConnectionLimits {
            request_header_timeout: Duration::from_secs_f64(self.request_header_timeout),
            keep_alive_timeout: Duration::from_secs_f64(self.keep_alive_timeout),
            request_body_timeout: Duration::from_secs_f64(self.request_body_timeout),
            max_connections: self
                .max_connections
                .unwrap_or_else(|| ConnectionLimits::max_connections_for_fd_limit(fd_limit)),
        }
    }
}

/// A secret from the first source that has one: each source is a value or a file to read it
/// from (giving both in one source is an error); empty values count as unset.
fn secret<const N: usize>(
    sources: [(Option<String>, Option<PathBuf>, &str); N],
) -> anyhow::Result<Option<String>> {
    for (value, file, name) in sources {
        let value = value.filter(|v| !v.is_empty());
        match (value, file) {
            (Some(_), Some(path)) => bail!(
                "{name} is given both as a value and as a file ({}); give one",
                path.display()
            ),
            (Some(v), None) => return Ok(Some(v)),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {name} from {}", path.display()))?;
                let v = text.trim();
                if v.is_empty() {
                    bail!("{} (for {name}) is empty", path.display());
                }
                return Ok(Some(v.to_string()));
            }
            (None, None) => {}
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "k3serve-config-{}-{}.toml",
            std::process::id(),
            text.len()
        ));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn flags_win_over_the_file_which_wins_over_defaults() {
        let path = write(
            "port = 9000\nmax_num_seqs = 8\ntool-call-parser = \"kimi_k2\"\nenable-prefix-caching = false\n",
        );
        let cfg = ServeConfig::resolve(Args {
            config: Some(path.clone()),
            port: Some(9100),
            ..Default::default()
        })
        .unwrap();
        std::fs::remove_file(path).ok();
        assert_eq!(cfg.port, 9100);
        assert_eq!(cfg.max_num_seqs, 8);
        assert_eq!(cfg.tool_call_parser, "kimi_k2");
        assert!(!cfg.enable_prefix_caching);
        assert_eq!(cfg.host, "0.0.0.0");
        assert_eq!(cfg.model, PathBuf::from("models/k3-mini"));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let path = write("max-modle-len = 5\n");
        let err = ServeConfig::resolve(Args {
            config: Some(path.clone()),
            ..Default::default()
        })
        .unwrap_err();
        std::fs::remove_file(path).ok();
        assert!(format!("{err:#}").contains("max-modle-len"), "{err:#}");
        let err = ServeConfig::resolve(Args {
            device: Some("tpu".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("tpu"));
        let err = ServeConfig::resolve(Args {
            max_num_seqs: Some(0),
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("max-num-seqs"));
        let err = ServeConfig::resolve(Args {
            load_format: Some("gguf".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("--load-format gguf"), "{err}");
        for bad in [0.0, 1.5, f64::NAN] {
            let err = ServeConfig::resolve(Args {
                gpu_memory_utilization: Some(bad),
                ..Default::default()
            })
            .unwrap_err();
            assert!(err.to_string().contains("gpu-memory-utilization"), "{err}");
        }
        let path = write("gpu-memory-utilization = 0.5\n");
        let cfg = ServeConfig::resolve(Args {
            config: Some(path.clone()),
            ..Default::default()
        })
        .unwrap();
        std::fs::remove_file(path).ok();
        assert_eq!(cfg.gpu_memory_utilization, 0.5);
    }

    #[test]
    fn cuda_options_from_flags_and_file() {
        let path =
            write("cuda_graphs = false\ndtype = \"float32\"\nmoe-gemm-min-assignments = 8192\n");
        let cfg = ServeConfig::resolve(Args {
            config: Some(path.clone()),
            cuda: CudaArgs {
                moe_gemm_min_assignments: Some(1024),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        assert!(!cfg.cuda.cuda_graphs);
        assert_eq!(cfg.cuda.dtype, k3_backend_cuda::Dtype::F32);
        assert_eq!(cfg.cuda.moe_gemm_min_assignments, 1024, "the flag wins");
        assert_eq!(
            cfg.cuda.gemv_max_weight_elems,
            CudaOptions::DEFAULT_GEMV_MAX_WEIGHT_ELEMS
        );
        let err = ServeConfig::resolve(Args {
            cuda: CudaArgs {
                dtype: Some("fp8".into()),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("--dtype"), "{err:#}");
        assert_eq!(
            ServeConfig::resolve(Args::default()).unwrap().cuda,
            CudaOptions::default()
        );
    }

    /// Parse a `serve` command line (after `serve`).
    fn parse(line: &str) -> anyhow::Result<ServeConfig> {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let words = std::iter::once("serve").chain(line.split_whitespace());
        ServeConfig::resolve(Cli::try_parse_from(words)?.args)
    }

    #[test]
    fn a_vllm_command_line_resolves() {
        let cfg = parse(
            "models/k3-mini --served-model-name k3 kimi --enable-auto-tool-choice \
             --tool-call-parser kimi_k3 --reasoning-parser kimi_k3 --trust-remote-code \
             --dtype bfloat16 --tensor-parallel-size 1 --disable-log-requests \
             --uvicorn-log-level warning --disable-log-stats --max-num-batched-tokens 1024 \
             --no-enable-prefix-caching --enable-log-requests --log-format json",
        )
        .unwrap();
        assert_eq!(cfg.model, PathBuf::from("models/k3-mini"));
        assert_eq!(cfg.served_model_names, ["k3", "kimi"]);
        assert!(!cfg.enable_prefix_caching);
        assert!(cfg.log_requests);
        assert_eq!(cfg.log_format, LogFormat::Json);
        assert_eq!(cfg.max_num_batched_tokens, 1024);
        assert_eq!(
            cfg.cuda.dtype,
            k3_backend_cuda::Dtype::Bf16,
            "--dtype is ours"
        );
        for flag in [
            "--enable-auto-tool-choice",
            "--trust-remote-code",
            "--tensor-parallel-size 1",
            "--disable-log-requests",
            "--uvicorn-log-level",
            "--disable-log-stats",
        ] {
            assert!(
                cfg.notes.iter().any(|n| n.contains(flag)),
                "{flag}: {:?}",
                cfg.notes
            );
        }
        assert!(parse("").unwrap().notes.is_empty());
        // The last of the pair wins, as in vLLM.
        assert!(
            parse("--no-enable-prefix-caching --enable-prefix-caching")
                .unwrap()
                .enable_prefix_caching
        );
        let cfg = parse("--served-model-name a --served-model-name b").unwrap();
        assert_eq!(cfg.served_model_names, ["a", "b"]);
        let err = parse("models/a --model models/b").unwrap_err();
        assert!(err.to_string().contains("given twice"), "{err}");
        let err = parse("--tensor-parallel-size 2").unwrap_err();
        assert!(err.to_string().contains("one device"), "{err}");
        let err = parse("--log-format xml").unwrap_err();
        assert!(err.to_string().contains("--log-format xml"), "{err}");
    }

    #[test]
    fn new_settings_from_the_file() {
        let path = write(
            "served-model-name = [\"a\", \"b\"]\nstrict_request_fields = true\nlog-format = \"json\"\nlog-requests = true\n",
        );
        let cfg = ServeConfig::resolve(Args {
            config: Some(path.clone()),
            ..Default::default()
        })
        .unwrap();
        std::fs::remove_file(path).ok();
        assert_eq!(cfg.served_model_names, ["a", "b"]);
        assert!(cfg.strict_request_fields && cfg.log_requests);
        assert_eq!(cfg.log_format, LogFormat::Json);
        let path = write("served-model-name = \"solo\"\n");
        let cfg = ServeConfig::resolve(Args {
            config: Some(path.clone()),
            ..Default::default()
        })
        .unwrap();
        std::fs::remove_file(path).ok();
        assert_eq!(cfg.served_model_names, ["solo"]);
    }

    #[test]
    fn load_format_and_tokenizer_dir() {
        let cfg = ServeConfig::resolve(Args::default()).unwrap();
        assert_eq!(cfg.load_format, LoadFormat::Safetensors);
        assert_eq!(cfg.tokenizer, None);
        let path = write("load-format = \"dummy\"\ntokenizer = \"models/k3-mini\"\n");
        let cfg = ServeConfig::resolve(Args {
            config: Some(path.clone()),
            model: Some("models/k3-slice".into()),
            ..Default::default()
        })
        .unwrap();
        std::fs::remove_file(path).ok();
        assert_eq!(cfg.load_format, LoadFormat::Dummy { seed: 0 });
        assert_eq!(cfg.tokenizer, Some(PathBuf::from("models/k3-mini")));
    }

    #[test]
    fn connection_limits_from_flags_and_file() {
        let cfg = ServeConfig::resolve(Args::default()).unwrap();
        let limits = cfg.connection_limits(1024);
        assert_eq!(limits.request_header_timeout, Duration::from_secs(20));
        assert_eq!(limits.keep_alive_timeout, Duration::from_secs(30));
        assert_eq!(limits.request_body_timeout, Duration::from_secs(30));
        assert_eq!(limits.max_connections, 896, "derived from the fd limit");
        let path =
            write("keep_alive_timeout = 5\nmax-connections = 50\nrequest-body-timeout = 2.5\n");
        let cfg = parse(&format!(
            "--config {} --request-header-timeout 0.5 --max-connections 60",
            path.display()
        ))
        .unwrap();
        std::fs::remove_file(path).ok();
        let limits = cfg.connection_limits(1024);
        assert_eq!(limits.request_header_timeout, Duration::from_millis(500));
        assert_eq!(limits.keep_alive_timeout, Duration::from_secs(5));
        assert_eq!(limits.request_body_timeout, Duration::from_millis(2500));
        assert_eq!(limits.max_connections, 60, "the flag wins");
        for (bad, flag) in [
            ("--request-header-timeout 0", "request-header-timeout"),
            ("--keep-alive-timeout=-1", "keep-alive-timeout"),
            ("--request-body-timeout 1e9", "request-body-timeout"),
            ("--max-connections 0", "max-connections"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.to_string().contains(flag), "{bad}: {err}");
        }
    }

    #[test]
    fn secrets_from_files() {
        let dir = std::env::temp_dir().join(format!("k3serve-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        let token = dir.join("token");
        std::fs::write(&key, "s3cret\n").unwrap();
        std::fs::write(&token, "  admin-t \n").unwrap();
        let cfg = parse(&format!(
            "--api-key-file {} --admin-token-file {}",
            key.display(),
            token.display()
        ))
        .unwrap();
        assert_eq!(cfg.api_key.as_deref(), Some("s3cret"));
        assert_eq!(cfg.admin_token.as_deref(), Some("admin-t"));
        // The command line wins over the config file's key.
        let file = write(&format!(
            "api-key = \"from-file\"\nadmin-token-file = \"{}\"\n",
            token.display()
        ));
        let cfg = parse(&format!(
            "--config {} --api-key-file {}",
            file.display(),
            key.display()
        ))
        .unwrap();
        assert_eq!(cfg.api_key.as_deref(), Some("s3cret"));
        assert_eq!(cfg.admin_token.as_deref(), Some("admin-t"));
        std::fs::remove_file(file).ok();
        let err = parse(&format!("--api-key x --api-key-file {}", key.display())).unwrap_err();
        assert!(err.to_string().contains("both"), "{err}");
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let err = parse(&format!("--admin-token-file {}", empty.display())).unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
        let err = parse("--api-key-file /nonexistent/k3serve-key").unwrap_err();
        assert!(
            format!("{err:#}").contains("/nonexistent/k3serve-key"),
            "{err:#}"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
