//! Router policy `router-kv-aware`, the default: send a request where its prompt is already
//! cached, unless that replica is busy enough that waiting there costs more than the prefill
//! it saves.
//!
//! For each healthy replica, with `n` = the prompt's full blocks (`prefix-block-hashes`), `h` =
//! the replica's usable hit (`prefix-hit-blocks`, capped at `n`; the host counts only blocks up
//! to the deepest KDA checkpoint inside the match, the part that saves prefill on a hybrid
//! model) and `avg` = a moving average of `n` over the requests this instance has routed:
//!
//! ```text
//! hit      = min(h / max(avg, MIN_AVG_BLOCKS), MAX_HIT)   prefill saved, in average prompts
//! load     = queued + running                             requests ahead of this one
//! pressure = 1 - kv_free_blocks / kv_total_blocks         in [0, 1] (0 when total is 0)
//! score    = HIT_WEIGHT * hit - load - PRESSURE_WEIGHT * pressure
//! ```
//!
//! The highest score wins; ties go to the lower load, then the smaller id. A request with no
//! hit on any replica (cold) goes to the least-loaded replica (fewest `queued + running`, then
//! most free blocks, then smallest id), exactly as `router-least-load` would send it.
//!
//! Why absolute blocks: a hit is worth the prefill time it saves, which grows with the blocks
//! saved, not with their share of this prompt. Twelve cached blocks of a long prompt save as
//! much as twelve of a short one; a short prompt's whole hit saves little. Dividing by the
//! average prompt (not a constant) keeps the unit meaningful for any traffic: a hit as long as
//! a typical prompt is worth [`HIT_WEIGHT`] requests of load. `avg` starts at the first
//! request's `n` and moves by [`AVG_WEIGHT`] of the gap per request; it lives in the instance,
//! so a fresh instance (after a fault or a swap) learns it again.
//!
//! The trade-off, explicitly: a hit is worth up to `HIT_WEIGHT * MAX_HIT` requests of load, and
//! a full pool costs [`PRESSURE_WEIGHT`] request. Since `hit` and `pressure` are bounded, a
//! replica with more than [`LOAD_GAP_WINS`] (= `HIT_WEIGHT * MAX_HIT + PRESSURE_WEIGHT`)
//! requests more than another never wins, whatever its hit: traffic sharing a prefix spreads
//! out once its favourite replica's queue grows, instead of piling up there. See
//! `docs/plugins.md`, "The router stage".

use k3_plugin_sdk::router::healthy;
use k3_plugin_sdk::{Info, Plugin, PluginError, Replica, RouteChoice, RouteRequest, Router};

/// Requests of load a hit as long as the average prompt is worth.
pub const HIT_WEIGHT: f64 = 4.0;
/// The most a hit counts for, in average prompts: without a bound, one huge prompt's hit would
/// outweigh any queue.
pub const MAX_HIT: f64 = 2.0;
/// Requests of load a completely full KV pool counts as (eviction and preemption ahead).
pub const PRESSURE_WEIGHT: f64 = 1.0;
/// The average is taken as at least this many blocks: where every prompt is short, saving a
/// few blocks of prefill is not worth queueing for.
pub const MIN_AVG_BLOCKS: f64 = 8.0;
/// How far the average moves towards each new prompt's length.
pub const AVG_WEIGHT: f64 = 1.0 / 32.0;
/// A load gap (`queued + running`) above which the less-loaded replica always wins.
pub const LOAD_GAP_WINS: f64 = HIT_WEIGHT * MAX_HIT + PRESSURE_WEIGHT;

/// The policy's state: the moving average of prompt length, in blocks.
#[derive(Debug, Default)]
pub struct KvAware {
    /// `None` before the first request with a known prompt.
    avg_blocks: Option<f64>,
}

impl KvAware {
    /// The average prompt length in blocks so far (`None` before the first prompt).
    pub fn avg_blocks(&self) -> Option<f64> {
        self.avg_blocks
    }

    /// Take a prompt of `blocks` into the average; returns the new average.
    fn observe(&mut self, blocks: u32) -> f64 {
        let n = f64::from(blocks);
        let avg = match self.avg_blocks {
            Some(avg) => avg + AVG_WEIGHT * (n - avg),
            None => n,
        };
        self.avg_blocks = Some(avg);
        avg
    }
}

impl Plugin for KvAware {
    const INFO: Info = Info::new(
        "router-kv-aware",
        env!("CARGO_PKG_VERSION"),
        "routes to the replica whose usable prefix-cache hit (prefill saved) best outweighs its load and pool pressure; cold requests go to the least-loaded replica",
    );

