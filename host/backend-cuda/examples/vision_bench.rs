//! Vision tower time per image (docs/vision.md): models/k3-mini's tower on random images of
//! each size, on the CPU or on CUDA; the mean over `--iters` runs after one warm-up, each run
//! ended by copying the output rows to the host (so a GPU run is waited for).
//!   cargo run --release -p k3-backend-cuda --example vision_bench -- [--device cpu|cuda]
//!       [--model models/k3-mini] [--iters 20] [--sizes 64x96,192x192,256x256]

use k3_backend_cpu::CpuBackend;
use k3_backend_cuda::CudaBackend;
use k3_model::backend::Backend;
use k3_model::{ImagePixels, Model};
use std::path::PathBuf;
use std::time::Instant;

struct Args {
    device: String,
    model: PathBuf,
    iters: usize,
    sizes: Vec<(usize, usize)>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        device: "cpu".into(),
        model: PathBuf::from("models/k3-mini"),
        iters: 20,
        sizes: vec![(64, 96), (192, 192), (256, 256)],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--device" => a.device = value,
            "--model" => a.model = value.into(),
            "--iters" => a.iters = value.parse().map_err(|e| format!("--iters: {e}"))?,
            "--sizes" => {
                a.sizes = value
                    .split(',')
                    .map(|s| {
                        let (h, w) = s.split_once('x').ok_or(format!("size {s}: HxW"))?;
                        Ok((
                            h.parse().map_err(|e| format!("{s}: {e}"))?,
                            w.parse().map_err(|e| format!("{s}: {e}"))?,
                        ))
                    })
                    .collect::<Result<_, String>>()?
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

fn image(h: usize, w: usize) -> ImagePixels {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ (h * 1000 + w) as u64;
    let pixels = (0..3 * h * w)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 256) as f32 / 127.5 - 1.0
        })
        .collect();
    ImagePixels {
        height: h,
        width: w,
        pixels,
        content_hash: [0; 32],
    }
}

fn bench<B: Backend>(model: &Model<B>, a: &Args, device: &str) -> Result<(), String> {
    let tower = model.vision().ok_or("the model has no vision_config")?;
    for &(h, w) in &a.sizes {
        let img = image(h, w);
        let run = || -> Result<usize, String> {
            let out = tower
                .encode(&model.backend, &img)
                .map_err(|e| e.to_string())?;
            Ok(model
                .backend
                .to_host(&out)
                .map_err(|e| e.to_string())?
                .len())
        };
        let floats = run()?;
        let t0 = Instant::now();
        for _ in 0..a.iters {
            run()?;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / a.iters.max(1) as f64;
        println!(
            "vision_bench device={device} image={h}x{w} patches={} tokens={} ms_per_image={ms:.3}",
            (h / 16) * (w / 16),
            floats / model.config.hidden_size
        );
    }
    Ok(())
}

fn main() -> Result<(), String> {
    let a = args()?;
    match a.device.as_str() {
        "cpu" => bench(
            &Model::load_dir(&a.model, CpuBackend::new()).map_err(|e| e.to_string())?,
            &a,
            "cpu",
        ),
        "cuda" => {
            let be = CudaBackend::try_new(0).map_err(|e| e.to_string())?;
            bench(
                &Model::load_dir(&a.model, be).map_err(|e| e.to_string())?,
                &a,
                "cuda",
            )
        }
        d => Err(format!("--device {d}: cpu or cuda")),
    }
}
