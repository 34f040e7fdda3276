//! Routed experts as a grouped MXFP4 GEMM (kernels/mxfp4_grouped.cu) for steps with many
//! (token, expert) assignments: with the cuBLAS path of moe_gemm.rs, picked by [`MoePrefill`]
//! (default: grouped below `K3_MOE_GROUPED_MAX` assignments) for the steps that
//! `K3_MOE_GEMM_MIN` sends to "many assignments".
//!
//! The cuBLAS path expands every touched expert to bf16 before its GEMMs (~8.7 ms per K3 layer of
//! memory traffic at T = 2048) and reads the expert counts back to the host. Here the MXFP4
//! decode sits in the GEMM's main loop (weights are read as packed bytes, ~0.53 B per weight), the
//! up kernel's epilogue applies SiTU-GLU and writes the hi / lo intermediate the down kernel
//! reads, and the tile list is derived on the device from the sort's offsets: no host sync, so
//! the path can also sit inside a captured decode graph.
//!
//! Per step: `mxfp4_tc2_split_f32` (z as hi / lo bf16 rows), `mxfp4_up_grouped_f32`,
//! `mxfp4_down_grouped_f32`, `moe_combine_ids_f32`.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::ops::DeviceExperts;
use cudarc::driver::CudaSlice;
use k3_model::backend::SituParams;

/// Routed experts of the steps with at least `K3_MOE_GEMM_MIN` assignments, from
/// `K3_MOE_PREFILL` at start-up (`auto` | `grouped` | `gemm` | `wg`, default `auto`); tests pin it
/// with `CudaBackend::set_moe_prefill`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoePrefill {
    /// kernels/mxfp4_grouped.cu: MXFP4 decoded inside the GEMM, no expanded weights.
    Grouped,
    /// moe_gemm.rs: experts expanded to bf16, one cuBLAS GEMM per expert and projection.
    Gemm,
    /// The default. moe_wg.rs on sm_90a: MXFP4 decoded into wgmma A fragments, the activations
    /// as `MoeAct` says (`K3_MOE_ACT`); H200, K3, top-16, split activations (call U): T = 512
    /// 4.27 ms vs grouped 5.02 and cuBLAS 9.77; T = 2048 14.5 ms vs cuBLAS 14.2 and grouped 16.9
    /// (a tie with cuBLAS, without its 2 GiB of expanded bf16 experts). Elsewhere: the grouped
    /// GEMMs below [`grouped_max`] assignments, cuBLAS from there (the bf16 expansion's fixed
    /// cost per touched expert is amortised over enough tokens there for cuBLAS's faster main
    /// loop to win).
    Wg(crate::moe_wg::MoeAct),
}

impl MoePrefill {
    /// `K3_MOE_PREFILL`: `grouped`, `gemm`, or `wg` / `auto` / unset: `Wg` (with `K3_MOE_ACT`).
    pub fn from_env() -> Self {
        match std::env::var("K3_MOE_PREFILL").as_deref() {
            Ok("grouped") => Self::Grouped,
            Ok("gemm") => Self::Gemm,
            _ => Self::Wg(crate::moe_wg::MoeAct::from_env()),
        }
    }

    /// Whether a many-assignment step of `assignments` (tokens x top-k) takes the grouped path
    /// (`Wg` asks here only where the wgmma kernels do not exist).
    pub fn grouped(self, assignments: usize) -> bool {
        match self {
            Self::Wg(_) => assignments < grouped_max(),
            Self::Grouped => true,
            Self::Gemm => false,
        }
    }
}

/// Assignments from which `MoePrefill::Wg` off sm_90a takes the cuBLAS path, unless `K3_MOE_GROUPED_MAX`
/// says otherwise (between the measured 8,192, where grouped wins 1.9x, and 32,768, where it
/// loses 0.85x).
const DEFAULT_GROUPED_MAX: usize = 16384;

