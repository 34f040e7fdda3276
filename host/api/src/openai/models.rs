//! `GET /v1/models` and `GET /v1/models/{model}`.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::AppState;
use crate::error::ErrorStyle;

fn model_object(state: &AppState) -> Value {
    let info = state.backend().model();
    json!({
        "id": state.model_name(),
        "object": "model",
        "created": info.created,
        "owned_by": "k3serve",
        "root": info.id,
        "max_model_len": info.max_model_len,
    })
}

pub async fn list_models(State(state): State<AppState>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&state)]})).into_response()
}

pub async fn get_model(State(state): State<AppState>, Path(model): Path<String>) -> Response {
    match state.check_model(&model, ErrorStyle::OpenAi) {
        Ok(()) => axum::Json(model_object(&state)).into_response(),
        Err(e) => e.into_response(),
    }
}
