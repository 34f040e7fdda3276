//! One request after submission: engine tokens → incremental detokenizer → stop strings →
//! reasoning parser → tool parser → [`GenEvent`]s.
//!
//! Runs as one task per request. When the HTTP side drops its receiver (client gone), the task
//! returns at once and drops the engine stream, which cancels the request and frees its memory.

use std::sync::Arc;

use k3_engine::{RequestError, RequestStream, TokenEvent};
use k3_plugin_host::{
    ParseEvent, PluginError, PluginHost, ReasoningOptions, ReasoningStream, ToolOptions, ToolStream,
};
use k3_sampling::{StopChecker, TokenVerdict};
use tokio::sync::mpsc;

use crate::detokenizer::IncrementalDetokenizer;
use crate::error::BackendError;
use crate::events::{FinishInfo, FinishReason, GenEvent, TokenLogprob, TopLogprob};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// How a chat request's parser stages start. They start when the request's first output needs
/// them, i.e. once the engine has scheduled it, so a request waiting in the queue holds no
/// plugin instance (the instance pool is sized for running requests, not queued ones).
pub struct ParserPlan {
    pub plugins: PluginHost,
    pub reasoning: ReasoningOptions,
    pub tools: ToolOptions,
    /// Whether tool calls are returned (false with `tool_choice: "none"`: the parser still
    /// strips tool markup from the content).
    pub emit_tool_calls: bool,
}

/// A chat request's parser stages: planned, then running.
pub enum ParserStages {
    Planned(ParserPlan),
    Running(Box<Parsers>),
}

impl ParserStages {
    /// The running parsers, starting them (on the then-active plugin versions) on first use.
    fn running(&mut self) -> Result<&mut Parsers, BackendError> {
        if let ParserStages::Planned(plan) = self {
            let reasoning = plan
                .plugins
                .reasoning_stream(&plan.reasoning)
                .map_err(plugin_error)?;
            let tools = plan
                .plugins
                .tool_stream(&plan.tools)
                .map_err(plugin_error)?;
            *self = ParserStages::Running(Box::new(Parsers {
                reasoning,
                tools,
                emit_tool_calls: plan.emit_tool_calls,
            }));
        }
        match self {
            ParserStages::Running(parsers) => Ok(parsers),
            ParserStages::Planned(_) => unreachable!("started just above"),
        }
    }
}

/// The parser stages of a chat request once running.
pub struct Parsers {
    pub reasoning: ReasoningStream,
    pub tools: ToolStream,
    /// Whether tool calls are returned (false with `tool_choice: "none"`: the parser still
    /// strips tool markup from the content).
    pub emit_tool_calls: bool,
}

pub struct RequestPath {
    pub tokenizer: Arc<Tokenizer>,
    pub detok: IncrementalDetokenizer,
    pub stop: StopChecker,
    /// Absent for raw completions.
    pub parsers: Option<ParserStages>,
    pub logprobs: bool,
    pub prompt_tokens: u32,
}

/// A plugin failure inside the path, as the request's error.
fn plugin_error(e: PluginError) -> BackendError {
    crate::error::plugin_failure(e)
}

impl RequestPath {
    /// Drive the request to its end, sending events to `tx`.
    pub async fn run(mut self, mut stream: RequestStream, tx: mpsc::Sender<GenEvent>) {
        let mut cached = 0u32;
        let mut timing = None;
        let mut completion = 0u32;
        loop {
            let next = tokio::select! {
                biased;
                _ = tx.closed() => return,
                next = stream.next() => next,
            };
            let event = match next {
                Some(Ok(event)) => event,
                Some(Err(e)) => {
                    let _ = tx.send(GenEvent::Error(engine_error(e))).await;
                    return;
                }
                None => {
                    let _ = tx
                        .send(GenEvent::Error(BackendError::Internal(
                            "the engine ended the request without a finish reason".into(),
                        )))
                        .await;
                    return;
                }
            };
            if let Some(c) = event.cached_tokens {
                cached = c.min(u32::MAX as usize) as u32;
            }
            timing = timing.or(event.timing);
            completion += 1;
            let mut out = Vec::new();
            let done = match self.step(&event, &mut out) {
                Ok(done) => done,
                Err(e) => {
                    out.push(GenEvent::Error(e));
                    send_all(&tx, out).await;
                    return;
                }
            };
            if done {
                out.push(GenEvent::Finished(FinishInfo {
                    reason: self.finish_reason(),
                    prompt_tokens: self.prompt_tokens,
                    completion_tokens: completion,
                    cached_tokens: cached,
                    timing,
                }));
                send_all(&tx, out).await;
                // Dropping `stream` here cancels the engine request when a stop string ended it.
                return;
            }
            if !send_all(&tx, out).await {
                return;
            }
        }
    }

