//! The routed experts on the GPU against the CPU: the inputs `ops_match_cpu` compares at
//! several token counts, the MoE block's two halves together, and the paths only some step
//! shapes or modes take (the many-assignment GEMMs, the single-token kernels, MXFP8).

use super::*;

fn mx_matrix(r: &mut Rng, rows: usize, cols: usize) -> MxMatrixHost {
    MxMatrixHost {
        rows,
        cols,
        packed: (0..rows * cols / 2).map(|_| r.u64() as u8).collect(),
        // E8M0 around 2^-4..2^2 (255 would be NaN).
        scales: (0..rows * cols / 32)
            .map(|_| 123 + r.below(7) as u8)
            .collect(),
    }
}

/// An MoE layer's routed inputs for `t` tokens: 32 experts (latent 128, width 256), top-4.
fn moe_inputs<B: Backend>(
    be: &B,
    r: &mut Rng,
    t: usize,
) -> (B::Experts, B::Act, B::Act, B::Vector, RouterParams) {
    let (e, lt, ie, k) = (32, 128, 256, 4);
    let host = MxExpertsHost {
        num_experts: e,
        latent: lt,
        inter: ie,
        w1: (0..e).map(|_| mx_matrix(r, ie, lt)).collect(),
        w3: (0..e).map(|_| mx_matrix(r, ie, lt)).collect(),
        w2: (0..e).map(|_| mx_matrix(r, lt, ie)).collect(),
    };
    let ex = be.experts(host).unwrap();
    let z = be
        .embed(
            &be.linear(t, lt, r.vec(t * lt, 0.3)).unwrap(),
            &(0..t as u32).collect::<Vec<_>>(),
        )
        .unwrap();
    let logits = be
        .embed(
            &be.linear(t, e, r.vec(t * e, 3.0)).unwrap(),
            &(0..t as u32).collect::<Vec<_>>(),
        )
        .unwrap();
    let bias = be.vector(r.vec(e, 0.2)).unwrap();
    let router = RouterParams {
        top_k: k,
        renormalize: true,
        scaling: 1.5,
    };
    (ex, z, logits, bias, router)
}

const MOE_SITU: SituParams = SituParams {
    beta: 4.0,
    linear_beta: Some(25.0),
};

pub(super) fn moe<B: Backend>(be: &B, r: &mut Rng, t: usize) -> Vec<f32> {
    let (ex, z, logits, bias, router) = moe_inputs(be, r, t);
    be.to_host(
        &be.moe_routed(&z, &logits, &bias, &ex, router, MOE_SITU)
            .unwrap(),
    )
    .unwrap()
}

/// An MoE block's two halves through `moe_routed_and_shared` (CUDA in bfloat16 mode: the shared
/// GLU's cuBLAS products, 8200 x 512 and 512 x 8200 past the GEMV's size, on a side stream while
/// the routed experts run, moe/shared.rs): the shared output, and each half's difference from
/// `moe_routed` and `glu` run one after the other (zero, bit for bit, on both backends).
pub(super) fn moe_and_shared<B: Backend>(
    be: &B,
    r: &mut Rng,
) -> Vec<(&'static str, Vec<f32>, f64)> {
    let (t, k, inter) = (4, 512, 8200);
    let x = be.upload_act(t, k, r.vec(t * k, 1.0)).unwrap();
    let mut lin = |n: usize, c: usize| be.linear(n, c, bf16_values(r.vec(n * c, 0.05))).unwrap();
    let (gw, uw, dw) = (lin(inter, k), lin(inter, k), lin(k, inter));
    let shared = Glu {
        gate: &gw,
        up: &uw,
        down: &dw,
        situ: MOE_SITU,
    };
    let (ex, z, logits, bias, router) = moe_inputs(be, r, t);
    let (y, s) = be
        .moe_routed_and_shared(&z, &logits, &bias, &ex, router, &[(0, t)], &x, &shared)
        .unwrap();
    let y1 = be
        .moe_routed(&z, &logits, &bias, &ex, router, MOE_SITU)
        .unwrap();
    let s1 = glu(be, &x, &shared).unwrap();
    let diff = |a: &B::Act, b: &B::Act| -> Vec<f32> {
        let (a, b) = (be.to_host(a).unwrap(), be.to_host(b).unwrap());
        a.iter().zip(&b).map(|(p, q)| p - q).collect()
    };
    vec![
        (
            "moe_routed_and_shared: shared GLU",
            be.to_host(&s).unwrap(),
            TOL_FUSED,
        ),
        (
            "moe_routed_and_shared: routed = moe_routed",
            diff(&y, &y1),
            0.0,
        ),
        ("moe_routed_and_shared: shared = glu", diff(&s, &s1), 0.0),
    ]
}

