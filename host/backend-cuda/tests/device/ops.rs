//! Every `Backend` op, the MLA paths and `top_k_rows` on the GPU against the CPU, on fresh
//! random inputs (the routed experts' inputs from experts.rs); and the harness's self-check on
//! the CPU.

use super::*;
use experts::{moe, moe_and_shared};

/// Simple ops, generic over the backend: each returns its output(s) on the host.
fn simple_ops<B: Backend>(be: &B, r: &mut Rng) -> Vec<(&'static str, Vec<f32>, f64)> {
    let mut out = Vec::new();
    let mat = |be: &B, rows: usize, cols: usize, d: &[f32]| {
        be.embed(
            &be.linear(rows, cols, d.to_vec()).unwrap(),
            &(0..rows as u32).collect::<Vec<_>>(),
        )
        .unwrap()
    };
    // matmul: prefill-like and decode-like shapes, K not a multiple of anything in particular.
    for &(m, k, n) in &[
        (37usize, 200usize, 130usize),
        (1, 256, 8192),
        (64, 128, 768),
    ] {
        let (x, w) = (r.vec(m * k, 1.0), r.vec(n * k, 0.1));
        let y = be
            .matmul(&mat(be, m, k, &x), &be.linear(n, k, w).unwrap())
            .unwrap();
        out.push(("matmul", be.to_host(&y).unwrap(), TOL_GEMM));
        let w = bf16_values(r.vec(n * k, 0.1));
        let y = be
            .matmul(&mat(be, m, k, &x), &be.linear(n, k, w).unwrap())
            .unwrap();
        out.push((
            "matmul, bf16 weights",
            be.to_host(&y).unwrap(),
            TOL_BF16_GEMM,
        ));
    }
    // bf16 weights at decode sizes (<= 16 rows, K % 8 == 0, <= 2^22 weights): the tensor-core
    // weight-streaming kernel (x in three bf16 pieces: f32 accuracy), split-K on short-N shapes
    // (1x7168x300 in 14 splits, 16x1544x2100 in 4); otherwise the split GEMM (16x7168x1536,
    // 2x1024x4200 and 1x1536x18432 over 2^22, 3x202x50 with K % 8 != 0, 17 rows), through
    // cuBLASLt up to 256 rows (64x512x8200) and cublasGemmEx past them (300x256x300; blas_lt.rs).
    // Tails: N not a multiple of 128, K not a multiple of the 64-column step.
    for &(m, k, n) in &[
        (1usize, 7168usize, 300usize),
        (5, 520, 77),
        (8, 64, 4096),
        (3, 202, 50),
        (2, 1024, 4200),
        (16, 7168, 1536),
        (16, 1544, 2100),
        (1, 1536, 18432),
        (17, 256, 300),
        (64, 512, 8200),
        (300, 256, 300),
    ] {
        let x = r.vec(m * k, 1.0);
        let w = bf16_values(r.vec(n * k, 0.1));
        let y = be
            .matmul(&mat(be, m, k, &x), &be.linear(n, k, w).unwrap())
            .unwrap();
        // dense/mod.rs matmul_linear: the tensor-core GEMV up to this many weights.
        let max_elems = CudaOptions::DEFAULT_GEMV_MAX_WEIGHT_ELEMS;
        let f32_exact = k % 8 == 0 && m <= 16 && n * k <= max_elems;
        let tol = if f32_exact { TOL_GEMM } else { TOL_BF16_GEMM };
        out.push((
            "matmul, bf16 weights, decode rows",
            be.to_host(&y).unwrap(),
            tol,
        ));
    }
    // matmuls: weights sharing one input (x's bf16 rows made once on CUDA), mixing the split
    // GEMM (17 rows), the tensor-core GEMV (4 rows) and an f32 weight; each result must equal
    // matmul's bit for bit (the pushed difference is zero on both backends). In bf16 mode the
    // two GEMMs of 17 rows run at once, on two side streams (lanes.rs), and at 4 rows the first
    // weight (past the GEMV's 2^22 elements) on a side stream while the GEMV runs.
    for &(m, k, n0) in &[(17usize, 256usize, 300usize), (4, 512, 300), (4, 512, 8200)] {
        let x = mat(be, m, k, &r.vec(m * k, 1.0));
        let ws = [
            be.linear(n0, k, bf16_values(r.vec(n0 * k, 0.1))).unwrap(),
            be.linear(77, k, r.vec(77 * k, 0.1)).unwrap(),
            be.linear(64, k, bf16_values(r.vec(64 * k, 0.1))).unwrap(),
        ];
        let ys = be.matmuls(&x, &[&ws[0], &ws[1], &ws[2]]).unwrap();
        assert_eq!(ys.len(), 3);
        for (w, y) in ws.iter().zip(&ys) {
            let got = be.to_host(y).unwrap();
            let one = be.to_host(&be.matmul(&x, w).unwrap()).unwrap();
            let diff: Vec<f32> = got.iter().zip(&one).map(|(a, b)| a - b).collect();
            out.push(("matmuls, one split for all", got, TOL_BF16_GEMM));
            out.push(("matmuls = matmul", diff, 0.0));
        }
    }
    let (rows, d) = (19, 256);
    let table = r.vec(50 * d, 1.0);
    let ids: Vec<u32> = (0..rows).map(|_| r.below(50) as u32).collect();
    let e = be.embed(&be.linear(50, d, table).unwrap(), &ids).unwrap();
    out.push(("embed", be.to_host(&e).unwrap(), 0.0));
    let table = bf16_values(r.vec(50 * d, 1.0));
    let eb = be.embed(&be.linear(50, d, table).unwrap(), &ids).unwrap();
    out.push(("embed, bf16 table", be.to_host(&eb).unwrap(), 0.0));
    out.push((
        "slice_rows",
        be.to_host(&be.slice_rows(&e, 3, 11).unwrap()).unwrap(),
        0.0,
    ));
    let x = mat(be, rows, d, &r.vec(rows * d, 2.0));
    let w = be.vector(r.vec(d, 1.0)).unwrap();
    out.push((
        "rms_norm",
        be.to_host(&be.rms_norm(&x, &w, 1e-5).unwrap()).unwrap(),
        TOL_POINTWISE,
    ));
    // A product of a norm's output: in bfloat16 mode CUDA's norm also writes its bf16 rows and
    // the cuBLAS product (19 rows) takes them; the same values uploaded without them are split
    // by the product itself. Bit for bit the same (the pushed difference is zero on both).
    let normed = be.rms_norm(&x, &w, 1e-5).unwrap();
    let wp = be.linear(40, d, bf16_values(r.vec(40 * d, 0.1))).unwrap();
    let via_norm = be.to_host(&be.matmul(&normed, &wp).unwrap()).unwrap();
    let plain = mat(be, rows, d, &be.to_host(&normed).unwrap());
    let via_split = be.to_host(&be.matmul(&plain, &wp).unwrap()).unwrap();
    let diff: Vec<f32> = via_norm
        .iter()
        .zip(&via_split)
        .map(|(a, b)| a - b)
        .collect();
    out.push(("matmul of a norm's output = of its values", diff, 0.0));
    // An op writing in place drops them: the product sees the new values.
    let mut bumped = be.rms_norm(&x, &w, 1e-5).unwrap();
    be.add_assign(&mut bumped, &plain).unwrap();
    let after = be.to_host(&be.matmul(&bumped, &wp).unwrap()).unwrap();
    let fresh = mat(be, rows, d, &be.to_host(&bumped).unwrap());
    let want = be.to_host(&be.matmul(&fresh, &wp).unwrap()).unwrap();
    let diff: Vec<f32> = after.iter().zip(&want).map(|(a, b)| a - b).collect();
    out.push(("matmul after an in-place add", diff, 0.0));
    let mut p = mat(be, rows, d, &r.vec(rows * d, 1.0));
    be.add_assign(&mut p, &x).unwrap();
    out.push(("add_assign", be.to_host(&p).unwrap(), TOL_POINTWISE));
    for n in [1usize, 3, 9] {
        let srcs: Vec<B::Act> = (0..n)
            .map(|_| mat(be, rows, d, &r.vec(rows * d, 1.5)))
            .collect();
        let refs: Vec<&B::Act> = srcs.iter().collect();
        let name = match n {
            1 => "attn_res(1)",
            3 => "attn_res(3)",
            _ => "attn_res(9)",
        };
        out.push((
            name,
            be.to_host(&be.attn_res(&refs, &w, 1e-5).unwrap()).unwrap(),
            TOL_POINTWISE,
        ));
    }
    // What opens a sublayer (one kernel on CUDA, the ops above composed on the CPU): four bank
    // sources and the running sum, with and without the mixer's output added into it first.
    for (name, with_add) in [
        ("attn_res_norm", false),
        ("attn_res_norm, last += add", true),
    ] {
        let bank: Vec<B::Act> = (0..4)
            .map(|_| mat(be, rows, d, &r.vec(rows * d, 1.5)))
            .collect();
        let refs: Vec<&B::Act> = bank.iter().collect();
        let mut last = mat(be, rows, d, &r.vec(rows * d, 1.5));
        let add = mat(be, rows, d, &r.vec(rows * d, 0.5));
        let norm = be.vector(r.vec(d, 1.0)).unwrap();
        let x = be
            .attn_res_norm(&refs, &mut last, with_add.then_some(&add), &w, &norm, 1e-5)
            .unwrap();
        out.push((name, be.to_host(&x).unwrap(), TOL_POINTWISE));
        out.push((
            "attn_res_norm's running sum",
            be.to_host(&last).unwrap(),
            TOL_POINTWISE,
        ));
    }
    let (g, u) = (
        mat(be, rows, 768, &r.vec(rows * 768, 4.0)),
        mat(be, rows, 768, &r.vec(rows * 768, 2.0)),
    );
    for (name, lb) in [("situ_glu", Some(25.0)), ("situ_glu(no linear)", None)] {
        let y = be
            .situ_glu(
                &g,
                &u,
                SituParams {
                    beta: 4.0,
                    linear_beta: lb,
                },
            )
            .unwrap();
        out.push((name, be.to_host(&y).unwrap(), TOL_POINTWISE));
    }
    let mut o = mat(be, rows, d, &r.vec(rows * d, 1.0));
    be.sigmoid_mul(&mut o, &x).unwrap();
    out.push(("sigmoid_mul", be.to_host(&o).unwrap(), TOL_POINTWISE));
    let hw = be.vector(r.vec(128, 1.0)).unwrap();
    let gate = mat(be, rows, d, &r.vec(rows * d, 3.0));
    out.push((
        "gated_head_norm",
        be.to_host(&be.gated_head_norm(&o, &gate, &hw, 128, 1e-5).unwrap())
            .unwrap(),
        TOL_POINTWISE,
    ));
    out
}

