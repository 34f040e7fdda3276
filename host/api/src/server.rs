//! The router, its middleware (auth, declared body sizes, request counting and the 5xx log), the
//! small routes, and `serve` (the accept loop itself is in [`crate::connections`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{ConnectInfo, DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde_json::json;

use crate::access_log::AccessLog;
use crate::error::{ApiError, ErrorKind, ErrorLabel, ErrorStyle};
use crate::{AppState, admin, anthropic, cache_events, openai, tokenize};

/// All routes with their middleware.
pub fn build_router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(openai::chat::chat_completions))
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/responses", post(openai::responses::create_response))
        .route("/v1/models", get(openai::models::list_models))
        .route("/v1/models/{*model}", get(openai::models::get_model))
        .route("/v1/messages", post(anthropic::messages::messages))
        .route(
            "/v1/messages/count_tokens",
            post(anthropic::count_tokens::count_tokens),
        )
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .layer(DefaultBodyLimit::max(state.config().max_request_body_bytes))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            refuse_declared_oversize_v1,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let admin = Router::new()
        .route("/admin/plugins", get(admin::list_plugins))
        .route("/admin/plugins/{stage}", put(admin::upload_plugin))
        .route(
            "/admin/plugins/{stage}/rollback",
            post(admin::rollback_plugin),
        )
        .route("/internal/cache-events", get(cache_events::cache_events))
        .layer(DefaultBodyLimit::max(state.config().max_plugin_bytes))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            refuse_declared_oversize_admin,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_admin_token,
        ));
    Router::new()
        .merge(v1)
        .merge(admin)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

/// Serve until `shutdown` resolves; then stop accepting, let running requests finish for up to
/// `grace`, shut the backend down (those streams get an error event) and wait, briefly, for their
/// last bytes to go out. Connection limits come from [`crate::ApiConfig::connections`]; see
/// [`crate::connections`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let router = build_router(state.clone());
    crate::connections::serve(listener, router, state, shutdown, grace).await
}

async fn health(State(state): State<AppState>) -> Response {
    if state.is_shutting_down() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "shutting_down"})),
        )
            .into_response();
    }
    match state.backend().health() {
        Ok(()) => axum::Json(json!({"status": "ok"})).into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "unavailable", "reason": why})),
        )
            .into_response(),
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let text = state.metrics().render(&state.backend().metrics());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        ErrorKind::NotFound,
        format!("no route for {method} {}", uri.path()),
    )
    .with_code("unknown_route")
    .styled(ErrorStyle::for_path(uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let mut resp = ApiError::new(
        ErrorKind::InvalidRequest,
        format!("method {method} is not allowed on {}", uri.path()),
    )
    .with_code("method_not_allowed")
    .styled(ErrorStyle::for_path(uri.path()))
    .into_response();
    *resp.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    resp
}

/// Compare secrets without an early exit on the first differing byte (the time taken does not
/// tell how much of a guess was right). Also used by `k3serve router`.
pub fn secret_eq(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    let mut diff = a.len() ^ b.len();
    for (i, byte) in b.iter().enumerate() {
        diff |= (a.get(i).copied().unwrap_or(0) ^ byte) as usize;
    }
    diff == 0
}

/// The token of an `Authorization: Bearer <token>` header.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = state.config().api_key.as_deref() else {
        return next.run(req).await;
    };
    let headers = req.headers();
    let given = bearer(headers).or_else(|| headers.get("x-api-key")?.to_str().ok());
    if given.is_some_and(|g| secret_eq(g, key)) {
        return next.run(req).await;
    }
    log_auth_failure(&req, "api_key", given.is_some());
    let message = if given.is_some() {
        "invalid API key"
    } else {
        "missing API key: send 'Authorization: Bearer <key>'"
    };
    ApiError::new(ErrorKind::Authentication, message)
        .with_code("invalid_api_key")
        .styled(ErrorStyle::for_path(req.uri().path()))
        .into_response()
}

