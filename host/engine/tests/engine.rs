//! Engine behaviour against a deterministic executor whose outputs depend on every KV byte and
//! every state byte. The harness is generic over `Box<dyn Executor>`: `executors()` lists what the
//! output-equality tests run against. Set `K3_ENGINE_REAL_MODEL=<model dir>` (e.g.
//! `models/k3-mini`, relative to the workspace root) to run them against the real model on the
//! CPU backend as well. (Memory-pressure tests stay on the toy: their arena sizes are in toy
//! blocks.)

use anyhow::{Context, Result, bail};
use k3_cache_events::{PrefixIndex, block_hashes};
use k3_engine::testing::{ToyConfig, ToyExecutor, reference_greedy};
use k3_engine::{
    Engine, EngineConfig, EngineCore, FinishReason, PoolMode, Request, RequestError,
    SamplingParams, SubmitError, TokenEvent,
};
use k3_model::Executor;
use proptest::prelude::*;
use std::time::Duration;

type MakeExecutor = Box<dyn Fn() -> Box<dyn Executor>>;

fn toy(arena: usize) -> Box<dyn Executor> {
    Box::new(
        ToyExecutor::new(ToyConfig {
            arena_bytes: arena,
            ..ToyConfig::default()
        })
        .unwrap(),
    )
}

/// Executors for the output-equality tests, each with room for a few dozen requests.
fn executors() -> Vec<(String, MakeExecutor)> {
    let mut v: Vec<(String, MakeExecutor)> = vec![("toy".into(), Box::new(|| toy(1 << 16)))];
    if let Ok(dir) = std::env::var("K3_ENGINE_REAL_MODEL") {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let dir = root.join(dir);
        v.push((
            format!("real model {}", dir.display()),
            Box::new(move || {
                let model = k3_model::Model::load_dir(&dir, k3_backend_cpu::CpuBackend::new())
                    .expect("load the real model");
                let exec = k3_model::ModelExecutor::with_capacity(model, 4, 24, 160, 96)
                    .expect("real executor");
                Box::new(exec) as Box<dyn Executor>
            }),
        ));
    }
    v
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens as u32),
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request::new(id, prompt, params(max_tokens))
}

fn cfg(cache: bool) -> EngineConfig {
    EngineConfig {
        prefix_cache: cache,
        checkpoint_interval: 8,
        step_tokens: 24,
        max_step_tokens: 40,
        few_running: 1,
        max_context: 4096,
        ..EngineConfig::default()
    }
}

/// Drain a receiver after the core went idle: the tokens and how it ended.
fn drain(rx: &mut k3_engine::scheduler::EventReceiver) -> Result<(Vec<TokenEvent>, FinishReason)> {
    let mut events = Vec::new();
    while let Ok(item) = rx.try_recv() {
        let ev = item.map_err(|e| anyhow::anyhow!("request failed: {e}"))?;
        let f = ev.finish.clone();
        events.push(ev);
        if let Some(f) = f {
            return Ok((events, f));
        }
    }
    bail!("request did not finish ({} events)", events.len())
}

fn tokens(events: &[TokenEvent]) -> Vec<u32> {
    events.iter().map(|e| e.token).collect()
}

/// A conversation: rounds of requests submitted together; a round may continue an earlier
/// request (its prompt + output + new tokens: multi-turn).
#[derive(Debug, Clone)]
struct Turn {
    /// Continue the conversation of this earlier request index (or start fresh).
    continues: Option<usize>,
    prompt: Vec<u32>,
    max_tokens: usize,
}

/// Run rounds of turns through one core, stepping synchronously and checking invariants after
/// every step. Returns each request's full prompt and its output.
fn run_rounds(
    exec: &mut dyn Executor,
    cfg: EngineConfig,
    rounds: &[Vec<Turn>],
) -> Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let overlap = cfg.overlap;
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg)?;
    let mut done: Vec<(Vec<u32>, Vec<u32>)> = Vec::new();
    let mut inflight = None;
    for round in rounds {
        let mut rxs = Vec::new();
        for t in round {
            let mut prompt = match t.continues {
                Some(i) => {
                    let (p, o) = &done[i];
                    [p.as_slice(), o.as_slice()].concat()
                }
                None => Vec::new(),
            };
            prompt.extend(&t.prompt);
            let id = (done.len() + rxs.len()) as u64;
            rxs.push((prompt.clone(), core.submit(req(id, prompt, t.max_tokens))?));
        }
        let mut steps = 0;
        while if overlap {
            core.step_overlapped(exec, &mut inflight)
        } else {
            core.step(exec)
        } {
            core.check_invariants()
                .map_err(anyhow::Error::msg)
                .context("after a step")?;
            steps += 1;
            if steps > 10_000 {
                bail!("no progress");
            }
        }
        for (prompt, mut rx) in rxs {
            let (events, _) = drain(&mut rx)?;
            done.push((prompt, tokens(&events)));
        }
    }
    Ok(done)
}

