//! The vision tower on the CPU backend (docs/vision.md): against an f64 re-implementation of
//! reference/k3ref/vision.py over seeded weights written to a bf16 safetensors file, against the
//! reference's own golden vectors (tests/golden/vision-golden.safetensors), and spliced into
//! image prompts through the executor (chunking, caching, errors).

use anyhow::{Context, Result, ensure};
use k3_backend_cpu::CpuBackend;
use k3_model::backend::Backend;
use k3_model::{
    Config, ExecError, ImagePixels, LogitsWant, MediaInput, Model, ModelExecutor, Session, Tensors,
    VisionConfig, VisionTower, WeightError, WeightFile,
};
use safetensors::{Dtype, tensor::TensorView};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The contract's vision_config for k3-mini (docs/vision.md).
fn contract_vision() -> VisionConfig {
    VisionConfig {
        weights: "vision.safetensors".into(),
        patch_size: 16,
        merge_size: 2,
        hidden_size: 192,
        num_hidden_layers: 4,
        num_attention_heads: 3,
        intermediate_size: 768,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        max_pixels: 65536,
        min_pixels: 1024,
        media_placeholder_token_id: 6,
        media_pad_token_id: 7,
    }
}

const DECODER: usize = 256;

/// xorshift64*, uniform in [-1, 1).
struct Rng(u64);

impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let u = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (u >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) as u16
}

/// Every tensor of the tower for `cfg`, name → (shape, values): matrices with variance ~1/fan-in,
/// norm weights near 1 (but not 1, so a swapped norm shows), biases small.
fn tower_shapes(cfg: &VisionConfig) -> Vec<(String, Vec<usize>)> {
    let (w, m, d) = (cfg.hidden_size, cfg.intermediate_size, DECODER);
    let p = cfg.patch_size * cfg.patch_size * 3;
    let mut v = vec![
        ("vision_tower.patch_embed.weight".into(), vec![w, p]),
        ("vision_tower.patch_embed.bias".into(), vec![w]),
    ];
    for i in 0..cfg.num_hidden_layers {
        let b = format!("vision_tower.blocks.{i}");
        for (n, s) in [
            ("norm1", vec![w]),
            ("qkv.weight", vec![3 * w, w]),
            ("qkv.bias", vec![3 * w]),
            ("proj.weight", vec![w, w]),
            ("proj.bias", vec![w]),
            ("norm2", vec![w]),
            ("fc1.weight", vec![m, w]),
            ("fc1.bias", vec![m]),
            ("fc2.weight", vec![w, m]),
            ("fc2.bias", vec![w]),
        ] {
            v.push((format!("{b}.{n}"), s));
        }
    }
    v.extend([
        ("multi_modal_projector.merge_norm".into(), vec![4 * w]),
        ("multi_modal_projector.proj1.weight".into(), vec![d, 4 * w]),
        ("multi_modal_projector.proj1.bias".into(), vec![d]),
        ("multi_modal_projector.proj2.weight".into(), vec![d, d]),
        ("multi_modal_projector.proj2.bias".into(), vec![d]),
    ]);
    v
}

type Weights = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn random_tower(cfg: &VisionConfig, seed: u64) -> Weights {
    let mut r = Rng(seed | 1);
    tower_shapes(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let vals: Vec<f32> = if shape.len() == 2 {
                let a = (3.0 / shape[1] as f32).sqrt();
                (0..n).map(|_| a * r.f()).collect()
            } else if name.ends_with("bias") {
                (0..n).map(|_| 0.1 * r.f()).collect()
            } else {
                (0..n).map(|_| 1.0 + 0.3 * r.f()).collect()
            };
            // As stored (bf16), so the f64 reference sees exactly what Rust loads.
            let vals = vals
                .into_iter()
                .map(|x| f32::from_bits((bf16_bits(x) as u32) << 16))
                .collect();
            (name, (shape, vals))
        })
        .collect()
}

/// `weights` as a bf16 safetensors file in a fresh temporary directory.
fn write_bf16(weights: &Weights, tag: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("k3-vision-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(n, (s, v))| {
            let b = v.iter().flat_map(|x| bf16_bits(*x).to_le_bytes()).collect();
            (n.clone(), s.clone(), b)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::BF16, s.clone(), b)?)))
        .collect::<Result<_>>()?;
    let path = dir.join("vision.safetensors");
    safetensors::serialize_to_file(views, None, &path)?;
    Ok(path)
}

