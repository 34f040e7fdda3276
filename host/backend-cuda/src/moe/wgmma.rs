//! Routed experts of many-assignment steps as grouped MXFP4 GEMMs on Hopper wgmma
//! (kernels/moe_wgmma.cu; sm_90a only, dispatch.rs sends other GPUs to moe/cublas.rs). The tile list
//! comes from the sort on the device (moe/sorted.rs: no host sync, so a step can sit in a
//! captured graph): `mxfp4_experts_wgmma_split_f32` (z as bf16 planes), `mxfp4_experts_wgmma_up_f32` (SiTU-GLU
//! in its epilogue), `mxfp4_experts_wgmma_down_f32`, `moe_combine_ids_f32`. In float32 mode the
//! activations enter the tensor cores as hi = bf16(x) and lo = bf16(x - hi), both multiplied and
//! summed in f32, so results stay at f32 level like every other expert path; in bf16 mode
//! (`CudaOptions::dtype`, the default) as bf16(x) alone, half the tensor-core work.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::Result;
use crate::geometry::Launch;
use crate::moe::sorted::SortedStep;
use cudarc::driver::CudaSlice;

use crate::geometry::MX_WG_SHARED;

/// Tokens per tile, threads per block, intermediate rows per up block (W1 and W3 each) and latent
/// rows per down block (kernels/moe_wgmma.cu MXW_TOK, MXW_THREADS, MXW_UP_ROWS, MXW_AROWS).
const WG_TOKENS: usize = 128;
const WG_THREADS: u32 = 256;
const WG_UP_ROWS: usize = 128;
const WG_DOWN_ROWS: usize = 256;

/// Split activation row length in bf16 (kernels/moe_wgmma.cu's chunk-major layout stores each row
/// as 64-column groups of `planes` x 64 values, the groups and chunks of all rows interleaved).
pub(crate) fn wgmma_row_u16(cols: usize, planes: usize) -> usize {
    cols.div_ceil(64) * 64 * planes
}

/// Grid of the wgmma GEMMs (moe/sorted.rs `tiled_launch`).
pub(crate) fn wgmma_launch(
    rows: usize,
    rows_per_block: usize,
    cols: usize,
    assignments: usize,
    experts: usize,
) -> Result<Launch> {
    let gemm = crate::moe::sorted::TiledGemm {
        tokens: WG_TOKENS,
        threads: WG_THREADS,
        shared: MX_WG_SHARED,
    };
    crate::moe::sorted::tiled_launch(gemm, rows, rows_per_block, cols, assignments, experts)
}

/// `mxfp4_experts_wgmma_split_f32`: one 64-thread block per 8 sorted positions and 64 columns.
pub(crate) fn wgmma_split_launch(assignments: usize, cols: usize) -> Result<Launch> {
    Launch::new((assignments.div_ceil(8), cols.div_ceil(64), 1), 64)
}

impl CudaBackend {
    /// `out [T, latent] = Σ_j w[t,j] · expert_{idx[t,j]}(z_t)` for a step sorted by expert, on the
    /// wgmma kernels. Callers check `geometry::moe_wg_supported` first.
    pub(crate) fn moe_experts_wgmma(&self, step: SortedStep<'_>) -> Result<DeviceMat> {
        let (d, ex, situ) = (step.dims()?, step.ex, step.situ);
        let (offsets, sorted) = (step.offsets, step.sorted);
        let planes = self.options.dtype.planes();
        let i = crate::launch::i32_of;
        let (pi, ni) = (i(planes, "planes")?, i(d.n, "assignments")?);
        let up = wgmma_launch(d.ie, WG_UP_ROWS, d.lt, d.n, d.e)?;
        let down = wgmma_launch(d.lt, WG_DOWN_ROWS, d.ie, d.n, d.e)?;
        let (lin, has) = crate::launch::situ_linear_args(situ);
        let (zx_len, actx_len, y_len) = (
            d.n * wgmma_row_u16(d.lt, planes),
            d.n * wgmma_row_u16(d.ie, planes),
            d.n * d.lt,
        );
        // Every element read is written first: the split writes every sorted position's row
        // (gathered from z, padded), each up block its groups of its tokens' rows, the down blocks
        // every row of a sorted assignment, and the combine reads only those. The GEMMs' mode is
        // the planes (no diagnostic bits).
        let run = |zx: &CudaSlice<u16>, actx: &CudaSlice<u16>, y: &CudaSlice<f32>| {
            launch!(self, "mxfp4_experts_wgmma_split_f32", wgmma_split_launch(d.n, d.lt)?;
                &step.z.buf, sorted, offsets, zx, &ni, &d.lti, &d.kk, &d.ei, &pi)?;
            launch!(self, "mxfp4_experts_wgmma_up_f32", up;
                zx, &ex.w1.0, &ex.w1.1, &ex.w3.0, &ex.w3.1, offsets, actx, &ni, &d.lti,
                &d.iei, &situ.beta, &lin, &has, &d.ei, &pi)?;
            launch!(self, "mxfp4_experts_wgmma_down_f32", down;
                actx, &ex.w2.0, &ex.w2.1, offsets, sorted, y, &ni, &d.lti, &d.iei, &d.ei, &pi)?;
            self.combine_sorted(y, &step, &d)
        };
        self.with_sorted_scratch(zx_len, actx_len, y_len, run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry;

    #[test]
    fn wgmma_needs_sm_90a() {
        assert!(geometry::moe_wg_supported("sm_90a") && !geometry::moe_wg_supported("sm_90"));
    }

    #[test]
    fn wgmma_launch_geometry() {
        // K3 at T = 2048, top-16 of 128: 256 full tiles of 128 + at most one partial per expert.
        let n = 2048 * 16;
        assert_eq!(crate::moe::sorted::tile_bound(n, 128, WG_TOKENS), 256 + 128);
        let up = wgmma_launch(3072, WG_UP_ROWS, 3584, n, 128).unwrap();
        assert_eq!(
            (up.grid, up.block, up.shared),
            ((24, 384, 1), 256, MX_WG_SHARED as u32)
        );
        let down = wgmma_launch(3584, WG_DOWN_ROWS, 3072, n, 128).unwrap();
        assert_eq!(down.grid, (14, 384, 1));
        assert_eq!(crate::moe::sorted::tile_bound(3, 128, WG_TOKENS), 1 + 3);
        // 64-column groups of hi / lo; partial groups padded.
        assert_eq!(wgmma_row_u16(3584, 2), 56 * 128);
        assert_eq!(wgmma_row_u16(160, 2), 3 * 128);
        let split = wgmma_split_launch(n, 3584).unwrap();
        assert_eq!((split.grid, split.block), ((4096, 56, 1), 64));
        assert!(wgmma_launch(3072, WG_UP_ROWS, 100, n, 128).is_err());
        // Five stages of 256 rows x (32 packed + 4 scale bytes) + 16 chunks x 128 tokens x 16 B
        // (kernels/moe_wgmma.cu MXW_SHARED_BYTES); within the opt-in limit; opted in by name.
        assert_eq!(MX_WG_SHARED, 5 * (256 * 32 + 256 * 4 + 16 * 128 * 16));
        const { assert!(MX_WG_SHARED + 1024 + 128 <= geometry::MAX_OPT_IN_SHARED) };
        for name in ["mxfp4_experts_wgmma_up_f32", "mxfp4_experts_wgmma_down_f32"] {
            assert!(
                geometry::OPT_IN_SHARED.contains(&(name, MX_WG_SHARED)),
                "{name} opts in to its shared memory"
            );
        }
    }
}
