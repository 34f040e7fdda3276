//! k3-mini end to end on the GPU against the CPU: logits and greedy tokens on the golden
//! prompts, CUDA-graph decode against eager, and the engine with concurrent requests.

use super::*;

/// Index and value of the two largest logits.
pub(super) fn top2(l: &[f32]) -> ((usize, f32), (usize, f32)) {
    let mut a = (0, f32::NEG_INFINITY);
    let mut b = (0, f32::NEG_INFINITY);
    for (i, &x) in l.iter().enumerate() {
        if x > a.1 {
            b = a;
            a = (i, x);
        } else if x > b.1 {
            b = (i, x);
        }
    }
    (a, b)
}

/// A near-tie: the CPU's top-2 gap is within what the backends' logits differ by (x4), or
/// below 1e-3 of the logit scale.
pub(super) fn near_tie(cpu: &[f32], gpu: &[f32]) -> (bool, f32) {
    let ((_, a), (_, b)) = top2(cpu);
    let gap = a - b;
    let diff = cpu
        .iter()
        .zip(gpu)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let scale = cpu.iter().fold(0f32, |m, x| m.max(x.abs()));
    (gap <= 4.0 * diff || gap <= 1e-3 * scale, gap)
}

fn golden() -> (Vec<Vec<u32>>, usize) {
    let (v, prompts) = prompt_file("tests/golden/golden.json");
    let n = v["greedy_tokens"].as_u64().unwrap_or(16) as usize;
    (prompts, n)
}

/// A JSON file under the repo root with prompts as token ids (`input_ids`): the whole value and
/// the prompts.
pub(super) fn prompt_file(rel: &str) -> (serde_json::Value, Vec<Vec<u32>>) {
    let path = root().join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect(rel);
    let prompts = v["input_ids"]
        .as_array()
        .expect("input_ids")
        .iter()
        .map(|p| {
            p.as_array()
                .expect("ids")
                .iter()
                .map(|x| x.as_u64().expect("id") as u32)
                .collect()
        })
        .collect();
    (v, prompts)
}

pub(super) const LOGITS_TOL: f64 = 1e-3;

#[test]
fn k3_mini_matches_cpu() {
    // Greedy tokens and LOGITS_TOL against the CPU need float32 mode (`cuda`).
    let Some(gpu) = cuda() else { return };
    let exec = compare_model(gpu, usize::MAX, "");
    // The decode steps above went through CUDA graphs (captured, then replayed).
    let c = exec.model().backend.graph_counts();
    println!("e2e cuda graphs {c:?}");
    assert!(
        c.captured > 0 && c.replayed > 0,
        "no decode step replayed: {c:?}"
    );
    // Every replay followed a dry pass, its own or one prepared while the step before ran,
    // and all were timed.
    assert!(
        c.dry_passes + c.prepared_replays >= c.replayed + c.captured
            && c.dry_pass_ns > 0
            && c.launch_ns > 0
            && (c.prepared == 0 || c.prepared_ns > 0),
        "graph host times: {c:?}"
    );
}

/// Decode through CUDA graphs gives bit-identical logits to eager launches (the same kernels
/// with the same inputs), over enough steps to cross MLA split buckets and page boundaries.
#[test]
fn cuda_graph_decode_matches_eager() {
    let (Some(a), Some(b)) = (cuda(), cuda()) else {
        return;
    };
    graph_decode_matches_eager(a, b, "float32");
}

/// As above in bfloat16 mode with every bf16 product on cuBLAS (k3-mini's weights are all small
/// enough for the GEMV otherwise): a layer's products that share an input run at once on side
/// streams (lanes.rs), captured as parallel branches of the graph.
#[test]
fn cuda_graph_decode_matches_eager_with_concurrent_products() {
    let options = || CudaOptions {
        dtype: Dtype::Bf16,
        gemv_max_weight_elems: 0,
        ..CudaOptions::default()
    };
    let (Ok(a), Ok(b)) = (
        CudaBackend::with_options(0, options()),
        CudaBackend::with_options(0, options()),
    ) else {
        println!("skipped: no CUDA device");
        return;
    };
    graph_decode_matches_eager(a, b, "bfloat16, cuBLAS products");
}