/// Normalised pixels of a random RGB image (u8 / 127.5 − 1), CHW.
fn image(h: usize, w: usize, seed: u64) -> Arc<ImagePixels> {
    let mut r = Rng(seed | 1);
    let pixels = (0..3 * h * w)
        .map(|_| ((r.f() + 1.0) * 127.99).floor() / 127.5 - 1.0)
        .collect();
    let mut content_hash = [0u8; 32];
    content_hash[..8].copy_from_slice(&seed.to_le_bytes());
    Arc::new(ImagePixels {
        height: h,
        width: w,
        pixels,
        content_hash,
    })
}

// ---- an f64 re-implementation of reference/k3ref/vision.py ----

fn linear(w: &Weights, name: &str, x: &[f64]) -> Vec<f64> {
    let (s, wt) = &w[&format!("{name}.weight")];
    let (_, b) = &w[&format!("{name}.bias")];
    let (out, inp) = (s[0], s[1]);
    x.chunks(inp)
        .flat_map(|row| {
            (0..out).map(move |o| {
                let wr = &wt[o * inp..(o + 1) * inp];
                b[o] as f64 + row.iter().zip(wr).map(|(a, c)| a * *c as f64).sum::<f64>()
            })
        })
        .collect()
}

fn rms(x: &[f64], g: &[f32], eps: f64) -> Vec<f64> {
    x.chunks(g.len())
        .flat_map(|row| {
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / g.len() as f64 + eps).sqrt();
            row.iter().zip(g).map(move |(v, c)| v * inv * *c as f64)
        })
        .collect()
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

fn rope(v: &mut [f64], row: usize, col: usize, theta: f64) {
    let q = v.len() / 4;
    for (half, pos) in [(0, row), (1, col)] {
        let part = &mut v[half * 2 * q..(half + 1) * 2 * q];
        for i in 0..q {
            let a = pos as f64 * theta.powf(-(i as f64) / q as f64);
            let (x1, x2) = (part[i], part[i + q]);
            part[i] = x1 * a.cos() - x2 * a.sin();
            part[i + q] = x2 * a.cos() + x1 * a.sin();
        }
    }
}

/// Stages as `encode_traced` records them, then the output.
fn reference(cfg: &VisionConfig, w: &Weights, img: &ImagePixels) -> Vec<Vec<f64>> {
    let (p, hgt, wid) = (cfg.patch_size, img.height, img.width);
    let (gh, gw) = (hgt / p, wid / p);
    let mut patches = Vec::new();
    for pr in 0..gh {
        for pc in 0..gw {
            for r in 0..p {
                for c in 0..p {
                    for ch in 0..3 {
                        patches.push(img.pixels[(ch * hgt + pr * p + r) * wid + pc * p + c] as f64);
                    }
                }
            }
        }
    }
    let (width, heads, n) = (cfg.hidden_size, cfg.num_attention_heads, gh * gw);
    let hd = width / heads;
    let eps = cfg.rms_norm_eps as f64;
    let mut x = linear(w, "vision_tower.patch_embed", &patches);
    let mut stages = vec![x.clone()];
    for i in 0..cfg.num_hidden_layers {
        let b = format!("vision_tower.blocks.{i}");
        let qkv = linear(
            w,
            &format!("{b}.qkv"),
            &rms(&x, &w[&format!("{b}.norm1")].1, eps),
        );
        let mut o = vec![0f64; n * width];
        for h in 0..heads {
            let head = |i: usize, part: usize| {
                let at = i * 3 * width + part * width + h * hd;
                let mut v = qkv[at..at + hd].to_vec();
                if part < 2 {
                    rope(&mut v, i / gw, i % gw, cfg.rope_theta as f64);
                }
                v
            };
            let ks: Vec<Vec<f64>> = (0..n).map(|j| head(j, 1)).collect();
            let vs: Vec<Vec<f64>> = (0..n).map(|j| head(j, 2)).collect();
            for i in 0..n {
                let q = head(i, 0);
                let s: Vec<f64> = ks
                    .iter()
                    .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt())
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for d in 0..hd {
                        o[i * width + h * hd + d] += ej / z * vs[j][d];
                    }
                }
            }
        }
        let y = linear(w, &format!("{b}.proj"), &o);
        x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        let f: Vec<f64> = linear(
            w,
            &format!("{b}.fc1"),
            &rms(&x, &w[&format!("{b}.norm2")].1, eps),
        )
        .into_iter()
        .map(gelu)
        .collect();
        let y = linear(w, &format!("{b}.fc2"), &f);
        x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        stages.push(x.clone());
    }
    let mut merged = Vec::new();
    for bi in 0..gh / 2 {
        for bj in 0..gw / 2 {
            for (dr, dc) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let at = ((2 * bi + dr) * gw + 2 * bj + dc) * width;
                merged.extend_from_slice(&x[at..at + width]);
            }
        }
    }
    stages.push(merged.clone());
    let m = rms(&merged, &w["multi_modal_projector.merge_norm"].1, eps);
    let y: Vec<f64> = linear(w, "multi_modal_projector.proj1", &m)
        .into_iter()
        .map(gelu)
        .collect();
    stages.push(linear(w, "multi_modal_projector.proj2", &y));
    stages
}

