//! Serving sockets: an own accept loop over hyper's HTTP/1 connections, so that every connection
//! has deadlines (request head, keep-alive idle, stalled request body), the number of open
//! connections stays under a cap below the process's file-descriptor limit, accept errors back
//! off instead of spinning, and shutdown waits (bounded) for in-flight responses to write their
//! last event. The limits and their defaults are documented in `host/api/README.md` ("Limits").
//!
//! hyper's own `header_read_timeout` runs one timer from the moment a connection goes idle to the
//! end of the next head, so it cannot give keep-alive idling and head reading separate limits;
//! a small per-connection watchdog does both instead.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tower::Service;

use crate::AppState;
use crate::error::{ApiError, ErrorKind, ErrorStyle};
use crate::metrics::ConnectionMetrics;

/// Per-connection limits of the HTTP server.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectionLimits {
    /// A new connection must deliver its first request head within this; on a kept-alive
    /// connection, a head must be complete this long after its first byte.
    pub request_header_timeout: Duration,
    /// A kept-alive connection with no request in progress is closed after this.
    pub keep_alive_timeout: Duration,
    /// A request body that delivers no bytes for this long ends its request with a 408 and
    /// closes the connection.
    pub request_body_timeout: Duration,
    /// Most connections open at once; at the cap the server stops accepting (new sockets wait in
    /// the kernel's backlog) until one closes.
    pub max_connections: usize,
}

impl ConnectionLimits {
    pub const DEFAULT_REQUEST_HEADER_TIMEOUT: Duration = Duration::from_secs(20);
    pub const DEFAULT_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(30);
    pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);
    /// The cap when nothing better is known (the server derives its own from `RLIMIT_NOFILE`).
    pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
    /// After the shutdown deadline ended the backend, how long in-flight responses get to write
    /// their error event and close.
    pub const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);
    /// Above this, idle connections cost more memory than file descriptors are worth guarding.
    pub const MAX_DERIVED_CONNECTIONS: usize = 32_768;

    /// The connection cap for a process allowed `fd_limit` open files: the limit less headroom
    /// for the model, plugins, logs and the runtime (an eighth, at least 64), at most
    /// [`Self::MAX_DERIVED_CONNECTIONS`], at least 1.
    pub fn max_connections_for_fd_limit(fd_limit: u64) -> usize {
        let headroom = (fd_limit / 8).max(64);
        let cap = fd_limit.saturating_sub(headroom);
        (cap.min(Self::MAX_DERIVED_CONNECTIONS as u64) as usize).max(1)
    }
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            request_header_timeout: Self::DEFAULT_REQUEST_HEADER_TIMEOUT,
            keep_alive_timeout: Self::DEFAULT_KEEP_ALIVE_TIMEOUT,
            request_body_timeout: Self::DEFAULT_REQUEST_BODY_TIMEOUT,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// Accept and serve connections with `router` until `shutdown` resolves; then stop accepting,