fn workload() -> Vec<Vec<Turn>> {
    let system: Vec<u32> = (0..29).map(|i| (i * 7 + 3) % 97).collect();
    let with = |tail: &[u32]| [system.as_slice(), tail].concat();
    vec![
        // Shared system prompt, different questions.
        vec![
            Turn {
                continues: None,
                prompt: with(&[1, 2, 3]),
                max_tokens: 6,
            },
            Turn {
                continues: None,
                prompt: with(&[4, 5]),
                max_tokens: 9,
            },
        ],
        vec![
            Turn {
                continues: None,
                prompt: with(&[1, 2, 3, 9, 9, 9, 9]),
                max_tokens: 5,
            },
            // Multi-turn continuations.
            Turn {
                continues: Some(0),
                prompt: vec![11, 12, 13],
                max_tokens: 7,
            },
            Turn {
                continues: Some(1),
                prompt: vec![21],
                max_tokens: 4,
            },
        ],
        vec![
            // Divergence mid-chunk inside the cached system prompt (branch point).
            Turn {
                continues: None,
                prompt: [&system[..19], &[50, 51, 52][..]].concat(),
                max_tokens: 5,
            },
            Turn {
                continues: Some(3),
                prompt: vec![31, 32],
                max_tokens: 6,
            },
        ],
        vec![
            // A second divergence at another offset of the same branch: restores at the branch.
            Turn {
                continues: None,
                prompt: [&system[..21], &[60][..]].concat(),
                max_tokens: 5,
            },
            Turn {
                continues: None,
                prompt: with(&[4, 5]),
                max_tokens: 9,
            },
        ],
    ]
}

