//! Plugin admin routes behind the admin token, with the server's paths and JSON shapes:
//! - `GET /admin/plugins`: `{"stages": [...]}` from [`PolicyAdmin::list`];
//! - `PUT /admin/plugins/router`: body = a wasm component; validated, then activated live;
//! - `POST /admin/plugins/router/rollback`: re-activate the previous version.
//!
//! Both answer `{"stage": "router", "activated": <version>}`.

use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use k3_api::server::{bearer, log_auth_failure, secret_eq};
use serde_json::json;

use crate::Shared;
use crate::errors::{Style, body_error, error};

/// The policy plugin's versions, as the binary keeps them (the wasm plugin host). Its methods
/// are called off the async threads (installing compiles a component).
pub trait PolicyAdmin: Send + Sync {
    /// Every stage the router's plugin host holds, each with its versions (the JSON array the
    /// server's `GET /admin/plugins` puts under `"stages"`).
    fn list(&self) -> serde_json::Value;
    /// Validate `component` as a router policy and make it the active version; returns that
    /// version's description.
    fn install(&self, component: Bytes) -> Result<serde_json::Value, AdminError>;
    /// Re-activate the version active before the current one; returns its description.
    fn rollback(&self) -> Result<serde_json::Value, AdminError>;
}

/// Why an admin action failed; each maps to the server's status and error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// Not a valid router component (400, `plugin_rejected`).
    #[error("{0}")]
    Rejected(String),
    /// Nothing to roll back to, or a similar request error (400).
    #[error("{0}")]
    InvalidRequest(String),
    /// Out of capacity for another version (503).
    #[error("{0}")]
    Unavailable(String),
    /// Anything else (500).
    #[error("{0}")]
    Internal(String),
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        let (status, kind, code) = match &self {
            AdminError::Rejected(_) => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("plugin_rejected"),
            ),
            AdminError::InvalidRequest(_) => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", None)
            }
            AdminError::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                Some("unavailable"),
            ),
            AdminError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error", None),
        };
        error(Style::OpenAi, status, kind, code, self.to_string())
    }
}

fn no_admin() -> Response {
    error(
        Style::OpenAi,
        StatusCode::NOT_FOUND,
        "not_found_error",
        Some("no_plugin_admin"),
        "this router has no policy plugin to administer",
    )
}

/// The 404 for a stage other than `router`.
fn wrong_stage(stage: &str) -> Option<Response> {
    (stage != "router").then(|| {
        error(
            Style::OpenAi,
            StatusCode::NOT_FOUND,
            "not_found_error",
            None,
            format!("unknown plugin stage '{stage}': the router has only 'router'"),
        )
    })
}

pub(crate) async fn list_plugins(State(shared): State<Arc<Shared>>) -> Response {
    match &shared.admin {
        Some(admin) => axum::Json(json!({"stages": admin.list()})).into_response(),
        None => no_admin(),
    }
}

pub(crate) async fn upload_plugin(
    State(shared): State<Arc<Shared>>,
    Path(stage): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if let Some(resp) = wrong_stage(&stage) {
        return resp;
    }
    let Some(admin) = shared.admin.clone() else {
        return no_admin();
    };
    let component = match body {
        Ok(b) => b,
        Err(e) => return body_error(Style::OpenAi, e),
    };
    if component.is_empty() {
        return error(
            Style::OpenAi,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("empty_component"),
            "the request body must be a wasm component (send it with Content-Type: application/wasm)",
        );
    }
    finish(
        &stage,
        "plugin activated",
        tokio::task::spawn_blocking(move || admin.install(component)).await,
    )
}

pub(crate) async fn rollback_plugin(
    State(shared): State<Arc<Shared>>,
    Path(stage): Path<String>,
) -> Response {
    if let Some(resp) = wrong_stage(&stage) {
        return resp;
    }
    let Some(admin) = shared.admin.clone() else {
        return no_admin();
    };
    finish(
        &stage,
        "plugin rolled back",
        tokio::task::spawn_blocking(move || admin.rollback()).await,
    )
}

fn finish(
    stage: &str,
    what: &str,
    result: Result<Result<serde_json::Value, AdminError>, tokio::task::JoinError>,
) -> Response {
    match result {
        Ok(Ok(version)) => {
            tracing::info!(stage, version = %version, "{what}");
            axum::Json(json!({"stage": stage, "activated": version})).into_response()
        }
        Ok(Err(e)) => e.into_response(),
        Err(e) => {
            AdminError::Internal(format!("the plugin admin task failed: {e}")).into_response()
        }
    }
}

pub(crate) async fn require_admin_token(
    State(shared): State<Arc<Shared>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(token) = shared.config.admin_token.as_deref() else {
        return error(
            Style::OpenAi,
            StatusCode::FORBIDDEN,
            "permission_error",
            Some("admin_disabled"),
            "the admin API is disabled; start the router with an admin token to enable it",
        );
    };
    let given = bearer(req.headers());
    if given.is_some_and(|g| secret_eq(g, token)) {
        return next.run(req).await;
    }
    log_auth_failure(&req, "admin_token", given.is_some());
    error(
        Style::OpenAi,
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        Some("invalid_admin_token"),
        "the admin API needs 'Authorization: Bearer <admin token>'",
    )
}