/// mark the server as shutting down (readiness 503), let running requests finish for up to
/// `grace`, shut the backend down (ending what still runs with an error event), and wait up to
/// [`ConnectionLimits::SHUTDOWN_FLUSH`] for those responses to be written.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> io::Result<()> {
    let limits = Arc::new(state.config().connections.clone());
    let metrics = state.metrics().connections.clone();
    let cap = limits.max_connections.clamp(1, u32::MAX as usize >> 1);
    let slots = Arc::new(Semaphore::new(cap));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    let mut backoff = Duration::ZERO;
    let mut last_cap_warning: Option<Instant> = None;
    loop {
        let permit = match slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                metrics.cap_reached.fetch_add(1, Ordering::Relaxed);
                if last_cap_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    last_cap_warning = Some(Instant::now());
                    tracing::warn!(
                        max_connections = cap,
                        "connection cap reached; not accepting until a connection closes"
                    );
                }
                tokio::select! {
                    permit = slots.clone().acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_) => break,
                    },
                    _ = &mut shutdown => break,
                }
            }
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut shutdown => break,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff = Duration::ZERO;
                metrics.accepted.fetch_add(1, Ordering::Relaxed);
                metrics.open.fetch_add(1, Ordering::Relaxed);
                let conn = Connection {
                    router: router.clone(),
                    limits: limits.clone(),
                    metrics: metrics.clone(),
                    peer,
                    _slot: permit,
                };
                tokio::spawn(conn.serve(stream, stop_rx.clone()));
            }
            // The peer gave up before we took the socket: nothing to back off from.
            Err(e) if is_per_connection(&e) => {}
            Err(e) => {
                // EMFILE, ENFILE, ENOBUFS...: retrying at once would spin; wait, doubling.
                backoff = (backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                tracing::warn!("accept failed: {e}; retrying in {backoff:?}");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut shutdown => break,
                }
            }
        }
    }
    drop(listener);
    state.begin_shutdown();
    tracing::info!(
        "shutting down: no new connections; waiting up to {grace:?} for running requests"
    );
    let _ = stop_tx.send(true);
    let everything = cap as u32;
    let drained = tokio::time::timeout(grace, slots.acquire_many(everything))
        .await
        .is_ok();
    if !drained {
        tracing::warn!(
            open = metrics.open.load(Ordering::Relaxed),
            "shutdown deadline passed; ending the requests still running"
        );
    }
    state.backend().shutdown().await;
    if !drained {
        let flush = ConnectionLimits::SHUTDOWN_FLUSH;
        if tokio::time::timeout(flush, slots.acquire_many(everything))
            .await
            .is_err()
        {
            tracing::warn!(
                open = metrics.open.load(Ordering::Relaxed),
                "connections still open {flush:?} after the backend stopped; closing them"
            );
        }
    }
    Ok(())
}

/// Accept errors that concern one connection only (not the listener or the process).
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
    )
}

/// One accepted connection and what it shares with the server.
struct Connection {
    router: Router,
    limits: Arc<ConnectionLimits>,
    metrics: Arc<ConnectionMetrics>,
    peer: SocketAddr,
    /// Its place under the connection cap, given back when the connection closes (shutdown
    /// waits for all of them).
    _slot: OwnedSemaphorePermit,
}

impl Connection {
    async fn serve(self, stream: TcpStream, mut stop: watch::Receiver<bool>) {
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(WatchedIo {
            inner: stream,
            activity: activity.clone(),
        });
        let service = ConnService {
            router: self.router.clone(),
            activity: activity.clone(),
            peer: self.peer,
            body_timeout: self.limits.request_body_timeout,
            metrics: self.metrics.clone(),
        };
        let mut builder = hyper::server::conn::http1::Builder::new();
        // The watchdog below owns the head and idle deadlines.
        builder.header_read_timeout(None);
        let mut conn = pin!(builder.serve_connection(io, service));
        let mut watchdog = pin!(watchdog(&activity, &self.limits));
        let mut draining = false;
        if *stop.borrow_and_update() {
            conn.as_mut().graceful_shutdown();
            draining = true;
        }
        loop {
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(peer = %self.peer, "connection ended: {e}");
                    }
                    break;
                }
                timeout = watchdog.as_mut() => {
                    let counter = match timeout {
                        Timeout::Header => &self.metrics.header_timeouts,
                        Timeout::Idle => &self.metrics.idle_timeouts,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(peer = %self.peer, ?timeout, "closing the connection: timed out");
                    break;
                }
                _ = stop.changed(), if !draining => {
                    // Idle connections close now; busy ones after their current response.
                    conn.as_mut().graceful_shutdown();
                    draining = true;
                }
            }
        }
        self.metrics.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Which deadline closed a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Timeout {
    Header,
    Idle,
}

const NOT_SET: u64 = u64::MAX;

