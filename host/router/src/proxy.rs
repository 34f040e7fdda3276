//! Proxying: choose a replica (policy, or least-load), forward the original body, pass the
//! response through chunk by chunk, and retry on another replica while nothing has been sent.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::Response;
use bytes::Bytes;
use futures::Stream;
use futures::stream::{BoxStream, StreamExt};
use k3_plugin_host::{ReplicaView, RouteChoice, RouteRequest};

use crate::Shared;
use crate::errors::{Style, body_error, error_chain, unavailable};
use crate::metrics::{ErrorKind, Outcome};
use crate::policy::{ApiRoute, least_load};
use crate::replica::{InFlight, Replica};

/// Request headers a replica needs; everything else (hop-by-hop, host, length) stays here.
const FORWARDED: [&str; 7] = [
    "content-type",
    "authorization",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "accept",
    "x-request-id",
];

/// Response headers that belong to one connection, not to the response.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The longest `x-k3-route-reason` passed on.
const MAX_REASON: usize = 200;

/// What the policy is told about a request, less the block hashes (per replica block size).
struct Summary {
    route: RouteRequest,
    tokens: Option<Vec<u32>>,
}

/// POST on a routed route.
pub(crate) async fn routed(
    shared: Arc<Shared>,
    route: ApiRoute,
    uri: Uri,
    mut headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let style = Style::for_path(uri.path());
    let body = match body {
        Ok(b) => b,
        Err(e) => return body_error(style, e),
    };
    let request_id = request_id(&shared, &mut headers);
    let tokens = shared.tokens.clone();
    let b = body.clone();
    // Parsing and tokenizing (a chat template render) take CPU time: off the async threads.
    let summary = tokio::task::spawn_blocking(move || summarize(route, &b, &*tokens, request_id))
        .await
        .unwrap_or_else(|e| {
            tracing::warn!("prompt tokenization failed: {e}; routing on load alone");
            Summary {
                route: RouteRequest::default(),
                tokens: None,
            }
        });
    dispatch(
        &shared,
        Some(&summary),
        Method::POST,
        &uri,
        &headers,
        body,
        style,
    )
    .await
}

/// Any other proxied route: the least-loaded healthy replica takes it.
pub(crate) async fn any_replica(
    shared: Arc<Shared>,
    method: Method,
    uri: Uri,
    mut headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let style = Style::for_path(uri.path());
    let body = match body {
        Ok(b) => b,
        Err(e) => return body_error(style, e),
    };
    request_id(&shared, &mut headers);
    dispatch(&shared, None, method, &uri, &headers, body, style).await
}

/// The client's `x-request-id`, or a new one added to the forwarded headers so the replica's
/// logs carry the same id as the router's.
fn request_id(shared: &Shared, headers: &mut HeaderMap) -> String {
    if let Some(id) = headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
        return id.to_string();
    }
    let id = format!(
        "rtr-{:x}-{:x}",
        shared.started,
        shared.request_seq.fetch_add(1, Ordering::Relaxed)
    );
    if let Ok(v) = HeaderValue::from_str(&id) {
        headers.insert("x-request-id", v);
    }
    id
}

fn summarize(
    route: ApiRoute,
    body: &[u8],
    tokens: &dyn crate::PromptTokens,
    request_id: String,
) -> Summary {
    let mut req = RouteRequest {
        request_id,
        ..RouteRequest::default()
    };
    // A body that does not parse still goes to a replica, which answers the protocol's 400.
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Summary {
            route: req,
            tokens: None,
        };
    };
    req.model = json
        .get("model")
        .and_then(|m| m.as_str())
        .unwrap_or_default()
        .to_string();
    req.max_tokens = ["max_completion_tokens", "max_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| json.get(*k).and_then(|v| v.as_u64()))
        .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
    req.priority = json
        .get("priority")
        .and_then(|v| v.as_i64())
        .map_or(0, |p| p.clamp(i32::MIN.into(), i32::MAX.into()) as i32);
    let tokens = tokens.tokens(route, &json);
    req.prompt_tokens = tokens
        .as_ref()
        .map_or(0, |t| u32::try_from(t.len()).unwrap_or(u32::MAX));
    Summary { route: req, tokens }
}

