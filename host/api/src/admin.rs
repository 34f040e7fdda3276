//! Plugin admin routes (behind the admin token, see `server.rs`):
//! - `GET /admin/plugins`: every stage, its active version and per-version counters;
//! - `PUT /admin/plugins/{stage}`: body = a wasm component; validated, then activated live;
//! - `POST /admin/plugins/{stage}/rollback`: re-activate the previous version.

use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::json;

use crate::AppState;
use crate::body::read_body;
use crate::error::{ApiError, ErrorKind, ErrorStyle};

pub async fn list_plugins(State(state): State<AppState>) -> Response {
    axum::Json(json!({"stages": state.backend().list_plugins()})).into_response()
}

pub async fn upload_plugin(
    State(state): State<AppState>,
    Path(stage): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let component = match read_body(body, ErrorStyle::OpenAi) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    if component.is_empty() {
        return ApiError::new(
            ErrorKind::InvalidRequest,
            "the request body must be a wasm component (send it with Content-Type: application/wasm)",
        )
        .with_code("empty_component")
        .into_response();
    }
    match state.backend().load_plugin(stage.clone(), component).await {
        Ok(version) => {
            tracing::info!(stage, version = %version.id, "plugin activated");
            axum::Json(json!({"stage": stage, "activated": version})).into_response()
        }
        Err(e) => ApiError::from(e).into_response(),
    }
}

pub async fn rollback_plugin(State(state): State<AppState>, Path(stage): Path<String>) -> Response {
    match state.backend().rollback_plugin(stage.clone()).await {
        Ok(version) => {
            tracing::info!(stage, version = %version.id, "plugin rolled back");
            axum::Json(json!({"stage": stage, "activated": version})).into_response()
        }
        Err(e) => ApiError::from(e).into_response(),
    }
}
