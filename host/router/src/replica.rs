//! The replica set: health, ejection and re-admission, the per-replica prefix index and load.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use k3_cache_events::{PrefixIndex, ReplicaLoad};
use k3_plugin_host::ReplicaView;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::watch;

use crate::Shared;
use crate::metrics::ReplicaMetrics;

/// One replica as `/health` and [`RouterHandle::replicas`](crate::RouterHandle::replicas) show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaStatus {
    pub id: String,
    pub url: String,
    pub healthy: bool,
    pub consecutive_failures: u32,
    /// A snapshot of its cache events has been applied and the stream is followed.
    pub events_synced: bool,
    /// From its last load event (0 while unknown).
    pub running: u32,
    pub waiting: u32,
    pub free_blocks: u32,
    pub total_blocks: u32,
    /// Requests the router has open to it now.
    pub in_flight: u32,
    pub index_blocks: usize,
    pub index_checkpoints: usize,
    pub block_tokens: Option<usize>,
}

struct Health {
    healthy: bool,
    failures: u32,
}

pub(crate) struct Replica {
    pub id: String,
    pub url: String,
    health: Mutex<Health>,
    /// Mirrors `health.healthy` for the events task, which drops its stream on ejection.
    healthy_tx: watch::Sender<bool>,
    pub index: RwLock<PrefixIndex>,
    pub in_flight: AtomicU32,
    pub metrics: ReplicaMetrics,
}

impl Replica {
    /// A replica starts ejected: the first successful probe admits it.
    pub(crate) fn new(id: String, url: String) -> Self {
        Replica {
            id,
            url,
            health: Mutex::new(Health {
                healthy: false,
                failures: 0,
            }),
            healthy_tx: watch::Sender::new(false),
            index: RwLock::new(PrefixIndex::new()),
            in_flight: AtomicU32::new(0),
            metrics: ReplicaMetrics::new(),
        }
    }

    pub(crate) fn is_healthy(&self) -> bool {
        self.health.lock().healthy
    }

    pub(crate) fn watch_health(&self) -> watch::Receiver<bool> {
        self.healthy_tx.subscribe()
    }

    /// One failed probe or request; ejects the replica at `eject_after` in a row.
    pub(crate) fn record_failure(&self, eject_after: u32, why: &str) {
        let mut h = self.health.lock();
        h.failures = h.failures.saturating_add(1);
        if h.healthy && h.failures >= eject_after {
            h.healthy = false;
            self.healthy_tx.send_replace(false);
            tracing::warn!(
                replica = %self.id,
                url = %self.url,
                failures = h.failures,
                "replica ejected: {why}"
            );
        } else {
            tracing::debug!(replica = %self.id, failures = h.failures, "replica failure: {why}");
        }
    }

    /// A successful probe: (re-)admits the replica.
    pub(crate) fn record_probe_success(&self) {
        let mut h = self.health.lock();
        h.failures = 0;
        if !h.healthy {
            h.healthy = true;
            self.healthy_tx.send_replace(true);
            tracing::info!(replica = %self.id, url = %self.url, "replica admitted");
        }
    }

    /// A request the replica answered: its failure streak is over (admission stays the probes'
    /// decision).
    pub(crate) fn record_request_success(&self) {
        self.health.lock().failures = 0;
    }

    /// What a policy sees of this replica for a prompt; `hashes` are the prompt's block hashes
    /// at this replica's block size (`None` when unknown).
    pub(crate) fn view(&self, hashes: Option<&[u64]>) -> ReplicaView {
        let index = self.index.read();
        let load = index.load().unwrap_or_default();
        let prefix_hit_blocks = match hashes {
            Some(h) if index.is_synced() => index.matched(h).usable_blocks,
            _ => 0,
        };
        ReplicaView {
            id: self.id.clone(),
            healthy: self.is_healthy(),
            queued: load.waiting,
            running: seen_running(load, self.in_flight.load(Ordering::Relaxed)),
            kv_free_blocks: load.free_blocks,
            kv_total_blocks: load.total_blocks,
            prefix_hit_blocks,
        }
    }