/// Try healthy replicas until one answers (at most `attempts`), then pass its response on.
async fn dispatch(
    shared: &Arc<Shared>,
    summary: Option<&Summary>,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
    style: Style,
) -> Response {
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let mut tried: Vec<String> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    for attempt in 0..shared.attempts {
        let candidates: Vec<Arc<Replica>> = shared
            .replicas
            .iter()
            .filter(|r| r.is_healthy() && !tried.contains(&r.id))
            .cloned()
            .collect();
        if candidates.is_empty() {
            break;
        }
        let (replica, reason) = match summary {
            Some(s) => decide(shared, s, &candidates, attempt > 0).await,
            None => {
                let views: Vec<ReplicaView> = candidates.iter().map(|r| r.view(None)).collect();
                let choice = least_load(&views).unwrap_or_default();
                let i = views
                    .iter()
                    .position(|v| v.id == choice.replica_id)
                    .unwrap_or(0);
                (candidates[i].clone(), choice.reason)
            }
        };
        tried.push(replica.id.clone());
        match send(
            shared,
            replica.clone(),
            &method,
            path,
            headers,
            body.clone(),
            &reason,
        )
        .await
        {
            Ok(resp) => return resp,
            Err(why) => {
                tracing::warn!(
                    replica = %replica.id,
                    path = uri.path(),
                    attempt = attempt + 1,
                    "request failed before its response started: {why}"
                );
                failures.push(format!("{}: {why}", replica.id));
            }
        }
    }
    shared.metrics.unroutable.fetch_add(1, Ordering::Relaxed);
    if failures.is_empty() {
        unavailable(
            style,
            "no_replica",
            "no healthy replica can take the request",
        )
    } else {
        unavailable(
            style,
            "replicas_failed",
            format!("every replica tried failed: {}", failures.join("; ")),
        )
    }
}

/// Ask the policy among `candidates`; fall back to least-load (counted and logged) when it errs,
/// times out or names no candidate.
async fn decide(
    shared: &Shared,
    summary: &Summary,
    candidates: &[Arc<Replica>],
    retry: bool,
) -> (Arc<Replica>, String) {
    // Hashes depend on the replica's block size (one size in practice): compute each once.
    let mut hashes: HashMap<usize, Vec<u64>> = HashMap::new();
    let mut views = Vec::with_capacity(candidates.len());
    let mut first_hashes: Option<Vec<u64>> = None;
    for r in candidates {
        let bt = r.index.read().block_tokens();
        let h = match (bt, &summary.tokens) {
            (Some(bt), Some(tokens)) => Some(
                hashes
                    .entry(bt)
                    .or_insert_with(|| k3_cache_events::block_hashes(tokens, bt))
                    .as_slice(),
            ),
            _ => None,
        };
        if first_hashes.is_none() {
            first_hashes = h.map(<[u64]>::to_vec);
        }
        views.push(r.view(h));
    }
    let mut req = summary.route.clone();
    req.prefix_block_hashes = first_hashes.unwrap_or_default();

    let policy = shared.policy.read().clone();
    let name = policy.name();
    let started = Instant::now();
    let (rq, vs) = (req.clone(), views.clone());
    let call = tokio::task::spawn_blocking(move || policy.choose(&rq, &vs));
    let result: Result<RouteChoice, (&'static str, String)> =
        match tokio::time::timeout(shared.config.policy_timeout, call).await {
            Ok(Ok(Ok(choice))) => Ok(choice),
            Ok(Ok(Err(e))) => Err(("error", e)),
            Ok(Err(e)) => Err(("error", format!("the policy call failed: {e}"))),
            Err(_) => Err((
                "timeout",
                format!("no answer within {:?}", shared.config.policy_timeout),
            )),
        };
    shared.metrics.policy_call.observe(started.elapsed());
    let result = result.and_then(|c| match views.iter().position(|v| v.id == c.replica_id) {
        Some(i) => Ok((i, c.reason)),
        None => Err((
            "unknown_replica",
            format!(
                "it chose {:?}, not one of the healthy untried replicas",
                c.replica_id
            ),
        )),
    });
    let (i, reason, outcome) = match result {
        Ok((i, reason)) => (i, reason, Outcome::Policy),
        Err((kind, message)) => {
            shared.metrics.policy_error(&name, kind);
            // A broken plugin fails every request: warn at most once a second (all are counted).
            if let Some(suppressed) = shared.policy_warnings.allow() {
                tracing::warn!(
                    policy = %name,
                    request_id = %req.request_id,
                    suppressed,
                    "routing policy failed ({kind}): {message}; using least-load"
                );
            }
            let choice = least_load(&views).unwrap_or_default();
            let i = views
                .iter()
                .position(|v| v.id == choice.replica_id)
                .unwrap_or(0);
            (
                i,
                format!("fallback ({kind}): {}", choice.reason),
                Outcome::Fallback,
            )
        }
    };
    let outcome = if retry { Outcome::Retry } else { outcome };
    shared.metrics.decision(&views[i].id, &name, outcome);
    if !retry && summary.tokens.is_some() {
        let bt = candidates[i].index.read().block_tokens();
        if let Some(h) = bt.and_then(|bt| hashes.get(&bt)) {
            let m = &shared.metrics;
            m.prefix_blocks_requested
                .fetch_add(h.len() as u64, Ordering::Relaxed);
            m.prefix_blocks_hit
                .fetch_add(views[i].prefix_hit_blocks.into(), Ordering::Relaxed);
        }
    }
    tracing::debug!(
        request_id = %req.request_id,
        replica = %views[i].id,
        usable_hit = views[i].prefix_hit_blocks,
        "routed: {reason}"
    );
    (candidates[i].clone(), reason)
}

/// Send the request to `replica`. `Err` (retryable) when it failed before response headers or
/// answered 502/503/504; otherwise its response, streaming.
async fn send(
    shared: &Shared,
    replica: Arc<Replica>,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
    reason: &str,
) -> Result<Response, String> {
    let mut req = shared
        .client
        .request(method.clone(), format!("{}{path}", replica.url));
    for name in FORWARDED {
        for v in headers.get_all(name) {
            req = req.header(name, v.clone());
        }
    }
    if !body.is_empty() || *method == Method::POST {
        req = req.body(body);
    }
    let guard = InFlight::new(replica.clone());
    replica.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let eject_after = shared.config.eject_after;
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            let kind = if e.is_connect() {
                ErrorKind::Connect
            } else if e.is_timeout() {
                ErrorKind::Timeout
            } else {
                ErrorKind::Transport
            };
            replica.metrics.error(kind);
            let why = format!("{}: {}", kind.as_str(), error_chain(&e));
            replica.record_failure(eject_after, &why);
            return Err(why);
        }
    };
    replica.metrics.time_to_headers.observe(started.elapsed());
    let status = resp.status();
    if matches!(status.as_u16(), 502..=504) {
        replica.metrics.error(ErrorKind::Unavailable);
        let why = format!("answered {status}");
        replica.record_failure(eject_after, &why);
        return Err(why);
    }
    replica.record_request_success();
    Ok(pass_through(resp, guard, started, reason))
}

