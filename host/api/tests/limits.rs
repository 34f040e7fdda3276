//! Connection and request limits over real loopback sockets (head, idle and body timeouts, the
//! connection cap, shutdown ending live streams) and through the router (413 at the headers,
//! Anthropic-shaped errors on Anthropic routes), with a small backend whose streams run until
//! shutdown.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use k3_api::backend::*;
use k3_api::connections::ConnectionLimits;
use k3_api::{ApiConfig, AppState, build_router};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tower::ServiceExt;

/// Streams one piece of content, then nothing until shutdown ends it with an error.
#[derive(Default)]
struct EndlessBackend {
    live: Mutex<Vec<mpsc::UnboundedSender<GenEvent>>>,
}

impl EndlessBackend {
    fn generation(&self) -> Generation {
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(GenEvent::Content("working".into()));
        self.live.lock().unwrap().push(tx);
        Generation {
            prompt_tokens: 3,
            prompt_text: None,
            events: Box::pin(tokio_stream_from(rx)),
        }
    }
}

fn tokio_stream_from(
    mut rx: mpsc::UnboundedReceiver<GenEvent>,
) -> impl futures::Stream<Item = GenEvent> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

impl ChatBackend for EndlessBackend {
    fn model(&self) -> ModelInfo {
        ModelInfo {
            id: "m".into(),
            aliases: Vec::new(),
            max_model_len: 100,
            created: 0,
        }
    }

    fn chat(&self, _: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move { Ok(self.generation()) })
    }

    fn complete(&self, _: CompletionGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move { Ok(self.generation()) })
    }

    fn metrics(&self) -> BackendMetrics {
        BackendMetrics::default()
    }

    fn list_plugins(&self) -> Vec<PluginStageInfo> {
        Vec::new()
    }

    fn load_plugin(
        &self,
        _: String,
        _: bytes::Bytes,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async { Err(BackendError::NotFound("no plugins here".into())) })
    }

    /// A server-side failure, for the 5xx log line.
    fn rollback_plugin(&self, _: String) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async { Err(BackendError::Internal("the plugin store broke".into())) })
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            for tx in self.live.lock().unwrap().drain(..) {
                let _ = tx.send(GenEvent::Error(BackendError::Unavailable(
                    "the server shut down".into(),
                )));
            }
        })
    }
}

fn state(config: ApiConfig) -> AppState {
    AppState::new(Arc::new(EndlessBackend::default()), config)
}

fn short_limits(max_connections: usize) -> ConnectionLimits {
    ConnectionLimits {
        request_header_timeout: Duration::from_millis(800),
        keep_alive_timeout: Duration::from_millis(800),
        request_body_timeout: Duration::from_millis(800),
        max_connections,
    }
}

/// A server on a loopback port; dropping the sender starts its shutdown.
async fn start(
    config: ApiConfig,
    grace: Duration,
) -> (
    std::net::SocketAddr,
    AppState,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let st = state(config);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = rx.await;
    };
    let task = tokio::spawn(k3_api::serve(listener, st.clone(), shutdown, grace));
    (addr, st, tx, task)
}

/// Read until the server closes the socket; `None` if it stays open past `limit`.
async fn read_to_close(sock: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    tokio::time::timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .ok()?;
    Some(out)
}

fn body_json(reply: &[u8]) -> Value {
    let text = String::from_utf8_lossy(reply);
    let (_, body) = text.split_once("\r\n\r\n").unwrap();
    serde_json::from_str(body).unwrap()
}