/// A batched decode step's graph gathers no rows: every sequence wants its one row's logits, so
/// the final norm runs over the whole act (forward.rs merges the adjacent ranges) instead of
/// slicing and concatenating each row of every AttnRes source (three copy nodes per sequence).
#[test]
fn batched_decode_graph_copies_no_rows() {
    use k3_model::{ForwardBatch, SeqInput};
    let Some(gpu) = cuda() else { return };
    let (n, prompt, steps) = (4usize, 8usize, 12usize);
    let mut exec = ModelExecutor::with_capacity(
        Model::load_dir(&root().join("models/k3-mini"), gpu).expect("load"),
        16,
        n,
        prompt + steps + 1 + 16, // room for 4-byte aligned state blocks
        0,
    )
    .expect("exec");
    let (block, pages) = exec
        .layout()
        .split_evenly(n, prompt + steps + 1)
        .expect("the arena holds the batch");
    exec.arena_zero(0, n * block).expect("zero states");
    let mut toks: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            (0..prompt)
                .map(|j| (100 + 37 * i + 11 * j) as u32)
                .collect()
        })
        .collect();
    for pos in std::iter::once(0).chain(prompt..prompt + steps) {
        let seqs = (0..n)
            .map(|i| SeqInput {
                tokens: &toks[i],
                start_pos: pos,
                kv_pages: &pages[i],
                state_block: i * block,
                checkpoints: &[],
                logits: LogitsWant::LastTopK(1),
            })
            .collect();
        let out = exec
            .forward(&ForwardBatch {
                seqs,
                ..Default::default()
            })
            .expect("step");
        toks = out.top.iter().map(|t| vec![t[0].0]).collect();
    }
    let g = exec
        .graph_counts()
        .expect("the CUDA executor keeps graph counts");
    println!("batched graph decode n={n}: {g:?}");
    assert!(g.captured > 0 && g.replayed > 0, "no graphs: {g:?}");
    // One copy per graph: the staging upload (graph.rs).
    assert!(
        g.captured_copies <= g.captured,
        "a batched decode graph copies rows: {g:?}"
    );
}

/// k3-mini decoding 140 greedy tokens on `a` with CUDA graphs and on `b` without: logits equal
/// bit for bit at every step.
fn graph_decode_matches_eager(a: CudaBackend, mut b: CudaBackend, tag: &str) {
    b.set_cuda_graphs(false);
    let dir = root().join("models/k3-mini");
    let (prompts, _) = golden();
    let steps = 140;
    let cap = prompts[0].len() + steps + 2;
    let mk = |be: CudaBackend| {
        let m = Model::load_dir(&dir, be).expect("load");
        Session::new(ModelExecutor::with_capacity(m, 16, 1, cap, 0).expect("exec")).expect("s")
    };
    let (mut g, mut e) = (mk(a), mk(b));
    let mut lg = g
        .feed(&prompts[0], LogitsWant::Last)
        .expect("graph prefill");
    let le = e
        .feed(&prompts[0], LogitsWant::Last)
        .expect("eager prefill");
    assert_eq!(lg, le, "prefill (never graphed) differs");
    for step in 0..steps {
        let next = top2(&lg).0.0 as u32;
        lg = g.feed(&[next], LogitsWant::Last).expect("graph decode");
        let le = e.feed(&[next], LogitsWant::Last).expect("eager decode");
        assert!(
            lg == le,
            "step {step}: graph logits differ from eager (max |d| {})",
            lg.iter()
                .zip(&le)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        );
    }
    let (cg, ce) = (
        g.executor().model().backend.graph_counts(),
        e.executor().model().backend.graph_counts(),
    );
    println!("graph_decode ({tag}) steps={steps} graphs {cg:?} eager-only {ce:?}");
    assert!(cg.replayed >= steps as u64 / 2, "too few replays: {cg:?}");
    // One sequence on fixed pages: after the capture, every step is the one expected, so it is
    // launched from the pass prepared while the step before ran, its token id written in then
    // (bit-for-bit equal to eager above, so the id reached the embedding).
    assert!(
        cg.prepared_replays >= steps as u64 / 2,
        "too few prepared steps: {cg:?}"
    );
    assert_eq!(ce.replayed + ce.captured, 0, "graphs were off: {ce:?}");
}

