//! The model crate's two error types: a backend op's failure and an executor step's.

/// Why a backend op failed. The one error type of every [`Backend`](crate::Backend) op: an op
/// either returns its result or this, never a stand-in value, so a failed step stops at its
/// first failure.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Shapes or arguments the op does not accept.
    #[error("invalid argument: {0}")]
    InvalidArg(String),
    /// An arena range past its end.
    #[error("arena access out of bounds: offset {offset} + {len} > {arena}")]
    OutOfBounds {
        offset: usize,
        len: usize,
        arena: usize,
    },
    /// A shape or parameter outside what this backend implements.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The device, its driver or a library call failed.
    #[error("device failure: {0}")]
    Device(String),
}

/// What every [`Backend`](crate::Backend) op returns.
pub type OpResult<T> = Result<T, BackendError>;

/// Why an executor call failed: a bad batch, an arena range, or the backend beneath it.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error("arena access out of bounds: offset {offset} + {len} > {arena}")]
    OutOfBounds {
        offset: usize,
        len: usize,
        arena: usize,
    },
    /// The executor itself failed (its thread stopped, a bad configuration).
    #[error("backend failure: {0}")]
    Backend(String),
    /// A backend op failed; the step's results are lost.
    #[error("backend op failed: {0}")]
    Op(#[from] BackendError),
}
