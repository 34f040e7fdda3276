//! Work buffers the expert paths keep between calls (grown, never shrunk), held by the backend's
//! device state; the moe modules fill them.

use cudarc::driver::CudaSlice;

/// Work buffers kept between calls (grown, never shrunk): at prefill sizes they are gigabytes,
/// and allocating them per layer costs more than the GEMMs (the stream-ordered pool hands
/// memory back at every synchronisation).
#[derive(Default)]
pub(crate) struct MoeScratch {
    pub(crate) xs: Option<CudaSlice<u16>>,
    pub(crate) w13: Option<CudaSlice<u16>>,
    pub(crate) w2: Option<CudaSlice<u16>>,
    pub(crate) act: Option<CudaSlice<u16>>,
    pub(crate) h: Option<CudaSlice<f32>>,
    pub(crate) y: Option<CudaSlice<f32>>,
    pub(crate) inv: Option<CudaSlice<i32>>,
}

/// Work buffers kept between eager calls (grown, never shrunk; at T = 2048 K3 ~0.9 GB), as
/// the cuBLAS path does: per-layer allocations of this size cost more than they should.
#[derive(Default)]
pub(crate) struct SortedScratch {
    pub(crate) zx: Option<CudaSlice<u16>>,
    pub(crate) actx: Option<CudaSlice<u16>>,
    pub(crate) y: Option<CudaSlice<f32>>,
}
