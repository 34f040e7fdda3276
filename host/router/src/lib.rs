//! The router process behind `k3serve router`: one HTTP front for many replicas.
//!
//! # How it works
//!
//! - **Replicas** are base URLs ([`RouterConfig::replicas`]), named `r0`, `r1`, ... Each is probed
//!   on `GET /health` every [`RouterConfig::health_interval`]. A replica starts ejected; the first
//!   successful probe admits it, [`RouterConfig::eject_after`] consecutive failures (probes, or
//!   requests that could not reach it or got 502/503/504) eject it.
//! - **Cache events**: the router follows each replica's `GET /internal/cache-events` (SSE of
//!   [`k3_cache_events::CacheEvent`], bearer [`RouterConfig::events_token`]) into a
//!   [`k3_cache_events::PrefixIndex`]: a snapshot first, then changes and load. When the stream
//!   breaks (or the replica is ejected) the index is reset, since nothing is known until the
//!   next snapshot, and the stream is reopened with a backoff of 200 ms doubling to 2 s.
//! - **Routing**: `POST /v1/chat/completions`, `/v1/completions`, `/v1/messages` and
//!   `/v1/responses` are parsed, the prompt tokenized by [`PromptTokens`] and hashed into blocks
//!   ([`k3_cache_events::block_hashes`] at the replica's block size), and the [`RoutePolicy`]
//!   sees one [`ReplicaView`] per healthy replica not yet tried: `prefix_hit_blocks` is the
//!   *usable* hit (up to the deepest KDA checkpoint inside the cached prefix), `queued` the
//!   replica's waiting requests, `running` its running sequences, raised so that
//!   `queued + running` is at least the requests the router has open to it (those are normally
//!   already in the replica's counts, so they are not added; a burst sent since the replica's
//!   last load event is still seen). If the policy fails, times out
//!   ([`RouterConfig::policy_timeout`]) or names no candidate, the built-in [`LeastLoad`]
//!   decides; the fallback is logged and counted in `/metrics`. Other routes (`/tokenize`,
//!   `/detokenize`, `/v1/models...`, `/v1/messages/count_tokens`) go to the least-loaded
//!   healthy replica.
//! - **Proxying**: the original body and the request headers a replica needs are forwarded; the
//!   response's status and headers come back with `x-k3-replica` and `x-k3-route-reason`, and its
//!   body is passed through chunk by chunk. A client that goes away drops the upstream stream,
//!   closing the replica's connection. A request that failed before its response started
//!   (connect error, reset, 502/503/504) is retried on another replica, up to
//!   [`RouterConfig::max_attempts`]; when none is left the client gets a 503 in its protocol's
//!   error shape.
//! - **`/health`** (200 while a replica is healthy, JSON per replica), **`/metrics`**
//!   (`k3router_*`), and with an admin token, **`/admin/plugins`** to list, hot-swap and roll
//!   back the policy plugin through [`PolicyAdmin`].

mod admin;
mod config;
mod errors;
mod events;
mod metrics;
mod policy;
mod proxy;
mod replica;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, any, get, post, put};
use parking_lot::RwLock;
use serde_json::json;
use tokio::task::AbortHandle;

pub use admin::{AdminError, PolicyAdmin};
pub use config::RouterConfig;
pub use k3_plugin_host::{ReplicaView, RouteChoice, RouteRequest};
pub use policy::{ApiRoute, LeastLoad, NoPromptTokens, PromptTokens, RoutePolicy, least_load};
pub use replica::ReplicaStatus;

use metrics::Metrics;
use replica::Replica;