#[tokio::test]
async fn idle_slow_and_stalled_connections_are_cut_on_time() {
    let config = ApiConfig {
        connections: short_limits(64),
        ..ApiConfig::default()
    };
    let (addr, st, stop, task) = start(config, Duration::from_secs(1)).await;
    let t0 = Instant::now();
    let mut idle = TcpStream::connect(addr).await.unwrap();
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\n").await.unwrap();
    let dripper = tokio::spawn(async move {
        for i in 0..40 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if slow
                .write_all(format!("X-{i}: y\r\n").as_bytes())
                .await
                .is_err()
            {
                return Instant::now();
            }
        }
        panic!("the slow head was never cut");
    });
    assert!(
        read_to_close(&mut idle, Duration::from_secs(3))
            .await
            .is_some()
    );
    let cut = dripper.await.unwrap() - t0;
    assert!(
        cut > Duration::from_millis(700) && cut < Duration::from_millis(2500),
        "{cut:?}"
    );

    // A kept-alive connection is closed once idle.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let reply = read_to_close(&mut kept, Duration::from_secs(3))
        .await
        .unwrap();
    assert!(reply.starts_with(b"HTTP/1.1 200"));

    // A stalled body: 408 in the route's shape, then the connection closes.
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled
        .write_all(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"a\"")
        .await
        .unwrap();
    let reply = read_to_close(&mut stalled, Duration::from_secs(3))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&reply);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.to_ascii_lowercase().contains("connection: close"));
    assert_eq!(body_json(&reply)["error"]["type"], "invalid_request_error");
    assert_eq!(body_json(&reply)["type"], "error");

    let page = st.metrics().render(&BackendMetrics::default());
    for line in [
        "k3serve_http_connections_timed_out_total{timeout=\"header\"} 2",
        "k3serve_http_connections_timed_out_total{timeout=\"idle\"} 1",
        "k3serve_http_connections_timed_out_total{timeout=\"body\"} 1",
        "k3serve_http_connections_open 0",
    ] {
        assert!(page.contains(line), "{line} missing:\n{page}");
    }
    drop(stop);
    task.await.unwrap().unwrap();
}

#[tokio::test]
async fn at_the_cap_new_sockets_wait_and_open_ones_work() {
    let config = ApiConfig {
        connections: ConnectionLimits {
            request_header_timeout: Duration::from_secs(30),
            keep_alive_timeout: Duration::from_secs(30),
            ..short_limits(2)
        },
        ..ApiConfig::default()
    };
    let (addr, st, stop, task) = start(config, Duration::from_secs(1)).await;
    let mut first = TcpStream::connect(addr).await.unwrap();
    let second = TcpStream::connect(addr).await.unwrap();
    let mut third = TcpStream::connect(addr).await.unwrap();
    third
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), third.read(&mut buf))
            .await
            .is_err(),
        "the third socket must wait while two are open"
    );
    first
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(2), first.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    drop(second);
    let n = tokio::time::timeout(Duration::from_secs(2), third.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let page = st.metrics().render(&BackendMetrics::default());
    assert!(!page.contains("k3serve_http_connection_cap_reached_total 0\n"));
    drop(stop);
    task.await.unwrap().unwrap();
}

#[tokio::test]
async fn shutdown_waits_for_live_streams_to_write_their_error_and_done() {
    let config = ApiConfig {
        connections: short_limits(16),
        ..ApiConfig::default()
    };
    let (addr, st, stop, task) = start(config, Duration::from_millis(200)).await;
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let mut streams = Vec::new();
    for _ in 0..4 {
        let mut sock = TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        sock.write_all(req.as_bytes()).await.unwrap();
        let mut buf = [0u8; 4096];
        let n = sock.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        streams.push(sock);
    }
    let t0 = Instant::now();
    drop(stop);
    // The server must not return before the streams' last events are out.
    let finished = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap();
    finished.unwrap().unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(200),
        "the grace period comes first"
    );
    assert!(st.is_shutting_down());
    for mut sock in streams {
        let rest = read_to_close(&mut sock, Duration::from_secs(2))
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&rest);
        assert!(text.contains("the server shut down"), "{text}");
        assert!(text.contains("data: [DONE]"), "{text}");
    }
}

async fn send(app: axum::Router, req: Request<Body>) -> (StatusCode, Option<String>, Value) {
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    let connection = resp
        .headers()
        .get(header::CONNECTION)
        .map(|v| v.to_str().unwrap().to_string());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, connection, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test]