/// KDA over three calls of one sequence (prefill with checkpoints, decode with a checkpoint,
/// another prefill chunk); returns each call's `o` and the arena afterwards.
fn kda<B: Backend>(be: &B, r: &mut Rng) -> (Vec<Vec<f32>>, Vec<f32>) {
    let g = KdaGeom {
        heads: 2,
        head_dim: 128,
        conv_kernel: 4,
        gate_lower_bound: -5.0,
    };
    let (hk, h) = (g.hk(), g.heads);
    let block = 4 * g.state_floats();
    let (work, ck) = (block, 3 * block); // block 0 unused: offsets are not all zero
    let mut arena = be.arena(6 * block).unwrap();
    let conv: Vec<B::Vector> = (0..3)
        .map(|_| be.vector(r.vec(hk * 4, 0.5)).unwrap())
        .collect();
    let a_log = be.vector(r.vec(h, 0.5)).unwrap();
    let dt_bias = be.vector(r.vec(hk, 0.5)).unwrap();
    let params = KdaParams::<B> {
        conv: [&conv[0], &conv[1], &conv[2]],
        a_log: &a_log,
        dt_bias: &dt_bias,
    };
    let mut outs = Vec::new();
    let steps: [(usize, Vec<(usize, usize)>); 3] = [
        (37, vec![(5, ck), (37, ck + block)]),
        (1, vec![(1, ck + 2 * block)]),
        (20, vec![(16, 0)]),
    ];
    for (t, cps) in steps {
        let ids: Vec<u32> = (0..t as u32).collect();
        let m = |be: &B, r: &mut Rng, w: usize, s: f32| {
            be.embed(&be.linear(t, w, r.vec(t * w, s)).unwrap(), &ids)
                .unwrap()
        };
        let (q, k, v) = (m(be, r, hk, 1.0), m(be, r, hk, 1.0), m(be, r, hk, 1.0));
        let (f, b) = (m(be, r, hk, 2.0), m(be, r, h, 2.0));
        let inputs = KdaInputs::<B> {
            qkv: [&q, &k, &v],
            f: &f,
            b: &b,
        };
        let o = be
            .kda(
                &mut arena,
                g,
                &params,
                &inputs,
                KdaStateLoc {
                    offset: work,
                    checkpoints: &cps,
                    record: None,
                },
            )
            .expect("kda");
        outs.push(be.to_host(&o).unwrap());
    }
    let len = be.arena_len(&arena);
    (outs, bytes_to_f32(&be.arena_read(&arena, 0, len).unwrap()))
}