    fn self_test() -> Result<(), String> {
        let mut policy = KvAware::default();
        let mut replicas = [
            replica("a", 1, 0, 16),
            replica("b", 0, 0, 0),
            replica("c", 0, 0, 99),
        ];
        replicas[2].healthy = false;
        let mut pick = |blocks: u64, replicas: &[Replica]| {
            policy
                .choose(&request(blocks), replicas)
                .map(|c| c.replica_id)
                .map_err(|e| e.to_string())
        };
        let warm = pick(16, &replicas)?;
        replicas[0].prefix_hit_blocks = 0;
        let cold = pick(16, &replicas)?;
        // After many 4-block prompts, a 16-block hit saves two average prompts' prefill: worth
        // a queue of 5 (a share-of-prompt score would give it 4).
        for _ in 0..100 {
            pick(4, &replicas)?;
        }
        replicas[0].prefix_hit_blocks = 16;
        replicas[0].queued = 5;
        let long = pick(16, &replicas)?;
        if [warm.as_str(), cold.as_str(), long.as_str()] == ["a", "b", "a"] {
            Ok(())
        } else {
            Err(format!(
                "expected a (warm), b (cold), a (long hit); got {warm}, {cold}, {long}"
            ))
        }
    }
}

/// One replica's terms of the score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    /// Usable hit blocks (capped at the prompt's blocks).
    pub hit_blocks: u32,
    pub hit: f64,
    pub load: u64,
    pub pressure: f64,
    pub score: f64,
}

/// The score of `replica` for a prompt of `prompt_blocks` full blocks, when the average prompt
/// is `avg_blocks` (see the crate docs).
pub fn score(replica: &Replica, prompt_blocks: u32, avg_blocks: f64) -> Score {
    let hit_blocks = replica.prefix_hit_blocks.min(prompt_blocks);
    let hit = (f64::from(hit_blocks) / avg_blocks.max(MIN_AVG_BLOCKS)).min(MAX_HIT);
    let load = replica.load();
    let pressure = if replica.kv_total_blocks == 0 {
        0.0
    } else {
        let free = replica.kv_free_blocks.min(replica.kv_total_blocks);
        1.0 - f64::from(free) / f64::from(replica.kv_total_blocks)
    };
    let score = HIT_WEIGHT * hit - load as f64 - PRESSURE_WEIGHT * pressure;
    Score {
        hit_blocks,
        hit,
        load,
        pressure,
        score,
    }
}

impl Router for KvAware {
    fn new() -> Self {
        KvAware::default()
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        replicas: &[Replica],
    ) -> Result<RouteChoice, PluginError> {
        let healthy = healthy(replicas)?;
        let blocks = u32::try_from(request.prefix_block_hashes.len()).unwrap_or(u32::MAX);
        // A request whose prompt the router could not read (no tokens, no hashes) says nothing
        // about prompt lengths.
        let avg = if request.prompt_tokens > 0 || blocks > 0 {
            self.observe(blocks)
        } else {
            self.avg_blocks.unwrap_or(0.0)
        };
        let scored: Vec<(&Replica, Score)> = healthy
            .iter()
            .map(|r| (*r, score(r, blocks, avg)))
            .collect();
        let cold = scored.iter().all(|(_, s)| s.hit_blocks == 0);
        let best = if cold {
            scored.iter().min_by(|(a, _), (b, _)| {
                a.load()
                    .cmp(&b.load())
                    .then(b.kv_free_blocks.cmp(&a.kv_free_blocks))
                    .then(a.id.cmp(&b.id))
            })
        } else {
            scored.iter().min_by(|(a, sa), (b, sb)| {
                sb.score
                    .total_cmp(&sa.score)
                    .then(sa.load.cmp(&sb.load))
                    .then(a.id.cmp(&b.id))
            })
        };
        let (replica, s) =
            best.ok_or_else(|| PluginError::Internal("no healthy replica left to compare".into()))?;
        let reason = if cold {
            format!(
                "cold (no hit anywhere): least load {} (queued {}, running {}), {} free blocks",
                s.load, replica.queued, replica.running, replica.kv_free_blocks
            )
        } else {
            format!(
                "hit {}/{} blocks, load {} (queued {}, running {}), pool {:.0}% used, avg prompt {:.1} blocks, score {:.2}",
                s.hit_blocks,
                blocks,
                s.load,
                replica.queued,
                replica.running,
                s.pressure * 100.0,
                avg,
                s.score
            )
        };
        Ok(RouteChoice {
            replica_id: replica.id.clone(),
            reason,
        })
    }
}

/// A request for a prompt of `blocks` full blocks (of 64 tokens).
fn request(blocks: u64) -> RouteRequest {
    RouteRequest {
        prompt_tokens: u32::try_from(blocks * 64).unwrap_or(u32::MAX),
        prefix_block_hashes: (1..=blocks).collect(),
        ..RouteRequest::default()
    }
}

/// A healthy replica with an empty 100-block pool.
fn replica(id: &str, queued: u32, running: u32, hit: u32) -> Replica {
    Replica {
        id: id.into(),
        healthy: true,
        queued,
        running,
        kv_free_blocks: 100,
        kv_total_blocks: 100,
        prefix_hit_blocks: hit,
    }
}

k3_plugin_sdk::export_router!(KvAware);

#[cfg(test)]
mod tests;
