//! `GET /internal/cache-events` (behind the admin token): the prefix cache as server-sent events
//! for a router (docs/routing.md). Each event is `data: <CacheEvent JSON>`: a `snapshot` first,
//! then every change in order, and a `load` whenever the load changed (checked every
//! [`LOAD_EVERY`]) and at least every [`HEARTBEAT`], so a router notices a dead stream.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use k3_cache_events::CacheEvent;

use crate::AppState;
use crate::error::{ApiError, ErrorKind};

/// How often the load is looked at.
pub const LOAD_EVERY: Duration = Duration::from_millis(100);
/// The longest gap between two events.
pub const HEARTBEAT: Duration = Duration::from_secs(2);

fn frame(event: &CacheEvent) -> Bytes {
    let json = serde_json::to_string(event).unwrap_or_else(|_| "{}".into());
    Bytes::from(format!("data: {json}\n\n"))
}

pub async fn cache_events(State(state): State<AppState>) -> Response {
    let Some(mut events) = state.backend().cache_events() else {
        return ApiError::new(
            ErrorKind::NotFound,
            "this server has no prefix cache (started with --no-enable-prefix-caching)",
        )
        .into_response();
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        // The snapshot goes out before any load event: the interval's first tick is immediate,
        // and a router must be able to rebuild its index from the first event it reads.
        let mut last_load = None;
        match events.recv().await {
            Some(e) => {
                if let CacheEvent::Snapshot { load, .. } = &e {
                    last_load = Some(*load);
                }
                if tx.send(frame(&e)).await.is_err() {
                    return;
                }
            }
            None => return,
        }
        let mut tick = tokio::time::interval(LOAD_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sent = Instant::now();
        loop {
            let out = tokio::select! {
                e = events.recv() => match e {
                    Some(e) => {
                        if let CacheEvent::Snapshot { load, .. } = &e {
                            last_load = Some(*load);
                        }
                        frame(&e)
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    let load = state.backend().replica_load();
                    if load == last_load && last_sent.elapsed() < HEARTBEAT {
                        continue;
                    }
                    last_load = load;
                    match load {
                        Some(l) => frame(&CacheEvent::Load(l)),
                        None => continue,
                    }
                }
                // The client went away: the body, and so `rx`, was dropped.
                _ = tx.closed() => break,
            };
            if tx.send(out).await.is_err() {
                break;
            }
            last_sent = Instant::now();
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((Ok::<_, Infallible>(chunk), rx))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}
