//! `k3serve generate`: one raw prompt (already in the model's chat format) → streamed text.

use super::model_loading::{Device, LoadFormat, init_threads, load_single};
use anyhow::{Context, bail};
use k3_frontend::{IncrementalDetokenizer, Tokenizer};
use k3_model::{Executor, LogitsWant, Session};
use k3_sampling::{Sampler, SamplingParams, SeqHistory, StopChecker, TokenVerdict};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json).
    #[arg(long, default_value = "models/k3-mini")]
    pub model: PathBuf,
    /// Raw prompt text, special markers included (no chat template is applied).
    #[arg(long)]
    pub prompt: String,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep going past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Worker threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// `cuda`, `cpu` or `auto` (CUDA when a GPU opens, else the CPU).
    #[arg(long)]
    pub device: Option<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    init_threads(a.threads)?;
    let device = Device::parse(a.device.as_deref())?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&a.model).context("loading the tokenizer")?);
    let prompt = tokenizer
        .encode(&a.prompt)
        .context("tokenizing the prompt")?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        min_p: a.min_p,
        seed: a.seed,
        max_tokens: Some(a.max_tokens),
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        ..Default::default()
    };
    params.validate().context("sampling flags")?;
    let (exec, config, _) = load_single(
        &a.model,
        prompt.len() + a.max_tokens as usize,
        device,
        LoadFormat::Safetensors,
    )?;
    let vocab = exec.vocab_size();
    let eos: Vec<u32> = std::iter::once(config.eos_token_id)
        .chain(tokenizer.eos_token_id())
        .collect();
    let mut session = Session::new(exec)?;
    let mut sampler = Sampler::new(&params, vocab)?;
    let mut history = SeqHistory::new(&prompt);
    let mut stop = StopChecker::new(&params, &eos);
    let mut detok = IncrementalDetokenizer::with_prompt(tokenizer.clone(), &prompt)?;
    let mut out = std::io::stdout().lock();

    let t0 = Instant::now();
    let mut logits = session.feed(&prompt, LogitsWant::Last)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut generated = 0usize;
    loop {
        let tok = sampler.sample(&logits, &history)?.token;
        history.push(tok);
        generated += 1;
        let verdict = stop.on_token(tok);
        let done = match verdict {
            TokenVerdict::StopToken { emit_text } => {
                if emit_text {
                    write!(out, "{}", detok.push(tok)?)?;
                }
                write!(out, "{}", stop.flush())?;
                true
            }
            TokenVerdict::Continue | TokenVerdict::LastToken => {
                let step = stop.push_text(&detok.push(tok)?);
                write!(out, "{}", step.text)?;
                if !step.stopped && verdict == TokenVerdict::LastToken {
                    write!(out, "{}", stop.push_text(&detok.flush()?).text)?;
                    write!(out, "{}", stop.flush())?;
                }
                step.stopped || verdict == TokenVerdict::LastToken
            }
        };
        out.flush()?;
        if done {
            break;
        }
        logits = session.feed(&[tok], LogitsWant::Last)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    writeln!(out)?;
    eprintln!(
        "[{} prompt tokens in {:.3}s ({:.0} tok/s); {} generated in {:.3}s ({:.1} tok/s); finish: {}]",
        prompt.len(),
        prefill_s,
        prompt.len() as f64 / prefill_s,
        generated,
        decode_s,
        generated as f64 / decode_s.max(1e-9),
        stop.finish_reason().map(|r| r.as_str()).unwrap_or("length"),
    );
    Ok(())
}
