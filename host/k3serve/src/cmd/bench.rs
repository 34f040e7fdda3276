//! `k3serve bench`: throughput of the model on this machine (CPU or CUDA) — batch-1 decode tok/s,
//! prefill tok/s of a long prompt, decode TPOT with N sequences per step (`--batch-sizes`), peak
//! RSS. Prompts are synthetic token ids (seeded), since
//! throughput does not depend on their content. Decode feeds back each step's greedy token,
//! except on dummy weights: their argmax repeats a few tokens, which would route every sequence
//! to the same experts (far fewer weight bytes than a trained model's step), so each step is fed
//! seeded random ids instead; the top-1 is still selected every step. On CUDA each batch's TPOT
//! is also stated against its byte roofline (`k3_model::flops::decode_step_bytes`).

use super::model_loading::{CudaArgs, Device, LoadFormat, init_threads, load_for};
use k3_model::exec::{ForwardBatch, GraphCounts, SeqInput};
use k3_model::{Executor, LogitsWant, Session};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value = "models/k3-mini")]
    pub model: PathBuf,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 2048)]
    pub prefill_tokens: usize,
    /// Decode steps measured (after a 64-token prompt).
    #[arg(long, default_value_t = 256)]
    pub decode_tokens: usize,
    /// Repetitions; the best is reported (the machine is shared and noisy).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Worker threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// `cuda`, `cpu` or `auto` (CUDA when a GPU opens, else the CPU).
    #[arg(long)]
    pub device: Option<String>,
    /// `safetensors`, or `dummy`: seeded random weights of the config's shapes (e.g. `--model
    /// models/k3-slice`, K3's real per-layer shapes, which has no checkpoint).
    #[arg(long, default_value = "safetensors")]
    pub load_format: String,
    /// Seed of the dummy weights.
    #[arg(long, default_value_t = 0)]
    pub weights_seed: u64,
    /// Also time decode steps of N sequences at once (one engine step = N decode tokens), for
    /// each N here, e.g. `16,64`: TPOT (ms per step) and output tok/s.
    #[arg(long, value_delimiter = ',')]
    pub batch_sizes: Vec<usize>,
    /// The HBM rate, TB/s, a CUDA decode step's bytes are divided by for its byte roofline: by
    /// default the H200's measured copy rate (docs/performance.md); on another GPU pass its own,
    /// e.g. from `python3 scripts/hbm_rate.py`.
    #[arg(long, default_value_t = 4.25, value_parser = parse_rate)]
    pub roofline_tbps: f64,
    #[command(flatten)]
    pub cuda: CudaArgs,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive rate in TB/s")),
    }
}

/// What a decode step is fed: its own greedy token, or seeded random ids (dummy weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeInputs {
    Greedy,
    Random,
}