/// What a connection's watchdog watches: updated by its socket reads and by its requests.
struct Activity {
    born: Instant,
    /// Requests whose response is not over yet.
    in_flight: AtomicUsize,
    /// Milliseconds after `born` when the first byte of the head being read arrived.
    head_since: AtomicU64,
    /// Milliseconds after `born` when the last response ended (none yet: `NOT_SET`).
    idle_since: AtomicU64,
    changed: Notify,
}

impl Activity {
    fn new() -> Self {
        Activity {
            born: Instant::now(),
            in_flight: AtomicUsize::new(0),
            head_since: AtomicU64::new(NOT_SET),
            idle_since: AtomicU64::new(NOT_SET),
            changed: Notify::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    /// Bytes arrived: with no request in progress they start a new head.
    fn on_read(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0
            && self
                .head_since
                .compare_exchange(NOT_SET, self.now_ms(), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.changed.notify_one();
        }
    }

    /// Bytes went out: a response still flushing after its body ended keeps the connection
    /// from counting as idle.
    fn on_write(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0
            && self.idle_since.load(Ordering::Acquire) != NOT_SET
        {
            self.idle_since.store(self.now_ms(), Ordering::Release);
        }
    }

    fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(NOT_SET, Ordering::Release);
        self.changed.notify_one();
    }

    fn request_ended(&self) {
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle_since.store(self.now_ms(), Ordering::Release);
            self.head_since.store(NOT_SET, Ordering::Release);
        }
        self.changed.notify_one();
    }

    /// The deadline in force now and what it is for; `None` while a request runs (a stalled
    /// body has its own timer, and a slow stream is the backend's business).
    fn deadline(&self, limits: &ConnectionLimits) -> Option<(Instant, Timeout)> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let at = |ms: u64, plus: Duration| self.born + Duration::from_millis(ms) + plus;
        let head = self.head_since.load(Ordering::Acquire);
        let idle = self.idle_since.load(Ordering::Acquire);
        Some(if head != NOT_SET {
            (at(head, limits.request_header_timeout), Timeout::Header)
        } else if idle == NOT_SET {
            // A fresh connection owes its first head.
            (at(0, limits.request_header_timeout), Timeout::Header)
        } else {
            (at(idle, limits.keep_alive_timeout), Timeout::Idle)
        })
    }
}

/// Resolves when the connection has passed the deadline in force (re-read on every change).
async fn watchdog(activity: &Activity, limits: &ConnectionLimits) -> Timeout {
    loop {
        match activity.deadline(limits) {
            None => activity.changed.notified().await,
            Some((at, why)) => {
                if Instant::now() >= at {
                    return why;
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = activity.changed.notified() => {}
                }
            }
        }
    }
}

/// The socket, telling the watchdog when bytes arrive.
struct WatchedIo {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for WatchedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.on_read();
        }
        polled
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.on_write();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.on_write();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Hands each request of a connection to the router: its body under the stall timer, its peer
/// address as `ConnectInfo`, and its response counted in flight until the body is over.
#[derive(Clone)]
struct ConnService {
    router: Router,
    activity: Arc<Activity>,
    peer: SocketAddr,
    body_timeout: Duration,
    metrics: Arc<ConnectionMetrics>,
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let in_flight = InFlight::new(self.activity.clone());
        let stalled = Arc::new(AtomicBool::new(false));
        let path = req.uri().path().to_string();
        let (timeout, metrics) = (self.body_timeout, self.metrics.clone());
        let flag = stalled.clone();
        let mut req = req.map(|body| Body::new(StallTimedBody::new(body, timeout, flag, metrics)));
        req.extensions_mut().insert(ConnectInfo(self.peer));
        let mut router = self.router.clone();
        Box::pin(async move {
            let response = match router.call(req).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            let mut response = if stalled.load(Ordering::Acquire) {
                body_stalled_response(&path, timeout)
            } else {
                response
            };
            if response.status() == StatusCode::REQUEST_TIMEOUT {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok(response.map(|body| {
                Body::new(CountedBody {
                    inner: body,
                    _in_flight: in_flight,
                })
            }))
        })
    }
}

