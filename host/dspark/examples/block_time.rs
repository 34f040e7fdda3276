//! Time of one DSpark block at k3-mini's shapes (the spec's drafter config: d = 256, 2 layers,
//! 4 heads × 64, γ = 7, r = 64, V = 8192) with seeded random drafter weights and k3-mini's own
//! embedding and LM head, on the CPU backend:
//!
//!     cargo run --release -p k3-dspark --example block_time [models/k3-mini]
//!
//! Prints the time of `propose(7)` over a full 512-position context (greedy and sampled), and of
//! `observe_taps` for a prefill and for one decode step's worth of positions.

use anyhow::{Context, Result};
use k3_backend_cpu::CpuBackend;
use k3_dspark::{DsparkConfig, DsparkDrafter, DsparkModel};
use k3_model::{Tensors, WeightFile};
use k3_speculative::{DraftSampling, DraftSource};
use rand::SeedableRng;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

const CONFIG: &str = r#"{"model_type": "k3_dspark", "target_taps": [2, 5, 8], "hidden_size": 256,
 "num_layers": 2, "num_heads": 4, "head_dim": 64, "intermediate_size": 768, "block_size": 7,
 "markov_rank": 64, "context_window": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
 "vocab_size": 8192, "confidence_temperatures": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}"#;

/// Median of `reps` timings of `f`, in milliseconds.
fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

fn main() -> Result<()> {
    let target_dir = std::env::args().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini"),
        PathBuf::from,
    );
    let config = DsparkConfig::from_json(CONFIG).map_err(anyhow::Error::msg)?;
    let target = k3_model::Config::from_file(&target_dir.join("config.json"))?;
    config.check_target(&target)?;
    let shared = WeightFile::open(&target_dir.join("model.safetensors"))
        .with_context(|| format!("{}", target_dir.display()))?;
    let model = Arc::new(DsparkModel::from_tensors(
        config,
        &Tensors::dummy(21),
        &shared.tensors(),
        CpuBackend::new(),
    )?);
    let (tw, window) = (model.tap_width(), model.config().context_window);
    let taps: Vec<f32> = (0..(window + 8) * tw)
        .map(|i| (i as f32 * 0.618).sin())
        .collect();

    let mut drafter = DsparkDrafter::new(Arc::clone(&model));
    drafter.extend(&vec![100; window + 1]);
    let prefill = median_ms(5, || drafter.observe_taps(0, &taps[..window * tw]));
    assert_eq!(drafter.context().len(), window);
    let step = median_ms(21, || drafter.observe_taps(window - 4, &taps[..4 * tw]));
    let greedy = median_ms(41, || {
        drafter.propose(7, &mut DraftSampling::Greedy);
    });
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let sampled = median_ms(41, || {
        drafter.propose(
            7,
            &mut DraftSampling::Sample {
                temperature: 1.0,
                rng: &mut rng,
            },
        );
    });
    // The block pass alone, with and without context (the rest is the Markov/confidence heads).
    let ctx = drafter.context().view_before(window);
    let block = median_ms(41, || {
        model.block_forward(&ctx, 100, window).unwrap();
    });
    let block_alone = median_ms(41, || {
        model
            .block_forward(&k3_dspark::ContextView::empty(), 100, window)
            .unwrap();
    });
    if let Some(e) = drafter.take_error() {
        return Err(e.into());
    }
    let threads = rayon_threads();
    println!(
        "DSpark block at k3-mini shapes (γ = 7, {window} context rows), CPU, {threads} threads:"
    );
    println!("  propose(7) greedy   {greedy:.2} ms");
    println!("  propose(7) sampled  {sampled:.2} ms");
    println!("  block pass alone    {block:.2} ms ({block_alone:.2} ms without context)");
    println!("  observe_taps 4 rows {step:.2} ms (a decode step's committed positions)");
    println!("  observe_taps {window} rows {prefill:.2} ms (prefill)");
    Ok(())
}

fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
