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
    /// The input is too large to process at all (it ran a stage into its resource limits).
    #[error("{message}")]
    InputTooLarge { message: String, param: String },
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

/// A plugin call's failure as the request's error: the host out of plugin instances is a 503 to
/// retry (the plugin did nothing wrong); anything else is the plugin's failure.
pub(crate) fn plugin_failure(e: k3_plugin_host::PluginError) -> BackendError {
    if e.is_capacity() {
        BackendError::Unavailable(e.to_string())
    } else {
        BackendError::Plugin(e.to_string())
    }
}

/// Failures of [`Frontend::output_grammar`](crate::Frontend::output_grammar); each converts
/// into the [`BackendError`] the API maps to a status.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrontendError {
    /// The active tool parser has no `output-grammar` export (WIT 0.3): `tool_choice`
    /// `required` / a named function and strict tools cannot be enforced (a 400).
    #[error(
        "the active tool parser ({plugin}) cannot constrain the output: it has no output grammar (WIT 0.3 `output-grammar` export), so tool_choice \"required\", a named function, strict tools and response_format are not supported with it"
    )]
    NoOutputGrammar { plugin: String },
    /// The parser refused the request as wrong (e.g. a named function that is not a tool).
    #[error("{0}")]
    InvalidRequest(String),
    /// The parser cannot constrain this request.
    #[error("{0}")]
    Unsupported(String),
    /// The plugin failed (trap, timeout, no active parser).
    #[error("{0}")]
    Plugin(String),
    /// The host had no plugin instance free to ask (retry later).
    #[error("{0}")]
    Capacity(String),
}
