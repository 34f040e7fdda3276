//! k3serve's HTTP API: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
//! `/v1/models`) and Anthropic (`/v1/messages`) protocols, `/health`, Prometheus `/metrics`, and
//! the plugin admin routes, over a [`backend::ChatBackend`]: `k3_frontend::Frontend` runs the
//! actual request path; this crate knows only the protocols.

pub mod access_log;
pub mod admin;
pub mod anthropic;
pub mod backend;
pub mod body;
pub mod cache_events;
pub mod connections;
mod content;
pub mod error;
pub mod generation;
pub mod metrics;
pub mod openai;
pub mod routing;
pub mod server;
pub mod sse;
pub mod structured;
pub mod tokenize;
pub mod unknown_fields;
pub mod validate;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use backend::ChatBackend;
pub use error::{ApiError, ErrorKind, ErrorStyle};
pub use server::{build_router, serve};
pub use unknown_fields::UnknownFields;

/// Settings of the HTTP layer.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The names `/v1/models` lists and requests may use; the first is the one responses name
    /// (empty: the backend's model id).
    pub served_model_names: Vec<String>,
    /// When set, `/v1/*` needs `Authorization: Bearer KEY` (or `x-api-key: KEY`).
    pub api_key: Option<String>,
    /// When set, `/admin/*` needs `Authorization: Bearer TOKEN`; unset disables the admin API.
    pub admin_token: Option<String>,
    pub max_request_body_bytes: usize,
    pub max_plugin_bytes: usize,
    /// Generations (each choice of each request) in flight at once; more get 429. Sizes the
    /// plugin instance pool too (each running choice holds two parser instances).
    pub max_concurrent_requests: usize,
    /// Unknown request fields are a 400 instead of being ignored (with a warning and a metric).
    pub strict_request_fields: bool,
    /// Access lines include the prompt (chat messages or completion prompt).
    pub log_requests: bool,
    /// Connection timeouts and cap.
    pub connections: connections::ConnectionLimits,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            served_model_names: Vec::new(),
            api_key: None,
            admin_token: None,
            max_request_body_bytes: 8 * 1024 * 1024,
            max_plugin_bytes: 64 * 1024 * 1024,
            max_concurrent_requests: 1024,
            strict_request_fields: false,
            log_requests: false,
            connections: connections::ConnectionLimits::default(),
        }
    }
}

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn ChatBackend>,
    config: ApiConfig,
    metrics: metrics::HttpMetrics,
    in_flight: Arc<Semaphore>,
    shutting_down: AtomicBool,
}

impl AppState {
    pub fn new(backend: Arc<dyn ChatBackend>, config: ApiConfig) -> Self {
        let permits = config.max_concurrent_requests.max(1);
        AppState {
            inner: Arc::new(Inner {
                backend,
                config,
                metrics: metrics::HttpMetrics::default(),
                in_flight: Arc::new(Semaphore::new(permits)),
                shutting_down: AtomicBool::new(false),
            }),
        }
    }

    pub fn backend(&self) -> &dyn ChatBackend {
        self.inner.backend.as_ref()
    }

    pub fn config(&self) -> &ApiConfig {
        &self.inner.config
    }

    pub fn metrics(&self) -> &metrics::HttpMetrics {
        &self.inner.metrics
    }

    /// A fresh collector for one request's unknown fields, under the server's policy.
    pub fn unknown_fields(&self) -> UnknownFields {
        UnknownFields::new(
            self.inner.config.strict_request_fields,
            Some(self.inner.metrics.ignored_fields.clone()),
        )
    }

    /// The model name responses carry: the first served name.
    pub fn model_name(&self) -> String {
        self.inner
            .config
            .served_model_names
            .first()
            .cloned()
            .unwrap_or_else(|| self.backend().model().id)
    }

    /// Every name `/v1/models` lists, the first being [`Self::model_name`].
    pub fn model_names(&self) -> Vec<String> {
        match self.inner.config.served_model_names.as_slice() {
            [] => vec![self.backend().model().id],
            names => names.to_vec(),
        }
    }

    /// Check a request's `model` names the served model.
    pub fn check_model(&self, requested: &str, style: ErrorStyle) -> Result<(), ApiError> {
        let name = self.model_name();
        let info = self.backend().model();
        if self
            .inner
            .config
            .served_model_names
            .iter()
            .any(|n| n == requested)
            || requested == info.id
            || info.aliases.iter().any(|a| a == requested)
        {
            return Ok(());
        }
        Err(ApiError::new(
            ErrorKind::NotFound,
            format!("the model '{requested}' does not exist; this server serves '{name}'"),
        )
        .with_param("model")
        .with_code("model_not_found")
        .styled(style))
    }

    /// Take `generations` slots (a request's `n` × prompts: each is its own sequence, with its
    /// own parser instances) or say why not: 400 when more than the server ever admits at
    /// once, 429 when full now, 503 when shutting down.
    pub fn admit(
        &self,
        style: ErrorStyle,
        generations: usize,
    ) -> Result<OwnedSemaphorePermit, ApiError> {
        if self.is_shutting_down() {
            return Err(ApiError::new(
                ErrorKind::Overloaded,
                "the server is shutting down and takes no new requests",
            )
            .with_code("shutting_down")
            .styled(style));
        }
        let limit = self.inner.config.max_concurrent_requests;
        let wanted = generations.max(1);
        if wanted > limit {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "this request asks for {wanted} generations (n × prompts) at once, more than \
                     this server ever runs together ({limit}); split it into smaller requests"
                ),
            )
            .styled(style));
        }
        let permits = u32::try_from(wanted).unwrap_or(u32::MAX);
        self.inner
            .in_flight
            .clone()
            .try_acquire_many_owned(permits)
            .map_err(|_| {
                ApiError::new(
                    ErrorKind::RateLimit,
                    format!(
                        "the server is at its limit of {limit} concurrent generations; retry later"
                    ),
                )
                .with_code("too_many_requests")
                .styled(style)
            })
    }

    pub fn begin_shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::SeqCst)
    }
}

/// Seconds since the Unix epoch, for `created` fields.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A random id with a prefix, e.g. `chatcmpl-3f9a…`.
pub fn random_id(prefix: &str) -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("{prefix}{tail}")
}
