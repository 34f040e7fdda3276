//! Routed experts of 1-token decode steps (kernels/moe_single_token.cu). Each assignment (token,
//! slot) is taken straight from the router's ids, so the step needs no sort by expert; the units
//! (assignment, row group, part of the row) are split evenly over all warps, the weights streamed
//! through a cp.async ring per warp, one 512-thread block per SM, with the products on tensor
//! cores (the kernel headers have the layout) and the combine folded into the down kernel (two
//! launches). Widths must be whole 128-column steps (K3's are); dispatch.rs sends other widths
//! and GPUs without the shared memory to the few-token pair.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::{
    Launch, SINGLE_TOKEN_MAX_COLS, SINGLE_TOKEN_SHARED, single_token_matrix_fits as fits,
};
use crate::moe::DeviceExperts;
use cudarc::driver::CudaSlice;
use k3_model::backend::SituParams;

/// Most parts a row's steps are cut into.
const SINGLE_TOKEN_MAX_PARTS: usize = 8;
/// Steps per warp below which a smaller grid is taken.
const SINGLE_TOKEN_MIN_STEPS_PER_WARP: usize = 8;

/// The single-token kernels (kernels/moe_single_token.cu): 16 warps per block, one block per SM; dynamic shared
/// memory MXV_SHARED = the 64 KB table + 17 rings of 4 steps x 2,176 bytes (16 warps and the most
/// that packing them around the 64 KB-aligned table can waste).
const SINGLE_TOKEN_THREADS: u32 = 512;
const SINGLE_TOKEN_WARPS: usize = 16;

/// Launch of one single-token kernel: the grid and `parts`, the number of step ranges (of 128 columns)
/// each row is cut into; every unit (assignment, 16-row tile, part) writes its own partial sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SingleTokenPlan {
    pub launch: Launch,
    pub parts: usize,
}

/// Grid and parts of a single-token kernel (harness common.py single_token_plan) for `assignments` x `rows`
/// output rows of input width `cols`: `down` (32-row groups, runs of parts merged) or up (16-row
/// tiles of W1 and W3). One block per SM (fewer: >= 8 steps per warp); parts minimising the
/// busiest warp's units times their cost (up: 2 per step + 1 for the flush; down: 4 per
/// step + 1, as consecutive parts of a warp merge into one run). K3, T = 1, 132 SMs: up 2 parts
/// (busiest warp 42 steps, mean 40.7), down 8 (21 vs 20.4).
pub fn single_token_plan(
    assignments: usize,
    rows: usize,
    cols: usize,
    sms: usize,
    down: bool,
) -> Result<SingleTokenPlan> {
    let group = if down { 32 } else { 16 };
    if !cols.is_multiple_of(128) || !rows.is_multiple_of(group) || !fits(rows, cols) {
        return Err(CudaError::Unsupported(format!(
            "MXFP4 single-token kernels: expert matrix {rows} x {cols} (width a multiple of 128, <= {SINGLE_TOKEN_MAX_COLS})"
        )));
    }
    let (steps, groups) = (cols / 128, rows / group);
    let want = (assignments * groups * steps)
        .div_ceil(SINGLE_TOKEN_WARPS * SINGLE_TOKEN_MIN_STEPS_PER_WARP);
    let blocks = want.clamp(1, sms.max(1));
    let warps = blocks * SINGLE_TOKEN_WARPS;
    let per_step = if down { 4 } else { 2 };
    let parts = (1..=steps.min(SINGLE_TOKEN_MAX_PARTS))
        .min_by_key(|&p| {
            (
                (assignments * groups * p).div_ceil(warps) * (per_step * steps.div_ceil(p) + 1),
                p,
            )
        })
        .unwrap_or(1);
    if assignments * groups * parts >= 1 << 31 {
        return Err(CudaError::Unsupported(format!(
            "MXFP4 single-token kernels: {assignments} assignments of {rows} rows (unit count past i32)"
        )));
    }
    Ok(SingleTokenPlan {
        launch: Launch::new((blocks, 1, 1), SINGLE_TOKEN_THREADS)?
            .with_opt_in_shared(SINGLE_TOKEN_SHARED)?,
        parts,
    })
}

