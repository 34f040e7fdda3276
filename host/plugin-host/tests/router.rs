//! The router stage through the host with the real policy components (built by build.rs /
//! scripts/build-plugins): the three shipped policies, state kept across calls, faults
//! contained to their call, and hot swaps taking effect on the next call.

use std::time::{Duration, Instant};

use k3_plugin_host::*;

fn config() -> PluginHostConfig {
    PluginHostConfig {
        max_instances: 32,
        call_timeout: Duration::from_millis(100),
        // Policies need little; a small cap lets the memory hog hit it well within the time
        // limit on a busy machine (the epoch deadline is wall-clock time).
        memory_limit: 16 << 20,
        ..PluginHostConfig::default()
    }
    .with_cache_dir(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("k3-plugin-cache"))
}

fn wasm(file: &str) -> Vec<u8> {
    let path = default_plugin_dir().join(file);
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} — run scripts/build-plugins", path.display()))
}

fn host_with(file: &str) -> (PluginHost, VersionInfo) {
    let host = PluginHost::new(config()).unwrap();
    let info = host.install(Stage::Router, &wasm(file)).unwrap();
    (host, info)
}

fn request(blocks: u64) -> RouteRequest {
    RouteRequest {
        request_id: "req-1".into(),
        model: "k3".into(),
        prompt_tokens: (blocks * 64 + 10) as u32,
        max_tokens: 256,
        prefix_block_hashes: (1..=blocks).map(|b| b.wrapping_mul(0x9e37_79b9)).collect(),
        priority: 0,
    }
}

fn replica(id: &str, queued: u32, running: u32, hit: u32) -> ReplicaView {
    ReplicaView {
        id: id.into(),
        healthy: true,
        queued,
        running,
        kv_free_blocks: 1000,
        kv_total_blocks: 1000,
        prefix_hit_blocks: hit,
    }
}

fn unhealthy(mut r: ReplicaView) -> ReplicaView {
    r.healthy = false;
    r
}

fn pick(router: &Router, req: &RouteRequest, replicas: &[ReplicaView]) -> String {
    router.choose(req, replicas).unwrap().replica_id
}

fn stats(host: &PluginHost, id: u64) -> VersionStats {
    host.list().into_iter().find(|v| v.id == id).unwrap().stats
}

#[test]
fn the_default_router_file_is_the_kv_aware_policy() {
    let (host, info) = host_with(DEFAULT_ROUTER_PLUGIN);
    assert_eq!(info.metadata.name, "router-kv-aware");
    assert_eq!(info.metadata.stage, Stage::Router);
    assert!(info.metadata.wit_version.starts_with("0.3."));
    assert_eq!(
        host.router().active_policy().as_deref(),
        Some(format!("router-kv-aware@{}", info.metadata.version).as_str())
    );
    // The replica defaults stay without a router: `serve` loads exactly these four.
    assert!(DEFAULT_PLUGINS.iter().all(|(s, _)| *s != Stage::Router));
}

#[test]
fn kv_aware_trades_the_usable_hit_against_load() {
    let (host, _) = host_with("router_kv_aware.wasm");
    let router = host.router();
    let req = request(16);

    // The usable hit wins when loads are close.
    let warm = [
        replica("a", 0, 1, 0),
        replica("b", 1, 1, 12),
        replica("c", 0, 1, 4),
    ];
    let c = router.choose(&req, &warm).unwrap();
    assert_eq!(c.replica_id, "b");
    assert!(
        c.reason.starts_with("hit 12/16 blocks, load 2"),
        "{}",
        c.reason
    );

    // A load gap of 7 outweighs a hit as long as the average prompt (worth 4 requests).
    let piled = [replica("a", 0, 0, 0), replica("b", 6, 1, 16)];
    assert_eq!(pick(&router, &req, &piled), "a");

    // Cold (no hit anywhere): the least-loaded replica, ties by free blocks then id.
    let mut cold = [
        replica("a", 2, 2, 0),
        replica("b", 1, 1, 0),
        replica("c", 0, 2, 0),
    ];
    cold[2].kv_free_blocks = 10;
    let c = router.choose(&req, &cold).unwrap();
    assert_eq!(c.replica_id, "b", "{}", c.reason);
    assert!(c.reason.starts_with("cold"), "{}", c.reason);

    // An unhealthy replica's hit counts for nothing.
    let down = [unhealthy(replica("a", 0, 0, 16)), replica("b", 3, 0, 0)];
    assert_eq!(pick(&router, &req, &down), "b");
}

