//! A fake replica: `/health`, `/internal/cache-events` (a snapshot, then events the test sends)
//! and `/v1/chat/completions` (JSON, a stream the test writes, a 503, or a dropped connection),
//! served on 127.0.0.1 with connections the test can kill all at once.

#![allow(dead_code)] // each test uses a part

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use k3_cache_events::{BlockRecord, CacheEvent, ReplicaLoad, block_hashes};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

pub const EVENTS_TOKEN: &str = "events-secret";
pub const BLOCK: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chat {
    /// `{"replica": name}`.
    Json,
    /// An SSE body whose chunks the test sends (see [`Fake::next_stream`]).
    Stream,
    /// 503 before any body.
    Unavailable,
    /// The connection is dropped before a response (the handler's task dies).
    Drop,
    /// No response ever; the handler's receiver (its sender is handed out like a stream's)
    /// goes when the handler is dropped.
    Hang,
}

pub type Chunks = mpsc::Sender<Result<Bytes, std::io::Error>>;

pub struct FakeState {
    pub name: String,
    pub healthy: AtomicBool,
    pub chat: Mutex<Chat>,
    /// Sent first on every events connection.
    pub snapshot: Mutex<CacheEvent>,
    events: Mutex<Option<mpsc::UnboundedSender<String>>>,
    pub event_connects: AtomicUsize,
    /// Bodies and headers of the chat requests received.
    pub received: Mutex<Vec<(HeaderMap, Bytes)>>,
    streams_tx: mpsc::UnboundedSender<Chunks>,
    streams_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Chunks>>,
}

pub struct Fake {
    pub addr: SocketAddr,
    pub url: String,
    pub state: Arc<FakeState>,
    server: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// A snapshot holding the blocks of `tokens`, with a checkpoint at the end of block `ckpt`.
pub fn snapshot(tokens: &[u32], ckpt: Option<usize>) -> CacheEvent {
    CacheEvent::Snapshot {
        block_tokens: BLOCK as u32,
        checkpoint_interval: BLOCK as u32,
        blocks: block_hashes(tokens, BLOCK)
            .into_iter()
            .enumerate()
            .map(|(i, hash)| BlockRecord {
                hash,
                checkpoint: Some(i) == ckpt,
            })
            .collect(),
        load: ReplicaLoad {
            total_blocks: 100,
            free_blocks: 90,
            ..ReplicaLoad::default()
        },
    }
}

impl Fake {
    pub async fn start(name: &str) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (streams_tx, streams_rx) = mpsc::unbounded_channel();
        let state = Arc::new(FakeState {
            name: name.into(),
            healthy: AtomicBool::new(true),
            chat: Mutex::new(Chat::Json),
            snapshot: Mutex::new(snapshot(&[], None)),
            events: Mutex::new(None),
            event_connects: AtomicUsize::new(0),
            received: Mutex::new(Vec::new()),
            streams_tx,
            streams_rx: tokio::sync::Mutex::new(streams_rx),
        });
        let fake = Fake {
            addr,
            url: format!("http://{addr}"),
            state,
            server: Mutex::new(None),
        };
        fake.serve(listener);
        fake
    }

    fn serve(&self, listener: TcpListener) {
        let app = axum::Router::new()
            .route("/health", get(health))
            .route("/internal/cache-events", get(events))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/messages", post(chat))
            .with_state(self.state.clone());
        let task = tokio::spawn(async move {
            // Aborting this task drops the listener and, with the set, every open connection.
            let mut conns = JoinSet::new();
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let svc = TowerToHyperService::new(app.clone());
                conns.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(sock), svc)
                        .await;
                });
            }
        });
        *self.server.lock() = Some(task);
    }

    /// Kill the server and every connection: new connections are refused.
    pub fn stop(&self) {
        if let Some(t) = self.server.lock().take() {
            t.abort();
        }
        self.state.events.lock().take();
    }

    /// Serve again on the same port.
    pub async fn restart(&self) {
        let mut tries = 0;
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("cannot rebind {}: {e}", self.addr),
            }
        };
        self.serve(listener);
    }

    pub fn set_chat(&self, mode: Chat) {
        *self.state.chat.lock() = mode;
    }

    /// Send an event on the open events stream; false when none is open.
    pub fn push_event(&self, event: &CacheEvent) -> bool {
        let line = format!("data: {}\n\n", serde_json::to_string(event).unwrap());
        self.state
            .events
            .lock()
            .as_ref()
            .is_some_and(|tx| tx.send(line).is_ok())
    }

    /// End the events stream (EOF); the next connection gets `next` first.
    pub fn restart_events(&self, next: CacheEvent) {
        *self.state.snapshot.lock() = next;
        self.state.events.lock().take();
    }

    /// The chunk sender of the next streamed chat response.
    pub async fn next_stream(&self) -> Chunks {
        let mut rx = self.state.streams_rx.lock().await;
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("no streamed request arrived")
            .unwrap()
    }

    pub fn received(&self) -> usize {
        self.state.received.lock().len()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn health(State(s): State<Arc<FakeState>>) -> StatusCode {
    if s.healthy.load(Ordering::Relaxed) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn events(State(s): State<Arc<FakeState>>, headers: HeaderMap) -> Response {
    let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
    if auth != Some(&format!("Bearer {EVENTS_TOKEN}")) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    s.event_connects.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::unbounded_channel::<String>();
    let first = format!(
        "data: {}\n\n",
        serde_json::to_string(&*s.snapshot.lock()).unwrap()
    );
    // Split the snapshot across two chunks: the router must parse incrementally.
    let mid = first.len() / 2;
    tx.send(first[..mid].to_string()).unwrap();
    tx.send(first[mid..].to_string()).unwrap();
    *s.events.lock() = Some(tx);
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|line| (Ok::<_, std::io::Error>(Bytes::from(line)), rx))
    });
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn chat(State(s): State<Arc<FakeState>>, headers: HeaderMap, body: Bytes) -> Response {
    s.received.lock().push((headers, body));
    let mode = *s.chat.lock();
    match mode {
        Chat::Json => axum::Json(serde_json::json!({"replica": s.name})).into_response(),
        Chat::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response(),
        Chat::Drop => panic!("fake replica drops this connection (intended)"),
        Chat::Hang => {
            let (tx, mut rx) = mpsc::channel(1);
            s.streams_tx.send(tx).unwrap();
            let _ = rx.recv().await;
            StatusCode::OK.into_response()
        }
        Chat::Stream => {
            let (tx, rx) = mpsc::channel(1);
            s.streams_tx.send(tx).unwrap();
            let stream = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|item| (item, rx))
            });
            (
                [("content-type", "text/event-stream")],
                Body::from_stream(stream),
            )
                .into_response()
        }
    }
}

/// Poll `check` every 10 ms until it holds (panics after 5 s).
pub async fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
