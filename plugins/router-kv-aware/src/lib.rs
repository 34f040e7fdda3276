//! Router policy `router-kv-aware`, the default: send a request where its prompt is already
//! cached, unless that replica is busy enough that waiting there costs more than the prefill
//! it saves.
//!
//! For each healthy replica, with `n` = the prompt's full blocks (`prefix-block-hashes`) and
//! `h` = the replica's usable hit (`prefix-hit-blocks`, capped at `n`; the host counts only
//! blocks up to the deepest KDA checkpoint inside the match, the part that saves prefill on a
//! hybrid model):
//!
//! ```text
//! hit      = h / max(n, SHORT_PROMPT_BLOCKS)              in [0, 1]: share of prefill saved
//! load     = queued + running                             requests ahead of this one
//! pressure = 1 - kv_free_blocks / kv_total_blocks         in [0, 1] (0 when total is 0)
//! score    = HIT_WEIGHT * hit - load - PRESSURE_WEIGHT * pressure
//! ```
//!
//! The highest score wins; ties go to the lower load, then the smaller id. A request with no
//! hit on any replica (cold) goes to the least-loaded replica (fewest `queued + running`, then
//! most free blocks, then smallest id), exactly as `router-least-load` would send it.
//!
//! The trade-off, explicitly: a whole-prompt hit is worth [`HIT_WEIGHT`] requests of load, and
//! a full pool costs [`PRESSURE_WEIGHT`] request. Since `hit` and `pressure` are both within
//! `[0, 1]`, a replica with more than [`LOAD_GAP_WINS`] (= `HIT_WEIGHT + PRESSURE_WEIGHT`)
//! requests more than another never wins, whatever its hit: traffic sharing a prefix spreads
//! out once its favourite replica's queue grows, instead of piling up there. Prompts shorter
//! than [`SHORT_PROMPT_BLOCKS`] get proportionally less credit: saving a few blocks of prefill
//! is not worth queueing for. See `docs/plugins.md`, "The router stage".

use k3_plugin_sdk::router::healthy;
use k3_plugin_sdk::{Info, Plugin, PluginError, Replica, RouteChoice, RouteRequest, Router};

/// Requests of load a whole-prompt usable hit is worth.
pub const HIT_WEIGHT: f64 = 4.0;
/// Requests of load a completely full KV pool counts as (eviction and preemption ahead).
pub const PRESSURE_WEIGHT: f64 = 1.0;
/// Prompts shorter than this many blocks earn `h / SHORT_PROMPT_BLOCKS`, not `h / n`.
pub const SHORT_PROMPT_BLOCKS: u32 = 8;
/// A load gap (`queued + running`) above which the less-loaded replica always wins.
pub const LOAD_GAP_WINS: f64 = HIT_WEIGHT + PRESSURE_WEIGHT;

pub struct KvAware;

impl Plugin for KvAware {
    const INFO: Info = Info::new(
        "router-kv-aware",
        env!("CARGO_PKG_VERSION"),
        "routes to the replica whose usable prefix-cache hit best outweighs its load and pool pressure; cold requests go to the least-loaded replica",
    );

    fn self_test() -> Result<(), String> {
        let request = RouteRequest {
            prompt_tokens: 16 * 64,
            prefix_block_hashes: (1..=16).collect(),
            ..RouteRequest::default()
        };
        let mut replicas = [
            replica("a", 1, 0, 16),
            replica("b", 0, 0, 0),
            replica("c", 0, 0, 99),
        ];
        replicas[2].healthy = false;
        let warm = KvAware
            .choose(&request, &replicas)
            .map_err(|e| e.to_string())?;
        replicas[0].prefix_hit_blocks = 0;
        let cold = KvAware
            .choose(&request, &replicas)
            .map_err(|e| e.to_string())?;
        if (warm.replica_id.as_str(), cold.replica_id.as_str()) == ("a", "b") {
            Ok(())
        } else {
            Err(format!(
                "expected a (warm) and b (cold), got {warm:?} and {cold:?}"
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

/// The score of `replica` for a prompt of `prompt_blocks` full blocks (see the crate docs).
pub fn score(replica: &Replica, prompt_blocks: u32) -> Score {
    let hit_blocks = replica.prefix_hit_blocks.min(prompt_blocks);
    let hit = f64::from(hit_blocks) / f64::from(prompt_blocks.max(SHORT_PROMPT_BLOCKS));
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
        KvAware
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        replicas: &[Replica],
    ) -> Result<RouteChoice, PluginError> {
        let healthy = healthy(replicas)?;
        let blocks = u32::try_from(request.prefix_block_hashes.len()).unwrap_or(u32::MAX);
        let scored: Vec<(&Replica, Score)> =
            healthy.iter().map(|r| (*r, score(r, blocks))).collect();
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
                "hit {}/{} blocks, load {} (queued {}, running {}), pool {:.0}% used, score {:.2}",
                s.hit_blocks,
                blocks,
                s.load,
                replica.queued,
                replica.running,
                s.pressure * 100.0,
                s.score
            )
        };
        Ok(RouteChoice {
            replica_id: replica.id.clone(),
            reason,
        })
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