impl CudaBackend {
    /// `act` = SiTU-GLU(W1 z, W3 z), `y` = W2 act for every assignment (ids `idx` `[T·k]`) and
    /// the fixed-order combine with weights `w`; out-of-range ids are skipped. The up kernel
    /// writes gu's parts and zeroes the down kernel's counters
    /// and part masks (`sync`: [T, latent / 32] then [T·k, latent / 32]); the down kernel writes
    /// run partials to `yp` and the warp that completes a (token, 32-row group) writes its `out`
    /// rows (every element: no zeroing pass).
    pub(crate) fn moe_experts_single_token(
        &self,
        z: &DeviceMat,
        idx: &CudaSlice<i32>,
        w: &CudaSlice<f32>,
        ex: &DeviceExperts,
        k: usize,
        situ: SituParams,
    ) -> Result<DeviceMat> {
        let t = z.rows;
        let na = t * k;
        let sms = self.multiprocessors;
        let up = single_token_plan(na, ex.inter, ex.latent, sms, false)?;
        let down = single_token_plan(na, ex.latent, ex.inter, sms, true)?;
        let gu = self.uninit::<f32>(na * up.parts * 2 * ex.inter)?;
        let yp = self.uninit::<f32>(na * down.parts * ex.latent)?;
        let n_sync = (t + na) * (ex.latent / 32);
        let sync = self.uninit::<i32>(n_sync)?;
        let (kk, lt, ie, e, n) = (
            k as i32,
            ex.latent as i32,
            ex.inter as i32,
            ex.experts as i32,
            crate::launch::i32_of(na, "assignments")?,
        );
        let (pu, pd, ns) = (
            up.parts as i32,
            down.parts as i32,
            crate::launch::i32_of(n_sync, "single-token counters")?,
        );
        let (lin, has) = crate::launch::situ_linear_args(situ);
        let out = self.output(t, ex.latent)?;
        launch!(self, "mxfp4_experts_single_token_up_f32", up.launch;
            &z.buf, &ex.w1.0, &ex.w1.1, &ex.w3.0, &ex.w3.1, idx, &gu, &sync, &ns, &kk, &lt, &ie, &e, &n,
            &pu)?;
        launch!(self, "mxfp4_experts_single_token_down_f32", down.launch;
            &gu, &ex.w2.0, &ex.w2.1, idx, w, &yp, &sync, &out.buf, &kk, &lt, &ie, &situ.beta, &lin, &has,
            &e, &n, &pu, &pd)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{self, single_token_fits};

    #[test]
    fn single_token_plan_geometry() {
        // K3, T = 1, top-16 on 132 SMs (harness check_moe_single_token replays the split): one
        // 512-thread block per SM; up 2 parts of 14 steps, down 8 parts of 3 steps (runs merge).
        let up = single_token_plan(16, 3072, 3584, 132, false).unwrap();
        assert_eq!(
            (up.launch.grid, up.launch.block, up.launch.shared, up.parts),
            ((132, 1, 1), 512, 213_504, 2)
        );
        let down = single_token_plan(16, 3584, 3072, 132, true).unwrap();
        assert_eq!((down.launch.grid, down.parts), ((132, 1, 1), 8));
        // Small: one block; parts never above the steps per row.
        let small = single_token_plan(3, 256, 384, 132, true).unwrap();
        assert_eq!(small.launch.grid, (1, 1, 1));
        assert!(small.parts <= 3);
        // Widths must be whole 128-column steps; rows whole groups.
        assert!(single_token_plan(16, 3072, 3968, 132, false).is_ok());
        assert!(single_token_plan(16, 96, 160, 132, false).is_err());
        assert!(single_token_plan(16, 48, 128, 132, true).is_err());
        assert!(single_token_fits(3584, 3072) && single_token_fits(128, 256));
        assert!(
            !single_token_fits(160, 96)
                && !single_token_fits(544, 288)
                && !single_token_fits(4096, 3072)
        );
        const { assert!(SINGLE_TOKEN_SHARED <= geometry::MAX_OPT_IN_SHARED) };
        for name in [
            "mxfp4_experts_single_token_up_f32",
            "mxfp4_experts_single_token_down_f32",
        ] {
            assert!(
                geometry::OPT_IN_SHARED.contains(&(name, SINGLE_TOKEN_SHARED)),
                "{name}"
            );
        }
    }
}