impl DecodeInputs {
    /// The next input of sequence `seq` at decode step `step`, given the token the step selected.
    fn next(self, selected: u32, vocab: usize, seq: usize, step: usize) -> u32 {
        match self {
            Self::Greedy => selected,
            Self::Random => {
                // splitmix64's finaliser of (seq, step): one xorshift draw from neighbouring
                // seeds would give neighbouring ids.
                let mut z = ((seq as u64) << 32 | step as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                ((z ^ (z >> 31)) % vocab as u64) as u32
            }
        }
    }
}

fn synthetic_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// CPU seconds (user + system, all threads) this process has used, from `/proc/self/stat`
/// (fields 14–15, in USER_HZ = 100 ticks per second on Linux).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may contain spaces; fields after it follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// A wall-clock rate and the CPU-time rate of the same run (tokens per CPU-second: on a shared,
/// loaded machine it shows what the code costs independently of the neighbours).
struct Rate {
    wall: f64,
    per_cpu_s: Option<f64>,
}

fn measure(tokens: usize, f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<Rate> {
    let c0 = cpu_seconds();
    let t = Instant::now();
    f()?;
    let wall = tokens as f64 / t.elapsed().as_secs_f64();
    let per_cpu_s = match (c0, cpu_seconds()) {
        (Some(a), Some(b)) if b > a => Some(tokens as f64 / (b - a)),
        _ => None,
    };
    Ok(Rate { wall, per_cpu_s })
}

fn fmt_cpu(r: &Rate) -> String {
    r.per_cpu_s
        .map(|c| format!("{c:.0} tok per CPU-second"))
        .unwrap_or_else(|| "CPU time: too short to read".into())
}

/// Peak resident set size of this process in MiB (Linux `VmHWM`), if available.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    init_threads(a.threads)?;
    let max = a.prefill_tokens.max(64 + a.decode_tokens) + 1;
    let t = Instant::now();
    let format = LoadFormat::parse(&a.load_format, a.weights_seed)?;
    let seqs = a.batch_sizes.iter().copied().max().unwrap_or(1).max(1);
    // One arena serves both: the batch-1 session uses it all; the batched runs split it.
    let (exec, _, device) = load_for(
        &a.model,
        seqs,
        max,
        Device::parse(a.device.as_deref())?,
        format,
        &a.cuda.resolve(&CudaArgs::default())?,
    )?;
    eprintln!(
        "loaded {} on the {} in {:.2}s",
        a.model.display(),
        device.name(),
        t.elapsed().as_secs_f64()
    );
    let vocab = exec.vocab_size();
    let inputs = match format {
        LoadFormat::Dummy { .. } => DecodeInputs::Random,
        LoadFormat::Safetensors => DecodeInputs::Greedy,
    };
    let mut session = Session::new(exec)?;

    let prompt = synthetic_ids(a.prefill_tokens, vocab, 42);
    let mut best_prefill = Rate {
        wall: 0.0,
        per_cpu_s: None,
    };
    for _ in 0..a.repeats.max(1) {
        session.reset()?;
        let r = measure(prompt.len(), || {
            session.feed(&prompt, LogitsWant::Last)?;
            Ok(())
        })?;
        if r.wall > best_prefill.wall {
            best_prefill = r;
        }
    }

    let short = synthetic_ids(64, vocab, 7);
    let mut best_decode = Rate {
        wall: 0.0,
        per_cpu_s: None,
    };
    for _ in 0..a.repeats.max(1) {
        session.reset()?;
        // Greedy through the same path as served greedy requests: the backend selects the
        // top logit, no vocabulary row leaves it.
        let mut top = session.feed_top(&short, 1)?;
        let r = measure(a.decode_tokens, || {
            for s in 0..a.decode_tokens {
                top = session.feed_top(&[inputs.next(first_id(&top)?, vocab, 0, s)], 1)?;
            }
            Ok(())
        })?;
        if r.wall > best_decode.wall {
            best_decode = r;
        }
    }

    let mut batched = Vec::new();
    let mut exec = session.into_inner();
    for &n in a.batch_sizes.iter().filter(|&&n| n > 0) {
        batched.push((
            n,
            batch_decode(&mut exec, n, a.decode_tokens, a.repeats, inputs)?,
        ));
    }

    println!("device:            {}", device.name());
    println!("threads:           {}", rayon::current_num_threads());
    println!(
        "prefill tok/s:     {:.0}  ({}-token prompt, best of {}; {})",
        best_prefill.wall,
        a.prefill_tokens,
        a.repeats,
        fmt_cpu(&best_prefill)
    );
    let cfg = k3_model::Config::from_file(&a.model.join("config.json"))?;
    let flops = k3_model::flops::prefill_flops(&cfg, a.prefill_tokens, 0, 1).total();
    println!(
        "prefill FLOPs:     {:.2} GFLOP/token, {:.1} TFLOP/s  (docs/performance.md, \"Prefill FLOPs\")",
        flops / a.prefill_tokens.max(1) as f64 / 1e9,
        flops * best_prefill.wall / a.prefill_tokens.max(1) as f64 / 1e12
    );
    println!(
        "decode tok/s:      {:.1}  (batch 1, {} steps after a 64-token prompt, best of {}; {})",
        best_decode.wall,
        a.decode_tokens,
        a.repeats,
        fmt_cpu(&best_decode)
    );
    if inputs == DecodeInputs::Random {
        println!(
            "decode inputs:     seeded random ids (dummy weights: docs/performance.md, \"Decode bytes\")"
        );
    }
    for (n, (step_s, graphs)) in batched {
        println!(
            "decode batch {n:<4}   TPOT {:.2} ms, {:.0} output tok/s  ({} steps after 64-token prompts, best of {})",
            step_s * 1e3,
            n as f64 / step_s,
            a.decode_tokens,
            a.repeats
        );
        if device == Device::Cuda {
            // The mean context over the measured steps.
            let bytes = k3_model::flops::decode_step_bytes(&cfg, n, 64 + a.decode_tokens / 2);
            let floor = bytes.total() / (a.roofline_tbps * 1e12);
            println!(
                "  byte roofline    {:.2} ms = {:.2} GB at {} TB/s ({:.1} experts per MoE layer, uniform routing); TPOT {:.2}x",
                floor * 1e3,
                bytes.total() / 1e9,
                a.roofline_tbps,
                bytes.experts_per_layer,
                step_s / floor
            );
        }
        if let Some(g) = graphs {
            println!("  host per step    {}", fmt_graph_host(&g));
            if let Some(nodes) = fmt_graph_nodes(&g) {
                println!("  graph nodes      {nodes}");
            }
        }
    }
    match peak_rss_mib() {
        Some(m) => println!("peak RSS:          {m:.0} MiB"),
        None => println!("peak RSS:          unavailable"),
    }
    Ok(())
}

/// Seconds per decode step with `n` sequences in every step (best of `repeats`): each sequence
/// is prefilled with its own 64-token prompt (one batched step), then decodes `steps` tokens fed
/// as `inputs` says. The arena is split evenly: `n` state blocks, then each sequence's KV pages.
/// Also the executor's recorded-step counts over the timed steps of every repeat, if it keeps them.
fn batch_decode<E: Executor>(
    exec: &mut E,
    n: usize,
    steps: usize,
    repeats: usize,
    inputs: DecodeInputs,
) -> anyhow::Result<(f64, Option<GraphCounts>)> {
    const PROMPT: usize = 64;
    let lay = exec.layout();
    let (block, pages) = lay.split_evenly(n, PROMPT + steps + 1).ok_or_else(|| {
        anyhow::anyhow!(
            "batch {n}: {} arena bytes hold fewer sequences",
            lay.arena_bytes
        )
    })?;
    let vocab = exec.vocab_size();
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| synthetic_ids(PROMPT, vocab, 1000 + i as u64))
        .collect();
    let mut best = f64::INFINITY;
    let mut graphs: Option<GraphCounts> = None;
    for _ in 0..repeats.max(1) {
        exec.arena_zero(0, n * block)?;
        let step = |exec: &mut E, toks: &[Vec<u32>], pos: usize| {
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
            let out = exec.forward(&ForwardBatch {
                seqs,
                ..Default::default()
            })?;
            out.top
                .iter()
                .enumerate()
                .map(|(i, t)| Ok(vec![inputs.next(first_id(t)?, vocab, i, pos)]))
                .collect::<anyhow::Result<Vec<_>>>()
        };
        let mut next = step(exec, &prompts, 0)?;
        let before = exec.graph_counts();
        let t = Instant::now();
        for s in 0..steps {
            next = step(exec, &next, PROMPT + s)?;
        }
        best = best.min(t.elapsed().as_secs_f64() / steps.max(1) as f64);
        if let (Some(b), Some(a)) = (before, exec.graph_counts()) {
            graphs = Some(graphs.unwrap_or_default() + (a - b));
        }
    }
    Ok((best, graphs))
}