/// The 408 for a request whose body stopped arriving, in the route's protocol shape.
fn body_stalled_response(path: &str, timeout: Duration) -> Response<Body> {
    let mut response = ApiError::new(
        ErrorKind::InvalidRequest,
        format!(
            "the request body stalled: no bytes for {} s (--request-body-timeout)",
            timeout.as_secs_f64()
        ),
    )
    .with_code("request_timeout")
    .styled(ErrorStyle::for_path(path))
    .into_response();
    *response.status_mut() = StatusCode::REQUEST_TIMEOUT;
    response
}

/// One request counted in flight on its connection until dropped.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: Arc<Activity>) -> Self {
        activity.request_started();
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// A response body that keeps its request counted in flight until hyper is done with it.
struct CountedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl HttpBody for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request body stopped delivering bytes for longer than the limit.
#[derive(Debug, thiserror::Error)]
#[error("the request body stalled: no bytes for {0:?}")]
pub struct BodyStalled(Duration);

/// A request body that fails with [`BodyStalled`] when no frame arrives for `timeout` while the
/// handler waits for one.
struct StallTimedBody {
    inner: Incoming,
    timeout: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    stalled: Arc<AtomicBool>,
    metrics: Arc<ConnectionMetrics>,
}

impl StallTimedBody {
    fn new(
        inner: Incoming,
        timeout: Duration,
        stalled: Arc<AtomicBool>,
        metrics: Arc<ConnectionMetrics>,
    ) -> Self {
        StallTimedBody {
            inner,
            timeout,
            timer: None,
            stalled,
            metrics,
        }
    }
}

impl HttpBody for StallTimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.timer = None;
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => {
                let timeout = this.timeout;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if timer.as_mut().poll(cx).is_ready() {
                    this.timer = None;
                    if !this.stalled.swap(true, Ordering::AcqRel) {
                        this.metrics.body_timeouts.fetch_add(1, Ordering::Relaxed);
                    }
                    return Poll::Ready(Some(Err(Box::new(BodyStalled(timeout)))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_follows_the_fd_limit() {
        assert_eq!(ConnectionLimits::max_connections_for_fd_limit(1024), 896);
        assert_eq!(ConnectionLimits::max_connections_for_fd_limit(256), 192);
        assert_eq!(ConnectionLimits::max_connections_for_fd_limit(10), 1);
        assert_eq!(
            ConnectionLimits::max_connections_for_fd_limit(1 << 20),
            ConnectionLimits::MAX_DERIVED_CONNECTIONS
        );
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_follow_the_connection_state() {
        let limits = ConnectionLimits {
            request_header_timeout: Duration::from_secs(2),
            keep_alive_timeout: Duration::from_secs(5),
            ..ConnectionLimits::default()
        };
        let activity = Activity::new();
        let born = activity.born;
        // Fresh: the first head is due.
        assert_eq!(
            activity.deadline(&limits),
            Some((born + Duration::from_secs(2), Timeout::Header))
        );
        activity.request_started();
        assert_eq!(activity.deadline(&limits), None);
        tokio::time::advance(Duration::from_secs(10)).await;
        activity.request_ended();
        let (at, why) = activity.deadline(&limits).unwrap();
        assert_eq!(why, Timeout::Idle);
        assert!(at >= born + Duration::from_secs(15));
        // A byte of the next head switches to the head deadline, from that byte.
        tokio::time::advance(Duration::from_secs(1)).await;
        activity.on_read();
        let (at, why) = activity.deadline(&limits).unwrap();
        assert_eq!(why, Timeout::Header);
        assert!(at >= born + Duration::from_secs(13) && at < born + Duration::from_secs(14));
        assert_eq!(watchdog(&activity, &limits).await, Timeout::Header);
    }
}