fn pass_through(
    resp: reqwest::Response,
    guard: InFlight,
    started: Instant,
    reason: &str,
) -> Response {
    let mut headers = HeaderMap::with_capacity(resp.headers().len() + 2);
    for (k, v) in resp.headers() {
        if !HOP_BY_HOP.contains(&k.as_str()) {
            headers.append(k.clone(), v.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(&guard.replica().id) {
        headers.insert(HeaderName::from_static("x-k3-replica"), v);
    }
    headers.insert(
        HeaderName::from_static("x-k3-route-reason"),
        sanitize_reason(reason),
    );
    let status: StatusCode = resp.status();
    let body = Body::from_stream(Tracked {
        inner: resp.bytes_stream().boxed(),
        guard,
        started,
    });
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// A policy's reason as a header value: printable ASCII, bounded.
fn sanitize_reason(reason: &str) -> HeaderValue {
    let clean: String = reason
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(MAX_REASON)
        .collect();
    let clean = clean.trim();
    HeaderValue::from_str(if clean.is_empty() { "-" } else { clean })
        .unwrap_or_else(|_| HeaderValue::from_static("-"))
}

/// The replica's body on its way to the client. Dropped when the body ends or the client goes
/// away; dropping it drops the upstream stream, which closes the replica's connection (so the
/// replica sees the disconnect), and ends the in-flight count.
struct Tracked {
    inner: BoxStream<'static, reqwest::Result<Bytes>>,
    guard: InFlight,
    started: Instant,
}

impl Stream for Tracked {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = self.inner.poll_next_unpin(cx);
        if let Poll::Ready(Some(Err(e))) = &item {
            let replica = self.guard.replica();
            replica.metrics.error(ErrorKind::Stream);
            tracing::warn!(replica = %replica.id, "response body broke off: {}", error_chain(e));
        }
        item
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.guard
            .replica()
            .metrics
            .duration
            .observe(self.started.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_become_header_values() {
        assert_eq!(sanitize_reason("  kv hit 3\n"), "kv hit 3?");
        assert_eq!(sanitize_reason(""), "-");
        assert_eq!(sanitize_reason("é"), "?");
        assert_eq!(sanitize_reason(&"x".repeat(500)).len(), MAX_REASON);
    }

    struct Fixed(Option<Vec<u32>>);

    impl crate::PromptTokens for Fixed {
        fn tokens(&self, _: ApiRoute, _: &serde_json::Value) -> Option<Vec<u32>> {
            self.0.clone()
        }
    }

    #[test]
    fn summaries_read_the_request() {
        let body = br#"{"model":"m","max_completion_tokens":7,"priority":-2}"#;
        let s = summarize(
            ApiRoute::ChatCompletions,
            body,
            &Fixed(Some(vec![1, 2, 3])),
            "id".into(),
        );
        assert_eq!(s.route.model, "m");
        assert_eq!(s.route.max_tokens, 7);
        assert_eq!(s.route.priority, -2);
        assert_eq!(s.route.prompt_tokens, 3);
        let s = summarize(
            ApiRoute::Messages,
            b"{not json",
            &Fixed(Some(vec![1])),
            "id".into(),
        );
        assert_eq!(s.route.request_id, "id");
        assert!(s.tokens.is_none());
    }
}
