//! Routed experts as a grouped MXFP4 GEMM on Hopper wgmma (kernels/mxfp4_wg.cu), the
//! many-assignment path of `K3_MOE_PREFILL=wg` (sm_90a only; elsewhere that value falls back to
//! `auto`). Same flow as moe_grouped.rs (device-side tile list, no host sync, so it can also sit
//! in a captured graph): `mxfp4_wg_split_f32` (z as bf16 planes), `mxfp4_up_wg_f32` (SiTU-GLU in
//! its epilogue), `mxfp4_down_wg_f32`, `moe_combine_ids_f32`.
//!
//! The activations enter the tensor cores as [`MoeAct`] says: hi / lo bf16 pairs (f32-level
//! results, the default) or bf16 rounded once (half the MMA work, ~3e-3 relative).

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::Launch;
use crate::moe_grouped::SortedStep;
use cudarc::driver::CudaSlice;

/// How the wgmma path feeds activations (z and the SiTU-GLU intermediate) to the tensor cores,
/// from `K3_MOE_ACT` with `K3_MOE_PREFILL=wg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeAct {
    /// Each value as hi = bf16(x) and lo = bf16(x - hi), both multiplied and summed in f32
    /// (~16 mantissa bits, as every other MoE path): the default.
    Split,
    /// Each value rounded to bf16 once (`K3_MOE_ACT=bf16`): half the MMA work; results differ
    /// from f32 by bf16 rounding (~3e-3 relative, checked against 1e-2).
    Bf16,
}

impl MoeAct {
    /// `K3_MOE_ACT`: `bf16`, or anything else / unset: `split`.
    pub fn from_env() -> Self {
        match std::env::var("K3_MOE_ACT").as_deref() {
            Ok("bf16") => Self::Bf16,
            _ => Self::Split,
        }
    }

    /// bf16 pieces per value: the kernels' `planes` argument.
    pub fn planes(self) -> usize {
        match self {
            Self::Split => 2,
            Self::Bf16 => 1,
        }
    }
}

/// Dynamic shared memory of both wgmma GEMM kernels (kernels/mxfp4_wg.cu MXW_SHARED_BYTES: five
/// 41,984-byte stages of 256 packed weight rows, their scales and 128 tokens x 64 columns x hi /
/// lo; the planes = 1 ring of eight 25,600-byte stages fits in it too).
pub(crate) const MX_WG_SHARED: usize = 209_920;

/// `mxfp4_*_wg_f32` mode bit (kernels/mxfp4_wg.cu MXW_NO_PROXY_FENCE): no fence.proxy.async per
/// stage between the cp.async copies and the wgmma reads of the tokens.
const WG_NO_PROXY_FENCE: usize = 32;

/// The GEMM kernels' `mode`: the planes of `act`, and the proxy fence unless `K3_MOE_WG_FENCE=0`
/// (read once; CUTLASS's and Triton's cp.async + wgmma mainloops go without it; the device harness
/// checks and times both).
fn wg_mode(act: MoeAct) -> usize {
    static FENCE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let fence = crate::ops::env_usize(&FENCE, "K3_MOE_WG_FENCE", 1) != 0;
    act.planes() | if fence { 0 } else { WG_NO_PROXY_FENCE }
}

/// Tokens per tile, threads per block, intermediate rows per up block (W1 and W3 each) and latent
/// rows per down block (kernels/mxfp4_wg.cu MXW_TOK, MXW_THREADS, MXW_UP_ROWS, MXW_AROWS).
const WG_TOKENS: usize = 128;
const WG_THREADS: u32 = 256;
const WG_UP_ROWS: usize = 128;
const WG_DOWN_ROWS: usize = 256;

/// Whether the wgmma kernels exist on a device compiled for `arch` (the arch-specific Hopper
/// target; elsewhere they are trapping stubs).
pub(crate) fn wg_supported(arch: &str) -> bool {
    arch == "sm_90a"
}

/// Split activation row length in bf16 (kernels/mxfp4_wg.cu layout: 64-column groups of `planes`
/// x 64 values).
pub(crate) fn wg_row_u16(cols: usize, planes: usize) -> usize {
    cols.div_ceil(64) * 64 * planes
}

/// Grid of the wgmma GEMMs (moe_grouped.rs `tiled_launch`).
pub(crate) fn wg_launch(
    rows: usize,
    rows_per_block: usize,
    cols: usize,
    assignments: usize,
    experts: usize,
) -> Result<Launch> {
    let gemm = crate::moe_grouped::TiledGemm {
        tokens: WG_TOKENS,
        threads: WG_THREADS,
        shared: MX_WG_SHARED,
    };
    crate::moe_grouped::tiled_launch(gemm, rows, rows_per_block, cols, assignments, experts)
}

/// `mxfp4_wg_split_f32`: one 128-thread block per row and 256 columns.
pub(crate) fn wg_split_launch(rows: usize, cols: usize) -> Result<Launch> {
    Launch::new((rows, cols.div_ceil(256), 1), 128)
}