#[test]
fn greedy_outputs_match_reference_cache_on_and_off() -> Result<()> {
    for (name, make) in executors() {
        let on = run_rounds(make().as_mut(), cfg(true), &workload())?;
        let off = run_rounds(make().as_mut(), cfg(false), &workload())?;
        assert_eq!(on, off, "{name}: cache on vs off");
        let serial = EngineConfig {
            overlap: false,
            ..cfg(true)
        };
        assert_eq!(
            run_rounds(make().as_mut(), serial, &workload())?,
            on,
            "{name}: overlap"
        );
        let mut reference = make();
        for (prompt, out) in &on {
            let want = reference_greedy(reference.as_mut(), prompt, out.len())?;
            assert_eq!(
                out, &want,
                "{name}: engine vs unbatched reference for prompt {prompt:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn cache_hits_checkpoints_and_branch_points() -> Result<()> {
    let mut exec = toy(1 << 16);
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg(true))?;
    let system: Vec<u32> = (0..40).map(|i| (i * 5 + 1) % 97).collect();
    let mut run = |core: &mut EngineCore,
                   id: u64,
                   prompt: Vec<u32>|
     -> Result<(Vec<TokenEvent>, FinishReason)> {
        let mut rx = core.submit(req(id, prompt, 3))?;
        while core.step(exec.as_mut()) {
            core.check_invariants().map_err(anyhow::Error::msg)?;
        }
        drain(&mut rx)
    };
    let (ev, _) = run(&mut core, 1, [&system[..], &[1, 2][..]].concat())?;
    assert_eq!(ev[0].cached_tokens, Some(0));
    // Same system prompt: restored from the deepest checkpoint at or below 40 tokens.
    let (ev, _) = run(&mut core, 2, [&system[..], &[3][..]].concat())?;
    assert_eq!(ev[0].cached_tokens, Some(40));
    let m = core.metrics();
    assert_eq!(m.checkpoint_hits, 1);
    // One checkpoint per prefill chunk: the 40-token chunk left one at 40 only. Diverging at
    // token 21: the walk matches 20 tokens (whole pages) but no checkpoint lies above them, so
    // all 20 replay, and the request leaves a branch-point checkpoint at 16.
    let (ev, _) = run(&mut core, 3, [&system[..21], &[90, 91][..]].concat())?;
    assert_eq!(ev[0].cached_tokens, Some(0));
    assert_eq!(core.metrics().replayed_tokens - m.replayed_tokens, 20);
    // Diverging at 27 now restores at the branch point (16), replays 8 and leaves one at 24.
    let m = core.metrics();
    let (ev, _) = run(&mut core, 4, [&system[..27], &[92][..]].concat())?;
    assert_eq!(ev[0].cached_tokens, Some(16));
    assert_eq!(core.metrics().replayed_tokens - m.replayed_tokens, 8);
    let (ev, _) = run(&mut core, 5, [&system[..25], &[93][..]].concat())?;
    assert_eq!(ev[0].cached_tokens, Some(24));
    Ok(())
}

/// The first event says where the time to it went: a request that waits for a free slot
/// reports that wait as queue time, and only its first event carries the timing.
#[test]
fn first_event_reports_queue_and_prefill_time() -> Result<()> {
    let mut exec = toy(1 << 16);
    let config = EngineConfig {
        max_running: 1,
        ..cfg(false)
    };
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), config)?;
    let start = std::time::Instant::now();
    let mut first = core.submit(req(1, vec![3; 30], 6))?;
    let mut second = core.submit(req(2, vec![4; 30], 2))?;
    while core.step(exec.as_mut()) {
        // Every step takes at least this long, so the wait is measurable on any host.
        std::thread::sleep(Duration::from_millis(2));
    }
    let total = start.elapsed();
    let (a, _) = drain(&mut first)?;
    let (b, _) = drain(&mut second)?;
    let ta = a[0].timing.context("first event without timing")?;
    let tb = b[0].timing.context("first event without timing")?;
    assert!(a[1..].iter().chain(&b[1..]).all(|e| e.timing.is_none()));
    // The second request waited for the first one's six tokens, a step (and a sleep) each.
    assert!(tb.queued >= Duration::from_millis(10), "{tb:?}");
    assert!(ta.queued < tb.queued, "{ta:?} vs {tb:?}");
    for t in [ta, tb] {
        assert!(t.queued + t.prefill <= total, "{t:?} over {total:?}");
    }
    Ok(())
}

/// A chat turn's next turn diverges where the conversation ended (the template's tail follows):
/// with that position as the hint, prefill leaves a checkpoint there, and the next turn restores
/// from it at once instead of replaying back to the root.
#[test]
fn a_checkpoint_hint_serves_the_next_turn() -> Result<()> {
    let system: Vec<u32> = (0..40).map(|i| (i * 5 + 1) % 97).collect();
    for (hint, want) in [(None, 0), (Some(21), 16)] {
        let mut exec = toy(1 << 16);
        let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg(true))?;
        let mut first = req(1, [&system[..], &[1, 2][..]].concat(), 3);
        first.checkpoint_hint = hint;
        let mut rx = core.submit(first)?;
        while core.step(exec.as_mut()) {
            core.check_invariants().map_err(anyhow::Error::msg)?;
        }
        drain(&mut rx)?;
        // The next turn shares the first 21 tokens (its tail differs from there).
        let mut rx = core.submit(req(2, [&system[..21], &[90, 91][..]].concat(), 3))?;
        while core.step(exec.as_mut()) {
            core.check_invariants().map_err(anyhow::Error::msg)?;
        }
        let (ev, _) = drain(&mut rx)?;
        assert_eq!(ev[0].cached_tokens, Some(want), "hint {hint:?}");
    }
    Ok(())
}

