//! What the server reports about itself: the served model, metrics read at scrape time, and the
//! plugin versions the admin routes list.

use serde::Serialize;

/// What `/v1/models` lists.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub id: String,
    /// Other names a request's `model` may use (e.g. the model directory path).
    pub aliases: Vec<String>,
    pub max_model_len: u32,
    pub created: u64,
}

/// Engine and plugin numbers for `/metrics`, read at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BackendMetrics {
    pub running: u64,
    pub waiting: u64,
    /// Prompt tokens looked up in the prefix cache, and how many of them hit.
    pub prefix_cache_queried_tokens: u64,
    pub prefix_cache_hit_tokens: u64,
    pub pool: Vec<PoolUsage>,
    pub preemptions: u64,
    pub plugins: Vec<PluginCounters>,
    /// Wasm plugin instances alive now (`None` without the pooling allocator).
    pub plugin_instances_in_use: Option<u64>,
    /// Plugin instance starts refused because every instance slot was taken.
    pub plugin_capacity_refusals: u64,
    /// Speculative decoding's counters; `None` when it is off.
    pub speculative: Option<SpecDecodeMetrics>,
}

/// Speculative decoding's counters (vLLM's `spec_decode_*` set, plus the planner's choices).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecDecodeMetrics {
    /// The configured method (`ngram`, `dspark`).
    pub method: String,
    /// Verify rounds (drafts checked).
    pub drafts: u64,
    /// Draft tokens verified, and how many were accepted.
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// Accepted draft tokens by position in the draft.
    pub accepted_by_position: Vec<u64>,
    /// Verify rounds by the number of draft tokens the planner kept (index = tokens).
    pub verify_lengths: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PoolUsage {
    /// e.g. "kv", "state".
    pub kind: String,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PluginCounters {
    pub stage: String,
    pub version: String,
    pub calls: u64,
    pub errors: u64,
}

/// One stage's plugins as the admin API shows them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PluginStageInfo {
    pub stage: String,
    /// The active version's id, if any.
    pub active: Option<String>,
    pub versions: Vec<PluginVersionInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PluginVersionInfo {
    /// Stable id of this loaded version (content digest based).
    pub id: String,
    /// Name and version the plugin declares in its metadata.
    pub name: String,
    pub version: String,
    pub digest: String,
    pub active: bool,
    pub calls: u64,
    pub errors: u64,
}
