//! Router policy `router-least-load`: among the healthy replicas, the one with the fewest
//! requests (`queued + running`); ties go to the one with the most free KV blocks, then to the
//! smallest id, so the choice is deterministic. Ignores the prefix cache. See
//! `docs/plugins.md`, "The router stage".

use k3_plugin_sdk::router::healthy;
use k3_plugin_sdk::{Info, Plugin, PluginError, Replica, RouteChoice, RouteRequest, Router};

pub struct LeastLoad;

impl Plugin for LeastLoad {
    const INFO: Info = Info::new(
        "router-least-load",
        env!("CARGO_PKG_VERSION"),
        "routes to the healthy replica with the fewest queued + running requests, then the most free KV blocks, then the smallest id",
    );

    fn self_test() -> Result<(), String> {
        let replicas = [
            replica("b", true, 1, 0, 10),
            replica("a", true, 0, 1, 10),
            replica("c", false, 0, 0, 99),
        ];
        match LeastLoad.choose(&RouteRequest::default(), &replicas) {
            Ok(c) if c.replica_id == "a" => Ok(()),
            other => Err(format!("expected replica a, got {other:?}")),
        }
    }
}

/// The least-loaded replica of `replicas` (healthy or not: the caller filters).
pub fn least_loaded<'a>(replicas: &[&'a Replica]) -> Option<&'a Replica> {
    replicas.iter().copied().min_by(|a, b| {
        a.load()
            .cmp(&b.load())
            .then(b.kv_free_blocks.cmp(&a.kv_free_blocks))
            .then(a.id.cmp(&b.id))
    })
}

impl Router for LeastLoad {
    fn new() -> Self {
        LeastLoad
    }

    fn choose(
        &mut self,
        _request: &RouteRequest,
        replicas: &[Replica],
    ) -> Result<RouteChoice, PluginError> {
        let healthy = healthy(replicas)?;
        let best = least_loaded(&healthy)
            .ok_or_else(|| PluginError::Internal("no healthy replica left to compare".into()))?;
        Ok(RouteChoice {
            replica_id: best.id.clone(),
            reason: format!(
                "least load {} (queued {}, running {}), {} free blocks",
                best.load(),
                best.queued,
                best.running,
                best.kv_free_blocks
            ),
        })
    }
}

fn replica(id: &str, healthy: bool, queued: u32, running: u32, free: u32) -> Replica {
    Replica {
        id: id.into(),
        healthy,
        queued,
        running,
        kv_free_blocks: free,
        kv_total_blocks: 100,
        prefix_hit_blocks: 0,
    }
}

k3_plugin_sdk::export_router!(LeastLoad);

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(replicas: &[Replica]) -> Result<String, PluginError> {
        LeastLoad
            .choose(&RouteRequest::default(), replicas)
            .map(|c| c.replica_id)
    }

    #[test]
    fn fewest_requests_win() {
        let r = [
            replica("a", true, 3, 1, 50),
            replica("b", true, 0, 2, 10),
            replica("c", true, 1, 2, 90),
        ];
        assert_eq!(pick(&r).unwrap(), "b");
    }

    #[test]
    fn ties_go_to_most_free_blocks_then_smallest_id() {
        let r = [
            replica("c", true, 1, 1, 40),
            replica("b", true, 2, 0, 60),
            replica("a", true, 0, 2, 60),
        ];
        assert_eq!(pick(&r).unwrap(), "a");
        let r = [replica("b", true, 1, 0, 10), replica("a", true, 0, 1, 30)];
        assert_eq!(pick(&r).unwrap(), "a");
    }

    #[test]
    fn unhealthy_replicas_are_skipped() {
        let r = [replica("a", false, 0, 0, 99), replica("b", true, 9, 9, 1)];
        assert_eq!(pick(&r).unwrap(), "b");
    }

    #[test]
    fn no_healthy_replica_is_invalid_input() {
        let r = [replica("a", false, 0, 0, 99)];
        assert!(matches!(pick(&r), Err(PluginError::InvalidInput(m)) if m.contains("no healthy")));
        assert!(matches!(pick(&[]), Err(PluginError::InvalidInput(_))));
    }

    #[test]
    fn self_test_passes() {
        LeastLoad::self_test().unwrap();
    }
}
