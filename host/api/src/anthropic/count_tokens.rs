//! `POST /v1/messages/count_tokens`: the tokens of the prompt a `/v1/messages` request with this
//! body would have (system, tools and thinking included), as `{"input_tokens": N}`.

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::json;

use crate::body::{parse_json, read_body};
use crate::error::{ApiError, ErrorStyle};
use crate::{AppState, random_id};

use super::request::MessagesRequest;

pub async fn count_tokens(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match handle(state, body).await {
        Ok(resp) => resp,
        Err(err) => err.styled(ErrorStyle::Anthropic).into_response(),
    }
}

async fn handle(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let style = ErrorStyle::Anthropic;
    let body = read_body(body, style)?;
    let mut unknown = state.unknown_fields();
    let mut request: MessagesRequest = parse_json(&body, style, &mut unknown)?;
    state.check_model(&request.model, style)?;
    // Counting generates nothing: the request needs no max_tokens (any valid value will do).
    request.max_tokens.get_or_insert(1);
    let valid = request.validate(random_id("count_"), &mut unknown)?;
    let tokens = state.backend().tokenize_chat(valid.request).await?;
    Ok(axum::Json(json!({"input_tokens": tokens.len()})).into_response())
}