#[test]
fn branch_point_checkpoint_is_created_when_the_path_is_capped() -> Result<()> {
    // With one checkpoint per path, a long prompt keeps only its deepest checkpoint; a request
    // diverging in the middle replays from the root but leaves a checkpoint at the branch point,
    // so the next diverging request restores there.
    let mut exec = toy(1 << 16);
    let config = EngineConfig {
        checkpoints_per_path: 1,
        ..cfg(true)
    };
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), config)?;
    let base: Vec<u32> = (0..48).map(|i| (i * 11 + 2) % 97).collect();
    let mut cached = Vec::new();
    for (id, prompt) in [
        (1, base.clone()),
        (2, [&base[..26], &[70, 71, 72][..]].concat()),
        (3, [&base[..27], &[80][..]].concat()),
    ] {
        let mut rx = core.submit(req(id, prompt, 2))?;
        while core.step(exec.as_mut()) {
            core.check_invariants().map_err(anyhow::Error::msg)?;
        }
        cached.push(drain(&mut rx)?.0[0].cached_tokens);
    }
    assert_eq!(cached, vec![Some(0), Some(0), Some(24)]);
    Ok(())
}

#[test]
fn alone_vs_batched_and_split_pool_give_identical_outputs() -> Result<()> {
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|k| {
            (0..(5 + 9 * k))
                .map(|i| ((i * 13 + k) % 97) as u32)
                .collect()
        })
        .collect();
    let rounds_batched = vec![
        prompts
            .iter()
            .map(|p| Turn {
                continues: None,
                prompt: p.clone(),
                max_tokens: 8,
            })
            .collect(),
    ];
    let rounds_alone: Vec<Vec<Turn>> = prompts
        .iter()
        .map(|p| {
            vec![Turn {
                continues: None,
                prompt: p.clone(),
                max_tokens: 8,
            }]
        })
        .collect();
    for (name, make) in executors() {
        let batched = run_rounds(make().as_mut(), cfg(false), &rounds_batched)?;
        let alone = run_rounds(make().as_mut(), cfg(false), &rounds_alone)?;
        assert_eq!(batched, alone, "{name}");
        let split = EngineConfig {
            pool_mode: PoolMode::Split {
                state_fraction: 0.3,
            },
            ..cfg(true)
        };
        assert_eq!(
            run_rounds(make().as_mut(), split, &rounds_batched)?,
            batched,
            "{name} split"
        );
    }
    Ok(())
}

#[test]
fn preemption_under_memory_pressure_keeps_outputs_and_finishes_all() -> Result<()> {
    // 6 KiB arena: state blocks 64 B, pages 64 B (4 tokens x 16 B) → ~96 blocks; 8 requests of
    // ~40 tokens each need ~11 pages + 4 slots: they cannot all run at once.
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|k| {
            (0..(20 + 3 * k))
                .map(|i| ((i * 3 + 7 * k) % 97) as u32)
                .collect()
        })
        .collect();
    let rounds = vec![
        prompts
            .iter()
            .map(|p| Turn {
                continues: None,
                prompt: p.clone(),
                max_tokens: 16,
            })
            .collect(),
    ];
    for cache in [false, true] {
        let mut exec = toy(6 * 1024);
        let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg(cache))?;
        let _ = &mut core;
        let out = run_rounds(exec.as_mut(), cfg(cache), &rounds)?;
        let mut reference = toy(1 << 16);
        for (prompt, o) in &out {
            assert_eq!(o.len(), 16);
            assert_eq!(
                o,
                &reference_greedy(reference.as_mut(), prompt, 16)?,
                "cache {cache}"
            );
        }
    }
    // And the engine did have to preempt.
    let mut exec = toy(6 * 1024);
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg(false))?;
    let rxs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| core.submit(req(i as u64, p.clone(), 16)).unwrap())
        .collect();
    while core.step(exec.as_mut()) {}
    assert!(
        core.metrics().preemptions > 0,
        "workload too small to preempt"
    );
    assert_eq!(core.metrics().finished, rxs.len() as u64);
    Ok(())
}