/// MLA over scattered pages: prefill, decode, a chunk, then a long decode (several splits).
/// `bf16`: kv_b of bf16 values (stored as bf16 by the CUDA backend: its absorbed path runs the
/// bf16 W_UK / W_UV kernels on 21, 1 and 9 items), else f32 values (the f32 kernels).
fn mla<B: Backend>(
    be: &B,
    r: &mut Rng,
    g: MlaGeom,
    long: usize,
    bf16: bool,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let (pt, row) = (8usize, g.row());
    let layer_off = 4 * row * pt; // two "layers" per page: test the second
    let page_bytes = 2 * layer_off;
    let total = 21 + 1 + 9 + long;
    let npages = total.div_ceil(pt);
    // Pages in reverse order, after a gap: page tables are followed, not assumed contiguous.
    let pages: Vec<usize> = (0..npages).map(|i| (npages - i) * page_bytes).collect();
    let mut arena = be.arena((npages + 1) * page_bytes).unwrap();
    let kv_norm = be.vector(r.vec(g.kv_lora, 1.0)).unwrap();
    let kvb = r.vec(g.heads * (g.nope + g.v_dim) * g.kv_lora, 0.1);
    let kvb = if bf16 { bf16_values(kvb) } else { kvb };
    let kv_b = be
        .linear(g.heads * (g.nope + g.v_dim), g.kv_lora, kvb)
        .unwrap();
    let mut outs = Vec::new();
    let mut pos = 0;
    for t in [21usize, 1, 9, long] {
        if t == 0 {
            continue;
        }
        let ids: Vec<u32> = (0..t as u32).collect();
        let q = be
            .embed(
                &be.linear(
                    t,
                    g.heads * (g.nope + g.rope),
                    r.vec(t * g.heads * (g.nope + g.rope), 1.0),
                )
                .unwrap(),
                &ids,
            )
            .unwrap();
        let kv_a = be
            .embed(&be.linear(t, row, r.vec(t * row, 1.0)).unwrap(), &ids)
            .unwrap();
        let loc = MlaCacheLoc {
            pages: &pages,
            page_tokens: pt,
            layer_offset: layer_off,
            start_pos: pos,
        };
        let o = be
            .mla(&mut arena, g, &q, &kv_a, &kv_norm, &kv_b, loc)
            .expect("mla");
        outs.push(be.to_host(&o).unwrap());
        pos += t;
    }
    let len = be.arena_len(&arena);
    (outs, bytes_to_f32(&be.arena_read(&arena, 0, len).unwrap()))
}