/// models/k3-mini on `gpu` vs the CPU: the golden prompts, `max_new` greedy tokens at most.
/// Returns the GPU executor (for its backend's counters).
pub(super) fn compare_model<G: Backend>(gpu: G, max_new: usize, tag: &str) -> ModelExecutor<G> {
    let dir = root().join("models/k3-mini");
    let (prompts, n) = golden();
    let n = n.min(max_new);
    let cap = prompts.iter().map(Vec::len).max().unwrap_or(0) + n + 1;
    let mk_cpu = || {
        ModelExecutor::with_capacity(
            Model::load_dir(&dir, CpuBackend::new()).expect("load cpu"),
            16,
            1,
            cap,
            0,
        )
        .expect("cpu exec")
    };
    let gpu_model = Model::load_dir(&dir, gpu).expect("load on the GPU");
    let mut g =
        Session::new(ModelExecutor::with_capacity(gpu_model, 16, 1, cap, 0).expect("gpu exec"))
            .expect("session");
    let mut c = Session::new(mk_cpu()).expect("session");
    let mut failures = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        g.reset().unwrap();
        c.reset().unwrap();
        // All prompt positions: every row of the prefill is compared, not only the last.
        let (lg, lc) = (
            g.feed(prompt, LogitsWant::All).expect("gpu prefill"),
            c.feed(prompt, LogitsWant::All).expect("cpu prefill"),
        );
        let e = rel_err(&lg, &lc);
        println!(
            "{tag}e2e prompt={i} tokens={} prefill_logits rel_err={e:.3e} tol={LOGITS_TOL:.0e}",
            prompt.len()
        );
        if e > LOGITS_TOL {
            failures.push(format!("prompt {i}: prefill logits {e:.3e}"));
        }
        let vocab = g.executor().vocab_size();
        let (mut lg, mut lc) = (
            lg[lg.len() - vocab..].to_vec(),
            lc[lc.len() - vocab..].to_vec(),
        );
        let (mut tg, mut tc) = (Vec::new(), Vec::new());
        let mut worst = 0f64;
        for step in 0..n {
            let (a, b) = (top2(&lg).0.0 as u32, top2(&lc).0.0 as u32);
            tg.push(a);
            tc.push(b);
            if a != b {
                let (tie, gap) = near_tie(&lc, &lg);
                println!(
                    "{tag}e2e prompt={i} diverges at step {step}: cuda {a} cpu {b}; CPU top-2 gap {gap:.3e} ({})",
                    if tie {
                        "near tie: acceptable"
                    } else {
                        "NOT a near tie"
                    }
                );
                if !tie {
                    failures.push(format!("prompt {i}: token {step} differs (gap {gap:.3e})"));
                }
                break;
            }
            if step + 1 == n {
                break;
            }
            lg = g.feed(&[a], LogitsWant::Last).expect("gpu decode");
            lc = c.feed(&[b], LogitsWant::Last).expect("cpu decode");
            worst = worst.max(rel_err(&lg, &lc));
        }
        println!("{tag}e2e prompt={i} decode_logits max_rel_err={worst:.3e} tol={LOGITS_TOL:.0e}");
        println!("{tag}e2e prompt={i} greedy cuda={tg:?}");
        println!(
            "{tag}e2e prompt={i} greedy cpu ={tc:?} {}",
            if tg == tc { "equal" } else { "differ" }
        );
        if worst > LOGITS_TOL {
            failures.push(format!("prompt {i}: decode logits {worst:.3e}"));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
    g.into_inner()
}

fn engine_tokens(exec: Box<dyn Executor>, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    use k3_engine::{Engine, EngineConfig, Request, SamplingParams};
    let cfg = EngineConfig {
        prefix_cache: true,
        checkpoint_interval: 8,
        step_tokens: 24,
        max_step_tokens: 40,
        max_context: 4096,
        ..EngineConfig::default()
    };
    let engine = Engine::start(exec, cfg).expect("engine");
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(n as u32),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    // Every other request samples (seeded top-k / top-p): its candidates are selected by the
    // backend (`LogitsWant::LastTopK`), like greedy's, and the draws must agree with the CPU's.
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.95,
        seed: Some(7),
        ..params.clone()
    };
    let mut streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = if i % 2 == 1 { &sampled } else { &params };
            engine
                .submit(Request::new(i as u64 + 1, p.clone(), params.clone()))
                .expect("submit")
        })
        .collect();
    let out = streams
        .iter_mut()
        .map(|s| {
            let mut toks = Vec::new();
            while let Some(ev) = s.blocking_next() {
                let ev = ev.expect("request failed");
                toks.push(ev.token);
                if ev.finish.is_some() {
                    break;
                }
            }
            toks
        })
        .collect();
    engine.shutdown(std::time::Duration::from_secs(5));
    out
}