/// The host side of recorded decode steps, per step: "dry pass X ms (A buffers), P of N steps
/// prepared ahead (Z ms while the device ran), graph launch Y ms (R of N steps replayed)". X is
/// the dry passes that ran with the device idle; a prepared step's ran during the step before.
fn fmt_graph_host(g: &GraphCounts) -> String {
    let per = |ns: u64, n: u64| ns as f64 / n.max(1) as f64 / 1e6;
    let steps = g.dry_passes + g.prepared_replays;
    format!(
        "dry pass {:.3} ms ({} buffers), {} of {steps} steps prepared ahead ({:.3} ms while the \
         device ran), graph launch {:.3} ms ({} of {steps} steps replayed)",
        per(g.dry_pass_ns, g.dry_passes),
        g.dry_allocs / (g.dry_passes + g.prepared).max(1),
        g.prepared_replays,
        per(g.prepared_ns, g.prepared),
        per(g.launch_ns, g.replayed),
        g.replayed,
    )
}

/// The nodes of the graphs captured in `g`, by kind, per graph (None: nothing captured).
fn fmt_graph_nodes(g: &GraphCounts) -> Option<String> {
    let n = g.captured;
    (n > 0).then(|| {
        format!(
            "{} kernels, {} memsets, {} copies, {} allocation / free, {} other (per captured graph)",
            g.captured_kernels / n,
            g.captured_memsets / n,
            g.captured_copies / n,
            g.captured_mem_nodes / n,
            g.captured_other_nodes / n
        )
    })
}