/// The steps of [`mla_both_paths`], in order.
const MLA_PATH_STEPS: [&str; 5] = [
    "prompt(T=64, no prefix: expanded)",
    "chunk(T=63 after 64: absorbed)",
    "chunk(T=600 after 127: expanded, 512 + 88 queries)",
    "batch(decode after 727: absorbed + T=70 prompt: expanded)",
    "batch(decode of both: 2 items after 728 and 70, absorbed)",
];

/// `q` `[t, H·(nope+rope)]` and `kv_a` `[t, row]` as activations.
fn mla_inputs<B: Backend>(be: &B, r: &mut Rng, g: MlaGeom, t: usize) -> (B::Act, B::Act) {
    let ids: Vec<u32> = (0..t as u32).collect();
    let qw = g.heads * (g.nope + g.rope);
    let q = be
        .embed(&be.linear(t, qw, r.vec(t * qw, 1.0)).unwrap(), &ids)
        .unwrap();
    let kv_a = be
        .embed(
            &be.linear(t, g.row(), r.vec(t * g.row(), 1.0)).unwrap(),
            &ids,
        )
        .unwrap();
    (q, kv_a)
}

/// MLA steps around the expanded-prefill threshold ([`MLA_PATH_STEPS`]): sequence 0 gets a
/// 64-token prompt, a 63-token chunk and a 600-token chunk; then one `mla_batch` step decodes
/// sequence 0 (row 0) together with sequence 1's 70-token prompt (rows 1..71), so the expanded
/// sequence's rows start at row 1 of the shared output; a last step decodes both. kv_b holds bf16
/// values (the CUDA backend's bf16 W_UK / W_UV kernels on the absorbed steps, the f32 copy on the
/// expanded ones). Returns the outputs and the arena.
fn mla_both_paths<B: Backend>(be: &B, r: &mut Rng, g: MlaGeom) -> (Vec<Vec<f32>>, Vec<f32>) {
    let pt = 16usize; // as in `loc` below
    let page_bytes = pt * g.row() * 4;
    let (n0, n1) = ((64 + 63 + 600 + 1usize).div_ceil(pt), 70usize.div_ceil(pt));
    // Sequence 1 in the first pages, sequence 0 in the rest in reverse order.
    let pages0: Vec<usize> = (0..n0).map(|i| (n0 + n1 - 1 - i) * page_bytes).collect();
    let pages1: Vec<usize> = (0..n1).map(|i| i * page_bytes).collect();
    let mut arena = be.arena((n0 + n1) * page_bytes).unwrap();
    let kv_norm = be.vector(r.vec(g.kv_lora, 1.0)).unwrap();
    let kvb_rows = g.heads * (g.nope + g.v_dim);
    let kvb = bf16_values(r.vec(kvb_rows * g.kv_lora, 0.1));
    let kv_b = be.linear(kvb_rows, g.kv_lora, kvb).unwrap();
    fn loc(pages: &[usize], start_pos: usize) -> MlaCacheLoc<'_> {
        MlaCacheLoc {
            pages,
            page_tokens: 16,
            layer_offset: 0,
            start_pos,
        }
    }
    let mut outs = Vec::new();
    let mut pos = 0;
    for t in [64usize, 63, 600] {
        let (q, kv_a) = mla_inputs(be, r, g, t);
        let o = be
            .mla(&mut arena, g, &q, &kv_a, &kv_norm, &kv_b, loc(&pages0, pos))
            .expect("mla");
        outs.push(be.to_host(&o).unwrap());
        pos += t;
    }
    let (q, kv_a) = mla_inputs(be, r, g, 71);
    let locs = [loc(&pages0, pos), loc(&pages1, 0)];
    let o = be
        .mla_batch(
            &mut arena,
            g,
            &q,
            &kv_a,
            &kv_norm,
            &kv_b,
            &[(0, 1), (1, 71)],
            &locs,
        )
        .expect("mla_batch");
    outs.push(be.to_host(&o).unwrap());
    let (q, kv_a) = mla_inputs(be, r, g, 2);
    let locs = [loc(&pages0, pos + 1), loc(&pages1, 70)];
    let o = be
        .mla_batch(
            &mut arena,
            g,
            &q,
            &kv_a,
            &kv_norm,
            &kv_b,
            &[(0, 1), (1, 2)],
            &locs,
        )
        .expect("mla_batch decode");
    outs.push(be.to_host(&o).unwrap());
    let len = be.arena_len(&arena);
    (outs, bytes_to_f32(&be.arena_read(&arena, 0, len).unwrap()))
}

