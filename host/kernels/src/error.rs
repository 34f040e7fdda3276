/// What can go wrong turning kernel sources into cubins.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// libnvrtc could not be loaded or lacks a symbol (set `K3_NVRTC_LIB` to its path, or add
    /// its directory to `LD_LIBRARY_PATH`).
    #[error("no NVRTC library: {0}")]
    NoNvrtc(String),
    #[error("NVRTC failed on {file}: {message}\n{log}")]
    Compile {
        file: String,
        message: String,
        log: String,
    },
    #[error("kernel source {file}: {message}")]
    Source { file: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, KernelError>;