#[test]
fn stop_tokens_max_tokens_and_context_length() -> Result<()> {
    let mut exec = toy(1 << 16);
    let prompt: Vec<u32> = (0..10).collect();
    let free_run = reference_greedy(exec.as_mut(), &prompt, 12)?;
    let config = EngineConfig {
        max_context: 16,
        eos_token_ids: vec![free_run[5]],
        ..cfg(true)
    };
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), config)?;
    let stop_at = free_run.iter().position(|&t| t == free_run[3]).unwrap();
    let sampling = SamplingParams {
        stop_token_ids: vec![free_run[3]],
        logprobs: Some(2),
        ..params(50)
    };
    let mut a = core.submit(Request::new(1, prompt.clone(), sampling))?;
    let with_eos = SamplingParams {
        ignore_eos: false,
        ..params(50)
    };
    let mut b = core.submit(Request::new(2, prompt.clone(), with_eos))?;
    let mut c = core.submit(req(3, prompt.clone(), 50))?;
    while core.step(exec.as_mut()) {}
    let (ev, f) = drain(&mut a)?;
    assert_eq!(
        (tokens(&ev), f),
        (free_run[..=stop_at].to_vec(), FinishReason::Stop)
    );
    assert_eq!(ev[0].top_logprobs.len(), 2);
    assert_eq!(ev[0].top_logprobs[0].0, ev[0].token);
    let eos_at = free_run.iter().position(|&t| t == free_run[5]).unwrap();
    let (ev, f) = drain(&mut b)?;
    assert_eq!(
        (tokens(&ev), f),
        (free_run[..=eos_at].to_vec(), FinishReason::Stop)
    );
    let (ev, f) = drain(&mut c)?;
    assert_eq!(
        (ev.len(), f),
        (6, FinishReason::Length),
        "clipped at the context length"
    );
    Ok(())
}

#[test]
fn submit_errors() -> Result<()> {
    let exec = toy(4096);
    let mut core = EngineCore::new(
        exec.layout(),
        exec.vocab_size(),
        EngineConfig {
            max_context: 64,
            max_waiting: 1,
            ..cfg(true)
        },
    )?;
    let err = |r: Result<_, SubmitError>| r.err().unwrap();
    assert!(matches!(
        err(core.submit(req(1, vec![], 4))),
        SubmitError::EmptyPrompt
    ));
    assert!(matches!(
        err(core.submit(req(1, vec![1; 64], 4))),
        SubmitError::ContextLengthExceeded {
            prompt: 64,
            limit: 64
        }
    ));
    assert!(matches!(
        err(core.submit(req(1, vec![500], 4))),
        SubmitError::InvalidToken { token: 500, .. }
    ));
    assert!(matches!(
        err(core.submit(req(1, vec![1], 0))),
        SubmitError::ZeroMaxTokens
    ));
    let bad = SamplingParams {
        top_p: 0.0,
        ..params(4)
    };
    assert!(matches!(
        err(core.submit(Request::new(1, vec![1], bad))),
        SubmitError::InvalidSampling(_)
    ));
    let big = EngineConfig {
        max_context: 1 << 20,
        ..cfg(true)
    };
    let mut core2 = EngineCore::new(exec.layout(), exec.vocab_size(), big)?;
    assert!(matches!(
        err(core2.submit(req(1, vec![1; 1000], 4))),
        SubmitError::PromptTooLargeForMemory
    ));
    let _rx = core.submit(req(1, vec![1, 2], 4))?;
    assert!(matches!(
        err(core.submit(req(1, vec![1, 2], 4))),
        SubmitError::DuplicateId(1)
    ));
    assert!(matches!(
        err(core.submit(req(2, vec![1, 2], 4))),
        SubmitError::Overloaded { .. }
    ));
    Ok(())
}

