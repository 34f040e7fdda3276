//! Side streams for cuBLAS products that share one input (a layer's q, k, v and gate
//! projections): each product runs on its own stream between a fork and a join on the backend's
//! stream, so their kernels overlap instead of each waiting for the last one's tail, while the
//! backend's stream runs the small products of the same input (the GEMVs of KDA's f_a and beta,
//! MLA's kv_a, the router), whose latency is then hidden. A decode step's product of 12288 x
//! 7168 bf16 weights alone reaches ~81 % of the copy rate (its ramp and tail are a fifth of its
//! time; docs/performance.md), the weights of four such products together stream like one
//! product four times as large. Captured into a CUDA graph, the fork and join become the
//! graph's parallel branches.
//!
//! What a side stream touches is allocated before the fork and freed after the join, on the
//! backend's stream (its stream-ordered allocator), so no memory is reused while a side stream
//! may still use it. Each side stream has its own cuBLAS handle with its own workspace.

use crate::device::CudaBackend;
use crate::error::Result;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Side streams: four cuBLAS products at once (K3's KDA q, k, v and gate).
pub(crate) const SIDE_LANES: usize = 4;

/// Every handle's cuBLAS workspace, the backend's own included: set once, so no product
/// allocates inside a capture, and the same for all, so a product picks the same algorithm (and
/// gives the same bits) on any stream. cuBLASLt's products (blas_lt.rs) use the same memory:
/// both run in their stream's order.
pub(crate) const WORKSPACE_BYTES: usize = 32 << 20;

/// One side stream and the cuBLAS handle bound to it.
pub(crate) struct SideLane {
    // Dropped in this order: the handle before its workspace and its stream.
    pub(crate) blas: CudaBlas,
    /// Owned here for as long as the handle uses it.
    workspace: CudaSlice<u8>,
    pub(crate) stream: Arc<CudaStream>,
}

/// Where a product runs: a stream, its cuBLAS handle and the workspace of both.
#[derive(Clone, Copy)]
pub(crate) struct GemmLane<'a> {
    pub(crate) blas: &'a CudaBlas,
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) workspace: &'a CudaSlice<u8>,
}

impl SideLane {
    pub(crate) fn gemm(&self) -> GemmLane<'_> {
        GemmLane {
            blas: &self.blas,
            stream: &self.stream,
            workspace: &self.workspace,
        }
    }
}

/// `SIDE_LANES` side streams with their handles, in `dtype`'s math mode.
pub(crate) fn side_lanes(
    ctx: &Arc<CudaContext>,
    main: &Arc<CudaStream>,
    dtype: crate::Dtype,
) -> Result<Vec<SideLane>> {
    (0..SIDE_LANES)
        .map(|_| {
            let stream = ctx.new_stream()?;
            let blas = CudaBlas::new(stream.clone())?;
            crate::device::set_blas_math(&blas, dtype)?;
            let workspace = set_workspace(&blas, main)?;
            Ok(SideLane {
                blas,
                workspace,
                stream,
            })
        })
        .collect()
}

/// Give `blas` a workspace of `WORKSPACE_BYTES`, allocated on `main`; the caller keeps it for
/// as long as the handle lives.
pub(crate) fn set_workspace(blas: &CudaBlas, main: &Arc<CudaStream>) -> Result<CudaSlice<u8>> {
    let workspace = main.alloc_zeros::<u8>(WORKSPACE_BYTES)?;
    let ptr = workspace.device_ptr(main).0;
    // SAFETY: a live handle and a live allocation of WORKSPACE_BYTES, which the caller keeps
    // alongside the handle; the zeroing was queued on `main`, which every side stream waits for
    // at each fork before cuBLAS can touch it.
    unsafe {
        cudarc::cublas::sys::cublasSetWorkspace_v2(
            *blas.handle(),
            ptr as *mut std::ffi::c_void,
            WORKSPACE_BYTES,
        )
    }
    .result()?;
    Ok(workspace)
}

impl CudaBackend {
    /// The backend's own stream as a product's lane.
    pub(crate) fn main_gemm(&self) -> GemmLane<'_> {
        GemmLane {
            blas: &self.blas,
            stream: &self.stream,
            workspace: &self.blas_workspace,
        }
    }

    /// Make the first `n` side streams wait for the work queued so far (nothing in a dry pass,
    /// which queues nothing).
    pub(crate) fn fork_lanes(&self, n: usize) -> Result<()> {
        if n == 0 || self.step.dry() {
            return Ok(());
        }
        let ev = self.stream.record_event(None)?;
        for lane in &self.lanes[..n] {
            lane.stream.wait(&ev)?;
        }
        Ok(())
    }

    /// Make the backend's stream wait for the first `n` side streams' work.
    pub(crate) fn join_lanes(&self, n: usize) -> Result<()> {
        if n == 0 || self.step.dry() {
            return Ok(());
        }
        for lane in &self.lanes[..n] {
            self.stream.join(&lane.stream)?;
        }
        Ok(())
    }
}
