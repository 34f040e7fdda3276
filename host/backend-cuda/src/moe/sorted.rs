//! Routed experts with their assignments sorted by expert (`moe_sort_assignments`): the
//! shapes, launch grids, work buffers and combine shared by the many-assignment paths (the
//! wgmma GEMMs of moe/wgmma.rs and the cuBLAS path of moe/cublas.rs). The tile list is derived on the
//! device from the sort's offsets: no host sync, so a step can sit inside a captured graph.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::moe::DeviceExperts;
use crate::workspace::SortedScratch;
use cudarc::driver::CudaSlice;
use k3_model::backend::SituParams;

/// Upper bound on the tiles of `assignments` sorted assignments over `experts` experts, cut into
/// tiles of `tokens` (the wgmma kernels, mxfp4_mma.cuh `mx_find_tile`): each busy
/// expert (at most min(E, n)) leaves at most one partial tile.
pub(crate) fn tile_bound(assignments: usize, experts: usize, tokens: usize) -> usize {
    assignments.div_ceil(tokens) + experts.min(assignments)
}

/// Shape of a tiled expert GEMM's launch: tokens per tile, threads per block, dynamic shared
/// memory.
pub(crate) struct TiledGemm {
    pub tokens: usize,
    pub threads: u32,
    pub shared: usize,
}

/// One many-assignment step of routed experts with its assignments sorted by expert: what the
/// sort-based paths (wgmma, cuBLAS) take.
#[derive(Clone, Copy)]
pub(crate) struct SortedStep<'a> {
    pub z: &'a DeviceMat,
    /// The router's expert ids and combine weights, `[T·k]` each.
    pub idx: &'a CudaSlice<i32>,
    pub w: &'a CudaSlice<f32>,
    pub ex: &'a DeviceExperts,
    pub top_k: usize,
    /// From `moe_sort_assignments`: `offsets [E+1]`, `sorted [T·k]`.
    pub offsets: &'a CudaSlice<i32>,
    pub sorted: &'a CudaSlice<i32>,
    pub situ: SituParams,
}

impl SortedStep<'_> {
    /// The step's sizes as the sorted-step kernels take them, checked to fit in i32 (element
    /// offsets inside the kernels are i64; row indices, positions and tokens, i32).
    pub(crate) fn dims(&self) -> Result<StepDims> {
        let i = crate::launch::i32_of;
        let (t, ex) = (self.z.rows, self.ex);
        let n = t * self.top_k;
        i(n, "assignments")?;
        Ok(StepDims {
            t,
            n,
            lt: ex.latent,
            ie: ex.inter,
            e: ex.experts,
            ti: i(t, "tokens")?,
            kk: i(self.top_k, "top_k")?,
            lti: i(ex.latent, "latent")?,
            iei: i(ex.inter, "inter")?,
            ei: i(ex.experts, "experts")?,
        })
    }
}

/// [`SortedStep::dims`]: tokens, assignments, the experts' latent / intermediate widths and count,
/// and the i32 kernel arguments (tokens, top-k, latent, intermediate, experts).
pub(crate) struct StepDims {
    pub t: usize,
    pub n: usize,
    pub lt: usize,
    pub ie: usize,
    pub e: usize,
    pub ti: i32,
    pub kk: i32,
    pub lti: i32,
    pub iei: i32,
    pub ei: i32,
}

/// Grid of a tiled expert GEMM: row blocks of `rows_per_block` over `rows` x the tile bound
/// (blocks past the last tile exit).
pub(crate) fn tiled_launch(
    gemm: TiledGemm,
    rows: usize,
    rows_per_block: usize,
    cols: usize,
    assignments: usize,
    experts: usize,
) -> Result<Launch> {
    geometry::check_mx_width(cols)?;
    Launch::new(
        (
            rows.div_ceil(rows_per_block),
            tile_bound(assignments, experts, gemm.tokens),
            1,
        ),
        gemm.threads,
    )?
    .with_opt_in_shared(gemm.shared)
}

impl CudaBackend {
    /// `out [T, latent] = Σ_j w[t,j] · y[(t, j)]` over the per-assignment rows `y` that a sorted
    /// path's down GEMM wrote (`moe_combine_ids_f32`: a fixed order per token).
    pub(crate) fn combine_sorted(
        &self,
        y: &CudaSlice<f32>,
        step: &SortedStep<'_>,
        d: &StepDims,
    ) -> Result<DeviceMat> {
        let out = self.output(d.t, d.lt)?;
        launch!(self, "moe_combine_ids_f32", geometry::elementwise(d.t * d.lt)?;
            y, step.idx, step.w, &out.buf, &d.ti, &d.kk, &d.lti, &d.ei)?;
        Ok(out)
    }

    /// Runs `run` on work buffers of these lengths (split activations, intermediate, per-assignment
    /// outputs): the shared scratch, or, inside a logged step, buffers of its
    /// own — a captured graph keeps the addresses it saw, never the scratch that a later, larger
    /// step may reallocate.
    pub(crate) fn with_sorted_scratch<R>(
        &self,
        zx_len: usize,
        actx_len: usize,
        y_len: usize,
        run: impl FnOnce(&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<f32>) -> Result<R>,
    ) -> Result<R> {
        if self.step.recording() {
            return run(
                &*self.uninit::<u16>(zx_len)?,
                &*self.uninit::<u16>(actx_len)?,
                &*self.uninit::<f32>(y_len)?,
            );
        }
        let mut guard = self
            .moe_sorted_scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let SortedScratch { zx, actx, y } = &mut *guard;
        let zx = self.grow(zx, zx_len)?;
        let actx = self.grow(actx, actx_len)?;
        let y = self.grow(y, y_len)?;
        run(zx, actx, y)
    }

    /// `slot`, reallocated (uninitialised, 25% headroom) when shorter than `len`.
    fn grow<'a, T: cudarc::driver::DeviceRepr>(
        &self,
        slot: &'a mut Option<CudaSlice<T>>,
        len: usize,
    ) -> Result<&'a CudaSlice<T>> {
        if slot.as_ref().is_none_or(|b| b.len() < len.max(1)) {
            *slot = None; // free first: the old and new buffers need not coexist
            *slot = Some(self.alloc_kept::<T>(len + len / 4)?);
        }
        slot.as_ref()
            .ok_or_else(|| CudaError::InvalidArg("moe sorted scratch".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_bound_counts_one_partial_tile_per_busy_expert() {
        // K3 at T = 2048, top-16 of 128, tiles of 128 tokens: 256 full + one partial per expert.
        assert_eq!(tile_bound(2048 * 16, 128, 128), 256 + 128);
        // Few assignments: no more partial tiles than assignments.
        assert_eq!(tile_bound(3, 128, 64), 1 + 3);
    }
}