    pub(crate) fn status(&self) -> ReplicaStatus {
        let (healthy, consecutive_failures) = {
            let h = self.health.lock();
            (h.healthy, h.failures)
        };
        let index = self.index.read();
        let load = index.load().unwrap_or_default();
        let (index_blocks, index_checkpoints) = index.counts();
        ReplicaStatus {
            id: self.id.clone(),
            url: self.url.clone(),
            healthy,
            consecutive_failures,
            events_synced: index.is_synced(),
            running: load.running,
            waiting: load.waiting,
            free_blocks: load.free_blocks,
            total_blocks: load.total_blocks,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            index_blocks,
            index_checkpoints,
            block_tokens: index.block_tokens(),
        }
    }
}

/// The running count a policy sees. The router's open requests are normally already in the
/// replica's last reported running + waiting, so adding them would count each twice; but a
/// burst sent since that report is not in it yet. So the open requests bound the load from
/// below: `queued + running` is `max(reported running + waiting, in_flight)`.
fn seen_running(load: ReplicaLoad, in_flight: u32) -> u32 {
    load.running.max(in_flight.saturating_sub(load.waiting))
}

/// Probe `replica`'s `/health` once and record the result.
pub(crate) async fn probe(shared: &Shared, replica: &Replica) {
    let url = format!("{}/health", replica.url);
    let result = shared
        .client
        .get(&url)
        .timeout(shared.config.health_timeout)
        .send()
        .await;
    match result {
        Ok(resp) if resp.status().is_success() => replica.record_probe_success(),
        Ok(resp) => replica.record_failure(
            shared.config.eject_after,
            &format!("/health answered {}", resp.status()),
        ),
        Err(e) => replica.record_failure(
            shared.config.eject_after,
            &format!("/health failed: {}", crate::errors::error_chain(&e)),
        ),
    }
}

/// Probe `replica` every `health_interval`, forever.
pub(crate) async fn health_loop(shared: Arc<Shared>, replica: Arc<Replica>) {
    let mut tick = tokio::time::interval(shared.config.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick fires at once; build_router has just probed.
    tick.tick().await;
    loop {
        tick.tick().await;
        probe(&shared, &replica).await;
    }
}

/// Guards one open request: counted in the replica's in-flight until dropped.
pub(crate) struct InFlight(Arc<Replica>);

impl InFlight {
    pub(crate) fn new(replica: Arc<Replica>) -> Self {
        replica.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(replica)
    }

    pub(crate) fn replica(&self) -> &Arc<Replica> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_cache_events::CacheEvent;

    fn replica_reporting(running: u32, waiting: u32) -> Arc<Replica> {
        let r = Arc::new(Replica::new("r0".into(), "http://127.0.0.1:1".into()));
        r.index.write().apply(&CacheEvent::Load(ReplicaLoad {
            running,
            waiting,
            ..ReplicaLoad::default()
        }));
        r
    }

    fn load(r: &Replica) -> u32 {
        let v = r.view(None);
        v.queued + v.running
    }

    #[test]
    fn open_requests_are_not_counted_twice() {
        // Three requests open, and the replica reports them running: the load is 3, not 6.
        let r = replica_reporting(3, 0);
        let open: Vec<InFlight> = (0..3).map(|_| InFlight::new(r.clone())).collect();
        assert_eq!(load(&r), 3);
        // Also when some of them wait in the replica's queue.
        let r = replica_reporting(1, 2);
        let open2: Vec<InFlight> = (0..3).map(|_| InFlight::new(r.clone())).collect();
        assert_eq!((r.view(None).queued, r.view(None).running), (2, 1));
        drop((open, open2));
        // Others' requests (another router, direct clients) count on top of none of ours.
        assert_eq!(load(&replica_reporting(4, 1)), 5);
    }

    #[test]
    fn a_burst_between_load_events_is_seen() {
        // The last report predates the burst: the open requests are the better count.
        let r = replica_reporting(1, 1);
        let open: Vec<InFlight> = (0..6).map(|_| InFlight::new(r.clone())).collect();
        assert_eq!(load(&r), 6);
        drop(open);
        assert_eq!(load(&r), 2);
    }
}