    /// Process one token; returns whether the generation is over.
    fn step(&mut self, event: &TokenEvent, out: &mut Vec<GenEvent>) -> Result<bool, BackendError> {
        if self.logprobs
            && let Some(lp) = self.token_logprob(event)
        {
            out.push(GenEvent::Logprobs(vec![lp]));
        }
        let detok_err = |e: TokenizerError| {
            BackendError::Internal(format!("detokenizing the output failed: {e}"))
        };
        let mut text = String::new();
        let mut done = false;
        match self.stop.on_token(event.token) {
            TokenVerdict::StopToken { emit_text } => {
                if emit_text {
                    text.push_str(&self.detok.push(event.token).map_err(detok_err)?);
                }
                text.push_str(&self.stop.flush());
                done = true;
            }
            verdict @ (TokenVerdict::Continue | TokenVerdict::LastToken) => {
                let piece = self.detok.push(event.token).map_err(detok_err)?;
                let step = self.stop.push_text(&piece);
                text.push_str(&step.text);
                let engine_done = event.finish.is_some();
                if step.stopped {
                    done = true;
                } else if verdict == TokenVerdict::LastToken || engine_done {
                    let tail = self.detok.flush().map_err(detok_err)?;
                    let step = self.stop.push_text(&tail);
                    text.push_str(&step.text);
                    if !step.stopped {
                        text.push_str(&self.stop.flush());
                    }
                    // The engine also ends on the context length, which the checker cannot see.
                    self.stop.finish_with(match event.finish {
                        Some(FinishReason::Stop) => FinishReason::Stop,
                        _ => FinishReason::Length,
                    });
                    done = true;
                }
            }
        }
        self.parse(&text, out)?;
        if done {
            self.finish_parsers(out)?;
        }
        Ok(done)
    }

    fn finish_reason(&self) -> FinishReason {
        self.stop.finish_reason().unwrap_or(FinishReason::Abort)
    }

    /// The token's logprob entry (`None` if the engine did not compute one).
    fn token_logprob(&self, event: &TokenEvent) -> Option<TokenLogprob> {
        let text_of = |id: u32| -> (String, Vec<u8>) {
            match self.tokenizer.token_bytes(id) {
                Some(bytes) => (String::from_utf8_lossy(bytes).into_owned(), bytes.to_vec()),
                None => {
                    let s = self.tokenizer.decode(&[id]).unwrap_or_default();
                    let b = s.clone().into_bytes();
                    (s, b)
                }
            }
        };
        let (token, bytes) = text_of(event.token);
        Some(TokenLogprob {
            token,
            logprob: event.logprob?,
            bytes,
            top: event
                .top_logprobs
                .iter()
                .map(|&(id, logprob)| {
                    let (token, bytes) = text_of(id);
                    TopLogprob {
                        token,
                        logprob,
                        bytes,
                    }
                })
                .collect(),
        })
    }

    fn parse(&mut self, text: &str, out: &mut Vec<GenEvent>) -> Result<(), BackendError> {
        if text.is_empty() {
            return Ok(());
        }
        let Some(stages) = &mut self.parsers else {
            push_text(out, GenEvent::Content(text.to_string()));
            return Ok(());
        };
        let parsers = stages.running()?;
        let events = parsers.reasoning.feed(text).map_err(plugin_error)?;
        route(parsers, events, out)
    }