#[test]
fn threaded_engine_streams_cancels_and_frees() -> Result<()> {
    for overlap in [true, false] {
        for cache in [false, true] {
            let config = EngineConfig {
                overlap,
                ..cfg(cache)
            };
            let engine = Engine::start(toy(1 << 16), config)?;
            let free0 = engine.metrics().pool.free_bytes;
            let prompts: Vec<Vec<u32>> = (0..5)
                .map(|k| {
                    (0..(11 + 6 * k))
                        .map(|i| ((i * 5 + k) % 97) as u32)
                        .collect()
                })
                .collect();
            let streams: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| engine.submit(req(i as u64, p.clone(), 10)))
                .collect::<Result<_, _>>()?;
            // Cancel one explicitly and drop one mid-stream (client disconnect).
            let long = engine.submit(req(100, prompts[4].clone(), 5000))?;
            let mut dropped = engine.submit(req(101, prompts[3].clone(), 5000))?;
            assert!(dropped.blocking_next().is_some());
            drop(dropped);
            engine.cancel(100);
            let mut reference = toy(1 << 16);
            for (p, s) in prompts.iter().zip(streams) {
                let (ev, f) = s.blocking_collect()?;
                assert_eq!(f, FinishReason::Length);
                assert_eq!(
                    tokens(&ev),
                    reference_greedy(reference.as_mut(), p, 10)?,
                    "overlap {overlap} cache {cache}"
                );
            }
            let mut long = long;
            while let Some(item) = long.blocking_next() {
                assert!(
                    item.is_ok() && item.unwrap().finish.is_none(),
                    "a cancelled request just stops"
                );
            }
            engine.flush_prefix_cache();
            // The engine publishes metrics after each loop turn; wait until it is idle.
            let mut m = engine.metrics();
            for _ in 0..200 {
                if m.running == 0 && m.waiting == 0 && m.pool.free_bytes == free0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
                engine.flush_prefix_cache();
                m = engine.metrics();
            }
            assert_eq!(
                m.pool.free_bytes, free0,
                "pool returned to its prior free size"
            );
            assert_eq!(m.cancelled, 2);
            engine.shutdown(Duration::from_secs(1));
            assert!(matches!(
                engine.submit(req(7, vec![1], 1)),
                Err(SubmitError::ShuttingDown)
            ));
        }
    }
    Ok(())
}

#[test]
fn cancel_returns_pool_to_prior_free_size_without_flush() -> Result<()> {
    let mut exec = toy(1 << 16);
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg(false))?;
    let free0 = core.pool_free_bytes();
    let _rx = core.submit(req(1, (0..50).collect(), 100))?;
    let _rx2 = core.submit(req(2, (0..30).collect(), 100))?;
    for _ in 0..5 {
        core.step(exec.as_mut());
    }
    assert!(core.pool_free_bytes() < free0);
    assert!(core.cancel(1) && core.cancel(2));
    assert_eq!(core.pool_free_bytes(), free0);
    core.check_invariants().map_err(anyhow::Error::msg)?;
    Ok(())
}

