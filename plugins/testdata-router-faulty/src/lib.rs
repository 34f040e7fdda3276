//! TEST ONLY. A router that picks the first healthy replica, except that the request's `model`
//! picks a fault: `trap` panics (a trap), `loop` spins forever (a timeout), `bomb` allocates
//! until the memory cap (a memory overrun), `error` returns a plugin error. The host must
//! contain each to the call that hit it and serve the next call on a fresh instance. Through a
//! real server the model name must be the served one, so `max-tokens` 13 also traps and 17 also
//! loops (tests/e2e/test_router.py).

use k3_plugin_sdk::router::healthy;
use k3_plugin_sdk::{Info, Plugin, PluginError, Replica, RouteChoice, RouteRequest, Router};

pub struct FaultyRouter {
    /// Calls served by this instance: the reason reports it, so the host's tests can tell a
    /// fresh instance from a reused one.
    calls: u64,
}

impl Plugin for FaultyRouter {
    const INFO: Info = Info::new(
        "testdata-router-faulty",
        "0.0.1",
        "test router that misbehaves on command",
    );
}

impl Router for FaultyRouter {
    fn new() -> Self {
        FaultyRouter { calls: 0 }
    }

    fn choose(
        &mut self,
        request: &RouteRequest,
        replicas: &[Replica],
    ) -> Result<RouteChoice, PluginError> {
        self.calls += 1;
        let fault = match request.max_tokens {
            13 => "trap",
            17 => "loop",
            _ => request.model.as_str(),
        };
        match fault {
            "trap" => panic!("deliberate trap requested by the test"),
            "loop" => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "bomb" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "error" => return Err(PluginError::Internal("deliberate plugin error".into())),
            _ => {}
        }
        let first = healthy(replicas)?[0];
        Ok(RouteChoice {
            replica_id: first.id.clone(),
            reason: format!("first healthy; call {} of this instance", self.calls),
        })
    }
}

k3_plugin_sdk::export_router!(FaultyRouter);