fn arena_ops<B: Backend>(be: &B, r: &mut Rng) -> Vec<f32> {
    let mut a = be.arena(4096).unwrap();
    let (rows, cols) = (4, 64);
    let src = be
        .embed(
            &be.linear(rows, cols, r.vec(rows * cols, 1.0)).unwrap(),
            &[0, 1, 2, 3],
        )
        .unwrap();
    // A pattern written through MLA's append: rows [RMSNorm(c_kv) (32) ; k_r (32)].
    let g = MlaGeom {
        heads: 1,
        nope: 32,
        rope: 32,
        v_dim: 32,
        kv_lora: 32,
        eps: 1e-5,
    };
    let q = be
        .embed(
            &be.linear(rows, 64, r.vec(rows * 64, 1.0)).unwrap(),
            &[0, 1, 2, 3],
        )
        .unwrap();
    let kv_b = be.linear(64, 32, r.vec(64 * 32, 0.1)).unwrap();
    let norm = be.vector(vec![1.0; 32]).unwrap();
    let loc = MlaCacheLoc {
        pages: &[0],
        page_tokens: 4,
        layer_offset: 0,
        start_pos: 0,
    };
    be.mla(&mut a, g, &q, &src, &norm, &kv_b, loc)
        .expect("mla append");
    be.arena_copy(&mut a, 0, 2048, 1024).unwrap();
    // Unaligned byte ranges, inside row 0's k_r part (bytes 128..256: copied verbatim, so the
    // bytes match exactly and their reinterpretation as floats is comparable).
    be.arena_copy(&mut a, 130, 3072 + 2, 120).unwrap();
    be.arena_zero(&mut a, 100, 37).unwrap();
    let mut out = bytes_to_f32(&be.arena_read(&a, 0, 4096).unwrap());
    out.extend(bytes_to_f32(&be.arena_read(&a, 3073, 12).unwrap()));
    out
}

