//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes.
//!
//! `/tokenize` takes either `prompt` (a raw text, tokenized as `/v1/completions` would:
//! special-token spellings become their ids; `add_special_tokens`, default true, runs the
//! tokenizer's post-processor) or chat `messages` (rendered and tokenized exactly as
//! `/v1/chat/completions` would render that request: any chat field that shapes the prompt
//! counts — `tools`, `tool_choice`, `response_format`, `reasoning_effort`,
//! `chat_template_kwargs` — plus `add_generation_prompt`, default true). It answers
//! `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only with
//! `return_token_strs`). `/detokenize` takes `{"tokens": [...]}` and answers `{"prompt": text}`.

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::body::{parse_json, read_body};
use crate::error::{ApiError, ErrorKind, ErrorStyle};
use crate::openai::chat_request::ChatCompletionRequest;
use crate::{AppState, random_id};

/// The `/tokenize` fields of its own; a chat body's other fields are the chat request's.
const TOKENIZE_FIELDS: [&str; 7] = [
    "prompt",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
    "chat_template",
    "model",
];

#[derive(Debug, Deserialize)]
struct TokenizeOptions {
    model: Option<String>,
    prompt: Option<String>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    return_token_strs: Option<bool>,
    chat_template: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

pub async fn tokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match handle_tokenize(state, body).await {
        Ok(resp) => resp,
        Err(err) => err.into_response(),
    }
}

pub async fn detokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match handle_detokenize(state, body) {
        Ok(resp) => resp,
        Err(err) => err.into_response(),
    }
}

async fn handle_tokenize(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let style = ErrorStyle::OpenAi;
    let body = read_body(body, style)?;
    let mut unknown = state.unknown_fields();
    let object: Map<String, Value> = parse_json(&body, style, &mut unknown)?;
    let own: Map<String, Value> = object
        .iter()
        .filter(|(k, _)| TOKENIZE_FIELDS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let options: TokenizeOptions = parse_json(
        Value::Object(own).to_string().as_bytes(),
        style,
        &mut unknown,
    )?;
    if let Some(model) = &options.model {
        state.check_model(model, style)?;
    }
    if options.chat_template.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::not_supported(
            "chat_template",
            "a per-request 'chat_template' is not supported; start the server with --chat-template",
        ));
    }
    if options.continue_final_message == Some(true) {
        return Err(ApiError::not_supported(
            "continue_final_message",
            "'continue_final_message' is not supported",
        ));
    }
    let has_messages = object.get("messages").is_some_and(|m| !m.is_null());
    let tokens = match (&options.prompt, has_messages) {
        (Some(_), true) => {
            return Err(ApiError::invalid(
                "prompt",
                "give either 'prompt' or 'messages', not both",
            ));
        }
        (None, false) => {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                "missing required field 'prompt' (or chat 'messages')",
            )
            .with_param("prompt")
            .with_code("missing_field"));
        }
        (Some(prompt), false) => {
            for key in object.keys() {
                if !TOKENIZE_FIELDS.contains(&key.as_str()) {
                    unknown.found(key.clone())?;
                }
            }
            state
                .backend()
                .tokenize_text(prompt, options.add_special_tokens.unwrap_or(true))?
        }
        (None, true) => {
            // The rest of the body is a chat request, validated as /v1/chat/completions does.
            let mut chat: Map<String, Value> = object
                .into_iter()
                .filter(|(k, _)| !TOKENIZE_FIELDS.contains(&k.as_str()))
                .collect();
            chat.insert("model".into(), Value::String(state.model_name()));
            let chat: ChatCompletionRequest = parse_json(
                Value::Object(chat).to_string().as_bytes(),
                style,
                &mut unknown,
            )?;
            let mut valid = chat.validate(random_id("tokenize-"), &mut unknown)?;
            valid.request.template_kwargs.insert(
                "add_generation_prompt".into(),
                Value::Bool(options.add_generation_prompt.unwrap_or(true)),
            );
            state.backend().tokenize_chat(valid.request).await?
        }
    };
    let token_strs = options
        .return_token_strs
        .unwrap_or(false)
        .then(|| state.backend().token_strings(&tokens));
    Ok(axum::Json(json!({
        "count": tokens.len(),
        "max_model_len": state.backend().model().max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
    .into_response())
}

fn handle_detokenize(
    state: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let style = ErrorStyle::OpenAi;
    let body = read_body(body, style)?;
    let req: DetokenizeRequest = parse_json(&body, style, &mut state.unknown_fields())?;
    if let Some(model) = &req.model {
        state.check_model(model, style)?;
    }
    let prompt = state.backend().detokenize(&req.tokens)?;
    Ok(axum::Json(json!({"prompt": prompt})).into_response())
}
