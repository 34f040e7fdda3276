//! `k3serve bench`: throughput of the model on this machine (CPU or CUDA) — batch-1 decode tok/s,
//! prefill tok/s of a long prompt, peak RSS. Prompts are synthetic token ids (seeded), since
//! throughput does not depend on their content.

use super::model_loading::{Device, LoadFormat, init_threads, load_single};
use k3_model::{Executor, LogitsWant, Session, argmax};
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
    let (exec, _, device) =
        load_single(&a.model, max, Device::parse(a.device.as_deref())?, format)?;
    eprintln!(
        "loaded {} on the {} in {:.2}s",
        a.model.display(),
        device.name(),
        t.elapsed().as_secs_f64()
    );
    let vocab = exec.vocab_size();
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
        let mut logits = session.feed(&short, LogitsWant::Last)?;
        let r = measure(a.decode_tokens, || {
            for _ in 0..a.decode_tokens {
                logits = session.feed(&[argmax(&logits)], LogitsWant::Last)?;
            }
            Ok(())
        })?;
        if r.wall > best_decode.wall {
            best_decode = r;
        }
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
    println!(
        "decode tok/s:      {:.1}  (batch 1, {} steps after a 64-token prompt, best of {}; {})",
        best_decode.wall,
        a.decode_tokens,
        a.repeats,
        fmt_cpu(&best_decode)
    );
    match peak_rss_mib() {
        Some(m) => println!("peak RSS:          {m:.0} MiB"),
        None => println!("peak RSS:          unavailable"),
    }
    Ok(())
}
