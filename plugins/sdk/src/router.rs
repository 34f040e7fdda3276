//! The router stage (world `router-plugin`): pick the replica that serves a request.
//!
//! A policy is an ordinary Rust type implementing [`Router`]; [`crate::export_router!`] makes it
//! the component. The host keeps one live instance per active version, so `&mut self` state
//! (a round-robin cursor, say) survives from call to call until a trap or a hot swap replaces
//! the instance. See `docs/plugins.md`, "The router stage".

use crate::PluginError;

/// WIT `request-summary`: what the router knows of the request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RouteRequest {
    pub request_id: String,
    pub model: String,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// The prompt's full token blocks, hashed (chained; one per block).
    pub prefix_block_hashes: Vec<u64>,
    pub priority: i32,
}

/// WIT `replica-state`: one replica as the router sees it now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Replica {
    pub id: String,
    pub healthy: bool,
    /// Requests waiting for admission.
    pub queued: u32,
    /// Requests being generated.
    pub running: u32,
    pub kv_free_blocks: u32,
    pub kv_total_blocks: u32,
    /// Leading blocks of this request's prompt the replica can reuse (the host fills in the
    /// usable part of the hit: blocks up to its deepest checkpoint inside the match).
    pub prefix_hit_blocks: u32,
}

impl Replica {
    /// `queued + running`, without overflow.
    pub fn load(&self) -> u64 {
        u64::from(self.queued) + u64::from(self.running)
    }
}

/// WIT `route-choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteChoice {
    /// The `id` of one of the replicas passed in.
    pub replica_id: String,
    /// Why, in a few words (logged by the router).
    pub reason: String,
}

/// The router stage. `new` runs once per instance; `choose` once per request.
pub trait Router: Sized + 'static {
    fn new() -> Self;
    fn choose(
        &mut self,
        request: &RouteRequest,
        replicas: &[Replica],
    ) -> Result<RouteChoice, PluginError>;
}

/// The healthy replicas, or the error every policy returns when there are none.
pub fn healthy(replicas: &[Replica]) -> Result<Vec<&Replica>, PluginError> {
    let healthy: Vec<&Replica> = replicas.iter().filter(|r| r.healthy).collect();
    if healthy.is_empty() {
        return Err(PluginError::InvalidInput(format!(
            "no healthy replica to route to ({} replicas, none healthy)",
            replicas.len()
        )));
    }
    Ok(healthy)
}
