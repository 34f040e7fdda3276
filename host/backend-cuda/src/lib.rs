//! CUDA backend for k3-model: the kernels of `kernels/*.cu` (built in as cubins when compiled
//! with `K3_KERNEL_ARCHS`, else compiled with NVRTC for the running GPU and cached on disk), and
//! one module per op family calling them. Loads libcuda/libnvrtc at run time, so the crate
//! builds and its tests run on machines without CUDA; [`CudaBackend::try_new`] then returns an
//! error.
//!
//! Layout: `backend.rs` is the one `impl Backend for CudaBackend`, calling the op modules
//! `dense/` (matmuls, norms, elementwise, AttnRes, top-k), `kda/`, `mla/` (with the expanded
//! prefill), `moe/` (router and the expert paths) and `vision.rs` (the vision tower's ops); `dispatch.rs` picks each op's kernel path
//! from the step's shape and the GPU, `options.rs` holds the deployment's choices
//! ([`CudaOptions`]); `device.rs` (context, memory, module loading), `graph.rs` (decode steps as
//! CUDA graphs), `cache.rs` / `kernels.rs` (where each cubin comes from; the sources are the `k3-kernels` crate), `profile.rs`
//! (`K3_PROFILE`) and `launch.rs` (the launch macro) are the infrastructure. The kernels are
//! checked on the H200 by `host/backend-cuda/harness/device_check.py`, the backend against the
//! CPU backend by `tests/device.rs`.

#[macro_use]
mod launch;
mod backend;
mod blas_lt;
pub mod buf;
pub mod cache;
mod dense;
pub mod device;
pub mod dispatch;
pub mod error;
pub mod geometry;
mod graph;
mod kda;
pub mod kernels;
mod lanes;
pub mod mla;
mod moe;
pub mod options;
mod prepared;
mod profile;
mod step;
mod vision;
mod workspace;

pub use device::{CudaBackend, DeviceLinear, DeviceMat, StartupTimes};
pub use error::{CudaError, Result};
pub use options::{CudaOptions, Dtype};
pub use step::GraphCounts;

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
