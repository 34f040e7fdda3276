//! The vision tower on CUDA (kernels/vision.cu, src/vision.rs; docs/vision.md) against the CPU
//! backend:
//!   vision_ops_match_cpu      add_bias, gelu_tanh, vision_attention (grids 1x1 .. 16x16, head
//!                             sizes 64 and 128) and merge_patches on random inputs
//!   vision_tower_matches_cpu  models/k3-mini's tower on images 64x96 .. 256x256 (the serving
//!                             limit, 65536 pixels): output rows within TOL_TOWER of the CPU's;
//!                             prints `vision_tower HxW tokens=n cpu=.. ms cuda=.. ms` per image
//!   vision_splice_matches_cpu an image prompt through ModelExecutor<CudaBackend>: logits within
//!                             LOGITS_TOL of the CPU executor's, and the same whole or split
//!                             mid-image, each image encoded once

use super::*;
use k3_model::backend::VisionAttnGeom;
use k3_model::{ImagePixels, MediaInput};
use std::sync::Arc;
use std::time::Instant;

/// The tower end to end: 4 blocks and the projector, ~25 matmuls whose activations enter the
/// bf16 tensor-core GEMM as hi/lo halves (TOL_BF16_GEMM each) plus the fused attention
/// (TOL_FUSED); the errors add up over the residual stream. Observed on the CPU side against
/// the reference: ~1e-6.
const TOL_TOWER: f64 = 5e-4;

fn vision_ops<B: Backend>(be: &B, seed: u64) -> Vec<(String, Vec<f32>, f64)> {
    let mut r = Rng(seed | 1);
    let mut out = Vec::new();
    let x = r.vec(37 * 192, 3.0);
    let b = r.vec(192, 1.0);
    let mut a = be.upload_act(37, 192, x.clone()).unwrap();
    be.add_bias(&mut a, &be.vector(b).unwrap()).unwrap();
    out.push(("add_bias".into(), be.to_host(&a).unwrap(), TOL_POINTWISE));
    let mut g = be.upload_act(37, 192, x).unwrap();
    be.gelu_tanh(&mut g).unwrap();
    out.push(("gelu_tanh".into(), be.to_host(&g).unwrap(), TOL_POINTWISE));
    for (gh, gw, heads, hd) in [
        (1, 1, 3, 64),
        (2, 3, 3, 64),
        (4, 6, 3, 64),
        (12, 12, 3, 64),
        (16, 16, 2, 128),
    ] {
        let n = gh * gw;
        let qkv = be.upload_act(n, 3 * heads * hd, r.vec(n * 3 * heads * hd, 2.0));
        let geom = VisionAttnGeom {
            heads,
            head_dim: hd,
            grid_h: gh,
            grid_w: gw,
            rope_theta: 10000.0,
        };
        let o = be.vision_attention(&qkv.unwrap(), geom).unwrap();
        out.push((
            format!("vision_attention {gh}x{gw} h={heads} hd={hd}"),
            be.to_host(&o).unwrap(),
            TOL_FUSED,
        ));
    }
    let (gh, gw) = (6, 4);
    let m = be
        .upload_act(gh * gw, 192, r.vec(gh * gw * 192, 1.0))
        .unwrap();
    let merged = be.merge_patches(&m, gh, gw, 2).unwrap();
    out.push((
        "merge_patches".into(),
        be.to_host(&merged).unwrap(),
        0.0, // a copy
    ));
    out
}

#[test]
fn vision_ops_match_cpu() {
    let Some(gpu) = cuda() else { return };
    let seed = Rng::new("vision_ops_match_cpu").u64();
    let mut t = Table::new("");
    let (g, c) = (vision_ops(&gpu, seed), vision_ops(&CpuBackend::new(), seed));
    for ((name, a, tol), (_, b, _)) in g.iter().zip(&c) {
        t.check(name, a, b, *tol);
    }
    // Shapes the op cannot take are errors, not launches.
    let bad = gpu.upload_act(6, 3 * 192, vec![0.0; 6 * 3 * 192]).unwrap();
    let geom = VisionAttnGeom {
        heads: 3,
        head_dim: 64,
        grid_h: 2,
        grid_w: 2,
        rope_theta: 10000.0,
    };
    assert!(gpu.vision_attention(&bad, geom).is_err());
    assert!(gpu.merge_patches(&bad, 3, 2, 2).is_err());
    t.finish();
}

/// A random image (pixels as the media stage normalises u8 values).
fn image(h: usize, w: usize, r: &mut Rng, tag: u8) -> Arc<ImagePixels> {
    let pixels = (0..3 * h * w)
        .map(|_| (r.below(256) as f32) / 127.5 - 1.0)
        .collect();
    Arc::new(ImagePixels {
        height: h,
        width: w,
        pixels,
        content_hash: [tag; 32],
    })
}