/// moe_routed's many-assignment paths: the wgmma GEMMs (moe/wgmma.rs, the path on sm_90a) at
/// T = 1100 (~137 assignments per expert: a tile of 128 and one of N = 32) and 2048, and the
/// cuBLAS fallback (moe/cublas.rs, what GPUs without wgmma run; forced here by presenting the GPU as
/// sm_90) at T = 1100; then the wgmma path at 2048 twice more for bitwise run-to-run equality.
/// The weights' E8M0 scales (123..129) include 129, past the one-factor decode.
#[test]
fn moe_gemm_path_matches_cpu() {
    let Some(mut gpu) = cuda() else { return };
    let cpu = CpuBackend::new();
    let seed = Rng::new("moe_gemm_path_matches_cpu").0;
    let mut t = Table::new("");
    let arch = gpu.limits.arch.clone();
    for (fallback, tokens, name) in [
        (true, 1100, "moe_routed(T=1100, cuBLAS bf16 split GEMMs)"),
        (false, 1100, "moe_routed(T=1100, wgmma MXFP4 GEMMs)"),
        (false, 2048, "moe_routed(T=2048, wgmma MXFP4 GEMMs)"),
    ] {
        gpu.limits.arch = if fallback {
            "sm_90".into()
        } else {
            arch.clone()
        };
        let (mut rc, mut rg) = (Rng(seed ^ tokens as u64), Rng(seed ^ tokens as u64));
        t.check(
            name,
            &moe(&gpu, &mut rg, tokens),
            &moe(&cpu, &mut rc, tokens),
            TOL_FUSED,
        );
    }
    gpu.limits.arch = arch;
    // Run-to-run bitwise equality. The sort's order within an expert may differ between runs
    // (atomic cursor), so this also checks that no result depends on a token's tile / column.
    let (mut r1, mut r2) = (Rng(seed ^ 3), Rng(seed ^ 3));
    let (a, b) = (moe(&gpu, &mut r1, 2048), moe(&gpu, &mut r2, 2048));
    t.check_rerun("moe_routed(T=2048, wgmma)", &a, &b);
    t.finish();
}

/// moe_routed at T = 1 through the single-token kernels (kernels/moe_single_token.cu: cp.async
/// rings, the combine folded into the down kernel) against the CPU, then twice more for bitwise
/// run-to-run equality (the combine sums in a fixed order).
#[test]
fn moe_single_token_matches_cpu() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::new();
    let seed = Rng::new("moe_single_token_matches_cpu").0;
    let mut t = Table::new("");
    let want = moe(&cpu, &mut Rng(seed), 1);
    let got = moe(&gpu, &mut Rng(seed), 1);
    t.check("moe_routed(T=1, single token)", &got, &want, TOL_FUSED);
    for _ in 0..2 {
        let again = moe(&gpu, &mut Rng(seed), 1);
        t.check_rerun("moe_routed(T=1, single token)", &got, &again);
    }
    t.finish();
}

/// moe_routed in mxfp8 mode (`Dtype::Mxfp8`: the MXFP8 pair at every step size, moe/mxfp8.rs) at
/// T = 1, 3, 40 and 1100 against the CPU's f32, within [`TOL_MXFP8`], then T = 40 again for
/// bitwise run-to-run equality.
#[test]
fn moe_mxfp8_matches_cpu() {
    let Some(gpu) = cuda_with(Dtype::Mxfp8) else {
        return;
    };
    let cpu = CpuBackend::new();
    let seed = Rng::new("moe_mxfp8_matches_cpu").0;
    let mut t = Table::new("mxfp8 ");
    for tokens in [1usize, 3, 40, 1100] {
        let s = seed ^ tokens as u64;
        let got = moe(&gpu, &mut Rng(s), tokens);
        let want = moe(&cpu, &mut Rng(s), tokens);
        t.check(
            &format!("moe_routed(T={tokens}, MXFP8 pair)"),
            &got,
            &want,
            TOL_MXFP8,
        );
        if tokens == 40 {
            let again = moe(&gpu, &mut Rng(s), tokens);
            t.check_rerun("moe_routed(T=40, MXFP8 pair)", &got, &again);
        }
    }
    t.finish();
}
