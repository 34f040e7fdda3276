//! Engine benchmark (docs/performance.md, "## Engine").
//!
//! ```text
//! cargo run -p k3-engine --release --example engine_bench            # full
//! cargo run -p k3-engine --release --example engine_bench -- --quick # smaller, for CI smoke
//! K3_BENCH_EXECUTOR=models/k3-mini cargo run -p k3-engine --release --example engine_bench -- --no-pools
//! ```
//!
//! 1. Multi-turn conversations sharing one system prompt, run through the threaded engine with
//!    the prefix cache on and off: mean TTFT, total time, prefix hits, and the bytes the cache
//!    holds as KDA checkpoints vs MLA KV pages.
//! 2. Unified pool vs two fixed pools on mixes that starve one fixed pool: how many requests are
//!    admitted (served concurrently) before the first one is refused for lack of memory.
//!
//! Everything is generic over `Box<dyn Executor>`; [`make_executor`] is the hook to benchmark the
//! real k3-mini model instead of the toy one.

use k3_engine::testing::{ToyConfig, ToyExecutor};
use k3_engine::{Engine, EngineConfig, EngineCore, PoolMode, Request, SamplingParams};
use k3_model::Executor;
use std::time::{Duration, Instant};

/// HOOK: the executor to benchmark. `K3_BENCH_EXECUTOR=toy` (default) or a model directory such
/// as `K3_BENCH_EXECUTOR=models/k3-mini` (the real model on the CPU backend, 16-token pages).
/// Another backend plugs in here; nothing else in this file depends on the model.
fn make_executor(arena_bytes: usize) -> Box<dyn Executor> {
    match std::env::var("K3_BENCH_EXECUTOR").as_deref() {
        Ok("toy") | Err(_) => Box::new(
            ToyExecutor::new(ToyConfig {
                vocab: 1024,
                page_tokens: 16,
                row_bytes: 64,
                // Like K3, one state block costs as much as many tokens of KV (here 256).
                state_bytes: 16 * 1024,
                arena_bytes,
            })
            .expect("toy executor"),
        ),
        Ok(dir) => {
            let model = k3_model::Model::load_dir(
                std::path::Path::new(dir),
                k3_backend_cpu::CpuBackend::new(),
            )
            .unwrap_or_else(|e| panic!("K3_BENCH_EXECUTOR={dir}: {e}"));
            Box::new(k3_model::ModelExecutor::new(model, 16, arena_bytes).expect("model executor"))
        }
    }
}

fn lcg(seed: &mut u64, vocab: u32) -> u32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) as u32) % vocab
}

fn sampling(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens as u32),
        ignore_eos: true,
        ..Default::default()
    }
}

struct Shape {
    conversations: usize,
    turns: usize,
    system: usize,
    user: usize,
    generate: usize,
}

struct MultiTurn {
    total: Duration,
    mean_ttft: Duration,
    first_turn_ttft: Duration,
    later_turn_ttft: Duration,
    prefix_hit_tokens: u64,
    prompt_tokens: u64,
    checkpoint_hits: u64,
    replayed: u64,
    checkpoint_bytes: usize,
    kv_bytes: usize,
    outputs: Vec<Vec<u32>>,
}

fn multi_turn(shape: &Shape, cache: bool) -> MultiTurn {
    let exec = make_executor(64 << 20);
    let layout = exec.layout();
    let vocab = exec.vocab_size() as u32;
    let cfg = EngineConfig {
        prefix_cache: cache,
        max_context: 1 << 16,
        ..EngineConfig::default()
    };
    let engine = Engine::start(exec, cfg).expect("engine");
    let mut seed = 7u64;
    let system: Vec<u32> = (0..shape.system).map(|_| lcg(&mut seed, vocab)).collect();
    let start = Instant::now();
    let threads: Vec<_> = (0..shape.conversations)
        .map(|c| {
            let engine = engine.clone();
            let system = system.clone();
            let (turns, user, generate) = (shape.turns, shape.user, shape.generate);
            std::thread::spawn(move || {
                let mut seed = 1000 + c as u64;
                let mut history = system;
                let mut ttfts = Vec::new();
                let mut outputs = Vec::new();
                for t in 0..turns {
                    history.extend((0..user).map(|_| lcg(&mut seed, vocab)));
                    let id = (c * 1000 + t) as u64;
                    let sent = Instant::now();
                    let mut stream = engine
                        .submit(Request::new(id, history.clone(), sampling(generate)))
                        .expect("submit");
                    let mut out = Vec::new();
                    while let Some(ev) = stream.blocking_next() {
                        let ev = ev.expect("event");
                        if out.is_empty() {
                            ttfts.push(sent.elapsed());
                        }
                        out.push(ev.token);
                    }
                    history.extend(&out);
                    outputs.push(out);
                }
                (ttfts, outputs)
            })
        })
        .collect();
    let mut first = Vec::new();
    let mut later = Vec::new();
    let mut outputs = Vec::new();
    for th in threads {
        let (ttfts, outs) = th.join().expect("conversation thread");
        first.push(ttfts[0]);
        later.extend(&ttfts[1..]);
        outputs.extend(outs);
    }
    let total = start.elapsed();
    // Metrics are published after the loop turn that sent the last event.
    std::thread::sleep(Duration::from_millis(20));
    let m = engine.metrics();
    engine.shutdown(Duration::from_secs(5));
    let mean = |v: &[Duration]| v.iter().sum::<Duration>() / v.len().max(1) as u32;
    let all: Vec<Duration> = first.iter().chain(&later).copied().collect();
    MultiTurn {
        total,
        mean_ttft: mean(&all),
        first_turn_ttft: mean(&first),
        later_turn_ttft: mean(&later),
        prefix_hit_tokens: m.prefix_hit_tokens,
        prompt_tokens: m.prompt_tokens,
        checkpoint_hits: m.checkpoint_hits,
        replayed: m.replayed_tokens,
        checkpoint_bytes: m.cache_checkpoints * layout.state_block_bytes,
        kv_bytes: m.cache_kv_pages * layout.kv_page_bytes,
        outputs,
    }
}

