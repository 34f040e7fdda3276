//! Routed experts of 1-token decode steps: the stream2 pair of kernels/mxfp4.cu
//! (`mxfp4_up_stream2_f32`, `mxfp4_down_stream2_f32`, `moe_combine_parts_f32`; ops.rs
//! `mx_experts_choice`). Each assignment (token, slot) is taken straight from the router's ids,
//! so the step needs no sort by expert; the units (assignment, 16-row tile, part of the row) are
//! split evenly over all warps of two blocks per SM, with the products on tensor cores (the
//! kernel header has the layout).

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch, MX_STREAM_SHARED};
use crate::ops::DeviceExperts;
use cudarc::driver::CudaSlice;
use k3_model::backend::SituParams;

/// Threads per block and blocks per SM (kernels/mxfp4.cu `__launch_bounds__(256, 2)`).
const MX_STREAM_THREADS: u32 = 256;
const MX_STREAM_BLOCKS_PER_SM: usize = 2;
/// Widest input row of the stream2 kernels: 124 blocks of 32 (padded to a multiple of 4 below the
/// zero block at staged row 127).
pub const MX_STREAM2_MAX_COLS: usize = 124 * 32;
/// Most parts a row's steps are cut into.
const MX_STREAM2_MAX_PARTS: usize = 8;
/// Steps per warp below which a smaller grid is taken.
const MX_STREAM2_MIN_STEPS_PER_WARP: usize = 8;

/// Launch of one stream2 kernel: the grid and `parts`, the number of step ranges (of 128 columns)
/// each row is cut into; every unit (assignment, 16-row tile, part) writes its own partial sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream2Plan {
    pub launch: Launch,
    pub parts: usize,
}

/// Whether the stream2 kernels take a matrix of `rows` x `cols` (an expert's bytes index as u32).
fn fits(rows: usize, cols: usize) -> bool {
    cols <= MX_STREAM2_MAX_COLS && rows * cols / 2 < 1 << 31
}

/// Whether the stream2 pair takes experts of these widths (up: inter x latent, down: latent x
/// inter); ops.rs runs the tc2 pair for the others.
pub(crate) fn stream2_fits(latent: usize, inter: usize) -> bool {
    fits(inter, latent)
        && fits(latent, inter)
        && geometry::check_mx_width(latent).is_ok()
        && geometry::check_mx_width(inter).is_ok()
}

/// Grid and parts of the stream2 kernels for `assignments` x `rows` output rows of input width
/// `cols` (harness common.py mx_stream2_plan): two blocks per SM (fewer: >= 8 steps per warp);
/// parts minimising the busiest warp's steps plus half a step per unit (its flush). K3, T = 1,
/// 132 SMs: up 2 parts (busiest warp 42 steps, mean 40.7), down 4 (42 vs 40.7).
pub fn mx_stream2_plan(
    assignments: usize,
    rows: usize,
    cols: usize,
    sms: usize,
) -> Result<Stream2Plan> {
    geometry::check_mx_width(cols)?;
    if !fits(rows, cols) {
        return Err(CudaError::Unsupported(format!(
            "MXFP4 stream2 kernels: expert matrix {rows} x {cols} (input width <= {MX_STREAM2_MAX_COLS}, < 2 GB)"
        )));
    }
    let (steps, tiles) = ((cols / 32).div_ceil(4), rows.div_ceil(16));
    let warps_per_block = (MX_STREAM_THREADS / 32) as usize;
    let want =
        (assignments * tiles * steps).div_ceil(warps_per_block * MX_STREAM2_MIN_STEPS_PER_WARP);
    let blocks = want.clamp(1, MX_STREAM_BLOCKS_PER_SM * sms.max(1));
    let warps = blocks * warps_per_block;
    let parts = (1..=steps.min(MX_STREAM2_MAX_PARTS))
        .min_by_key(|&p| {
            (
                (assignments * tiles * p).div_ceil(warps) * (2 * steps.div_ceil(p) + 1),
                p,
            )
        })
        .unwrap_or(1);
    Ok(Stream2Plan {
        launch: Launch::new((blocks, 1, 1), MX_STREAM_THREADS)?
            .with_opt_in_shared(MX_STREAM_SHARED)?,
        parts,
    })
}

