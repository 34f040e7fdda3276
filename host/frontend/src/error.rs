//! The one error type of the request path; the HTTP layer maps each variant to one status.

/// Failures the backend reports; the API maps each to one HTTP status and error type.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    #[error("{0}")]
    ContextLengthExceeded(String),
    /// The chat template rejected the conversation.
    #[error("{0}")]
    Template(String),
    #[error("{message}")]
    NotSupported {
        message: String,
        param: Option<String>,
    },
    /// Too much queued work: try again later.
    #[error("{0}")]
    Overloaded(String),
    /// Shutting down or not ready.
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    NotFound(String),
    /// A plugin failed (trap, timeout, bad output) while serving this request.
    #[error("{0}")]
    Plugin(String),
    /// A plugin upload was rejected (does not type-check, fails its self-test, wrong stage).
    #[error("{0}")]
    PluginRejected(String),
    #[error("{0}")]
    Internal(String),
}