async fn declared_oversize_bodies_get_413_at_the_headers() {
    let app = build_router(state(ApiConfig {
        max_request_body_bytes: 1000,
        max_plugin_bytes: 5000,
        admin_token: Some("t".into()),
        ..ApiConfig::default()
    }));
    // The body is never read: a stream that would fail if polled stands in for it.
    let unread = || {
        Body::from_stream(futures::stream::once(async {
            Err::<bytes::Bytes, _>(std::io::Error::other("the body was read"))
        }))
    };
    let request = |method: &str, path: &str, len: usize| {
        Request::builder()
            .method(method)
            .uri(path)
            .header(header::CONTENT_LENGTH, len)
            .header(header::EXPECT, "100-continue")
            .header(header::AUTHORIZATION, "Bearer t")
            .body(unread())
            .unwrap()
    };
    let (status, connection, body) =
        send(app.clone(), request("POST", "/v1/chat/completions", 1001)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(connection.as_deref(), Some("close"));
    assert_eq!(body["error"]["code"], "request_too_large");
    let (status, _, body) = send(app.clone(), request("POST", "/v1/messages", 1001)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "request_too_large");
    // Admin routes use the plugin limit.
    let (status, _, _) = send(
        app.clone(),
        request("PUT", "/admin/plugins/tool-parser", 5001),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let (status, _, _) = send(
        app.clone(),
        request("PUT", "/admin/plugins/tool-parser", 4000),
    )
    .await;
    assert_ne!(
        status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "under the plugin limit"
    );
}

#[tokio::test]
async fn anthropic_routes_answer_errors_in_anthropic_shape() {
    let app = build_router(state(ApiConfig {
        api_key: Some("k".into()),
        ..ApiConfig::default()
    }));
    let with_key = |method: &str, path: &str, key: Option<&str>| {
        let mut req = Request::builder().method(method).uri(path);
        if let Some(key) = key {
            req = req.header("x-api-key", key);
        }
        req.body(Body::empty()).unwrap()
    };
    for (req, status) in [
        (with_key("GET", "/v1/messages", Some("k")), 405),
        (with_key("POST", "/v1/messages/other", Some("k")), 404),
        (with_key("POST", "/v1/messages", Some("wrong")), 401),
        (with_key("POST", "/v1/messages/count_tokens", None), 401),
    ] {
        let path = req.uri().path().to_string();
        let (got, _, body) = send(app.clone(), req).await;
        assert_eq!(got.as_u16(), status, "{path}");
        assert_eq!(body["type"], "error", "{path}: {body}");
        assert!(body["error"]["message"].is_string(), "{path}: {body}");
        assert!(body["error"].get("code").is_none(), "{path}: {body}");
    }
    let (got, _, body) = send(app.clone(), with_key("GET", "/v1/nothing", Some("k"))).await;
    assert_eq!(got, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["code"], "unknown_route");
}

/// Log lines written while the guard lives (this thread only).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn server_errors_and_auth_failures_are_logged_without_secrets() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let app = build_router(state(ApiConfig {
        api_key: Some("the-api-key".into()),
        admin_token: Some("the-admin-token".into()),
        ..ApiConfig::default()
    }));
    let req = |method: &str, path: &str, auth: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {auth}"))
            .body(Body::empty())
            .unwrap()
    };
    let (status, _, _) = send(
        app.clone(),
        req(
            "POST",
            "/admin/plugins/tool-parser/rollback",
            "the-admin-token",
        ),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let (status, _, _) = send(app.clone(), req("GET", "/v1/models", "guessed-key")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = send(app.clone(), req("GET", "/admin/plugins", "guessed-token")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = |needle: &str| {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle}:\n{log}"))
            .to_string()
    };
    let failed = line("request failed with 500");
    assert!(
        failed.contains("ERROR") && failed.contains("/admin/plugins/{stage}/rollback"),
        "{failed}"
    );
    assert!(
        failed.contains("error_type=\"internal_error\"")
            || failed.contains("error_type=internal_error"),
        "{failed}"
    );
    assert!(
        !failed.contains("the plugin store broke"),
        "the message stays out: {failed}"
    );
    let auth = line("credential=\"api_key\"");
    assert!(
        auth.contains("WARN") && auth.contains("problem=\"wrong\""),
        "{auth}"
    );
    line("credential=\"admin_token\"");
    for secret in [
        "guessed-key",
        "guessed-token",
        "the-api-key",
        "the-admin-token",
    ] {
        assert!(
            !log.contains(secret),
            "{secret} leaked into the log:\n{log}"
        );
    }
}