pub(crate) fn grouped_max() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    crate::ops::env_usize(&MAX, "K3_MOE_GROUPED_MAX", DEFAULT_GROUPED_MAX)
}

/// Tokens per tile, threads per block, weight rows per up block (intermediate rows: W1 and W3
/// each) and per down block (kernels/mxfp4_grouped.cu MXG_TOK, MXG_UP_ROWS, MXG_AROWS).
const GROUPED_TOKENS: usize = 64;
const GROUPED_THREADS: u32 = 512;
const GROUPED_UP_ROWS: usize = 128;
const GROUPED_DOWN_ROWS: usize = 256;

/// Split activation row length in bf16 (mxfp4_tc.cu tc2 layout: per 128-column super-step, 128
/// hi then 128 lo values).
fn split_row_u16(cols: usize) -> usize {
    cols.div_ceil(128) * 256
}

/// Upper bound on the tiles of `assignments` sorted assignments over `experts` experts, cut into
/// tiles of `tokens` (the grouped and the wgmma kernels, mxfp4_mma.cuh `mx_find_tile`): each busy
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
/// sort-based paths (grouped, wgmma, cuBLAS) take.
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
        let i = crate::ops::i32_of;
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

/// Grid of the grouped kernels.
pub(crate) fn grouped_launch(
    rows: usize,
    rows_per_block: usize,
    cols: usize,
    assignments: usize,
    experts: usize,
) -> Result<Launch> {
    let gemm = TiledGemm {
        tokens: GROUPED_TOKENS,
        threads: GROUPED_THREADS,
        shared: geometry::MX_GROUPED_SHARED,
    };
    tiled_launch(gemm, rows, rows_per_block, cols, assignments, experts)
}

/// Work buffers kept between eager calls (grown, never shrunk; at T = 2048 K3 ~0.9 GB), as
/// moe_gemm.rs does: per-layer allocations of this size cost more than they should.
#[derive(Default)]
pub(crate) struct GroupedScratch {
    zx: Option<CudaSlice<u16>>,
    actx: Option<CudaSlice<u16>>,
    y: Option<CudaSlice<f32>>,
}

impl CudaBackend {
    /// Choose the routed-expert path of many-assignment steps (default from `K3_MOE_PREFILL`,
    /// see [`MoePrefill`]).
    pub fn set_moe_prefill(&mut self, choice: MoePrefill) {
        self.moe_prefill = choice;
    }

    pub fn moe_prefill(&self) -> MoePrefill {
        self.moe_prefill
    }

