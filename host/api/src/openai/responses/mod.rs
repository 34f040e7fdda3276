//! `POST /v1/responses` (OpenAI Responses API), stateless: the request becomes a chat request
//! ([`request`], [`input`]) run by the chat machinery; the answer is a `response` object
//! ([`response`]) or a stream of Responses events ([`stream`]). Nothing is stored, so
//! `previous_response_id` and `conversation` are a 400.

pub mod input;
pub mod request;
pub mod response;
pub mod stream;

use std::time::Instant;

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use crate::body::{parse_json, read_body};
use crate::error::{ApiError, ErrorStyle};
use crate::generation;
use crate::{AppState, random_id, unix_now};

use request::ResponsesRequest;
use response::ResponseMeta;
use stream::ResponsesStream;

pub async fn create_response(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match handle(state, body).await {
        Ok(resp) => resp,
        Err(err) => err.into_response(),
    }
}

async fn handle(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let start = Instant::now();
    let style = ErrorStyle::OpenAi;
    let body = read_body(body, style)?;
    let mut unknown = state.unknown_fields();
    let request: ResponsesRequest = parse_json(&body, style, &mut unknown)?;
    state.check_model(&request.model, style)?;
    let id = random_id("resp_");
    let valid = request.validate(id.clone(), &mut unknown)?;
    let permit = state.admit(style, 1)?;
    let gens = generation::start_chat(&state, valid.request, 1, style)
        .await
        .map_err(|e| valid.names.rename_error(e))?;
    let meta = ResponseMeta {
        id,
        created_at: unix_now(),
        model: state.model_name(),
        echo: valid.echo,
        logprobs: valid.logprobs,
    };
    if valid.stream {
        return Ok(generation::stream_response(
            state,
            permit,
            gens,
            start,
            valid.parallel_tool_calls,
            ResponsesStream::new(meta),
        ));
    }
    let results =
        generation::collect(&state, gens, start, valid.parallel_tool_calls, style).await?;
    drop(permit);
    Ok(axum::Json(meta.finished(&results[0])).into_response())
}
