//! CUDA backend for k3-model (first stage): the kernels of `kernels/*.cu` embedded as source,
//! compiled with NVRTC for the running GPU (cubin cached on disk), and launch wrappers for every
//! op of the K3 layer graph. Loads libcuda/libnvrtc at run time, so the crate builds and its
//! tests run on machines without CUDA; [`CudaBackend::try_new`] then returns an error.
//!
//! Status: the kernels are verified on the H200 by `host/backend-cuda/harness/device_check.py`;
//! [`CudaBackend`] implements `k3_model::backend::Backend` (backend_impl.rs), checked against
//! the CPU backend by `tests/device.rs` on a GPU. Besides the kernels: bf16 weights and their
//! GEMMs (backend_impl.rs `matmul_linear`), routed experts as tensor-core GEMMs for large steps
//! (moe_gemm.rs, or the wgmma MXFP4 GEMMs of moe_wg.rs), MLA prefill in the expanded form (mla_prefill.rs), per-op timing (profile.rs).

pub mod cache;
pub mod device;
pub mod dispatch;
pub mod error;
pub mod geometry;
#[macro_use]
pub mod ops;
pub mod backend_impl;
mod graph;
pub mod mla_prefill;
mod moe_gemm;
mod moe_sorted;
mod moe_stream;
mod moe_wg;
pub mod options;
mod profile;
pub mod sources;

pub use device::{CudaBackend, DeviceLinear, DeviceMat};
pub use error::{CudaError, Result};
pub use graph::GraphCounts;
pub use options::{CudaOptions, MlaDecodePrecision};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn try_new_without_a_driver_is_an_error_not_a_panic() {
        // On CI (no NVIDIA driver) this is the NoDriver path; on a GPU machine it must succeed
        // or fail with a typed error, never panic.
        match CudaBackend::try_new(0) {
            Ok(b) => assert!(b.limits.arch.starts_with("sm_")),
            Err(e) => {
                if !device::driver_present() {
                    assert!(matches!(e, CudaError::NoDriver(_)), "{e}");
                }
                assert!(!e.to_string().is_empty());
            }
        }
    }
}