/// Max over rows of `max|a−b| / max|b|` (as tests/golden.rs measures).
fn rel_err(got: &[f32], want: &[f64], width: usize) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let mut worst = 0f64;
    for (ra, rb) in got.chunks(width).zip(want.chunks(width)) {
        let scale = rb.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-6);
        let diff = ra
            .iter()
            .zip(rb)
            .fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

const STAGE_NAMES: [&str; 7] = [
    "patch_embed",
    "block0",
    "block1",
    "block2",
    "block3",
    "merged",
    "output",
];

/// The CPU tower's stages and output for `img`, on the host.
fn cpu_stages(tower: &VisionTower<CpuBackend>, img: &ImagePixels) -> Result<Vec<Vec<f32>>> {
    let be = CpuBackend::new();
    let mut trace = Vec::new();
    let out = tower.encode_traced(&be, img, Some(&mut trace))?;
    trace.push(be.to_host(&out)?);
    Ok(trace)
}

#[test]
fn tower_matches_an_f64_reference_on_bf16_weights() -> Result<()> {
    let cfg = contract_vision();
    let weights = random_tower(&cfg, 11);
    let path = write_bf16(&weights, "ref")?;
    let file = WeightFile::open(&path)?;
    let tower = VisionTower::load(&cfg, DECODER, &file.tensors(), &CpuBackend::new())?;
    for (h, w, seed) in [(64, 96, 1), (96, 64, 2), (32, 32, 3)] {
        let img = image(h, w, seed);
        assert_eq!(tower.tokens(&img)?, (h / 32) * (w / 32));
        let got = cpu_stages(&tower, &img)?;
        let want = reference(&cfg, &weights, &img);
        for (k, (g, r)) in got.iter().zip(&want).enumerate() {
            let width = match k {
                5 => 4 * cfg.hidden_size,
                6 => DECODER,
                _ => cfg.hidden_size,
            };
            let e = rel_err(g, r, width);
            eprintln!("{h}x{w} {}: rel err {e:.2e}", STAGE_NAMES[k]);
            ensure!(e <= 1e-4, "{h}x{w} {}: {e:.3e} > 1e-4", STAGE_NAMES[k]);
        }
    }
    std::fs::remove_dir_all(path.parent().unwrap())?;
    Ok(())
}

#[test]
fn missing_and_misshaped_tensors_are_named() -> Result<()> {
    let cfg = contract_vision();
    let mut weights = random_tower(&cfg, 5);
    weights.remove("vision_tower.blocks.2.fc1.bias");
    let missing = write_bf16(&weights, "missing")?;
    let err = VisionTower::load(
        &cfg,
        DECODER,
        &WeightFile::open(&missing)?.tensors(),
        &CpuBackend::new(),
    )
    .err()
    .context("a tower without blocks.2.fc1.bias loaded")?;
    assert!(matches!(&err, WeightError::Missing(n) if n == "vision_tower.blocks.2.fc1.bias"));
    // Loaded for a decoder of another width: the projector's shapes do not fit.
    let weights = random_tower(&cfg, 5);
    let path = write_bf16(&weights, "shape")?;
    let err = VisionTower::load(
        &cfg,
        128,
        &WeightFile::open(&path)?.tensors(),
        &CpuBackend::new(),
    )
    .err()
    .context("a tower loaded for the wrong decoder width")?;
    let msg = err.to_string();
    assert!(msg.contains("multi_modal_projector.proj1.weight") && msg.contains("[256, 768]"));
    for p in [missing, path] {
        std::fs::remove_dir_all(p.parent().unwrap())?;
    }
    Ok(())
}

