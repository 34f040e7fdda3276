//! `k3serve bench`: CPU throughput of the model on this machine — batch-1 decode tok/s,
//! prefill tok/s of a long prompt, peak RSS. Prompts are synthetic token ids (seeded), since
//! throughput does not depend on their content.

use super::model_loading::{init_threads, load_cpu};
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
    let exec = load_cpu(&a.model, max)?;
    eprintln!(
        "loaded {} in {:.2}s",
        a.model.display(),
        t.elapsed().as_secs_f64()
    );
    let vocab = exec.vocab_size();
    let mut session = Session::new(exec)?;

    let prompt = synthetic_ids(a.prefill_tokens, vocab, 42);
    let mut best_prefill = 0f64;
    for _ in 0..a.repeats.max(1) {
        session.reset()?;
        let t = Instant::now();
        session.feed(&prompt, LogitsWant::Last)?;
        best_prefill = best_prefill.max(prompt.len() as f64 / t.elapsed().as_secs_f64());
    }

    let short = synthetic_ids(64, vocab, 7);
    let mut best_decode = 0f64;
    for _ in 0..a.repeats.max(1) {
        session.reset()?;
        let mut logits = session.feed(&short, LogitsWant::Last)?;
        let t = Instant::now();
        for _ in 0..a.decode_tokens {
            logits = session.feed(&[argmax(&logits)], LogitsWant::Last)?;
        }
        best_decode = best_decode.max(a.decode_tokens as f64 / t.elapsed().as_secs_f64());
    }

    println!("threads:           {}", rayon::current_num_threads());
    println!(
        "prefill tok/s:     {best_prefill:.0}  ({}-token prompt, best of {})",
        a.prefill_tokens, a.repeats
    );
    println!(
        "decode tok/s:      {best_decode:.1}  (batch 1, {} steps after a 64-token prompt, best of {})",
        a.decode_tokens, a.repeats
    );
    match peak_rss_mib() {
        Some(m) => println!("peak RSS:          {m:.0} MiB"),
        None => println!("peak RSS:          unavailable"),
    }
    Ok(())
}
