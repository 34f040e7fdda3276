//! `POST /v1/completions`: raw prompts (text or token ids), no template, no parsers.

use std::time::Instant;

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::backend::{CompletionGenRequest, FinishInfo, GenEvent, PromptInput, TokenLogprob};
use crate::body::{parse_json, read_body};
use crate::error::{ApiError, ErrorStyle};
use crate::generation::{self, StreamFormat};
use crate::openai::chat_request::validate_response_format;
use crate::openai::{StreamOptions, finish_reason};
use crate::structured::{self, ConstraintFields};
use crate::validate::{self, MAX_TOP_LOGPROBS, SamplingFields};
use crate::{AppState, random_id, sse, unix_now};

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: i64 = 16;
/// Most prompts in one batched request.
const MAX_PROMPTS: usize = 64;

/// The accepted fields; others go to [`crate::unknown_fields::UnknownFields`].
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Value,
    pub suffix: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub min_tokens: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub logit_bias: Option<Map<String, Value>>,
    pub user: Option<String>,
    pub skip_special_tokens: Option<bool>,
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    /// vLLM's choice of grammar engine: accepted and ignored (llguidance is the one engine).
    pub guided_decoding_backend: Option<String>,
}

/// `prompt` as a list of prompts: a string, strings, token ids, or lists of token ids.
pub fn parse_prompts(prompt: &Value) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "'prompt' must be a string, an array of strings, an array of token ids, or an array of token-id arrays",
        )
    };
    let token = |v: &Value, param: String| {
        v.as_u64()
            .filter(|t| *t <= u32::MAX as u64)
            .map(|t| t as u32)
            .ok_or_else(|| {
                ApiError::invalid(&param, format!("'{param}' must be a non-negative token id"))
            })
    };
    let prompts = match prompt {
        Value::String(s) => vec![PromptInput::Text(s.clone())],
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::invalid("prompt", "'prompt' must not be empty"));
        }
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(PromptInput::Text(s.clone())),
                    _ => Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        format!("'prompt[{i}]' must be a string like the other prompts"),
                    )),
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![PromptInput::Tokens(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| token(v, format!("prompt[{i}]")))
                    .collect::<Result<_, _>>()?,
            )],
            Value::Array(_) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::Array(ids) if !ids.is_empty() => Ok(PromptInput::Tokens(
                        ids.iter()
                            .enumerate()
                            .map(|(j, t)| token(t, format!("prompt[{i}][{j}]")))
                            .collect::<Result<_, _>>()?,
                    )),
                    _ => Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        format!("'prompt[{i}]' must be a non-empty array of token ids"),
                    )),
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    if prompts.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!("at most {MAX_PROMPTS} prompts per request"),
        ));
    }
    if let Some(PromptInput::Text(t)) = prompts
        .iter()
        .find(|p| matches!(p, PromptInput::Text(t) if t.is_empty()))
    {
        debug_assert!(t.is_empty());
        return Err(ApiError::invalid(
            "prompt",
            "'prompt' must not be an empty string",
        ));
    }
    Ok(prompts)
}

pub async fn completions(
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
    let req: CompletionRequest = parse_json(&body, style, &mut state.unknown_fields())?;
    state.check_model(&req.model, style)?;
    let prompts = parse_prompts(&req.prompt)?;
    let n = validate::validate_n(req.n)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::not_supported(
            "suffix",
            "'suffix' is not supported",
        ));
    }
    if let Some(b) = req.best_of
        && b != n as i64
    {
        return Err(ApiError::not_supported(
            "best_of",
            "'best_of' other than n is not supported",
        ));
    }
    if req.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(ApiError::not_supported(
            "logit_bias",
            "'logit_bias' is not supported yet",
        ));
    }
    let stream = req.stream.unwrap_or(false);
    if req.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "'stream_options' is only allowed when 'stream' is true",
        ));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Some(k as u32),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ));
        }
    };
    let sampling = validate::validate_sampling(&SamplingFields {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        seed: req.seed,
        stop: req.stop,
        stop_param: "stop",
        stop_token_ids: req.stop_token_ids,
        max_tokens: Some((req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS), "max_tokens")),
        min_tokens: req.min_tokens,
        ignore_eos: req.ignore_eos,
        logprobs,
    })?;
    if let Some(rf) = &req.response_format {
        validate_response_format(rf)?;
    }
    let constraint = structured::constraint(&ConstraintFields {
        response_format: req.response_format.as_ref(),
        structured_outputs: req.structured_outputs.as_ref(),
        guided_json: req.guided_json.as_ref(),
        guided_regex: req.guided_regex.as_ref(),
        guided_choice: req.guided_choice.as_ref(),
        guided_grammar: req.guided_grammar.as_ref(),
    })?;
    let (constraint, constraint_param) = match constraint {
        Some((c, p)) => (Some(c), p),
        None => (None, String::new()),
    };
    let echo = req.echo.unwrap_or(false);
    let permit = state.admit(style, prompts.len() * n)?;
    let id = random_id("cmpl-");
    let mut gens = Vec::with_capacity(prompts.len() * n);
    for (p, prompt) in prompts.into_iter().enumerate() {
        let request = CompletionGenRequest {
            request_id: format!("{id}-{p}"),
            prompt,
            sampling: sampling.clone(),
            echo,
            constraint: constraint.clone(),
            constraint_param: constraint_param.clone(),
        };
        gens.extend(generation::start_completion(&state, request, n).await?);
    }
    let echoes: Vec<String> = gens
        .iter()
        .map(|g| {
            if echo {
                g.prompt_text.clone().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .collect();
    let mut format = CompletionStream {
        id,
        created: unix_now(),
        model: state.model_name(),
        n,
        include_usage: req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        logprobs: logprobs.is_some(),
        choices: echoes
            .into_iter()
            .map(|e| CompletionChoice {
                offset: e.len(),
                echo: e,
                ..Default::default()
            })
            .collect(),
    };
    if stream {
        return Ok(generation::stream_response(
            state, permit, gens, start, true, format,
        ));
    }
    let results = generation::collect(&state, gens, start, true, style).await?;
    drop(permit);
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let c = &mut format.choices[i];
            let text = format!("{}{}", c.echo, r.content);
            let lp = format
                .logprobs
                .then(|| legacy_logprobs(&r.logprobs, &mut c.offset));
            let finish = r
                .finish
                .as_ref()
                .expect("collect() checks every choice finished");
            json!({
                "index": i,
                "text": text,
                "logprobs": lp,
                "finish_reason": finish_reason(finish, false),
            })
        })
        .collect();
    let finishes: Vec<&FinishInfo> = results.iter().filter_map(|r| r.finish.as_ref()).collect();
    Ok(axum::Json(json!({
        "id": format.id,
        "object": "text_completion",
        "created": format.created,
        "model": format.model,
        "choices": choices,
        "usage": completion_usage(&finishes, n),
    }))
    .into_response())
}

