//! API errors: one stable `type` string per kind of failure, each with one HTTP status.
//!
//! OpenAI routes answer `{"error":{"message","type","param","code"}}`; Anthropic routes answer
//! `{"type":"error","error":{"type","message"}}` so each official client parses its own shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::backend::BackendError;

/// The error kinds. The `type` string and status never change for a kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    RequestTooLarge,
    Template,
    RateLimit,
    Overloaded,
    Plugin,
    Internal,
}

impl ErrorKind {
    pub fn type_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RequestTooLarge => "request_too_large",
            ErrorKind::Template => "template_error",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::Plugin => "plugin_error",
            ErrorKind::Internal => "internal_error",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::Permission => StatusCode::FORBIDDEN,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::Template => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorKind::RateLimit => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Plugin | ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// Which wire shape an error takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorStyle {
    #[default]
    OpenAi,
    Anthropic,
}

impl ErrorStyle {
    /// Anthropic's shape for everything under `/v1/messages` (known routes or not), OpenAI's
    /// elsewhere.
    pub fn for_path(path: &str) -> Self {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            ErrorStyle::Anthropic
        } else {
            ErrorStyle::OpenAi
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// The request field at fault, as a path (`messages[2].content`).
    pub param: Option<String>,
    /// A finer, stable reason (`context_length_exceeded`, `unknown_field`, `not_supported`, ...).
    pub code: Option<&'static str>,
    pub style: ErrorStyle,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
            param: None,
            code: None,
            style: ErrorStyle::OpenAi,
        }
    }

    /// A 400 about one named parameter.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(ErrorKind::InvalidRequest, message)
            .with_param(param)
            .with_code("invalid_parameter")
    }

    /// A 400 for a valid request that asks for something not implemented yet.
    pub fn not_supported(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(ErrorKind::InvalidRequest, message)
            .with_param(param)
            .with_code("not_supported")
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn styled(mut self, style: ErrorStyle) -> Self {
        self.style = style;
        self
    }

    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    /// The JSON body in this error's style.
    pub fn body(&self) -> serde_json::Value {
        match self.style {
            ErrorStyle::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.kind.type_str(),
                    "param": self.param,
                    "code": self.code,
                }
            }),
            ErrorStyle::Anthropic => {
                // Anthropic has no `param`; fold it into the message so the field is still named.
                let message = match &self.param {
                    Some(p) if !self.message.contains(p.as_str()) => {
                        format!("{}: {}", p, self.message)
                    }
                    _ => self.message.clone(),
                };
                let kind = match self.kind {
                    ErrorKind::Internal | ErrorKind::Plugin => "api_error",
                    ErrorKind::Template => "invalid_request_error",
                    other => other.type_str(),
                };
                json!({"type": "error", "error": {"type": kind, "message": message}})
            }
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind.type_str(), self.message)
    }
}

/// Seconds a client told "too many requests" or "unavailable" should wait: generations finish
/// within seconds, so a short wait is the useful hint.
const RETRY_AFTER_SECS: &str = "1";

/// An error response's kind and code, kept in its extensions for the server's 5xx log line.
#[derive(Debug, Clone, Copy)]
pub struct ErrorLabel {
    pub kind: &'static str,
    pub code: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let label = ErrorLabel {
            kind: self.kind.type_str(),
            code: self.code,
        };
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        resp.extensions_mut().insert(label);
        if matches!(self.kind, ErrorKind::RateLimit | ErrorKind::Overloaded) {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        resp
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::InvalidRequest { message, param } => {
                let mut err = ApiError::new(ErrorKind::InvalidRequest, message)
                    .with_code("invalid_parameter");
                err.param = param;
                err
            }
            BackendError::ContextLengthExceeded(message) => {
                ApiError::new(ErrorKind::InvalidRequest, message)
                    .with_param("messages")
                    .with_code("context_length_exceeded")
            }
            BackendError::InputTooLarge { message, param } => {
                ApiError::new(ErrorKind::InvalidRequest, message)
                    .with_param(param)
                    .with_code("input_too_large")
            }
            BackendError::Template(message) => ApiError::new(
                ErrorKind::Template,
                format!("the chat template rejected the conversation: {message}"),
            )
            .with_code("template_error"),
            BackendError::NotSupported { message, param } => {
                let mut err =
                    ApiError::new(ErrorKind::InvalidRequest, message).with_code("not_supported");
                err.param = param;
                err
            }
            BackendError::Overloaded(message) => {
                ApiError::new(ErrorKind::RateLimit, message).with_code("overloaded")
            }
            BackendError::Unavailable(message) => {
                ApiError::new(ErrorKind::Overloaded, message).with_code("unavailable")
            }
            BackendError::NotFound(message) => ApiError::new(ErrorKind::NotFound, message),
            BackendError::Plugin(message) => {
                ApiError::new(ErrorKind::Plugin, message).with_code("plugin_failed")
            }
            BackendError::PluginRejected(message) => {
                ApiError::new(ErrorKind::InvalidRequest, message).with_code("plugin_rejected")
            }
            BackendError::Internal(message) => ApiError::new(ErrorKind::Internal, message),
        }
    }
}