    /// `out [T, latent] = Σ_j w[t,j] · expert_{idx[t,j]}(z_t)` for a step sorted by expert.
    pub(crate) fn moe_experts_grouped(&self, step: SortedStep<'_>) -> Result<DeviceMat> {
        let (d, ex, situ) = (step.dims()?, step.ex, step.situ);
        let (offsets, sorted) = (step.offsets, step.sorted);
        let up = grouped_launch(d.ie, GROUPED_UP_ROWS, d.lt, d.n, d.e)?;
        let down = grouped_launch(d.lt, GROUPED_DOWN_ROWS, d.ie, d.n, d.e)?;
        let (lin, has) = crate::ops::situ_linear_args(situ);
        let (zx_len, actx_len, y_len) = (
            d.t * split_row_u16(d.lt),
            d.n * split_row_u16(d.ie),
            d.n * d.lt,
        );
        // Every element read is written first: the split pads z's rows, each up block writes its
        // whole super-step of its tokens' rows, the down blocks every row of a sorted assignment
        // and the combine reads only those.
        let run = |zx: &CudaSlice<u16>, actx: &CudaSlice<u16>, y: &CudaSlice<f32>| {
            launch!(self, "mxfp4_tc2_split_f32", Launch::new((d.t, d.lt.div_ceil(128), 1), 32)?;
                &step.z.buf, zx, &d.ti, &d.lti)?;
            launch!(self, "mxfp4_up_grouped_f32", up;
                zx, &ex.w1.0, &ex.w1.1, &ex.w3.0, &ex.w3.1, offsets, sorted, actx, &d.kk, &d.lti,
                &d.iei, &situ.beta, &lin, &has, &d.ei)?;
            launch!(self, "mxfp4_down_grouped_f32", down;
                actx, &ex.w2.0, &ex.w2.1, offsets, sorted, y, &d.lti, &d.iei, &d.ei)?;
            self.combine_sorted(y, &step, &d)
        };
        self.with_grouped_scratch(zx_len, actx_len, y_len, run)
    }

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
    /// outputs): the shared grouped scratch (one many-assignment path runs per process, and the
    /// grouped and wgmma kernels use the same layouts), or, inside a logged step, buffers of its
    /// own — a captured graph keeps the addresses it saw, never the scratch that a later, larger
    /// step may reallocate.
    pub(crate) fn with_grouped_scratch<R>(
        &self,
        zx_len: usize,
        actx_len: usize,
        y_len: usize,
        run: impl FnOnce(&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<f32>) -> Result<R>,
    ) -> Result<R> {
        if self.step.recording() {
            return run(
                &self.uninit(zx_len)?,
                &self.uninit(actx_len)?,
                &self.uninit(y_len)?,
            );
        }
        let mut guard = self
            .moe_grouped_scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let GroupedScratch { zx, actx, y } = &mut *guard;
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
            *slot = Some(self.uninit::<T>(len + len / 4)?);
        }
        slot.as_ref()
            .ok_or_else(|| CudaError::InvalidArg("moe grouped scratch".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_policy() {
        // Wg off sm_90a: grouped from K3_MOE_GEMM_MIN (the caller's bound) up to K3_MOE_GROUPED_MAX.
        let max = grouped_max();
        let off_hopper = MoePrefill::Wg(crate::moe_wg::MoeAct::Split);
        assert!(off_hopper.grouped(4096) && off_hopper.grouped(max - 1));
        assert!(!off_hopper.grouped(max));
        assert!(MoePrefill::Grouped.grouped(1 << 20) && !MoePrefill::Gemm.grouped(4096));
    }

    #[test]
    fn grouped_launch_geometry() {
        // K3 at T = 2048, top-16 of 128: 512 full tiles + at most one partial tile per expert.
        let n = 2048 * 16;
        assert_eq!(tile_bound(n, 128, GROUPED_TOKENS), 512 + 128);
        let up = grouped_launch(3072, GROUPED_UP_ROWS, 3584, n, 128).unwrap();
        assert_eq!(
            (up.grid, up.block, up.shared),
            ((24, 640, 1), 512, geometry::MX_GROUPED_SHARED as u32)
        );
        let down = grouped_launch(3584, GROUPED_DOWN_ROWS, 3072, n, 128).unwrap();
        assert_eq!(down.grid, (14, 640, 1));
        // Few assignments: no more partial tiles than assignments.
        assert_eq!(tile_bound(3, 128, GROUPED_TOKENS), 1 + 3);
        assert_eq!(split_row_u16(3584), 28 * 256);
        assert_eq!(split_row_u16(160), 2 * 256);
        assert!(grouped_launch(3072, GROUPED_UP_ROWS, 100, n, 128).is_err());
        // 64 tokens x hi / lo B rows of 288 bytes, 256 A rows of 64 packed + 4 scale bytes, three
        // stages, the 32 KB decode table: one block per SM.
        assert_eq!(
            geometry::MX_GROUPED_SHARED,
            8192 * 4 + 3 * (256 * 64 + 256 * 4 + 128 * 288)
        );
        for name in ["mxfp4_up_grouped_f32", "mxfp4_down_grouped_f32"] {
            assert!(
                geometry::OPT_IN_SHARED.contains(&(name, geometry::MX_GROUPED_SHARED)),
                "{name} opts in to its shared memory"
            );
        }
    }
}