/// Usage over several prompts × n choices: each prompt counted once.
fn completion_usage(finishes: &[&FinishInfo], n: usize) -> Value {
    let prompt: u64 = finishes
        .iter()
        .step_by(n.max(1))
        .map(|f| f.prompt_tokens as u64)
        .sum();
    let cached: u64 = finishes
        .iter()
        .step_by(n.max(1))
        .map(|f| f.cached_tokens as u64)
        .sum();
    let completion: u64 = finishes.iter().map(|f| f.completion_tokens as u64).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// The legacy completions logprobs object; `offset` is the running text offset.
fn legacy_logprobs(tokens: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(*offset);
        *offset += t.token.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| &t.token).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| {
            t.top.iter().map(|a| (a.token.clone(), json!(a.logprob))).collect::<Map<String, Value>>()
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

#[derive(Debug, Default)]
struct CompletionChoice {
    echo: String,
    offset: usize,
    pending_logprobs: Vec<TokenLogprob>,
    finish: Option<FinishInfo>,
}

struct CompletionStream {
    id: String,
    created: u64,
    model: String,
    n: usize,
    include_usage: bool,
    logprobs: bool,
    choices: Vec<CompletionChoice>,
}

impl CompletionStream {
    fn chunk(&mut self, i: usize, text: String, finish: Option<&str>) -> Bytes {
        let c = &mut self.choices[i];
        let lp = if self.logprobs {
            let pending = std::mem::take(&mut c.pending_logprobs);
            legacy_logprobs(&pending, &mut c.offset)
        } else {
            Value::Null
        };
        let mut obj = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}],
        });
        if self.include_usage {
            obj["usage"] = Value::Null;
        }
        sse::data(&obj)
    }
}

impl StreamFormat for CompletionStream {
    fn start(&mut self) -> Vec<Bytes> {
        (0..self.choices.len())
            .filter(|i| !self.choices[*i].echo.is_empty())
            .collect::<Vec<_>>()
            .into_iter()
            .map(|i| {
                let echo = self.choices[i].echo.clone();
                self.chunk(i, echo, None)
            })
            .collect()
    }

    fn event(&mut self, choice: usize, event: GenEvent) -> Vec<Bytes> {
        match event {
            GenEvent::Content(t) => vec![self.chunk(choice, t, None)],
            GenEvent::Logprobs(lp) => {
                self.choices[choice].pending_logprobs.extend(lp);
                Vec::new()
            }
            GenEvent::Finished(info) => {
                let reason = finish_reason(&info, false);
                self.choices[choice].finish = Some(info);
                vec![self.chunk(choice, String::new(), Some(reason))]
            }
            _ => Vec::new(),
        }
    }

    fn end(&mut self) -> Vec<Bytes> {
        let mut out = Vec::new();
        if self.include_usage {
            let finishes: Vec<&FinishInfo> = self
                .choices
                .iter()
                .filter_map(|c| c.finish.as_ref())
                .collect();
            out.push(sse::data(&json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": completion_usage(&finishes, self.n),
            })));
        }
        out.push(sse::done());
        out
    }

    fn error(&mut self, error: ApiError) -> Vec<Bytes> {
        vec![sse::data(&error.body()), sse::done()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms() {
        assert_eq!(
            parse_prompts(&json!("hi")).unwrap(),
            vec![PromptInput::Text("hi".into())]
        );
        assert_eq!(
            parse_prompts(&json!([1, 2])).unwrap(),
            vec![PromptInput::Tokens(vec![1, 2])]
        );
        assert_eq!(parse_prompts(&json!([[1], [2, 3]])).unwrap().len(), 2);
        assert_eq!(
            parse_prompts(&json!([1, -2])).unwrap_err().param.as_deref(),
            Some("prompt[1]")
        );
        assert_eq!(
            parse_prompts(&json!(["a", 1]))
                .unwrap_err()
                .param
                .as_deref(),
            Some("prompt[1]")
        );
        assert!(parse_prompts(&json!([])).is_err());
        assert!(parse_prompts(&json!("")).is_err());
        assert!(parse_prompts(&json!({"a": 1})).is_err());
    }
}
