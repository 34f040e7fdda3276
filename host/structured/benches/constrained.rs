//! Constrained decoding costs on the CPU (`cargo bench -p k3-structured --bench constrained`):
//! 1. mask computation per token (p50 / p99) along JSON-schema outputs over k3-mini's tokenizer;
//! 2. decode tok/s of k3-mini through the engine, unconstrained vs JSON-schema constrained, at
//!    batch 1 and 16, in the same run.
//!
//! Reported in `docs/performance.md`.

use std::path::PathBuf;
use std::time::Instant;

use k3_engine::{EngineConfig, EngineCore, Request, RequestSampler, SamplingParams};
use k3_model::Executor;
use k3_structured::{
    ConstrainedSampler, GrammarCompiler, GrammarPlan, OutputConstraint, TokenBytes, token_env,
};
use llguidance::toktrie::TokEnv;
use serde_json::{Value, json};

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini")
}

/// k3-mini's tokens as llguidance sees them, read from tokenizer.json (the server builds the
/// same from its tokenizer).
fn k3_env(width: usize) -> TokEnv {
    let text = std::fs::read_to_string(model_dir().join("tokenizer.json")).unwrap();
    let json: Value = serde_json::from_str(&text).unwrap();
    let bytes = llguidance::token_bytes_from_tokenizer_json(&json).unwrap();
    let mut tokens: Vec<TokenBytes> = bytes.into_iter().map(TokenBytes::Text).collect();
    for added in json["added_tokens"].as_array().unwrap() {
        let id = added["id"].as_u64().unwrap() as usize;
        if added["special"].as_bool() == Some(true) && id < tokens.len() {
            tokens[id] = TokenBytes::Special(added["content"].as_str().unwrap().into());
        }
    }
    tokens.resize(width.max(tokens.len()), TokenBytes::Unused);
    let eos = json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["content"] == "<|end_of_msg|>")
        .and_then(|t| t["id"].as_u64())
        .unwrap() as u32;
    token_env(&tokens, &[eos]).unwrap()
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
               "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
               "required": ["name", "age", "tags"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
               "required": ["x", "ok"], "additionalProperties": false}, "maxItems": 6}),
        json!({"type": "object", "properties": {"kind": {"enum": ["circle", "square", "triangle"]},
               "size": {"type": "integer", "minimum": 1, "maximum": 1000},
               "note": {"type": ["string", "null"], "maxLength": 30}},
               "required": ["kind", "size", "note"], "additionalProperties": false}),
    ]
}

/// Pseudo-random logits: the walk visits many grammar states instead of one greedy path.
fn logits(width: usize, step: u64, seed: u64) -> Vec<f32> {
    (0..width as u64)
        .map(|t| {
            let x = (t ^ seed.rotate_left(23) ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (x >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Time every mask computation along constrained outputs (the worker's job per token).
fn mask_times(compiler: &GrammarCompiler, width: usize) {
    let mut times = Vec::new();
    for (i, schema) in schemas().into_iter().enumerate() {
        for seed in 0..20u64 {
            let c = OutputConstraint::JsonSchema {
                schema: schema.clone(),
                strict: true,
            };
            let mut m = compiler.compile_constraint(&c).unwrap();
            for step in 0..200u64 {
                let t = Instant::now();
                let mask = m.compute_mask().unwrap();
                times.push(t.elapsed().as_secs_f64() * 1e6);
                let row = logits(width, step, seed * 31 + i as u64);
                let best = (0..width)
                    .filter(|&t| k3_model::select::token_mask_allows(&mask, t))
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                    .unwrap();
                m.consume_token(best as u32).unwrap();
                if m.is_stopped() {
                    break;
                }
            }
        }
    }
    times.sort_by(f64::total_cmp);
    println!(
        "mask per token: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs over {} masks (vocab {width})",
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        times.last().unwrap(),
        times.len()
    );
}

/// Decode `tokens` tokens for each of `batch` requests through the engine; output tok/s.
fn decode(compiler: Option<&GrammarCompiler>, batch: usize, tokens: usize) -> f64 {
    let model = k3_model::Model::load_dir(&model_dir(), k3_backend_cpu::CpuBackend::new()).unwrap();
    let mut exec =
        k3_model::ModelExecutor::with_capacity(model, 16, batch + 1, 64 + tokens + 16, 8).unwrap();
    let cfg = EngineConfig {
        prefix_cache: false,
        max_context: 64 + tokens + 16,
        max_running: batch,
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg).unwrap();
    // A JSON array of at least `tokens` integers: the grammar never completes early, so both
    // runs decode exactly `tokens` tokens per request.
    let schema = json!({"type": "array", "items": {"type": "integer"}, "minItems": tokens});
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(tokens as u32),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut rxs = Vec::new();
    for i in 0..batch {
        let prompt: Vec<u32> = (0..64)
            .map(|j| 10 + ((i * 131 + j * 7) % 8000) as u32)
            .collect();
        let mut req = Request::new(i as u64, prompt.clone(), params.clone());
        if let Some(c) = compiler {
            let c = c
                .compile_constraint(&OutputConstraint::JsonSchema {
                    schema: schema.clone(),
                    strict: true,
                })
                .unwrap();
            let inner = RequestSampler::new(&params, exec.vocab_size(), &prompt).unwrap();
            let plan = GrammarPlan {
                grammar: c,
                trigger: None,
            };
            req.sampler = Some(Box::new(
                ConstrainedSampler::new(Box::new(inner), plan).unwrap(),
            ));
        }
        rxs.push(core.submit(req).unwrap());
    }
    // Prefill first; the decode steps are what is timed.
    while rxs.iter_mut().any(|rx| rx.is_empty()) {
        core.step(&mut exec);
    }
    let t = Instant::now();
    while core.step(&mut exec) {}
    let secs = t.elapsed().as_secs_f64();
    let mut generated = 0;
    for mut rx in rxs {
        while let Ok(ev) = rx.try_recv() {
            ev.expect("request failed");
            generated += 1;
        }
    }
    assert_eq!(generated, batch * tokens);
    (batch * (tokens - 1)) as f64 / secs
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` run only checks it builds.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let width = 8192;
    let compiler = GrammarCompiler::new(k3_env(width)).unwrap();
    mask_times(&compiler, width);
    // Tokens decoded per request: long enough that per-step costs dominate start-up.
    let tokens = 64;
    for batch in [1, 16] {
        // Alternate, best of three each: the machine is shared.
        let (mut free, mut bound) = (0f64, 0f64);
        for _ in 0..3 {
            free = free.max(decode(None, batch, tokens));
            bound = bound.max(decode(Some(&compiler), batch, tokens));
        }
        println!(
            "decode batch {batch:>2}: {free:.1} tok/s unconstrained, {bound:.1} tok/s JSON-schema \
             constrained ({:+.1} %)",
            (bound / free - 1.0) * 100.0
        );
    }
}