impl CudaBackend {
    /// `out [T, latent] = Σ_j w[t,j] · expert_{idx[t,j]}(z_t)` for a step sorted by expert, on the
    /// wgmma kernels with activations as `act` says. Callers check [`wg_supported`] first.
    pub(crate) fn moe_experts_wg(&self, step: SortedStep<'_>, act: MoeAct) -> Result<DeviceMat> {
        let (d, ex, situ) = (step.dims()?, step.ex, step.situ);
        let (offsets, sorted) = (step.offsets, step.sorted);
        let planes = act.planes();
        let i = crate::ops::i32_of;
        let (pi, mi) = (i(planes, "planes")?, i(wg_mode(act), "mode")?);
        let up = wg_launch(d.ie, WG_UP_ROWS, d.lt, d.n, d.e)?;
        let down = wg_launch(d.lt, WG_DOWN_ROWS, d.ie, d.n, d.e)?;
        let (lin, has) = crate::ops::situ_linear_args(situ);
        let (zx_len, actx_len, y_len) = (
            d.t * wg_row_u16(d.lt, planes),
            d.n * wg_row_u16(d.ie, planes),
            d.n * d.lt,
        );
        // Every element read is written first: the split pads z's rows, each up block writes its
        // groups of its tokens' rows, the down blocks every row of a sorted assignment and the
        // combine reads only those.
        let run = |zx: &CudaSlice<u16>, actx: &CudaSlice<u16>, y: &CudaSlice<f32>| {
            launch!(self, "mxfp4_wg_split_f32", wg_split_launch(d.t, d.lt)?;
                &step.z.buf, zx, &d.ti, &d.lti, &pi)?;
            launch!(self, "mxfp4_up_wg_f32", up;
                zx, &ex.w1.0, &ex.w1.1, &ex.w3.0, &ex.w3.1, offsets, sorted, actx, &d.kk, &d.lti,
                &d.iei, &situ.beta, &lin, &has, &d.ei, &mi)?;
            launch!(self, "mxfp4_down_wg_f32", down;
                actx, &ex.w2.0, &ex.w2.1, offsets, sorted, y, &d.lti, &d.iei, &d.ei, &mi)?;
            self.combine_sorted(y, &step, &d)
        };
        self.with_grouped_scratch(zx_len, actx_len, y_len, run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry;

    #[test]
    fn act_planes() {
        assert_eq!((MoeAct::Split.planes(), MoeAct::Bf16.planes()), (2, 1));
        assert!(wg_supported("sm_90a") && !wg_supported("sm_90") && !wg_supported("sm_80"));
        // The mode's low bits are the planes; the fence bit sits above them.
        assert_eq!(wg_mode(MoeAct::Split) & 3, 2);
        assert_eq!(wg_mode(MoeAct::Bf16) & 3, 1);
    }

    #[test]
    fn wg_launch_geometry() {
        // K3 at T = 2048, top-16 of 128: 256 full tiles of 128 + at most one partial per expert.
        let n = 2048 * 16;
        assert_eq!(crate::moe_grouped::tile_bound(n, 128, WG_TOKENS), 256 + 128);
        let up = wg_launch(3072, WG_UP_ROWS, 3584, n, 128).unwrap();
        assert_eq!(
            (up.grid, up.block, up.shared),
            ((24, 384, 1), 256, MX_WG_SHARED as u32)
        );
        let down = wg_launch(3584, WG_DOWN_ROWS, 3072, n, 128).unwrap();
        assert_eq!(down.grid, (14, 384, 1));
        assert_eq!(crate::moe_grouped::tile_bound(3, 128, WG_TOKENS), 1 + 3);
        // 64-column groups of hi / lo (or one bf16 plane); partial groups padded.
        assert_eq!(wg_row_u16(3584, 2), 56 * 128);
        assert_eq!(wg_row_u16(3584, 1), 56 * 64);
        assert_eq!(wg_row_u16(160, 2), 3 * 128);
        // Never larger than the grouped layout whose scratch it shares.
        assert!(wg_row_u16(160, 2) <= 2 * 256 && wg_row_u16(3584, 2) <= 28 * 256);
        assert_eq!(wg_split_launch(2048, 3584).unwrap().grid, (2048, 14, 1));
        assert!(wg_launch(3072, WG_UP_ROWS, 100, n, 128).is_err());
        // Five stages of 256 rows x (32 packed + 4 scale bytes) + 16 chunks x 128 tokens x 16 B
        // (kernels/mxfp4_wg.cu MXW_SHARED_BYTES); within the opt-in limit; opted in by name.
        assert_eq!(MX_WG_SHARED, 5 * (256 * 32 + 256 * 4 + 16 * 128 * 16));
        const { assert!(MX_WG_SHARED + 1024 + 128 <= geometry::MAX_OPT_IN_SHARED) };
        for name in ["mxfp4_up_wg_f32", "mxfp4_down_wg_f32"] {
            assert!(
                geometry::OPT_IN_SHARED.contains(&(name, MX_WG_SHARED)),
                "{name} opts in to its shared memory"
            );
        }
    }
}