#[test]
fn vision_tower_matches_cpu() {
    let Some(gpu) = cuda() else { return };
    let mut r = Rng::new("vision_tower_matches_cpu");
    let dir = root().join("models/k3-mini");
    let g = Model::load_dir(&dir, gpu).expect("load on the GPU");
    let c = Model::load_dir(&dir, CpuBackend::new()).expect("load cpu");
    let (gt, ct) = (
        g.vision().expect("k3-mini has a vision tower"),
        c.vision().unwrap(),
    );
    let mut t = Table::new("");
    for (k, (h, w)) in [(64, 96), (96, 64), (192, 192), (256, 256)]
        .into_iter()
        .enumerate()
    {
        let img = image(h, w, &mut r, k as u8);
        // Warm-up (module loads, cuBLAS handles), then the mean of several runs, each ended by
        // the copy to the host (which waits for the stream).
        let time = |f: &dyn Fn() -> Vec<f32>| {
            let out = f();
            let runs = 10;
            let t0 = Instant::now();
            for _ in 0..runs {
                f();
            }
            (out, t0.elapsed().as_secs_f64() * 1e3 / runs as f64)
        };
        let (og, ms_g) = time(&|| {
            g.backend
                .to_host(&gt.encode(&g.backend, &img).unwrap())
                .unwrap()
        });
        let (oc, ms_c) = time(&|| {
            c.backend
                .to_host(&ct.encode(&c.backend, &img).unwrap())
                .unwrap()
        });
        println!(
            "vision_tower {h}x{w} tokens={} cpu={ms_c:.3} ms cuda={ms_g:.3} ms",
            oc.len() / c.config.hidden_size
        );
        t.check(&format!("vision_tower {h}x{w}"), &og, &oc, TOL_TOWER);
    }
    t.finish();
}

/// Text, a 64x96 image (6 tokens), text, a 96x64 image (6 tokens), text.
fn prompt(pad: u32, r: &mut Rng, tag: u8) -> (Vec<u32>, Vec<MediaInput>) {
    let text = |r: &mut Rng, n: usize| -> Vec<u32> {
        (0..n).map(|_| 100 + r.below(8000) as u32).collect()
    };
    let mut ids = text(r, 5);
    let a = MediaInput {
        position: ids.len(),
        tokens: 6,
        image: image(64, 96, r, tag),
    };
    ids.extend([pad; 6]);
    ids.extend(text(r, 4));
    let b = MediaInput {
        position: ids.len(),
        tokens: 6,
        image: image(96, 64, r, tag + 1),
    };
    ids.extend([pad; 6]);
    ids.extend(text(r, 3));
    (ids, vec![a, b])
}

fn session<B: Backend>(m: Model<B>) -> Session<ModelExecutor<B>> {
    let exec = ModelExecutor::with_capacity(m, 16, 1, 128, 0).expect("executor");
    Session::new(exec).expect("session")
}

#[test]
fn vision_splice_matches_cpu() {
    let Some(gpu) = cuda() else { return };
    let mut r = Rng::new("vision_splice_matches_cpu");
    let dir = root().join("models/k3-mini");
    let mut g = session(Model::load_dir(&dir, gpu).expect("load on the GPU"));
    let mut c = session(Model::load_dir(&dir, CpuBackend::new()).expect("load cpu"));
    let pad = c
        .executor()
        .model()
        .config
        .vision
        .as_ref()
        .unwrap()
        .media_pad_token_id;
    let (ids, media) = prompt(pad, &mut r, 1);
    let lg = g
        .feed_media(&ids, &media, LogitsWant::All)
        .expect("gpu prefill");
    let lc = c
        .feed_media(&ids, &media, LogitsWant::All)
        .expect("cpu prefill");
    let e = rel_err(&lg, &lc);
    println!("vision_splice whole rel_err={e:.3e} tol={LOGITS_TOL:.0e}");
    // Split inside each image, under new hashes: encoded once each, same logits.
    let media2: Vec<MediaInput> = media
        .iter()
        .map(|m| {
            let mut img = (*m.image).clone();
            img.content_hash[0] ^= 0x80;
            MediaInput {
                image: Arc::new(img),
                ..m.clone()
            }
        })
        .collect();
    g.reset().unwrap();
    let mut split = Vec::new();
    for w in [0, 8, 17, ids.len()].windows(2) {
        split.extend(
            g.feed_media(&ids[w[0]..w[1]], &media2, LogitsWant::All)
                .expect("gpu chunk"),
        );
    }
    let es = rel_err(&split, &lg);
    let encoded = g.executor().model().images_encoded();
    println!(
        "vision_splice chunked-vs-whole rel_err={es:.3e} tol={TOL_FUSED:.0e} images_encoded={encoded}"
    );
    // Decoding on after the image prompt (a CUDA-graph step once warm) still matches.
    let vocab = lc.len() / ids.len();
    let last = |l: &[f32]| top2(&l[l.len() - vocab..]).0.0 as u32;
    let (ng, nc) = (last(&split), last(&lc));
    c.reset().unwrap();
    c.feed_media(&ids, &media2, LogitsWant::Last).unwrap();
    let (dg, dc) = (
        g.feed(&[ng], LogitsWant::Last).expect("gpu decode"),
        c.feed(&[nc], LogitsWant::Last).expect("cpu decode"),
    );
    let ed = if ng == nc { rel_err(&dg, &dc) } else { 0.0 };
    println!("vision_splice decode next={ng}/{nc} rel_err={ed:.3e} tol={LOGITS_TOL:.0e}");
    assert!(
        e <= LOGITS_TOL,
        "image prompt logits {e:.3e} > {LOGITS_TOL:.0e}"
    );
    assert!(
        es <= TOL_FUSED,
        "chunked image prompt {es:.3e} > {TOL_FUSED:.0e}"
    );
    assert_eq!(encoded, 4, "each image encoded once");
    assert!(ed <= LOGITS_TOL, "decode after the image {ed:.3e}");
}