    fn finish_parsers(&mut self, out: &mut Vec<GenEvent>) -> Result<(), BackendError> {
        let Some(stages) = &mut self.parsers else {
            return Ok(());
        };
        let parsers = stages.running()?;
        let events = parsers.reasoning.finish().map_err(plugin_error)?;
        route(parsers, events, out)?;
        let events = parsers.tools.finish().map_err(plugin_error)?;
        for e in events {
            push_tool_event(parsers.emit_tool_calls, e, out);
        }
        Ok(())
    }
}

/// Reasoning-parser events: reasoning goes out, content goes through the tool parser.
fn route(
    parsers: &mut Parsers,
    events: Vec<ParseEvent>,
    out: &mut Vec<GenEvent>,
) -> Result<(), BackendError> {
    for e in events {
        match e {
            ParseEvent::Content { text } => {
                for te in parsers.tools.feed(&text).map_err(plugin_error)? {
                    push_tool_event(parsers.emit_tool_calls, te, out);
                }
            }
            other => push_tool_event(parsers.emit_tool_calls, other, out),
        }
    }
    Ok(())
}

fn push_tool_event(emit_tool_calls: bool, e: ParseEvent, out: &mut Vec<GenEvent>) {
    match e {
        ParseEvent::Content { text } => push_text(out, GenEvent::Content(text)),
        ParseEvent::Reasoning { text } => push_text(out, GenEvent::Reasoning(text)),
        _ if !emit_tool_calls => {}
        ParseEvent::ToolCallStart { index, id, name } => {
            out.push(GenEvent::ToolCallStart { index, id, name })
        }
        ParseEvent::ToolCallArguments { index, delta } => {
            out.push(GenEvent::ToolCallArguments { index, delta })
        }
        ParseEvent::ToolCallEnd { index, complete } => {
            out.push(GenEvent::ToolCallEnd { index, complete })
        }
    }
}

/// Append text, merging with the previous event of the same kind (fewer, larger chunks).
fn push_text(out: &mut Vec<GenEvent>, event: GenEvent) {
    match (out.last_mut(), &event) {
        (_, GenEvent::Content(t) | GenEvent::Reasoning(t)) if t.is_empty() => {}
        (Some(GenEvent::Content(prev)), GenEvent::Content(t)) => prev.push_str(t),
        (Some(GenEvent::Reasoning(prev)), GenEvent::Reasoning(t)) => prev.push_str(t),
        _ => out.push(event),
    }
}

async fn send_all(tx: &mpsc::Sender<GenEvent>, events: Vec<GenEvent>) -> bool {
    for e in events {
        if tx.send(e).await.is_err() {
            return false;
        }
    }
    true
}

fn engine_error(e: RequestError) -> BackendError {
    match e {
        RequestError::OutOfMemory => BackendError::Overloaded(
            "the request does not fit in the cache memory; retry later or send a shorter one"
                .into(),
        ),
        RequestError::Shutdown => {
            BackendError::Unavailable("the server shut down before the request finished".into())
        }
        RequestError::Rejected(m) => BackendError::InvalidRequest {
            message: m,
            param: None,
        },
        RequestError::Execution(m) => {
            BackendError::Internal(format!("model execution failed: {m}"))
        }
        RequestError::Sampling(m) => BackendError::Internal(format!("sampling failed: {m}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_events_merge() {
        let mut out = Vec::new();
        push_text(&mut out, GenEvent::Content("a".into()));
        push_text(&mut out, GenEvent::Content("b".into()));
        push_text(&mut out, GenEvent::Reasoning("".into()));
        push_text(&mut out, GenEvent::Reasoning("r".into()));
        assert_eq!(
            out,
            vec![
                GenEvent::Content("ab".into()),
                GenEvent::Reasoning("r".into())
            ]
        );
    }
}