#[test]
fn tower_matches_the_reference_golden_vectors() -> Result<()> {
    let p = root().join("host/model/tests/golden/vision-golden.safetensors");
    let file = WeightFile::open(&p).with_context(|| {
        format!(
            "{} (exported by reference/ with models/k3-mini/vision.safetensors)",
            p.display()
        )
    })?;
    let g = file.tensors();
    let model = Model::load_dir(&root().join("models/k3-mini"), CpuBackend::new())?;
    let tower = model
        .vision()
        .context("models/k3-mini has no vision_config")?;
    let cfg = tower.config().clone();
    let mut images = 0;
    for k in 0.. {
        let name = format!("image{k}.pixels");
        if !g.contains(&name) {
            break;
        }
        let (shape, pixels) = g.any_f32(&name)?;
        ensure!(shape.len() == 3 && shape[0] == 3, "{name}: shape {shape:?}");
        let img = ImagePixels {
            height: shape[1],
            width: shape[2],
            pixels,
            content_hash: [k as u8; 32],
        };
        let got = cpu_stages(tower, &img)?;
        for (s, stage) in STAGE_NAMES.iter().enumerate() {
            let (ws, want) = g.any_f32(&format!("image{k}.{stage}"))?;
            let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
            let e = rel_err(&got[s], &want, *ws.last().unwrap_or(&1));
            eprintln!("image{k} {stage}: rel err {e:.2e}");
            ensure!(e <= 1e-4, "image{k} {stage}: {e:.3e} > 1e-4");
        }
        assert_eq!(
            got[6].len(),
            cfg.image_tokens(img.height, img.width) * DECODER
        );
        images += 1;
    }
    ensure!(images >= 2, "{} holds {images} images", p.display());
    Ok(())
}

// ---- the splice, through the executor ----

/// k3-mini with its vision tower: the trained one when models/k3-mini has it, else (until
/// then) the contract's config with seeded random weights.
fn vision_model() -> Result<Model<CpuBackend>> {
    let dir = root().join("models/k3-mini");
    let mut cfg = Config::from_file(&dir.join("config.json"))?;
    if cfg.vision.is_some() {
        return Ok(Model::load_dir(&dir, CpuBackend::new())?);
    }
    cfg.vision = Some(contract_vision());
    let file = WeightFile::open(&dir.join("model.safetensors"))?;
    Ok(
        Model::from_tensors(cfg, &file.tensors(), CpuBackend::new())?
            .with_vision(&Tensors::dummy(3))?,
    )
}

fn session(model: Model<CpuBackend>) -> Result<Session<ModelExecutor<CpuBackend>>> {
    Ok(Session::new(ModelExecutor::with_capacity(
        model, 16, 1, 128, 0,
    )?)?)
}

/// Text, a 64x96 image (6 tokens), text, a 96x64 image (6 tokens), text.
fn image_prompt(pad: u32, seed: u64) -> (Vec<u32>, Vec<MediaInput>) {
    let mut ids: Vec<u32> = vec![1, 310, 2201, 45, 6000];
    let a = MediaInput {
        position: ids.len(),
        tokens: 6,
        image: image(64, 96, seed),
    };
    ids.extend([pad; 6]);
    ids.extend([777, 1500, 92, 4000]);
    let b = MediaInput {
        position: ids.len(),
        tokens: 6,
        image: image(96, 64, seed + 1),
    };
    ids.extend([pad; 6]);
    ids.extend([3141, 59, 2653]);
    (ids, vec![a, b])
}