/// Submit `prompt_len`-token requests one at a time, each kept running (long generation),
/// until one cannot be admitted. Returns how many were admitted.
fn admitted_before_refusal(mode: PoolMode, prompt_len: usize, arena: usize) -> usize {
    let mut exec = make_executor(arena);
    let cfg = EngineConfig {
        pool_mode: mode,
        prefix_cache: false,
        max_running: 100_000,
        max_waiting: 100_000,
        max_context: 1 << 20,
        step_tokens: 1 << 20,
        max_step_tokens: 1 << 20,
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg).expect("core");
    let vocab = exec.vocab_size() as u32;
    let mut seed = 99u64;
    let mut streams = Vec::new();
    for id in 0.. {
        let prompt: Vec<u32> = (0..prompt_len).map(|_| lcg(&mut seed, vocab)).collect();
        match core.submit(Request::new(id, prompt, sampling(1 << 19))) {
            Ok(rx) => streams.push(rx),
            Err(_) => return id as usize,
        }
        // Give it a few steps to be admitted (its prompt may need eviction or a later step).
        for _ in 0..8 {
            core.step(exec.as_mut());
            if core.metrics().waiting == 0 {
                break;
            }
        }
        let m = core.metrics();
        if m.waiting > 0 || m.failed > 0 || m.preemptions > 0 {
            return id as usize;
        }
    }
    unreachable!()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let shape = if quick {
        Shape {
            conversations: 4,
            turns: 3,
            system: 256,
            user: 32,
            generate: 16,
        }
    } else {
        Shape {
            conversations: 8,
            turns: 4,
            system: 1024,
            user: 64,
            generate: 32,
        }
    };
    println!(
        "## Engine benchmark ({} conversations x {} turns, system prompt {} tokens, +{} user tokens and {} generated per turn)\n",
        shape.conversations, shape.turns, shape.system, shape.user, shape.generate
    );
    let on = multi_turn(&shape, true);
    let off = multi_turn(&shape, false);
    assert_eq!(
        on.outputs, off.outputs,
        "greedy outputs must not depend on the prefix cache"
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "| prefix cache | total (ms) | mean TTFT (ms) | TTFT turn 1 (ms) | TTFT later turns (ms) | prefix hit tokens | checkpoint hits | replayed tokens |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (name, r) in [("on", &on), ("off", &off)] {
        println!(
            "| {name} | {:.1} | {:.2} | {:.2} | {:.2} | {} / {} | {} | {} |",
            ms(r.total),
            ms(r.mean_ttft),
            ms(r.first_turn_ttft),
            ms(r.later_turn_ttft),
            r.prefix_hit_tokens,
            r.prompt_tokens,
            r.checkpoint_hits,
            r.replayed
        );
    }
    println!(
        "\nratio off/on: total {:.2}x, mean TTFT {:.2}x, later-turn TTFT {:.2}x",
        ms(off.total) / ms(on.total),
        ms(off.mean_ttft) / ms(on.mean_ttft),
        ms(off.later_turn_ttft) / ms(on.later_turn_ttft)
    );
    println!(
        "cache held at the end: checkpoints {} KiB vs KV {} KiB ({:.2} checkpoint bytes per KV byte)\n",
        on.checkpoint_bytes / 1024,
        on.kv_bytes / 1024,
        on.checkpoint_bytes as f64 / on.kv_bytes.max(1) as f64
    );

    if std::env::args().any(|a| a == "--no-pools") {
        return;
    }
    // Arena in state blocks, so the comparison means the same for any executor's block sizes.
    let state_bytes = make_executor(1 << 20).layout().state_block_bytes;
    let arena = state_bytes * if quick { 256 } else { 512 };
    let split = PoolMode::Split {
        state_fraction: 0.5,
    };
    println!(
        "Requests admitted before the first refusal ({} MiB arena = {} state blocks, fixed pools split 50/50):\n",
        arena >> 20,
        arena / state_bytes
    );
    println!("| mix | unified pool | two fixed pools |");
    println!("|---|---|---|");
    for (name, len) in [
        ("short prompts (32 tokens, state-heavy)", 32),
        ("long prompts (2048 tokens, KV-heavy)", 2048),
    ] {
        println!(
            "| {name} | {} | {} |",
            admitted_before_refusal(PoolMode::Unified, len, arena),
            admitted_before_refusal(split, len, arena)
        );
    }
}