#[test]
fn least_load_picks_fewest_requests_then_free_blocks_then_id() {
    let (host, _) = host_with("router_least_load.wasm");
    let router = host.router();
    let req = request(8);
    let r = [
        replica("a", 2, 1, 8),
        replica("b", 0, 2, 0),
        replica("c", 1, 3, 0),
    ];
    assert_eq!(pick(&router, &req, &r), "b");
    let mut r = [
        replica("b", 1, 0, 0),
        replica("a", 0, 1, 0),
        replica("c", 1, 0, 0),
    ];
    r[2].kv_free_blocks = 2000;
    assert_eq!(pick(&router, &req, &r), "c");
    r[2].kv_free_blocks = 1000;
    assert_eq!(pick(&router, &req, &r), "a");
    let r = [unhealthy(replica("a", 0, 0, 0)), replica("b", 5, 5, 0)];
    assert_eq!(pick(&router, &req, &r), "b");
}

#[test]
fn round_robin_keeps_its_cursor_across_calls_and_skips_unhealthy() {
    let (host, info) = host_with("router_round_robin.wasm");
    let router = host.router();
    let req = request(4);
    let all = [
        replica("c", 0, 0, 0),
        replica("a", 0, 0, 0),
        replica("b", 0, 0, 0),
    ];
    let picks: Vec<String> = (0..5).map(|_| pick(&router, &req, &all)).collect();
    assert_eq!(picks, ["a", "b", "c", "a", "b"]);
    // `b` goes down: the cursor (at b) moves on to c, then wraps past b.
    let some = [
        replica("a", 0, 0, 0),
        unhealthy(replica("b", 0, 0, 0)),
        replica("c", 0, 0, 0),
    ];
    let picks: Vec<String> = (0..3).map(|_| pick(&router, &req, &some)).collect();
    assert_eq!(picks, ["c", "a", "c"]);
    // One live instance served all of it; a clone of the router shares it.
    assert_eq!(pick(&host.router(), &req, &all), "a");
    let s = stats(&host, info.id);
    assert_eq!((s.sessions, s.faults, s.errors), (1, 0, 0), "{s:?}");
}

#[test]
fn round_robin_shares_its_state_between_threads() {
    let (host, _) = host_with("router_round_robin.wasm");
    let all = [
        replica("a", 0, 0, 0),
        replica("b", 0, 0, 0),
        replica("c", 0, 0, 0),
    ];
    let counts = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let router = host.router();
                let all = &all;
                s.spawn(move || {
                    (0..30)
                        .map(|_| pick(&router, &request(2), all))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut counts = std::collections::BTreeMap::<String, u32>::new();
        for h in handles {
            for id in h.join().unwrap() {
                *counts.entry(id).or_default() += 1;
            }
        }
        counts
    });
    // 120 calls, serialised on one cursor: exactly 40 each.
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), [40, 40, 40]);
}

#[test]
fn no_healthy_replica_is_the_policys_error() {
    for file in [
        "router_kv_aware.wasm",
        "router_least_load.wasm",
        "router_round_robin.wasm",
    ] {
        let (host, info) = host_with(file);
        let router = host.router();
        let down = [unhealthy(replica("a", 0, 0, 0))];
        for replicas in [&down[..], &[]] {
            let e = router.choose(&request(4), replicas).unwrap_err();
            assert!(
                matches!(&e, PluginError::Guest { error: GuestError::InvalidInput(m), .. }
                    if m.contains("no healthy replica")),
                "{file}: {e}"
            );
            assert!(!e.is_fault());
        }
        // The next call is served normally.
        assert_eq!(pick(&router, &request(4), &[replica("b", 0, 0, 0)]), "b");
        let s = stats(&host, info.id);
        assert_eq!((s.errors, s.faults), (2, 0), "{file}: {s:?}");
    }
}

