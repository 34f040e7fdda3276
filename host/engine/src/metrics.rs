//! Counters and gauges the engine publishes after every step; the HTTP layer renders them.

use crate::memory::PoolUsage;
use k3_cache_events::ReplicaLoad;

/// A point-in-time snapshot. Counters are totals since start; gauges are current.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    /// Gauges.
    pub running: usize,
    pub waiting: usize,
    /// Pool use by kind, including the blocks held by the prefix cache.
    pub pool: PoolUsage,
    /// Of `pool`: state blocks holding prefix-cache checkpoints, KV pages held by the tree.
    pub cache_checkpoints: usize,
    pub cache_kv_pages: usize,
    /// Tokens in the most recent step.
    pub last_step_tokens: usize,
    /// Counters.
    pub steps: u64,
    pub step_tokens_total: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Prompt tokens served from the prefix cache (KV + state restored, not computed).
    pub prefix_hit_tokens: u64,
    /// Admissions that restored a KDA checkpoint.
    pub checkpoint_hits: u64,
    /// Tokens whose KV was cached but had to be recomputed because no checkpoint was deep enough.
    pub replayed_tokens: u64,
    pub preemptions: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub failed: u64,
    /// Speculative decoding: verify rounds, draft tokens verified, draft tokens accepted.
    pub spec_verify_rounds: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    /// Accepted draft tokens by position in the draft (index 0: the first draft token).
    pub spec_accepted_by_position: Vec<u64>,
    /// Verify rounds by the draft length the planner chose (index = draft tokens verified).
    pub spec_verify_lengths: Vec<u64>,
}

impl EngineMetrics {
    /// The load a router weighs, given the layout's block sizes: bytes held only by the prefix
    /// cache count as free (evictable on demand), so a replica is not penalised for what it has
    /// cached.
    pub fn replica_load(&self, kv_page_bytes: usize, state_block_bytes: usize) -> ReplicaLoad {
        let cached =
            self.cache_kv_pages * kv_page_bytes + self.cache_checkpoints * state_block_bytes;
        let capacity = self.pool.capacity_bytes;
        let free = (self.pool.free_bytes + cached).min(capacity);
        let page_bytes = kv_page_bytes.max(1);
        ReplicaLoad {
            running: self.running as u32,
            waiting: self.waiting as u32,
            free_pool_bytes: free as u64,
            total_pool_bytes: capacity as u64,
            free_blocks: (free / page_bytes) as u32,
            total_blocks: (capacity / page_bytes) as u32,
        }
    }

    /// Prometheus text exposition (names prefixed `k3_engine_`).
    pub fn to_prometheus(&self) -> String {
        let mut s = String::new();
        let mut put = |name: &str, kind: &str, v: f64| {
            s.push_str(&format!(
                "# TYPE k3_engine_{name} {kind}\nk3_engine_{name} {v}\n"
            ));
        };
        put("running_requests", "gauge", self.running as f64);
        put("waiting_requests", "gauge", self.waiting as f64);
        put(
            "pool_capacity_bytes",
            "gauge",
            self.pool.capacity_bytes as f64,
        );
        put("pool_free_bytes", "gauge", self.pool.free_bytes as f64);
        put("pool_state_bytes", "gauge", self.pool.state_bytes as f64);
        put("pool_kv_bytes", "gauge", self.pool.kv_bytes as f64);
        put("cache_checkpoints", "gauge", self.cache_checkpoints as f64);
        put("cache_kv_pages", "gauge", self.cache_kv_pages as f64);
        put("last_step_tokens", "gauge", self.last_step_tokens as f64);
        put("steps_total", "counter", self.steps as f64);
        put(
            "step_tokens_total",
            "counter",
            self.step_tokens_total as f64,
        );
        put("prompt_tokens_total", "counter", self.prompt_tokens as f64);
        put(
            "generated_tokens_total",
            "counter",
            self.generated_tokens as f64,
        );
        put(
            "prefix_hit_tokens_total",
            "counter",
            self.prefix_hit_tokens as f64,
        );
        put(
            "checkpoint_hits_total",
            "counter",
            self.checkpoint_hits as f64,
        );
        put(
            "replayed_tokens_total",
            "counter",
            self.replayed_tokens as f64,
        );
        put("preemptions_total", "counter", self.preemptions as f64);
        put("finished_total", "counter", self.finished as f64);
        put("cancelled_total", "counter", self.cancelled as f64);
        put("failed_total", "counter", self.failed as f64);
        put(
            "spec_verify_rounds_total",
            "counter",
            self.spec_verify_rounds as f64,
        );
        put(
            "spec_draft_tokens_total",
            "counter",
            self.spec_draft_tokens as f64,
        );
        put(
            "spec_accepted_tokens_total",
            "counter",
            self.spec_accepted_tokens as f64,
        );
        // Tokens committed per verify round: accepted drafts plus the one the target adds.
        if let Some(mean) = self.spec_mean_acceptance_length() {
            put("spec_mean_acceptance_length", "gauge", mean);
        }
        let mut labelled = |name: &str, values: &[u64], label: &str| {
            if values.is_empty() {
                return;
            }
            s.push_str(&format!("# TYPE k3_engine_{name} counter\n"));
            for (i, v) in values.iter().enumerate() {
                s.push_str(&format!("k3_engine_{name}{{{label}=\"{i}\"}} {v}\n"));
            }
        };
        labelled(
            "spec_accepted_by_position_total",
            &self.spec_accepted_by_position,
            "position",
        );
        labelled(
            "spec_verify_length_total",
            &self.spec_verify_lengths,
            "draft_tokens",
        );
        s
    }

    /// Mean tokens committed per verify round (accepted drafts + 1); `None` before any round.
    pub fn spec_mean_acceptance_length(&self) -> Option<f64> {
        (self.spec_verify_rounds > 0).then(|| {
            (self.spec_accepted_tokens + self.spec_verify_rounds) as f64
                / self.spec_verify_rounds as f64
        })
    }
}