impl CudaBackend {
    /// `act` = SiTU-GLU(W1 z, W3 z) and `y` = W2 act for every assignment (ids `idx` `[T·k]`),
    /// then the fixed-order combine with weights `w`. Assignments whose id is out of range are
    /// skipped, as the sort-based pairs do.
    /// The up kernel writes partial W1 / W3 sums per part, the down kernel's staging adds them and
    /// applies SiTU-GLU, and `moe_combine_parts_f32` adds the down kernel's parts and skips slots
    /// whose id is out of range (their partial rows are never written: no zeroing pass).
    pub(crate) fn moe_experts_stream2(
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
        let up = mx_stream2_plan(na, ex.inter, ex.latent, self.multiprocessors)?;
        let down = mx_stream2_plan(na, ex.latent, ex.inter, self.multiprocessors)?;
        let gu = self.uninit::<f32>(na * up.parts * 2 * ex.inter)?;
        let yp = self.uninit::<f32>(na * down.parts * ex.latent)?;
        let (kk, lt, ie, e, n) = (
            k as i32,
            ex.latent as i32,
            ex.inter as i32,
            ex.experts as i32,
            crate::ops::i32_of(na, "assignments")?,
        );
        let (pu, pd) = (up.parts as i32, down.parts as i32);
        let (lin, has) = (
            situ.linear_beta.unwrap_or(1.0),
            i32::from(situ.linear_beta.is_some()),
        );
        launch!(self, "mxfp4_up_stream2_f32", up.launch;
            &z.buf, &ex.w1.0, &ex.w1.1, &ex.w3.0, &ex.w3.1, idx, &gu, &kk, &lt, &ie, &e, &n, &pu)?;
        launch!(self, "mxfp4_down_stream2_f32", down.launch;
            &gu, &ex.w2.0, &ex.w2.1, idx, &yp, &lt, &ie, &situ.beta, &lin, &has, &e, &n, &pu, &pd)?;
        let out = self.output(t, ex.latent)?;
        let tt = t as i32;
        launch!(self, "moe_combine_parts_f32", geometry::elementwise(t * ex.latent)?;
            &yp, idx, w, &out.buf, &tt, &kk, &lt, &e, &pd)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream2_plan() {
        // K3, T = 1, top-16 on 132 SMs (harness check_moe_stream2 replays the split).
        let up = mx_stream2_plan(16, 3072, 3584, 132).unwrap();
        assert_eq!(
            (up.launch.grid, up.launch.shared, up.parts),
            ((264, 1, 1), 65_536, 2)
        );
        let down = mx_stream2_plan(16, 3584, 3072, 132).unwrap();
        assert_eq!((down.launch.grid, down.parts), ((264, 1, 1), 4));
        // Small: fewer blocks; parts never above the steps per row (an empty part would spin).
        let small = mx_stream2_plan(9, 40, 160, 132).unwrap();
        assert_eq!((small.launch.grid, small.parts), ((1, 1, 1), 1));
        for (na, rows, cols) in [(3, 96, 96), (5, 96, 544), (48, 3072, 3584), (1, 16, 32)] {
            let p = mx_stream2_plan(na, rows, cols, 132).unwrap();
            assert!(
                p.parts >= 1 && p.parts <= (cols / 32).div_ceil(4),
                "{na} {rows} {cols}"
            );
        }
        assert!(mx_stream2_plan(16, 3072, 3968, 132).is_ok());
        assert!(
            mx_stream2_plan(16, 3072, 4000, 132).is_err(),
            "no room for the padding"
        );
        // ops.rs falls back to tc2 for what the plan refuses.
        assert!(stream2_fits(3584, 3072) && stream2_fits(3968, 3968));
        assert!(!stream2_fits(4096, 3072) && !stream2_fits(3584, 4000));
        assert!(!stream2_fits(3584, 100), "width not a multiple of 32");
        const { assert!(MX_STREAM_SHARED <= geometry::MAX_OPT_IN_SHARED) };
        for name in ["mxfp4_up_stream2_f32", "mxfp4_down_stream2_f32"] {
            assert!(
                geometry::OPT_IN_SHARED.contains(&(name, MX_STREAM_SHARED)),
                "{name}"
            );
        }
    }
}
