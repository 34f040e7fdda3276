//! Error responses in each protocol's shape: OpenAI `{"error":{"message","type","param","code"}}`,
//! Anthropic `{"type":"error","error":{"type","message"}}` (everything under `/v1/messages`).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// The replicas' choice of shape, by path (`ErrorStyle::for_path`): the router answers as they do.
pub(crate) use k3_api::error::ErrorStyle as Style;

/// An error response. `kind` is the OpenAI `type` (`overloaded_error`, ...); Anthropic gets the
/// same except `internal_error`, which it calls `api_error`.
pub(crate) fn error(
    style: Style,
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    message: impl Into<String>,
) -> Response {
    let message = message.into();
    let body = match style {
        Style::OpenAi => json!({
            "error": {"message": message, "type": kind, "param": null, "code": code}
        }),
        Style::Anthropic => {
            let kind = if kind == "internal_error" {
                "api_error"
            } else {
                kind
            };
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
    };
    let mut resp = (status, axum::Json(body)).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        // Replicas come back within seconds (or another is admitted): a short wait is the hint.
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// A 503: no replica could take the request.
pub(crate) fn unavailable(
    style: Style,
    code: &'static str,
    message: impl Into<String>,
) -> Response {
    error(
        style,
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded_error",
        Some(code),
        message,
    )
}

/// The request body could not be read (too large, or the client broke off).
pub(crate) fn body_error(
    style: Style,
    rejection: axum::extract::rejection::BytesRejection,
) -> Response {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        error(
            style,
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            Some("request_too_large"),
            rejection.body_text(),
        )
    } else {
        error(
            style,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("unreadable_body"),
            rejection.body_text(),
        )
    }
}

/// An error's message with its causes (reqwest's own message names only the URL).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}
