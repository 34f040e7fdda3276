//! The seams the binary fills: the routing policy (a wasm plugin there) and prompt tokenization,
//! plus the built-in least-load policy the router falls back on.

use k3_plugin_host::{ReplicaView, RouteChoice, RouteRequest};

/// Chooses a replica for a request. Called off the async threads, under
/// [`RouterConfig::policy_timeout`](crate::RouterConfig::policy_timeout). `replicas` holds only
/// healthy replicas the request has not been tried on, so any of them may be named.
pub trait RoutePolicy: Send + Sync {
    /// The replica to send `req` to (by [`ReplicaView::id`]) and why. An error, or a name not in
    /// `replicas`, makes the router use [`LeastLoad`] and report it.
    fn choose(&self, req: &RouteRequest, replicas: &[ReplicaView]) -> Result<RouteChoice, String>;
    /// Shown in `/health`, logs and the `policy` label of `/metrics`.
    fn name(&self) -> String;
}

/// The routes whose requests are routed by the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiRoute {
    ChatCompletions,
    Completions,
    Messages,
    Responses,
}

impl ApiRoute {
    pub fn path(self) -> &'static str {
        match self {
            ApiRoute::ChatCompletions => "/v1/chat/completions",
            ApiRoute::Completions => "/v1/completions",
            ApiRoute::Messages => "/v1/messages",
            ApiRoute::Responses => "/v1/responses",
        }
    }
}

/// A request's prompt as token ids, the way a replica would tokenize it (tokenizer and chat
/// template of the served model). Called off the async threads.
pub trait PromptTokens: Send + Sync {
    /// `None` when the prompt cannot be known (the request is routed without prefix
    /// information).
    fn tokens(&self, route: ApiRoute, body: &serde_json::Value) -> Option<Vec<u32>>;
}

/// Knows no prompt: every request is routed on load alone.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPromptTokens;

impl PromptTokens for NoPromptTokens {
    fn tokens(&self, _: ApiRoute, _: &serde_json::Value) -> Option<Vec<u32>> {
        None
    }
}

/// The built-in policy: fewest running + waiting requests; ties go to the larger usable prefix
/// hit, then to more free KV blocks, then to the earlier replica.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeastLoad;

impl RoutePolicy for LeastLoad {
    fn choose(&self, _: &RouteRequest, replicas: &[ReplicaView]) -> Result<RouteChoice, String> {
        least_load(replicas).ok_or_else(|| "no replica to choose from".to_string())
    }

    fn name(&self) -> String {
        "least-load (built-in)".into()
    }
}

/// [`LeastLoad`]'s choice among `replicas`, `None` when there are none.
pub fn least_load(replicas: &[ReplicaView]) -> Option<RouteChoice> {
    let best = replicas.iter().enumerate().min_by_key(|(i, r)| {
        (
            r.queued.saturating_add(r.running),
            std::cmp::Reverse(r.prefix_hit_blocks),
            std::cmp::Reverse(r.kv_free_blocks),
            *i,
        )
    })?;
    let r = best.1;
    Some(RouteChoice {
        replica_id: r.id.clone(),
        reason: format!(
            "least-load: {} running, {} queued, {} usable prefix blocks",
            r.running, r.queued, r.prefix_hit_blocks
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(id: &str, running: u32, queued: u32, hit: u32) -> ReplicaView {
        ReplicaView {
            id: id.into(),
            healthy: true,
            running,
            queued,
            prefix_hit_blocks: hit,
            ..ReplicaView::default()
        }
    }

    #[test]
    fn least_load_weighs_load_then_hit() {
        assert!(least_load(&[]).is_none());
        let r = [view("a", 2, 1, 9), view("b", 1, 1, 0), view("c", 1, 1, 3)];
        assert_eq!(least_load(&r).unwrap().replica_id, "c");
        let r = [view("a", 0, 0, 0), view("b", 0, 0, 0)];
        assert_eq!(least_load(&r).unwrap().replica_id, "a");
    }
}