async fn require_admin_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(token) = state.config().admin_token.as_deref() else {
        return ApiError::new(
            ErrorKind::Permission,
            "the admin API is disabled; start the server with --admin-token to enable it",
        )
        .with_code("admin_disabled")
        .into_response();
    };
    let given = bearer(req.headers());
    if given.is_some_and(|g| secret_eq(g, token)) {
        return next.run(req).await;
    }
    log_auth_failure(&req, "admin_token", given.is_some());
    ApiError::new(
        ErrorKind::Authentication,
        "the admin API needs 'Authorization: Bearer <admin token>'",
    )
    .with_code("invalid_admin_token")
    .into_response()
}

/// One warning per refused credential: route, peer and which credential, never its value.
/// `given`: a credential was sent (and was wrong) rather than missing.
pub fn log_auth_failure(req: &Request, credential: &'static str, given: bool) {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| addr.to_string());
    tracing::warn!(
        target: "k3serve::auth",
        method = %req.method(),
        path = %req.uri().path(),
        peer = peer.as_deref().unwrap_or("-"),
        credential,
        problem = if given { "wrong" } else { "missing" },
        "authentication failed"
    );
}

/// Refuse a request whose `Content-Length` is over `limit` before its body is read: a 413 in
/// the route's shape, sent instead of `100 Continue`, and the connection closed afterwards
/// (the unread body would otherwise have to be drained).
fn refuse_declared_oversize(
    state: &AppState,
    req: &Request,
    limit: usize,
    flag: &str,
) -> Option<Response> {
    let declared: u64 = req
        .headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if declared <= limit as u64 {
        return None;
    }
    state
        .metrics()
        .connections
        .declared_body_too_large
        .fetch_add(1, Ordering::Relaxed);
    let mut resp = ApiError::new(
        ErrorKind::RequestTooLarge,
        format!(
            "the request body declares {declared} bytes; this route takes at most {limit} ({flag})"
        ),
    )
    .with_code("request_too_large")
    .styled(ErrorStyle::for_path(req.uri().path()))
    .into_response();
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    Some(resp)
}

async fn refuse_declared_oversize_v1(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let limit = state.config().max_request_body_bytes;
    match refuse_declared_oversize(&state, &req, limit, "--max-request-body-bytes") {
        Some(resp) => resp,
        None => next.run(req).await,
    }
}

async fn refuse_declared_oversize_admin(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let limit = state.config().max_plugin_bytes;
    match refuse_declared_oversize(&state, &req, limit, "the plugin size limit") {
        Some(resp) => resp,
        None => next.run(req).await,
    }
}

/// Count the request in `/metrics` and open its access line (logged once the response, or its
/// stream, is over; see [`AccessLog`]).
async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let log = AccessLog::new(
        req.method().as_str(),
        req.uri().path(),
        Instant::now(),
        state.config().log_requests,
    );
    // Label by route template, never the raw path, so unknown paths cannot grow the label set.
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let resp = log.clone().scope(next.run(req)).await;
    let status = resp.status().as_u16();
    state.metrics().record_request(&route, status);
    if resp.status().is_server_error() {
        // The error's kind and code, never its message (it may quote the request).
        let label = resp.extensions().get::<ErrorLabel>().copied();
        tracing::error!(
            route = %route,
            path = %path,
            status,
            request_id = log.request_id().as_deref().unwrap_or("-"),
            error_type = label.map_or("-", |l| l.kind),
            error_code = label.and_then(|l| l.code).unwrap_or("-"),
            "request failed with {status}"
        );
    }
    log.set_status(status);
    resp
}

#[cfg(test)]
mod tests {
    use super::secret_eq;

    #[test]
    fn secret_comparison() {
        assert!(secret_eq("abc", "abc"));
        assert!(!secret_eq("abd", "abc"));
        assert!(!secret_eq("ab", "abc"));
        assert!(!secret_eq("abcd", "abc"));
        assert!(!secret_eq("", "abc"));
    }
}
