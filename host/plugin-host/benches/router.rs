//! The router stage's per-request cost (docs/plugins.md, "The router stage"):
//!   cargo bench -p k3-plugin-host --bench router
//! One `Router::choose` on the live instance with 3 replicas and a 64-block prompt, for each
//! shipped policy.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use k3_plugin_host::*;

fn replica(id: &str, queued: u32, running: u32, hit: u32) -> ReplicaView {
    ReplicaView {
        id: id.into(),
        healthy: true,
        queued,
        running,
        kv_free_blocks: 3000,
        kv_total_blocks: 4096,
        prefix_hit_blocks: hit,
    }
}

fn choose(c: &mut Criterion) {
    let cache = std::env::temp_dir().join("k3-plugin-bench-cache");
    let request = RouteRequest {
        request_id: "chatcmpl-0123456789abcdef".into(),
        model: "k3-mini".into(),
        prompt_tokens: 64 * 64 + 17,
        max_tokens: 1024,
        prefix_block_hashes: (0..64u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect(),
        priority: 0,
    };
    let replicas = [
        replica("replica-0", 2, 6, 40),
        replica("replica-1", 0, 5, 0),
        replica("replica-2", 1, 7, 64),
    ];
    let mut g = c.benchmark_group("router_choose_3x64");
    for file in [
        "router_kv_aware.wasm",
        "router_least_load.wasm",
        "router_round_robin.wasm",
    ] {
        let host = PluginHost::new(PluginHostConfig::default().with_cache_dir(&cache))
            .expect("plugin host");
        let wasm = std::fs::read(default_plugin_dir().join(file))
            .expect("router plugins (run scripts/build-plugins)");
        host.install(Stage::Router, &wasm).expect("router plugin");
        let router = host.router();
        g.bench_function(file.trim_end_matches(".wasm"), |b| {
            b.iter(|| black_box(router.choose(&request, &replicas).unwrap()))
        });
    }
    g.finish();
}

criterion_group!(benches, choose);
criterion_main!(benches);