#[test]
fn image_prompts_splice_the_same_rows_whole_or_chunked() -> Result<()> {
    let model = vision_model()?;
    let pad = model.config.vision.as_ref().unwrap().media_pad_token_id;
    let vocab = model.config.vocab_size;
    let mut s = session(model)?;
    let (ids, media) = image_prompt(pad, 40);
    let whole = s.feed_media(&ids, &media, LogitsWant::All)?;
    assert_eq!(s.executor().model().images_encoded(), 2);

    // Split inside each image (rows 5..11 and 15..21), the images under new hashes: each is
    // encoded once although its span crosses two chunks.
    let media2: Vec<MediaInput> = media
        .iter()
        .map(|m| {
            let mut img = (*m.image).clone();
            img.content_hash[31] ^= 0xFF;
            MediaInput {
                image: Arc::new(img),
                ..m.clone()
            }
        })
        .collect();
    s.reset()?;
    let mut chunked = Vec::new();
    for w in [0, 8, 17, ids.len()].windows(2) {
        chunked.extend(s.feed_media(&ids[w[0]..w[1]], &media2, LogitsWant::All)?);
    }
    assert_eq!(s.executor().model().images_encoded(), 4);
    let e = rel_err(
        &chunked,
        &whole.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        vocab,
    );
    eprintln!("chunked vs whole image prompt: rel err {e:.2e}");
    ensure!(e <= 1e-4, "chunked prefill changed the logits: {e:.3e}");

    // The same prompt again: every image from the cache.
    s.reset()?;
    let again = s.feed_media(&ids, &media, LogitsWant::All)?;
    assert_eq!(s.executor().model().images_encoded(), 4);
    assert_eq!(again, whole, "cached tower rows must be the same rows");

    // The same tokens as plain `<|media_pad|>` embeddings: the rows before the first image are
    // unchanged (up to the experts' arithmetic, which follows how many rows each one gets),
    // those from it on are not.
    let close = |a: &[f32], b: &[f32]| {
        rel_err(a, &b.iter().map(|&x| x as f64).collect::<Vec<_>>(), vocab) <= 1e-5
    };
    s.reset()?;
    let plain = s.feed(&ids, LogitsWant::All)?;
    let first = media[0].position;
    ensure!(close(&plain[..first * vocab], &whole[..first * vocab]));
    for r in first..ids.len() {
        let row = |v: &[f32]| v[r * vocab..(r + 1) * vocab].to_vec();
        let d = row(&plain)
            .iter()
            .zip(row(&whole))
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        ensure!(
            d > 1e-3,
            "row {r}: image rows left the logits unchanged ({d})"
        );
    }

    // A different image gives different logits from its first row on.
    s.reset()?;
    let (_, other) = image_prompt(pad, 90);
    let diff = s.feed_media(&ids, &other, LogitsWant::All)?;
    let r = first * vocab;
    ensure!(close(&diff[..r], &whole[..r]) && !close(&diff[r..r + vocab], &whole[r..r + vocab]));
    Ok(())
}

fn invalid(r: Result<Vec<f32>, ExecError>, want: &str) -> Result<()> {
    match r {
        Err(ExecError::InvalidBatch(m)) if m.contains(want) => Ok(()),
        Err(e) => anyhow::bail!("expected an invalid batch naming {want:?}, got {e}"),
        Ok(_) => anyhow::bail!("expected an invalid batch naming {want:?}, the step ran"),
    }
}

#[test]
fn bad_media_is_an_error_and_the_session_goes_on() -> Result<()> {
    let mut s = session(vision_model()?)?;
    let (ids, media) = image_prompt(7, 3);
    // A span one token short of the tower's 6.
    let mut short = media.clone();
    short[0].tokens = 5;
    invalid(s.feed_media(&ids, &short, LogitsWant::Last), "gives 6")?;
    // Overlapping spans.
    let mut overlap = media.clone();
    overlap[1].position = overlap[0].position + 3;
    invalid(s.feed_media(&ids, &overlap, LogitsWant::Last), "overlap")?;
    // Pixels that do not match the size, and a size the tower cannot take.
    let mut bad = media.clone();
    let mut img = (*bad[0].image).clone();
    img.pixels.pop();
    bad[0].image = Arc::new(img);
    invalid(s.feed_media(&ids, &bad, LogitsWant::Last), "pixel values")?;
    let mut odd = media.clone();
    let mut img = (*odd[0].image).clone();
    img.width = 80;
    odd[0].image = Arc::new(img);
    invalid(s.feed_media(&ids, &odd, LogitsWant::Last), "multiple of 32")?;
    // Nothing was consumed: the good prompt still runs from position 0.
    assert_eq!(s.position(), 0);
    s.feed_media(&ids, &media, LogitsWant::Last)?;

    // A model without a vision tower refuses images (and still serves text).
    let dir = root().join("models/k3-mini");
    let mut cfg = Config::from_file(&dir.join("config.json"))?;
    cfg.vision = None;
    let file = WeightFile::open(&dir.join("model.safetensors"))?;
    let mut text = session(Model::from_tensors(
        cfg,
        &file.tensors(),
        CpuBackend::new(),
    )?)?;
    invalid(
        text.feed_media(&ids, &media, LogitsWant::Last),
        "no vision tower",
    )?;
    text.feed(&ids, LogitsWant::Last)?;
    Ok(())
}