#[test]
fn engine_matches_cpu() {
    let Some(gpu) = cuda() else { return }; // float32: token-level agreement with the CPU
    compare_engine(gpu, 10, "");
}

/// A few concurrent requests (shared prefix included) through k3_engine on `gpu` vs the CPU.
pub(super) fn compare_engine<G: Backend>(gpu: G, n: usize, tag: &str) {
    let dir = root().join("models/k3-mini");
    let (mut prompts, _) = golden();
    // A shared prefix (prefix cache hit + checkpoints) and a longer continuation.
    let first = prompts[0].clone();
    prompts.push([&first[..], &[17, 18, 19]].concat());
    prompts.push(first.iter().rev().copied().collect());
    let gpu_exec = ModelExecutor::with_capacity(
        Model::load_dir(&dir, gpu).expect("load gpu"),
        4,
        24,
        160,
        96,
    )
    .expect("gpu exec");
    let cpu_exec = ModelExecutor::with_capacity(
        Model::load_dir(&dir, CpuBackend::new()).expect("load cpu"),
        4,
        24,
        160,
        96,
    )
    .expect("cpu exec");
    let g = engine_tokens(Box::new(gpu_exec), &prompts, n);
    let c = engine_tokens(Box::new(cpu_exec), &prompts, n);
    let mut bad = Vec::new();
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        println!("{tag}engine request={i} cuda={a:?}");
        println!(
            "{tag}engine request={i} cpu ={b:?} {}",
            if a == b { "equal" } else { "differ" }
        );
        if a.len() != n {
            bad.push(format!("request {i}: {} tokens", a.len()));
        } else if a != b {
            // Judge the first divergence on the CPU's logits at that point.
            let j = a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(0);
            let mut s = Session::new(
                ModelExecutor::with_capacity(
                    Model::load_dir(&dir, CpuBackend::new()).expect("load"),
                    16,
                    1,
                    256,
                    0,
                )
                .expect("exec"),
            )
            .expect("session");
            let l = s
                .feed(&[&prompts[i][..], &b[..j]].concat(), LogitsWant::Last)
                .expect("cpu");
            let ((_, x), (_, y)) = top2(&l);
            let scale = l.iter().fold(0f32, |m, v| m.max(v.abs()));
            let tie = x - y <= 1e-3 * scale;
            println!(
                "{tag}engine request={i} diverges at {j}; CPU top-2 gap {:.3e} ({})",
                x - y,
                if tie {
                    "near tie: acceptable"
                } else {
                    "NOT a near tie"
                }
            );
            if !tie {
                bad.push(format!("request {i}: differs at {j}"));
            }
        }
    }
    assert!(bad.is_empty(), "{bad:?}");
}