#[test]
fn faults_fail_one_call_and_the_next_call_gets_a_fresh_instance() {
    let (host, info) = host_with("testdata_router_faulty.wasm");
    let router = host.router();
    let replicas = [unhealthy(replica("a", 0, 0, 0)), replica("b", 0, 0, 0)];
    let ok = |model: &str| RouteRequest {
        model: model.into(),
        ..request(4)
    };
    let c = router.choose(&ok("k3"), &replicas).unwrap();
    assert_eq!(
        (c.replica_id.as_str(), c.reason.as_str()),
        ("b", "first healthy; call 1 of this instance")
    );
    let c = router.choose(&ok("k3"), &replicas).unwrap();
    assert!(
        c.reason.ends_with("call 2 of this instance"),
        "{}",
        c.reason
    );

    // A trap: only that call fails; the next one runs on a new instance.
    let e = router.choose(&ok("trap"), &replicas).unwrap_err();
    assert!(
        matches!(&e, PluginError::Trap { detail, .. } if detail.contains("deliberate trap")),
        "{e}"
    );
    let c = router.choose(&ok("k3"), &replicas).unwrap();
    assert!(
        c.reason.ends_with("call 1 of this instance"),
        "{}",
        c.reason
    );

    // An endless loop is stopped at the time limit.
    let t = Instant::now();
    let e = router.choose(&ok("loop"), &replicas).unwrap_err();
    let took = t.elapsed();
    assert!(
        matches!(e, PluginError::Timeout { limit_ms: 100, .. }),
        "{e}"
    );
    assert!(took < Duration::from_secs(2), "stopped after {took:?}");
    assert_eq!(pick(&router, &ok("k3"), &replicas), "b");

    // A memory hog hits the store's cap.
    let e = router.choose(&ok("bomb"), &replicas).unwrap_err();
    assert!(matches!(e, PluginError::MemoryLimit { .. }), "{e}");
    assert!(e.is_fault() && e.is_resource_limit());
    assert_eq!(pick(&router, &ok("k3"), &replicas), "b");

    // A plugin error is an error, not a fault; the instance is replaced all the same.
    let e = router.choose(&ok("error"), &replicas).unwrap_err();
    assert!(
        matches!(&e, PluginError::Guest { error: GuestError::Internal(m), .. } if m.contains("deliberate")),
        "{e}"
    );
    let c = router.choose(&ok("k3"), &replicas).unwrap();
    assert!(
        c.reason.ends_with("call 1 of this instance"),
        "{}",
        c.reason
    );

    let s = stats(&host, info.id);
    assert_eq!((s.faults, s.errors), (3, 1), "{s:?}");
    // The first instance, then one after each of the four failures.
    assert_eq!(s.sessions, 5, "{s:?}");
}

#[test]
fn a_hot_swap_takes_effect_on_the_next_call() {
    let (host, rr) = host_with("router_round_robin.wasm");
    let router = host.router();
    let req = request(4);
    // `a` is the least loaded; round robin ignores that.
    let r = [
        replica("a", 0, 0, 0),
        replica("b", 5, 0, 0),
        replica("c", 9, 0, 0),
    ];
    assert_eq!(pick(&router, &req, &r), "a");
    assert_eq!(pick(&router, &req, &r), "b");

    let ll = host
        .install(Stage::Router, &wasm("router_least_load.wasm"))
        .unwrap();
    assert_ne!(ll.id, rr.id);
    for _ in 0..3 {
        assert_eq!(pick(&router, &req, &r), "a");
    }

    // Rolling back brings round robin back, with a fresh cursor (its instance was dropped at
    // the swap).
    let back = host.rollback(Stage::Router).unwrap();
    assert_eq!(back.id, rr.id);
    assert_eq!(pick(&router, &req, &r), "a");
    assert_eq!(pick(&router, &req, &r), "b");
    assert_eq!(stats(&host, rr.id).sessions, 2);
}

#[test]
fn without_an_active_router_choose_says_so() {
    let host = PluginHost::new(config()).unwrap();
    let e = host
        .router()
        .choose(&request(1), &[replica("a", 0, 0, 0)])
        .unwrap_err();
    assert_eq!(e, PluginError::NoActivePlugin(Stage::Router));
    assert_eq!(host.router().active_policy(), None);
}

#[test]
fn routers_and_other_stages_do_not_mix() {
    let host = PluginHost::new(config()).unwrap();
    let e = host
        .load(Stage::ToolParser, &wasm("router_least_load.wasm"))
        .unwrap_err();
    assert!(
        matches!(
            e,
            PluginError::WrongWorld {
                stage: Stage::ToolParser,
                ..
            }
        ),
        "{e}"
    );
    let e = host
        .load(Stage::Router, &wasm("testdata_faulty.wasm"))
        .unwrap_err();
    assert!(
        matches!(
            e,
            PluginError::WrongWorld {
                stage: Stage::Router,
                ..
            }
        ),
        "{e}"
    );
}

/// The cost of one `choose` on a live instance: 3 replicas, a 64-block prompt (the
/// `router` bench measures it precisely; this bounds it loosely even in a debug build).
#[test]
fn a_choice_costs_microseconds() {
    let (host, _) = host_with("router_kv_aware.wasm");
    let router = host.router();
    let req = request(64);
    let r = [
        replica("a", 2, 4, 40),
        replica("b", 0, 3, 0),
        replica("c", 1, 1, 64),
    ];
    pick(&router, &req, &r);
    let n = 2000;
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(router.choose(&req, &r).unwrap());
    }
    let per_call = t.elapsed() / n;
    println!("router_kv_aware choose, 3 replicas x 64 hashes: {per_call:?} per call");
    assert!(per_call < Duration::from_millis(1), "{per_call:?} per call");
}
