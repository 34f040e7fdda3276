//! Times encoding of text files with this crate's tokenizer and with the `tokenizers` crate it
//! wraps, after checking both give the same ids. Driven by `scripts/bench-tokenizer.py`, which
//! adds the Python `tokenizers` and `fastokens` to the same run.
//!
//! Usage: `bench_tokenizer [--ours-only] MODEL_DIR REPEATS FILE...`; prints one JSON object per
//! file. `--ours-only` skips timing `tokenizers` (for profiling).

use std::time::Instant;

use k3_frontend::Tokenizer;

fn median_ms(repeats: usize, mut f: impl FnMut() -> usize) -> f64 {
    f(); // warm-up
    let mut times: Vec<f64> = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let ours_only = args.first().is_some_and(|a| a == "--ours-only");
    if ours_only {
        args.remove(0);
    }
    let [model_dir, repeats, files @ ..] = args.as_slice() else {
        return Err("usage: bench_tokenizer MODEL_DIR REPEATS FILE...".into());
    };
    let repeats: usize = repeats.parse()?;
    let tok = Tokenizer::from_dir(model_dir)?;
    if !tok.uses_fast_encoder() {
        return Err(format!("no fast path: {:?}", tok.fast_encoder_unavailable()).into());
    }
    let hf = tok.inner();
    for file in files {
        let text = std::fs::read_to_string(file)?;
        let ours = tok.encode(&text)?;
        let reference = hf.encode(text.as_str(), false)?.get_ids().to_vec();
        if ours != reference {
            return Err(format!("{file}: ids differ from tokenizers").into());
        }
        let ours_ms = median_ms(repeats, || tok.encode(&text).map_or(0, |ids| ids.len()));
        let hf_ms = if ours_only {
            f64::NAN
        } else {
            median_ms(repeats, || {
                hf.encode(text.as_str(), false)
                    .map_or(0, |e| e.get_ids().len())
            })
        };
        println!(
            "{}",
            serde_json::json!({
                "file": file,
                "bytes": text.len(),
                "tokens": ours.len(),
                "ours_ms": ours_ms,
                "hf_rust_ms": hf_ms,
                "threads": rayon::current_num_threads(),
            })
        );
    }
    Ok(())
}
