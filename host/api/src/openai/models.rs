//! `GET /v1/models` and `GET /v1/models/{model}`.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::AppState;
use crate::error::ErrorStyle;

fn model_object(state: &AppState, name: &str) -> Value {
    let info = state.backend().model();
    json!({
        "id": name,
        "object": "model",
        "created": info.created,
        "owned_by": "k3serve",
        "root": info.id,
        "max_model_len": info.max_model_len,
    })
}

pub async fn list_models(State(state): State<AppState>) -> Response {
    let data: Vec<Value> = state
        .model_names()
        .iter()
        .map(|name| model_object(&state, name))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

pub async fn get_model(State(state): State<AppState>, Path(model): Path<String>) -> Response {
    match state.check_model(&model, ErrorStyle::OpenAi) {
        Ok(()) => {
            // Answer under the name asked for when it is one of the served names.
            let names = state.model_names();
            let name = names.iter().find(|n| **n == model).unwrap_or(&names[0]);
            axum::Json(model_object(&state, name)).into_response()
        }
        Err(e) => e.into_response(),
    }
}
