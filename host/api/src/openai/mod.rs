//! The OpenAI protocol: chat completions, completions, models, responses.

pub mod chat;
pub mod chat_request;
pub mod completions;
pub mod messages;
pub mod models;
pub mod responses;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::backend::{FinishInfo, FinishReason, TokenLogprob};

/// `stream_options`.
#[derive(Debug, Default, Clone, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    pub continuous_usage_stats: Option<bool>,
    pub include_obfuscation: Option<bool>,
}

/// OpenAI's `finish_reason`: `tool_calls` whenever calls were returned, else stop/length.
pub fn finish_reason(info: &FinishInfo, had_tool_calls: bool) -> &'static str {
    if had_tool_calls {
        return "tool_calls";
    }
    match info.reason {
        FinishReason::Stop | FinishReason::StopSequence(_) => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

/// The usage object over all choices: the prompt once, completions summed.
pub fn usage(finishes: &[&FinishInfo]) -> Value {
    let prompt = finishes.first().map_or(0, |f| f.prompt_tokens);
    let cached = finishes.first().map_or(0, |f| f.cached_tokens);
    let completion: u64 = finishes.iter().map(|f| f.completion_tokens as u64).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt as u64 + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Chat-style logprobs entries: `[{token, logprob, bytes, top_logprobs:[...]}]`.
pub fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    Value::Array(
        tokens
            .iter()
            .map(|t| {
                json!({
                    "token": t.token,
                    "logprob": t.logprob,
                    "bytes": t.bytes,
                    "top_logprobs": t.top.iter().map(|a| json!({
                        "token": a.token, "logprob": a.logprob, "bytes": a.bytes,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}