#[test]
fn shutdown_deadline_aborts_unfinished() -> Result<()> {
    let engine = Engine::start(toy(1 << 16), cfg(true))?;
    let mut s = engine.submit(req(1, vec![1, 2, 3], 1_000_000 / 2))?;
    assert!(s.blocking_next().is_some());
    engine.shutdown(Duration::from_millis(20));
    let mut last = None;
    while let Some(item) = s.blocking_next() {
        last = Some(item);
    }
    assert_eq!(last, Some(Err(RequestError::Shutdown)));
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn async_stream() -> Result<()> {
    use futures::StreamExt;
    let engine = Engine::start(toy(1 << 16), cfg(true))?;
    let stream = engine.submit(req(1, vec![4, 5, 6], 7))?;
    let events: Vec<_> = stream.collect().await;
    assert_eq!(events.len(), 7);
    assert_eq!(
        events[6].as_ref().unwrap().finish,
        Some(FinishReason::Length)
    );
    // Metrics are published after the loop turn that sent the last event.
    let mut m = engine.metrics();
    for _ in 0..200 {
        if m.generated_tokens == 7 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        m = engine.metrics();
    }
    assert_eq!(m.generated_tokens, 7);
    assert!(
        m.to_prometheus()
            .contains("k3_engine_generated_tokens_total 7")
    );
    tokio::task::spawn_blocking(move || engine.shutdown(Duration::from_secs(1))).await?;
    Ok(())
}

#[derive(Debug, Clone)]
enum Op {
    Submit {
        prefix: usize,
        tail: Vec<u32>,
        max_tokens: usize,
    },
    Steps(usize),
    Cancel(usize),
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..3, prop::collection::vec(0u32..97, 1..20), 1usize..40)
            .prop_map(|(prefix, tail, max_tokens)| Op::Submit { prefix, tail, max_tokens }),
        4 => (1usize..6).prop_map(Op::Steps),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => Just(Op::Flush),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random request mixes (shared prefixes, cancellations, flushes, memory pressure): after
    /// every step no block has two owners and the pool/tree invariants hold; once everything
    /// has ended and the cache is flushed, the whole arena is free again; every finished
    /// request's output equals the unbatched reference.
    #[test]
    fn random_request_mixes(
        ops in prop::collection::vec(op(), 1..30),
        arena_kib in 3usize..10,
        unified in any::<bool>(),
        cache in any::<bool>(),
        overlap in any::<bool>(),
    ) {
        let mut exec = toy(arena_kib * 1024);
        let pool_mode = if unified { PoolMode::Unified } else { PoolMode::Split { state_fraction: 0.35 } };
        let config = EngineConfig { pool_mode, ..cfg(cache) };
        let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), config).unwrap();
        let total = core.pool_free_bytes();
        let prefixes: [Vec<u32>; 3] = [vec![], (0..13).collect(), (0..26).map(|i| (i * 3) % 97).collect()];
        let mut live = Vec::new();
        let mut finished = Vec::new();
        let mut next_id = 0u64;
        let mut inflight = None;
        let check = |core: &EngineCore| core.check_invariants().map_err(TestCaseError::fail);
        // A router's view of the cache, kept from its events only, must equal a fresh snapshot.
        let mut mirror = PrefixIndex::new();
        if let Some(snapshot) = core.subscribe_cache() {
            mirror.apply(&snapshot);
        }
        let mirrored = |core: &mut EngineCore, mirror: &mut PrefixIndex| -> Result<(), TestCaseError> {
            for e in core.take_cache_events() {
                mirror.apply(&e);
            }
            if let Some(snapshot) = core.subscribe_cache() {
                let mut fresh = PrefixIndex::new();
                fresh.apply(&snapshot);
                prop_assert_eq!(fresh.records(), mirror.records());
            }
            Ok(())
        };
        for op in ops.into_iter().chain([Op::Steps(10_000)]) {
            match op {
                Op::Submit { prefix, tail, max_tokens } => {
                    let prompt = [prefixes[prefix].as_slice(), &tail].concat();
                    if let Ok(rx) = core.submit(req(next_id, prompt.clone(), max_tokens)) {
                        live.push((next_id, prompt, max_tokens, rx));
                    }
                    next_id += 1;
                }
                Op::Steps(n) => {
                    for _ in 0..n {
                        let progressed = if overlap {
                            core.step_overlapped(exec.as_mut(), &mut inflight)
                        } else {
                            core.step(exec.as_mut())
                        };
                        check(&core)?;
                        mirrored(&mut core, &mut mirror)?;
                        if !progressed { break; }
                    }
                }
                Op::Cancel(i) if !live.is_empty() => {
                    let (id, ..) = live.remove(i % live.len());
                    core.cancel(id);
                    check(&core)?;
                    mirrored(&mut core, &mut mirror)?;
                }
                Op::Cancel(_) => {}
                Op::Flush => { core.flush_cache(); check(&core)?; mirrored(&mut core, &mut mirror)?; }
            }
        }
        prop_assert!(core.is_empty());
        for (_, prompt, max_tokens, mut rx) in live {
            let mut out = Vec::new();
            let mut ended = false;
            while let Ok(item) = rx.try_recv() {
                match item {
                    Ok(ev) => { out.push(ev.token); ended |= ev.finish.is_some(); }
                    Err(RequestError::OutOfMemory) => { ended = true; out.clear(); }
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
                }
            }
            prop_assert!(ended, "every request ends");
            if !out.is_empty() {
                prop_assert_eq!(out.len(), max_tokens);
                finished.push((prompt, out));
            }
        }
        core.flush_cache();
        check(&core)?;
        prop_assert_eq!(core.pool_free_bytes(), total, "nothing leaks");
        let mut reference = toy(1 << 16);
        for (prompt, out) in finished {
            prop_assert_eq!(&out, &reference_greedy(reference.as_mut(), &prompt, out.len()).unwrap());
        }
    }
}

#[test]
fn handle_and_stream_can_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<k3_engine::EngineHandle>();
    send::<k3_engine::RequestStream>();
    send_sync::<k3_engine::EngineMetrics>();
}