#[test]
fn ops_match_cpu() {
    let Some(gpu) = cuda() else { return };
    // The f32-level decode attend: the MLA tolerances below (TOL_FUSED) hold only for it;
    // `mla_bf16_matches_cpu` covers the bf16 ones.
    compare_ops(&gpu, "ops_match_cpu", "", 0.0);
}

/// Every op of `ops_match_cpu` in bf16 mode, the serving default: each within
/// [`TOL_BF16_MODE`] of the CPU (the table prints each op's error: the per-op bounds of
/// docs/architecture.md, "Precision").
#[test]
fn ops_match_cpu_bf16() {
    let Some(gpu) = cuda_bf16() else { return };
    compare_ops(&gpu, "ops_match_cpu", "bf16 ", TOL_BF16_MODE);
}

/// The MLA comparisons of `ops_match_cpu` with the bf16 decode attend on mma.sync
/// (kernels/mla_attend_bf16.cu, the fallback off sm_90a; forced here by presenting the GPU as
/// sm_90): the absorbed steps (T < 64 new tokens) take it, so decode, chunks and batched decode
/// differ from the CPU by bf16 rounding (TOL_MLA_BF16).
#[test]
fn mla_bf16_matches_cpu() {
    mla_bf16_attend_matches_cpu(Some("sm_90"), "mla_bf16_matches_cpu", "bf16");
}

/// The same with the attend the GPU runs by default (on sm_90a the cluster-pair wgmma attend,
/// kernels/mla_attend_pair_wgmma.cu): the same bf16 rounding on 64-position tiles, the same tolerance.
#[test]
fn mla_pair_wgmma_matches_cpu() {
    mla_bf16_attend_matches_cpu(None, "mla_pair_wgmma_matches_cpu", "pair");
}

fn mla_bf16_attend_matches_cpu(arch: Option<&str>, test: &str, tag: &str) {
    let Some(mut gpu) = cuda_bf16() else { return };
    if let Some(arch) = arch {
        gpu.limits.arch = arch.into();
    }
    let cpu = CpuBackend::new();
    let seed = Rng::new(test).0;
    let mut t = Table::new("");
    let names = [
        "prefill(T=21)",
        "decode(T=1)",
        "chunk(T=9, from 22)",
        "long prefill",
    ];
    // The long prefills take the expanded path (mode-independent); "paths" ends with a decode
    // over 728 positions (8 position splits on the GPU).
    for (label, g, long) in [("k3-mini", MLA_MINI, 900), ("K3", MLA_K3_DIMS, 700)] {
        let (mut rc, mut rg) = (Rng(seed ^ 11), Rng(seed ^ 11));
        let ((oc, _), (og, _)) = (
            mla(&cpu, &mut rc, g, long, true),
            mla(&gpu, &mut rg, g, long, true),
        );
        for (i, name) in names.iter().enumerate().take(oc.len()) {
            t.check(
                &format!("mla {tag} {label} {name}"),
                &og[i],
                &oc[i],
                TOL_MLA_BF16,
            );
        }
    }
    let (mut rc, mut rg) = (Rng(seed ^ 19), Rng(seed ^ 19));
    let ((oc, _), (og, _)) = (
        mla_both_paths(&cpu, &mut rc, MLA_K3_DIMS),
        mla_both_paths(&gpu, &mut rg, MLA_K3_DIMS),
    );
    for (i, name) in MLA_PATH_STEPS.iter().enumerate() {
        t.check(
            &format!("mla {tag} paths {name}"),
            &og[i],
            &oc[i],
            TOL_MLA_BF16,
        );
    }
    t.finish();
}

/// The harness itself on the CPU against the CPU (runs everywhere): shapes and plumbing of every
/// comparison above, and a deterministic CPU backend (all errors 0).
#[test]
fn harness_self_check_on_cpu() {
    const TAG: &str = "cpu-selfcheck ";
    compare_ops(&CpuBackend::new(), "harness_self_check_on_cpu", TAG, 0.0);
    let _ = compare_model(CpuBackend::new(), 4, TAG);
    compare_engine(CpuBackend::new(), 3, TAG);
}

