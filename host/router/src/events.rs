//! Following a replica's `/internal/cache-events` (SSE of [`CacheEvent`]s) into its index.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use k3_cache_events::CacheEvent;

use crate::Shared;
use crate::replica::Replica;

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// The largest event taken; a snapshot of a large cache is a few MB.
const MAX_EVENT_BYTES: usize = 256 * 1024 * 1024;

/// An incremental `text/event-stream` parser: bytes in, the `data` of complete events out.
/// Lines may be split anywhere across chunks; `\n` and `\r\n` both end a line.
#[derive(Debug, Default)]
pub(crate) struct SseParser {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for a line end.
    scanned: usize,
    data: Option<String>,
}

impl SseParser {
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Result<Vec<String>, String> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(pos) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            let end = self.scanned + pos;
            let mut line = &self.buf[start..end];
            if let Some(stripped) = line.strip_suffix(b"\r") {
                line = stripped;
            }
            let line = std::str::from_utf8(line)
                .map_err(|_| "an event line is not UTF-8".to_string())?
                .to_string();
            self.line(&line, &mut events);
            start = end + 1;
            self.scanned = start;
        }
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        let pending = self.buf.len() + self.data.as_ref().map_or(0, String::len);
        if pending > MAX_EVENT_BYTES {
            return Err(format!("an event is over {MAX_EVENT_BYTES} bytes"));
        }
        Ok(events)
    }

    fn line(&mut self, line: &str, events: &mut Vec<String>) {
        if line.is_empty() {
            events.extend(self.data.take());
            return;
        }
        if line.starts_with(':') {
            return; // a comment (keep-alive)
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
    }
}

/// Follow `replica`'s events forever: on every break the index is reset (nothing is known until
/// the next snapshot) and the stream reopened after a backoff.
pub(crate) async fn events_loop(shared: Arc<Shared>, replica: Arc<Replica>) {
    let mut backoff = BACKOFF_MIN;
    let mut quiet = false;
    loop {
        let (synced, end) = follow(&shared, &replica).await;
        replica.index.write().reset();
        if synced {
            backoff = BACKOFF_MIN;
            quiet = false;
        }
        // Log the first break of a streak; a replica that stays down would flood the log.
        if !quiet {
            match &end {
                Ok(()) => tracing::info!(replica = %replica.id, "cache events ended; reconnecting"),
                Err(e) => tracing::warn!(replica = %replica.id, "cache events: {e}; reconnecting"),
            }
            quiet = true;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// One connection: (whether a snapshot was applied, how it ended).
async fn follow(shared: &Shared, replica: &Replica) -> (bool, Result<(), String>) {
    let mut synced = false;
    let mut health = replica.watch_health();
    health.borrow_and_update();
    let mut req = shared
        .client
        .get(format!("{}/internal/cache-events", replica.url))
        .header(reqwest::header::ACCEPT, "text/event-stream");
    if let Some(token) = &shared.config.events_token {
        req = req.bearer_auth(token);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => return (false, Err(crate::errors::error_chain(&e))),
    };
    if !resp.status().is_success() {
        return (false, Err(format!("answered {}", resp.status())));
    }
    replica
        .metrics
        .event_connects
        .fetch_add(1, Ordering::Relaxed);
    let mut stream = resp.bytes_stream();
    let mut parser = SseParser::default();
    // Resolves when the replica is ejected: its stream may hang on a dead peer, and its index
    // should not steer requests meanwhile.
    let ejected = async {
        loop {
            if health.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            if !*health.borrow() {
                return;
            }
        }
    };
    tokio::pin!(ejected);
    loop {
        let chunk = tokio::select! {
            c = stream.next() => c,
            () = &mut ejected => return (synced, Err("replica ejected".into())),
        };
        let chunk = match chunk {
            None => return (synced, Ok(())),
            Some(Err(e)) => return (synced, Err(crate::errors::error_chain(&e))),
            Some(Ok(c)) => c,
        };
        let datas = match parser.push(&chunk) {
            Ok(d) => d,
            Err(e) => return (synced, Err(e)),
        };
        for data in datas {
            match serde_json::from_str::<CacheEvent>(&data) {
                Ok(event) => {
                    let snapshot = matches!(event, CacheEvent::Snapshot { .. });
                    replica.index.write().apply(&event);
                    replica.metrics.events.fetch_add(1, Ordering::Relaxed);
                    if snapshot && !synced {
                        synced = true;
                        let (blocks, checkpoints) = replica.index.read().counts();
                        tracing::info!(
                            replica = %replica.id,
                            blocks,
                            checkpoints,
                            "cache events synced from a snapshot"
                        );
                    }
                }
                Err(e) => {
                    // A newer replica's event kind, or a broken one: skip it, keep the stream.
                    replica.metrics.bad_events.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(replica = %replica.id, "skipping a cache event: {e}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_any_split() {
        let text = ": keep-alive\n\ndata: {\"a\":1}\n\nevent: x\ndata:{\"b\":\r\ndata: 2}\r\n\r\n";
        let want = vec!["{\"a\":1}".to_string(), "{\"b\":\n2}".to_string()];
        let bytes = text.as_bytes();
        for cut in 0..=bytes.len() {
            let mut p = SseParser::default();
            let mut got = p.push(&bytes[..cut]).unwrap();
            got.extend(p.push(&bytes[cut..]).unwrap());
            assert_eq!(got, want, "cut at {cut}");
        }
        let mut p = SseParser::default();
        let mut got = Vec::new();
        for b in bytes {
            got.extend(p.push(std::slice::from_ref(b)).unwrap());
        }
        assert_eq!(got, want);
    }

    #[test]
    fn an_unfinished_event_is_not_emitted() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {}\n").unwrap().is_empty());
        assert_eq!(p.push(b"\n").unwrap(), ["{}"]);
        assert!(p.push(b"\xff\n").is_err());
    }
}