#[test]
fn images_key_the_prefix_cache_by_content() -> Result<()> {
    use k3_model::{ImagePixels, MediaInput};
    use std::sync::Arc;
    // The same ids around an image span (25 positions, across prefill chunks of 24): the same
    // image again is a cache hit past the image, a different image is no hit beyond the text
    // before it, and outputs equal a cache-off run.
    let prompt: Vec<u32> = [
        &[1u32, 2, 3, 4, 5][..],
        &[7; 25][..],
        &[11, 12, 13, 14, 15][..],
    ]
    .concat();
    let image = |seed: u8| MediaInput {
        position: 5,
        tokens: 25,
        image: Arc::new(ImagePixels {
            height: 32 * 5,
            width: 32 * 5,
            pixels: Vec::new(),
            content_hash: [seed; 32],
        }),
    };
    let run = |core: &mut EngineCore, exec: &mut dyn Executor, id: u64, seed: u8| {
        let mut r = req(id, prompt.clone(), 4);
        r.media = vec![image(seed)];
        let mut rx = core.submit(r)?;
        while core.step(exec) {
            core.check_invariants().map_err(anyhow::Error::msg)?;
        }
        let (ev, _) = drain(&mut rx)?;
        Ok::<_, anyhow::Error>((ev[0].cached_tokens, tokens(&ev)))
    };
    let mut exec = toy(1 << 16);
    let mut cold = EngineCore::new(exec.layout(), exec.vocab_size(), cfg(false))?;
    let (_, want_a) = run(&mut cold, exec.as_mut(), 1, 1)?;
    let (_, want_b) = run(&mut cold, exec.as_mut(), 2, 2)?;
    assert_ne!(want_a, want_b, "the image's content reaches the model");

    let mut exec = toy(1 << 16);
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg(true))?;
    let (cached, out) = run(&mut core, exec.as_mut(), 1, 1)?;
    assert_eq!((cached, &out), (Some(0), &want_a));
    let (cached, out) = run(&mut core, exec.as_mut(), 2, 1)?;
    assert_eq!(out, want_a);
    assert!(
        cached >= Some(30),
        "the same image is a hit past it: {cached:?}"
    );
    let (cached, out) = run(&mut core, exec.as_mut(), 3, 2)?;
    assert_eq!(out, want_b);
    assert!(
        cached <= Some(5),
        "a different image is never a hit: {cached:?}"
    );
    // A malformed layout is refused, not run.
    let mut bad = req(4, prompt.clone(), 4);
    bad.media = vec![MediaInput {
        position: 30,
        ..image(1)
    }];
    assert!(matches!(
        core.submit(bad),
        Err(SubmitError::InvalidMedia(_))
    ));
    Ok(())
}

/// A router hashes a prompt's ids the way the engine's events name its cached blocks: after one
/// request, the index kept from the events covers its prompt, usable up to a checkpoint, and a
/// prompt diverging in its first block matches nothing.
#[test]
fn cache_events_let_a_router_see_the_prefix() -> Result<()> {
    let engine = Engine::start(toy(1 << 16), cfg(true))?;
    let mut events = engine.subscribe_cache().context("prefix cache on")?;
    let mut index = PrefixIndex::new();
    let first = events.blocking_recv().context("snapshot")?;
    index.apply(&first);
    assert!(index.is_synced());
    let block = index.block_tokens().context("block size")?;
    assert_eq!(index.counts(), (0, 0), "an empty cache to start");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 97) as u32).collect();
    engine
        .submit(req(1, prompt.clone(), 4))?
        .blocking_collect()?;
    let hashes = block_hashes(&prompt, block);
    let mut hit = index.matched(&hashes);
    for _ in 0..500 {
        while let Ok(e) = events.try_recv() {
            index.apply(&e);
        }
        hit = index.matched(&hashes);
        if hit.usable_blocks > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(hit.walked_blocks as usize >= 32 / block, "{hit:?}");
    assert!(
        hit.usable_blocks > 0 && hit.usable_blocks <= hit.walked_blocks,
        "{hit:?}"
    );
    let mut other = prompt.clone();
    other[0] = 96;
    assert_eq!(index.matched(&block_hashes(&other, block)).walked_blocks, 0);
    // A flush is seen as removals.
    engine.flush_prefix_cache();
    for _ in 0..500 {
        while let Ok(e) = events.try_recv() {
            index.apply(&e);
        }
        if index.counts().0 == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(index.matched(&hashes).walked_blocks, 0);
    assert!(
        Engine::start(toy(1 << 16), cfg(false))?
            .subscribe_cache()
            .is_none()
    );
    Ok(())
}