/// Why the router could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("no replicas configured: give at least one replica URL")]
    NoReplicas,
    #[error("replica URL {url:?}: {reason}")]
    BadReplicaUrl { url: String, reason: String },
    #[error("replica {0} is listed twice")]
    DuplicateReplica(String),
    #[error("invalid router setting: {0}")]
    Invalid(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// What the router calls out to (implemented by the binary over the plugin host and tokenizer).
pub struct RouterDeps {
    /// The routing policy; replace it later with [`RouterHandle::set_policy`].
    pub policy: Arc<dyn RoutePolicy>,
    pub tokens: Arc<dyn PromptTokens>,
    /// The policy plugin's admin; `None` answers the admin routes 404.
    pub admin: Option<Arc<dyn PolicyAdmin>>,
}

/// State shared by the handlers and background tasks.
pub(crate) struct Shared {
    pub config: RouterConfig,
    pub replicas: Vec<Arc<Replica>>,
    pub client: reqwest::Client,
    pub policy: RwLock<Arc<dyn RoutePolicy>>,
    pub tokens: Arc<dyn PromptTokens>,
    pub admin: Option<Arc<dyn PolicyAdmin>>,
    pub metrics: Metrics,
    pub policy_warnings: metrics::LogLimiter,
    pub attempts: usize,
    /// Start time (seconds) and a counter make the ids of requests that came without one.
    pub started: u64,
    pub request_seq: AtomicU64,
}

impl Shared {
    /// The `/metrics` text: the router's own series and each replica's.
    fn metrics_text(&self) -> String {
        let rows: Vec<metrics::ReplicaRow<'_>> = (self.replicas.iter())
            .map(|r| metrics::ReplicaRow {
                status: r.status(),
                metrics: &r.metrics,
            })
            .collect();
        self.metrics.render(&rows)
    }
}

/// Control over a running router. Dropping it stops the health and cache-event tasks, so keep
/// it for as long as the [`axum::Router`] serves.
pub struct RouterHandle {
    shared: Arc<Shared>,
    tasks: Vec<AbortHandle>,
}

impl RouterHandle {
    /// Route new requests with `policy` (requests being decided keep the old one).
    pub fn set_policy(&self, policy: Arc<dyn RoutePolicy>) {
        tracing::info!(policy = %policy.name(), "routing policy set");
        *self.shared.policy.write() = policy;
    }

    pub fn policy_name(&self) -> String {
        self.shared.policy.read().name()
    }

    /// Every replica's state, in configuration order.
    pub fn replicas(&self) -> Vec<ReplicaStatus> {
        self.shared.replicas.iter().map(|r| r.status()).collect()
    }

    /// The `/metrics` text.
    pub fn metrics(&self) -> String {
        self.shared.metrics_text()
    }

    /// Stop the background tasks (also done on drop).
    pub fn shutdown(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Build the router's routes and start its background tasks (on the current tokio runtime).
/// Every replica is probed once before this returns, so those that answer are admitted at once.
pub async fn build_router(
    config: RouterConfig,
    deps: RouterDeps,
) -> Result<(axum::Router, RouterHandle), RouterError> {
    let urls = config.validate()?;
    let client = reqwest::Client::builder()
        .connect_timeout(config.connect_timeout)
        .tcp_nodelay(true)
        // A replica that vanished without closing its connections is found by keepalive.
        .tcp_keepalive(Duration::from_secs(15))
        // Replicas are reached directly, never through an HTTP proxy from the environment.
        .no_proxy()
        .build()?;
    let replicas: Vec<Arc<Replica>> = urls
        .into_iter()
        .enumerate()
        .map(|(i, url)| Arc::new(Replica::new(format!("r{i}"), url)))
        .collect();
    for r in &replicas {
        tracing::info!(replica = %r.id, url = %r.url, "replica configured");
    }
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let shared = Arc::new(Shared {
        attempts: config.attempts(),
        config,
        replicas,
        client,
        policy: RwLock::new(deps.policy),
        tokens: deps.tokens,
        admin: deps.admin,
        metrics: Metrics::new(),
        policy_warnings: metrics::LogLimiter::new(Duration::from_secs(1)),
        started,
        request_seq: AtomicU64::new(0),
    });
    futures::future::join_all(shared.replicas.iter().map(|r| replica::probe(&shared, r))).await;
    let mut tasks = Vec::new();
    for r in &shared.replicas {
        let health = tokio::spawn(replica::health_loop(shared.clone(), r.clone()));
        let events = tokio::spawn(events::events_loop(shared.clone(), r.clone()));
        tasks.push(health.abort_handle());
        tasks.push(events.abort_handle());
    }
    let router = routes(shared.clone());
    Ok((router, RouterHandle { shared, tasks }))
}

fn routed(route: ApiRoute) -> MethodRouter<Arc<Shared>> {
    post(
        move |State(shared): State<Arc<Shared>>, uri: Uri, headers, body| {
            proxy::routed(shared, route, uri, headers, body)
        },
    )
}

fn forwarded() -> MethodRouter<Arc<Shared>> {
    any(
        |State(shared): State<Arc<Shared>>, method: Method, uri: Uri, headers, body| {
            proxy::any_replica(shared, method, uri, headers, body)
        },
    )
}

fn routes(shared: Arc<Shared>) -> axum::Router {
    let v1 = axum::Router::new()
        .route("/v1/chat/completions", routed(ApiRoute::ChatCompletions))
        .route("/v1/completions", routed(ApiRoute::Completions))
        .route("/v1/messages", routed(ApiRoute::Messages))
        .route("/v1/responses", routed(ApiRoute::Responses))
        .route("/v1/messages/count_tokens", forwarded())
        .route("/v1/models", forwarded())
        .route("/v1/models/{*model}", forwarded())
        .route("/tokenize", forwarded())
        .route("/detokenize", forwarded())
        .layer(DefaultBodyLimit::max(shared.config.max_request_body_bytes));
    let admin = axum::Router::new()
        .route("/admin/plugins", get(admin::list_plugins))
        .route("/admin/plugins/{stage}", put(admin::upload_plugin))
        .route(
            "/admin/plugins/{stage}/rollback",
            post(admin::rollback_plugin),
        )
        .layer(DefaultBodyLimit::max(shared.config.max_plugin_bytes))
        .route_layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            admin::require_admin_token,
        ));
    axum::Router::new()
        .merge(v1)
        .merge(admin)
        .route("/health", get(health))
        .route("/metrics", get(metrics_route))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared)
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    let replicas: Vec<ReplicaStatus> = shared.replicas.iter().map(|r| r.status()).collect();
    let healthy = replicas.iter().filter(|r| r.healthy).count();
    let (status, word) = if healthy > 0 {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
    };
    let body = json!({
        "status": word,
        "healthy_replicas": healthy,
        "policy": shared.policy.read().name(),
        "replicas": replicas,
    });
    (status, axum::Json(body)).into_response()
}

async fn metrics_route(State(shared): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        shared.metrics_text(),
    )
        .into_response()
}

async fn not_found(method: Method, uri: Uri) -> Response {
    errors::error(
        errors::Style::for_path(uri.path()),
        StatusCode::NOT_FOUND,
        "not_found_error",
        Some("unknown_route"),
        format!("no route for {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    errors::error(
        errors::Style::for_path(uri.path()),
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        Some("method_not_allowed"),
        format!("method {method} is not allowed on {}", uri.path()),
    )
}
