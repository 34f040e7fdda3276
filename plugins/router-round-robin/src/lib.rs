//! Router policy `router-round-robin`: cycles over the healthy replicas in id order. The
//! instance remembers the id it chose last and picks the next healthy id after it (wrapping),
//! so replicas joining, leaving or turning unhealthy never make it skip or repeat the others.
//! Ignores load and the prefix cache. See `docs/plugins.md`, "The router stage".

use k3_plugin_sdk::router::healthy;
use k3_plugin_sdk::{Info, Plugin, PluginError, Replica, RouteChoice, RouteRequest, Router};

/// The cursor: the id chosen last (`None` before the first call).
#[derive(Debug, Default)]
pub struct RoundRobin {
    last: Option<String>,
}

impl Plugin for RoundRobin {
    const INFO: Info = Info::new(
        "router-round-robin",
        env!("CARGO_PKG_VERSION"),
        "cycles over the healthy replicas in id order (state kept in the instance)",
    );

    fn self_test() -> Result<(), String> {
        let replicas = [replica("b", true), replica("a", true), replica("c", false)];
        let mut rr = RoundRobin::default();
        let picks: Vec<String> = (0..3)
            .map(|_| rr.choose(&RouteRequest::default(), &replicas))
            .map(|c| c.map(|c| c.replica_id).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        if picks == ["a", "b", "a"] {
            Ok(())
        } else {
            Err(format!("expected a, b, a; got {picks:?}"))
        }
    }
}

impl Router for RoundRobin {
    fn new() -> Self {
        RoundRobin::default()
    }

    fn choose(
        &mut self,
        _request: &RouteRequest,
        replicas: &[Replica],
    ) -> Result<RouteChoice, PluginError> {
        let mut ids: Vec<&str> = healthy(replicas)?.iter().map(|r| r.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        let next = match &self.last {
            Some(last) => ids
                .iter()
                .find(|id| **id > last.as_str())
                .unwrap_or(&ids[0]),
            None => &ids[0],
        };
        let position = ids.iter().position(|id| id == next).unwrap_or(0);
        let choice = RouteChoice {
            replica_id: next.to_string(),
            reason: format!("round robin: {} of {} healthy", position + 1, ids.len()),
        };
        self.last = Some(choice.replica_id.clone());
        Ok(choice)
    }
}

fn replica(id: &str, healthy: bool) -> Replica {
    Replica {
        id: id.into(),
        healthy,
        kv_total_blocks: 100,
        kv_free_blocks: 100,
        ..Replica::default()
    }
}

k3_plugin_sdk::export_router!(RoundRobin);

#[cfg(test)]
mod tests {
    use super::*;

    fn picks(rr: &mut RoundRobin, replicas: &[Replica], n: usize) -> Vec<String> {
        (0..n)
            .map(|_| {
                rr.choose(&RouteRequest::default(), replicas)
                    .unwrap()
                    .replica_id
            })
            .collect()
    }

    #[test]
    fn cycles_in_id_order() {
        let r = [replica("c", true), replica("a", true), replica("b", true)];
        let mut rr = RoundRobin::default();
        assert_eq!(picks(&mut rr, &r, 5), ["a", "b", "c", "a", "b"]);
    }

    #[test]
    fn skips_unhealthy_and_survives_membership_changes() {
        let mut rr = RoundRobin::default();
        let r = [replica("a", true), replica("b", false), replica("c", true)];
        assert_eq!(picks(&mut rr, &r, 3), ["a", "c", "a"]);
        // b recovers: it is next after a.
        let r = [replica("a", true), replica("b", true), replica("c", true)];
        assert_eq!(picks(&mut rr, &r, 2), ["b", "c"]);
        // c (the last pick) disappears: the cursor wraps to a.
        let r = [replica("a", true), replica("b", true)];
        assert_eq!(picks(&mut rr, &r, 2), ["a", "b"]);
    }

    #[test]
    fn no_healthy_replica_is_invalid_input() {
        let mut rr = RoundRobin::default();
        let e = rr
            .choose(&RouteRequest::default(), &[replica("a", false)])
            .unwrap_err();
        assert!(matches!(e, PluginError::InvalidInput(m) if m.contains("no healthy")));
    }

    #[test]
    fn self_test_passes() {
        RoundRobin::self_test().unwrap();
    }
}
