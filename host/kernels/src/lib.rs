//! The CUDA kernels as data: the sources of `kernels/*.cu` (`sources`), the key that names a
//! compiled cubin (`key`), NVRTC loaded at run time and called on many files at once (`nvrtc`),
//! and the table of cubins compiled at build time into a binary (`embed`).
//!
//! A crate of its own because two builds use it: `k3-backend-cuda` at run time, and that crate's
//! build script, which compiles the kernels ahead of time when `K3_KERNEL_ARCHS` is set (see
//! `docs/architecture.md`, "Kernels ahead of time"). Nothing here needs a GPU.

pub mod embed;
pub mod error;
pub mod key;
pub mod nvrtc;
pub mod sources;

pub use embed::EmbeddedCubin;
pub use error::{KernelError, Result};
pub use key::{NVRTC_OPTIONS, cache_key};
pub use nvrtc::{CompileJob, Nvrtc};
pub use sources::{FILES, HEADERS, KernelFile, expand};
