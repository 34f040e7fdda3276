//! `k3serve router`: the OpenAI and Anthropic routes in front of several `k3serve serve`
//! replicas, each request sent where a wasm policy says (docs/routing.md, docs/deploy.md).
//!
//! The process loads the model directory's tokenizer and the chat-template plugin (never the
//! weights), so it hashes the ids a replica will cache; the policy is a router-stage plugin,
//! hot-swappable through the admin routes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use bytes::Bytes;
use k3_api::routing::{PromptRoute, RoutingPrompt, routing_prompt};
use k3_frontend::{BackendError, PromptInput, PromptRenderer, Tokenizer, plugin_admin};
use k3_plugin_host::{
    PluginHost, PluginHostConfig, ReplicaView, RouteChoice, RouteRequest, Stage, default_plugin_dir,
};
use k3_router::{AdminError, ApiRoute, PolicyAdmin, PromptTokens, RoutePolicy, RouterConfig};
use serde::Deserialize;
use serde_json::Value;

use super::plugin_install::install_file;

#[derive(clap::Args)]
pub struct Args {
    /// TOML file: `model`, `plugin_dir`, `router_plugin`, `host`, `port` at the top, the
    /// proxy's settings under `[router]` (flags given here win).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A replica's base URL (`http://10.0.0.5:8000`); repeat for each.
    #[arg(long = "replica", value_name = "URL")]
    pub replicas: Vec<String>,
    /// The model directory the replicas serve: its tokenizer and chat template are used (not its
    /// weights) [default: models/k3-mini].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the wasm plugins are [default: the built plugins, or $K3_PLUGIN_DIR].
    #[arg(long)]
    pub plugin_dir: Option<PathBuf>,
    /// The routing policy: `kv-aware`, `least-load`, `round-robin` (router_NAME.wasm in the
    /// plugin directory) or a path to a router component [default: kv-aware].
    #[arg(long)]
    pub router_plugin: Option<String>,
    #[arg(long)]
    pub host: Option<String>,
    /// [default: 8080]
    #[arg(long)]
    pub port: Option<u16>,
    /// Enables the admin routes (policy hot swap) behind `Authorization: Bearer TOKEN`.
    #[arg(long, env = "K3SERVE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// The replicas' admin token, for their `/internal/cache-events`.
    #[arg(long, env = "K3SERVE_REPLICA_TOKEN", hide_env_values = true)]
    pub replica_token: Option<String>,
    /// Seconds between health probes of each replica [default: 1].
    #[arg(long)]
    pub health_interval: Option<f64>,
    /// Consecutive failures that eject a replica [default: 2].
    #[arg(long)]
    pub eject_after: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    model: Option<PathBuf>,
    plugin_dir: Option<PathBuf>,
    router_plugin: Option<String>,
    host: Option<String>,
    port: Option<u16>,
    #[serde(default)]
    router: Option<RouterConfig>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    super::serve::init_logging(None, super::serve_config::LogFormat::Text);
    let file: FileConfig = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
        }
        None => FileConfig::default(),
    };
    let mut cfg = file.router.unwrap_or_default();
    if !args.replicas.is_empty() {
        cfg.replicas = args.replicas.clone();
    }
    if let Some(s) = args.health_interval {
        if !(s.is_finite() && s > 0.0) {
            bail!("--health-interval must be a positive number of seconds");
        }
        cfg.health_interval = std::time::Duration::from_secs_f64(s);
    }
    if let Some(n) = args.eject_after {
        cfg.eject_after = n;
    }
    cfg.admin_token = args.admin_token.clone().or(cfg.admin_token);
    cfg.events_token = args.replica_token.clone().or(cfg.events_token);
    cfg.validate().context("the router's settings")?;
    let model = args
        .model
        .or(file.model)
        .unwrap_or_else(|| PathBuf::from("models/k3-mini"));
    let plugin_dir = args
        .plugin_dir
        .or(file.plugin_dir)
        .unwrap_or_else(default_plugin_dir);
    let policy_spec = args
        .router_plugin
        .or(file.router_plugin)
        .unwrap_or_else(|| "kv-aware".into());
    let host = args
        .host
        .or(file.host)
        .unwrap_or_else(|| "127.0.0.1".into());
    let port = args.port.or(file.port).unwrap_or(8080);
    let addr: SocketAddr = format!("{host}:{port}")
        .parse()
        .with_context(|| format!("bad --host/--port {host}:{port}"))?;

    let plugins =
        PluginHost::new(PluginHostConfig::default()).context("starting the plugin host")?;
    install_file(
        &plugins,
        Stage::ChatTemplate,
        &plugin_dir.join("kimi_k3_template.wasm"),
        "--plugin-dir",
    )?;
    install_file(
        &plugins,
        Stage::Router,
        &policy_path(&plugin_dir, &policy_spec)?,
        "--plugin-dir",
    )?;
    let tokenizer = Tokenizer::from_dir(&model)
        .map(Arc::new)
        .with_context(|| format!("loading the tokenizer from {}", model.display()))?;
    let chat_template = tokenizer
        .chat_template()
        .map(str::to_string)
        .context("the model has no chat_template in tokenizer_config.json")?;
    let prompts = ModelPrompts {
        placeholder: media_placeholder(&model)?,
        renderer: PromptRenderer {
            tokenizer,
            plugins: plugins.clone(),
            chat_template,
        },
    };
    let deps = k3_router::RouterDeps {
        policy: Arc::new(PluginPolicy(plugins.clone())),
        tokens: Arc::new(prompts),
        admin: Some(Arc::new(PluginAdmin(plugins))),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let (app, handle) = k3_router::build_router(cfg, deps)
            .await
            .context("starting the router")?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        tracing::info!(%addr, policy = %policy_spec, "router listening");
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving")?;
        handle.shutdown();
        anyhow::Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// `kv-aware` → `router_kv_aware.wasm` in the plugin directory; a path is taken as it is.
fn policy_path(dir: &Path, spec: &str) -> anyhow::Result<PathBuf> {
    if spec.ends_with(".wasm") || spec.contains('/') {
        return Ok(PathBuf::from(spec));
    }
    let name = spec.to_ascii_lowercase().replace('-', "_");
    let path = dir.join(format!("router_{name}.wasm"));
    if !path.exists() {
        bail!(
            "--router-plugin {spec}: {} does not exist (kv-aware, least-load, round-robin, or a \
             path to a router component)",
            path.display()
        );
    }
    Ok(path)
}

/// The image placeholder id, where the router's ids stop: read by the model crate's own
/// config parser, so the router and the replicas agree on where it lives (top level of
/// config.json, present only with a `vision_config`). A directory without config.json (a
/// tokenizer-only copy) gives `None`, with a warning, since images then cannot be cut.
fn media_placeholder(model: &Path) -> anyhow::Result<Option<u32>> {
    let path = model.join("config.json");
    if !path.exists() {
        tracing::warn!(
            path = %path.display(),
            "no config.json: prompts with images are hashed past the first image"
        );
        return Ok(None);
    }
    let config = k3_model::Config::from_file(&path)
        .with_context(|| format!("reading the model config {}", path.display()))?;
    Ok(config.vision.map(|v| v.media_placeholder_token_id))
}

/// Prompt ids as a replica computes them, cut at the first image.
struct ModelPrompts {
    renderer: PromptRenderer,
    placeholder: Option<u32>,
}

impl PromptTokens for ModelPrompts {
    fn tokens(&self, route: ApiRoute, body: &Value) -> Option<Vec<u32>> {
        let route = match route {
            ApiRoute::ChatCompletions => PromptRoute::ChatCompletions,
            ApiRoute::Completions => PromptRoute::Completions,
            ApiRoute::Messages => PromptRoute::Messages,
            ApiRoute::Responses => PromptRoute::Responses,
        };
        let mut ids = match routing_prompt(route, body)? {
            RoutingPrompt::Chat(req) => self.renderer.chat_ids(&req).ok()?,
            RoutingPrompt::Completion(PromptInput::Text(t)) => self.renderer.text_ids(&t).ok()?,
            RoutingPrompt::Completion(PromptInput::Tokens(ids)) => ids,
        };
        if let Some(p) = self.placeholder
            && let Some(i) = ids.iter().position(|&t| t == p)
        {
            ids.truncate(i);
        }
        Some(ids)
    }
}

/// The active router-stage plugin.
struct PluginPolicy(PluginHost);

impl RoutePolicy for PluginPolicy {
    fn choose(&self, req: &RouteRequest, replicas: &[ReplicaView]) -> Result<RouteChoice, String> {
        self.0
            .router()
            .choose(req, replicas)
            .map_err(|e| e.to_string())
    }

    fn name(&self) -> String {
        self.0
            .active(Stage::Router)
            .map(|v| v.metadata.name)
            .unwrap_or_else(|| "none".into())
    }
}

/// The admin routes' view of the router stage.
struct PluginAdmin(PluginHost);

fn admin_error(e: BackendError) -> AdminError {
    match e {
        BackendError::PluginRejected(m) => AdminError::Rejected(m),
        BackendError::InvalidRequest { message, .. } => AdminError::InvalidRequest(message),
        BackendError::Unavailable(m) => AdminError::Unavailable(m),
        other => AdminError::Internal(other.to_string()),
    }
}

impl PolicyAdmin for PluginAdmin {
    fn list(&self) -> Value {
        serde_json::to_value(plugin_admin::list(&self.0)).unwrap_or(Value::Null)
    }

    fn install(&self, component: Bytes) -> Result<Value, AdminError> {
        let info =
            plugin_admin::install_now(&self.0, Stage::Router, &component).map_err(admin_error)?;
        serde_json::to_value(info).map_err(|e| AdminError::Internal(e.to_string()))
    }

    fn rollback(&self) -> Result<Value, AdminError> {
        let info = plugin_admin::rollback(&self.0, "router").map_err(admin_error)?;
        serde_json::to_value(info).map_err(|e| AdminError::Internal(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mini() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini")
    }

    #[test]
    fn prompts_stop_at_the_models_image_placeholder() {
        // The id is top-level in config.json; reading it from `vision_config` found nothing.
        let model = mini();
        let placeholder = media_placeholder(&model).unwrap();
        assert_eq!(placeholder, Some(6));
        let plugins = PluginHost::new(PluginHostConfig::default()).unwrap();
        let tokenizer = Arc::new(Tokenizer::from_dir(&model).unwrap());
        let prompts = ModelPrompts {
            placeholder,
            renderer: PromptRenderer {
                tokenizer,
                plugins,
                chat_template: String::new(),
            },
        };
        let body = serde_json::json!({"model": "k3", "prompt": [11, 12, 6, 13, 6]});
        assert_eq!(
            prompts.tokens(ApiRoute::Completions, &body),
            Some(vec![11, 12])
        );
    }

    #[test]
    fn a_directory_without_config_json_cuts_nothing() {
        let dir = std::env::temp_dir().join(format!("k3-router-noconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(media_placeholder(&dir).unwrap(), None);
        std::fs::write(dir.join("config.json"), "{not json").unwrap();
        assert!(media_placeholder(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
