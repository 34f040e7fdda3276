//! Counters and gauges the engine publishes after every step; the HTTP layer renders them.

use crate::memory::PoolUsage;

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
}

impl EngineMetrics {
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
        s
    }
}
