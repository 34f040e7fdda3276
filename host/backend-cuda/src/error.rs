use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// libcuda (the driver) could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// libnvrtc could not be loaded (set LD_LIBRARY_PATH to a CUDA 13 toolkit or the nvidia-cuda-nvrtc wheel's lib/).
    #[error("no NVRTC library: {0}")]
    NoNvrtc(String),
    /// libcublas could not be loaded (the nvidia-cublas wheel's lib/ or a CUDA 13 toolkit).
    #[error("no cuBLAS library: {0}")]
    NoCublas(String),
    #[error("cuBLAS call failed: {0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    #[error("cuBLASLt call failed: {0}")]
    CublasLt(#[from] cudarc::cublaslt::result::CublasError),
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A kernel source that did not expand or compile (the file and NVRTC's log).
    #[error(transparent)]
    Kernel(#[from] k3_kernels::KernelError),
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("kernel {0} not found in any loaded module")]
    MissingKernel(String),
    /// A shape or parameter outside what the kernels support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid argument: {0}")]
    InvalidArg(String),
}

pub type Result<T> = std::result::Result<T, CudaError>;

impl From<CudaError> for k3_model::BackendError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::InvalidArg(m) => Self::InvalidArg(m),
            CudaError::Unsupported(m) => Self::Unsupported(m),
            other => Self::Device(other.to_string()),
        }
    }
}