fn compare_ops<G: Backend>(gpu: &G, name: &str, tag: &'static str, floor: f64) {
    let cpu = CpuBackend::new();
    let seed = Rng::new(name).0;
    let mut t = Table {
        floor,
        ..Table::new(tag)
    };
    let (mut rc, mut rg) = (Rng(seed), Rng(seed));
    let (a, b) = (simple_ops(&cpu, &mut rc), simple_ops(gpu, &mut rg));
    for ((name, want, tol), (_, got, _)) in a.iter().zip(&b) {
        t.check(name, got, want, *tol);
    }
    for tokens in [1usize, 3, 40, 1100] {
        let (mut rc, mut rg) = (Rng(seed ^ tokens as u64), Rng(seed ^ tokens as u64));
        // Assignments = tokens x top-4 over 32 experts: 4, 12 and 160 take the decode-step kernels
        // (dispatch.rs: T = 1 the single-token pair (moe_single_token.cu, moe/single_token.rs), T >= 2 the
        // few-token pair (moe_few_tokens.cu): T = 3 fills part of an n-tile, T = 40 puts 5 tokens per
        // expert on average, so most experts take two or three n-tiles of 4 tokens (float32 mode)
        // or one or two of 8 (bf16 mode) in their one pass), 4400 the many-assignment path (from the default
        // `CudaOptions::moe_gemm_min_assignments` = 4096; `moe_gemm_path_matches_cpu` also runs
        // the cuBLAS fallback).
        let name = match tokens {
            1 => "moe_routed(T=1, single-token kernels)",
            3 => "moe_routed(T=3, few-token kernels)",
            40 => "moe_routed(T=40, few-token kernels, several n-tiles)",
            _ => "moe_routed(T=1100, many-assignment path: the default (wgmma on sm_90a))",
        };
        t.check(
            name,
            &moe(gpu, &mut rg, tokens),
            &moe(&cpu, &mut rc, tokens),
            TOL_FUSED,
        );
    }
    let (mut rc, mut rg) = (Rng(seed ^ 5), Rng(seed ^ 5));
    let (a, b) = (moe_and_shared(&cpu, &mut rc), moe_and_shared(gpu, &mut rg));
    for ((name, want, tol), (_, got, _)) in a.iter().zip(&b) {
        t.check(name, got, want, *tol);
    }
    let (mut rc, mut rg) = (Rng(seed ^ 7), Rng(seed ^ 7));
    let ((oc, ac), (og, ag)) = (kda(&cpu, &mut rc), kda(gpu, &mut rg));
    for (i, name) in [
        "kda prefill(T=37)",
        "kda decode(T=1)",
        "kda prefill(T=20, from state)",
    ]
    .iter()
    .enumerate()
    {
        t.check(name, &og[i], &oc[i], TOL_FUSED);
    }
    t.check("kda state+checkpoints", &ag, &ac, TOL_FUSED);
    for (label, g, long) in [("k3-mini", MLA_MINI, 0), ("K3", MLA_K3_DIMS, 700)] {
        let (mut rc, mut rg) = (Rng(seed ^ 11), Rng(seed ^ 11));
        let ((oc, ac), (og, ag)) = (
            mla(&cpu, &mut rc, g, long, true),
            mla(gpu, &mut rg, g, long, true),
        );
        let names = [
            "prefill(T=21)",
            "decode(T=1)",
            "chunk(T=9, from 22)",
            "long prefill",
        ];
        for i in 0..oc.len() {
            t.check(
                &format!("mla {label} {}", names[i]),
                &og[i],
                &oc[i],
                TOL_FUSED,
            );
        }
        t.check(&format!("mla {label} cache rows"), &ag, &ac, TOL_POINTWISE);
    }
    {
        // A long prefill after 31 cached rows (several position splits on the GPU), with f32 kv_b
        // values: the f32 W_UK / W_UV kernels on the absorbed steps (21, 1 and 9 items).
        let g = MLA_MINI;
        let (mut rc, mut rg) = (Rng(seed ^ 13), Rng(seed ^ 13));
        let ((oc, _), (og, _)) = (
            mla(&cpu, &mut rc, g, 900, false),
            mla(gpu, &mut rg, g, 900, false),
        );
        let names = [
            "prefill(T=21)",
            "decode(T=1)",
            "chunk(T=9, from 22)",
            "prefill(T=900 after 31)",
        ];
        for (i, name) in names.iter().enumerate() {
            t.check(
                &format!("mla k3-mini f32 kv_b {name}"),
                &og[i],
                &oc[i],
                TOL_FUSED,
            );
        }
    }
    {
        // Both sides of the CUDA backend's expanded-prefill threshold (mla/prefill.rs,
        // MLA_EXPANDED_MIN_TOKENS = 64), at K3 head dims; the "long prefill" cases above (700 and
        // 900 new tokens after 31 cached) take the expanded form too.
        let g = MLA_K3_DIMS;
        let (mut rc, mut rg) = (Rng(seed ^ 19), Rng(seed ^ 19));
        let ((oc, ac), (og, ag)) = (
            mla_both_paths(&cpu, &mut rc, g),
            mla_both_paths(gpu, &mut rg, g),
        );
        for (i, name) in MLA_PATH_STEPS.iter().enumerate() {
            t.check(&format!("mla paths {name}"), &og[i], &oc[i], TOL_FUSED);
        }
        t.check("mla paths cache rows", &ag, &ac, TOL_POINTWISE);
    }
    let (mut rc, mut rg) = (Rng(seed ^ 17), Rng(seed ^ 17));
    t.check(
        "arena copy/zero/read",
        &arena_ops(gpu, &mut rg),
        &arena_ops(&cpu, &mut rc),
        TOL_POINTWISE,
    );
    let (mut rc, mut rg) = (Rng(seed ^ 23), Rng(seed ^ 23));
    t.check(
        "top_k_rows (sampling candidates; exact)",
        &top_k_cases(gpu, &mut rg),
        &top_k_cases(&cpu, &mut rc),
        0.0,
    );
    t.finish();
}

