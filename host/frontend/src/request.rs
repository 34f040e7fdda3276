//! The validated, protocol-neutral requests the frontend takes. The HTTP protocols (OpenAI,
//! Anthropic) parse their JSON into these; token limits are checked here, once, against the
//! model's context length and the prompt ([`token_budget`]).

use k3_structured::OutputConstraint;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::BackendError;

/// Sampling options after validation. `None` means "the backend's default".
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingOptions {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// `None` or 0 disables top-k.
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// Stop strings; generation ends before the matched string, which is not returned.
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// `None`: up to the model's context length.
    pub max_tokens: Option<u32>,
    pub min_tokens: u32,
    pub ignore_eos: bool,
    /// `Some(k)`: return the chosen token's logprob and the top `k` alternatives.
    pub logprobs: Option<u32>,
}

/// How the model may use the declared tools (OpenAI `tool_choice`; Anthropic `auto` / `any` /
/// `tool` / `none`). `Required` and `Function` are enforced by constrained decoding with the
/// tool parser's output grammar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolChoice {
    Auto,
    None,
    /// At least one call, to any declared tool.
    Required,
    /// At least one call, all to the named function.
    Function(String),
}

/// A validated chat request. `messages` and `tools` are OpenAI-shaped JSON (Anthropic requests
/// are converted to this shape), normalised so the template sees one form:
/// - every message has a string `role` among system/user/assistant/tool;
/// - `content` is a string (text parts joined) or absent;
/// - assistant `tool_calls[*].function.arguments` is a string holding a JSON object;
/// - tool messages carry `name` (resolved from the matching assistant call) and `tool_call_id`;
/// - assistant reasoning is in `reasoning_content`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatGenRequest {
    pub request_id: String,
    pub messages: Vec<Value>,
    /// OpenAI function tools: `{"type":"function","function":{"name","description","parameters"}}`.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// Whether the model is prompted to think first (the reasoning parser starts in reasoning).
    pub thinking: bool,
    /// Everything the chat template receives besides messages and tools: `thinking`,
    /// `thinking_effort`, `tool_choice`, `response_format`, plus the request's `chat_template_kwargs`.
    pub template_kwargs: Map<String, Value>,
    pub sampling: SamplingOptions,
    /// What the response content must match (`response_format`, `structured_outputs`,
    /// `guided_*`); enforced through the tool parser's output grammar.
    pub constraint: Option<OutputConstraint>,
    /// The request field the constraint came from, named in errors.
    pub constraint_param: String,
}

impl ChatGenRequest {
    /// Choice `i` of `n`: with several, its id is `<id>-i` and its seed (if any) seed + i, so
    /// choices differ yet stay reproducible.
    pub fn choice(&self, i: usize, n: usize) -> ChatGenRequest {
        let mut r = self.clone();
        if n > 1 {
            r.request_id = format!("{}-{i}", self.request_id);
            r.sampling.seed = self.sampling.seed.map(|s| s.wrapping_add(i as u64));
        }
        r
    }
}

/// The prompt of a raw completion request.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// A validated raw completion request: no template, no parsers; the text comes back as content.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionGenRequest {
    pub request_id: String,
    pub prompt: PromptInput,
    pub sampling: SamplingOptions,
    /// Whether the caller wants the prompt text back (filled into [`Generation::prompt_text`](crate::Generation::prompt_text)).
    pub echo: bool,
    /// What the generated text must match, whole.
    pub constraint: Option<OutputConstraint>,
    /// The request field the constraint came from, named in errors.
    pub constraint_param: String,
}

/// How many tokens a request may generate: `max_tokens` (or, when absent, the rest of the
/// context) checked against the model's context length and the prompt. Every request path
/// calls this, so the protocols only parse the field.
pub fn token_budget(
    prompt_tokens: u32,
    max_tokens: Option<u32>,
    max_model_len: u32,
) -> Result<u32, BackendError> {
    let (n, limit) = (prompt_tokens, max_model_len);
    let too_long = |asked: u32| {
        BackendError::ContextLengthExceeded(format!(
            "this model's maximum context length is {limit} tokens; the request has {n} prompt \
             tokens and asks for {asked} more (reduce the prompt or max_tokens)"
        ))
    };
    if n >= limit {
        return Err(too_long(1));
    }
    match max_tokens {
        Some(0) => Err(BackendError::InvalidRequest {
            message: "max_tokens must be at least 1".into(),
            param: Some("max_tokens".into()),
        }),
        Some(m) if u64::from(n) + u64::from(m) > u64::from(limit) => Err(too_long(m)),
        Some(m) => Ok(m),
        None => Ok(limit - n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_budget_fits_the_context() {
        assert_eq!(token_budget(10, None, 100), Ok(90));
        assert_eq!(token_budget(10, Some(90), 100), Ok(90));
        assert!(matches!(
            token_budget(10, Some(91), 100),
            Err(BackendError::ContextLengthExceeded(_))
        ));
        assert!(matches!(
            token_budget(100, None, 100),
            Err(BackendError::ContextLengthExceeded(_))
        ));
        assert!(matches!(
            token_budget(10, Some(u32::MAX), 100),
            Err(BackendError::ContextLengthExceeded(_))
        ));
        assert!(matches!(
            token_budget(10, Some(0), 100),
            Err(BackendError::InvalidRequest { .. })
        ));
    }
}