/// The selected token of a greedy step's candidates.
fn first_id(top: &[(u32, f32)]) -> anyhow::Result<u32> {
    top.first()
        .map(|&(t, _)| t)
        .ok_or_else(|| anyhow::anyhow!("no finite logit to continue from"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::model_loading::Device;

    fn k3_mini() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini")
    }

    #[test]
    fn batched_decode_runs_in_its_share_of_the_arena_and_refuses_more() {
        let fmt = LoadFormat::parse("safetensors", 0).unwrap();
        let (mut exec, _, _) = load_for(
            &k3_mini(),
            3,
            64 + 4 + 1,
            Some(Device::Cpu),
            fmt,
            &Default::default(),
        )
        .unwrap();
        for inputs in [DecodeInputs::Greedy, DecodeInputs::Random] {
            let (step, graphs) = batch_decode(&mut exec, 3, 4, 1, inputs).unwrap();
            assert!(step.is_finite() && step > 0.0, "{step}");
            assert_eq!(graphs, None, "the CPU backend records no steps");
        }
        let err = batch_decode(&mut exec, 4, 4, 1, DecodeInputs::Greedy)
            .unwrap_err()
            .to_string();
        assert!(err.contains("arena"), "{err}");
    }

    #[test]
    fn graph_host_times_are_per_step() {
        let g = GraphCounts {
            replayed: 30,
            captured: 1,
            eager: 1,
            dry_passes: 4,
            dry_pass_ns: 4 * 850_000,
            dry_allocs: 33 * 400,
            launch_ns: 30 * 40_000,
            prepared: 29,
            prepared_ns: 29 * 800_000,
            prepared_replays: 28,
            ..Default::default()
        };
        assert_eq!(
            fmt_graph_host(&g),
            "dry pass 0.850 ms (400 buffers), 28 of 32 steps prepared ahead (0.800 ms while the \
             device ran), graph launch 0.040 ms (30 of 32 steps replayed)"
        );
        // Nothing recorded: zeros, not a division by zero.
        assert_eq!(
            fmt_graph_host(&GraphCounts::default()),
            "dry pass 0.000 ms (0 buffers), 0 of 0 steps prepared ahead (0.000 ms while the \
             device ran), graph launch 0.000 ms (0 of 0 steps replayed)"
        );
    }

    #[test]
    fn graph_nodes_are_per_captured_graph() {
        let g = GraphCounts {
            captured: 2,
            captured_kernels: 650,
            captured_memsets: 10,
            captured_copies: 42,
            captured_mem_nodes: 1200,
            ..Default::default()
        };
        assert_eq!(
            fmt_graph_nodes(&g).as_deref(),
            Some(
                "325 kernels, 5 memsets, 21 copies, 600 allocation / free, 0 other (per captured graph)"
            )
        );
        // Nothing captured: no line, not a division by zero.
        assert_eq!(fmt_graph_nodes(&GraphCounts::default()), None);
    }

    #[test]
    fn the_roofline_rate_is_a_positive_number_of_tb_per_s() {
        use clap::{Args as _, FromArgMatches as _};
        let parse = |argv: &[&str]| {
            let cmd = Args::augment_args(clap::Command::new("bench"));
            cmd.try_get_matches_from(argv)
                .and_then(|m| Args::from_arg_matches(&m))
                .map(|a| a.roofline_tbps)
        };
        assert_eq!(parse(&["bench"]).unwrap(), 4.25);
        assert_eq!(parse(&["bench", "--roofline-tbps", "2.99"]).unwrap(), 2.99);
        for bad in ["0", "-1", "nan", "inf", "fast"] {
            let arg = format!("--roofline-tbps={bad}");
            let err = parse(&["bench", &arg]).unwrap_err().to_string();
            assert!(err.contains("positive rate"), "{bad}: {err}");
        }
    }

    #[test]
    fn random_inputs_differ_by_sequence_and_step_and_greedy_keeps_the_selection() {
        let vocab = 163_840;
        let mut seen = std::collections::HashSet::new();
        for seq in 0..16 {
            for step in 0..32 {
                let id = DecodeInputs::Random.next(7, vocab, seq, step);
                assert!((id as usize) < vocab);
                seen.insert(id);
            }
        }
        // 512 draws from 163,840 ids: a repeat or two at most, never one id for all.
        assert!(seen.len() > 500, "{}", seen.len());
        assert_eq!(DecodeInputs::Greedy.next(7, vocab, 3, 9), 7);
    }
}