/// `Backend::top_k_rows` on logits rows with heavy ties (quarter steps), -0 / +0, NaN / ±inf and
/// fully masked rows, at greedy, top-k and beyond-the-kernel k (host fallback), without and with
/// token bitmasks (`top_k_rows_masked`); flattened as
/// `[count, id, value, id, value, …]` per row so the comparison is exact (tolerance 0).
fn top_k_cases<B: Backend>(be: &B, r: &mut Rng) -> Vec<f32> {
    let mut out = Vec::new();
    for (rows, vocab, k) in [
        (3usize, 163_840usize, 1usize),
        (3, 163_840, 50),
        (2, 70_001, 1024),
        (2, 300, 1024),
        (2, 500, 2000),
    ] {
        let mut v: Vec<f32> = (0..rows * vocab)
            .map(|_| (r.f(12.0) * 4.0).round() / 4.0)
            .collect();
        for (i, x) in v[vocab..2 * vocab].iter_mut().enumerate() {
            *x = match i % 7 {
                0 => -0.0,
                1 => 0.0,
                2 => f32::NAN,
                3 => f32::INFINITY,
                4 => f32::NEG_INFINITY,
                _ => *x - 20.0, // below every ±0
            };
        }
        if rows > 2 {
            v[2 * vocab..].fill(f32::NAN); // nothing finite: an empty selection
        }
        let ids: Vec<u32> = (0..rows as u32).collect();
        let logits = be.embed(&be.linear(rows, vocab, v).unwrap(), &ids).unwrap();
        // Token masks (constrained decoding): a sparse random mask, an unmasked row, and a mask
        // shorter than the vocabulary (what it does not cover is forbidden).
        let words = vocab.div_ceil(32);
        let sparse: Vec<u32> = (0..words)
            .map(|_| (r.f(1.0).abs() * u32::MAX as f32) as u32 & 0x0101_0101)
            .collect();
        let short: Vec<u32> = vec![u32::MAX; words / 2];
        let masks: Vec<Option<&[u32]>> = [Some(&sparse[..]), None, Some(&short[..])]
            .into_iter()
            .take(rows)
            .collect();
        let plain = be.top_k_rows(&logits, k).unwrap();
        let masked = be.top_k_rows_masked(&logits, k, &masks).unwrap();
        for row in plain.into_iter().chain(masked) {
            out.push(row.len() as f32);
            for (id, val) in row {
                out.extend([id as f32, val]);
            }
        }
    }
    out
}
