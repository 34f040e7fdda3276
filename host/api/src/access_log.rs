//! One access line per request, logged when the request is over (for a stream: when its last
//! event was sent or its client left): request id, method, path, status, prompt / cached /
//! generated tokens, time to first output, duration and finish reason, under the tracing target
//! `k3serve::access` (so `--log-format json` makes it one JSON object). The prompt (chat
//! messages as JSON, or the completion prompt) is added only with `--log-requests`.
//!
//! The router's outer middleware opens a record per request and runs the handler inside a task
//! local scope holding it; the generation helpers ([`crate::generation`]) fill it in, and a
//! streaming response's task keeps a handle, so the line is written when the last handle drops.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{FinishInfo, FinishReason};

tokio::task_local! {
    static CURRENT: AccessLog;
}

/// A handle on one request's access record; the line is logged when the last handle drops.
#[derive(Clone)]
pub struct AccessLog {
    record: Arc<Mutex<Record>>,
}

struct Record {
    start: Instant,
    method: String,
    path: String,
    status: Option<u16>,
    request_id: Option<String>,
    prompt_tokens: u64,
    cached_tokens: u64,
    generated_tokens: u64,
    first_output: Option<Instant>,
    /// The engine's queue and prefill time (the longest over `n` choices).
    queued: Option<Duration>,
    prefill: Option<Duration>,
    finish_reasons: Vec<&'static str>,
    error: Option<String>,
    log_prompt: bool,
    prompt: Option<String>,
}

impl AccessLog {
    /// Open the record of a request that arrived at `start`.
    pub fn new(method: &str, path: &str, start: Instant, log_prompt: bool) -> Self {
        AccessLog {
            record: Arc::new(Mutex::new(Record {
                start,
                method: method.to_string(),
                path: path.to_string(),
                status: None,
                request_id: None,
                prompt_tokens: 0,
                cached_tokens: 0,
                generated_tokens: 0,
                first_output: None,
                queued: None,
                prefill: None,
                finish_reasons: Vec::new(),
                error: None,
                log_prompt,
                prompt: None,
            })),
        }
    }

    /// Run `fut` with this record as the current one.
    pub async fn scope<F: std::future::Future>(self, fut: F) -> F::Output {
        CURRENT.scope(self, fut).await
    }

    /// The record of the request being handled, if any (outside the router: none).
    pub fn current() -> Option<AccessLog> {
        CURRENT.try_with(|log| log.clone()).ok()
    }

    fn with(&self, f: impl FnOnce(&mut Record)) {
        f(&mut self.record.lock().unwrap_or_else(|e| e.into_inner()));
    }

    pub fn set_status(&self, status: u16) {
        self.with(|r| r.status = Some(status));
    }

    /// The request's id (the first one set: choices of one request share it).
    pub fn set_request_id(&self, id: &str) {
        self.with(|r| {
            r.request_id.get_or_insert_with(|| id.to_string());
        });
    }

    /// The request's id, once a handler set one.
    pub fn request_id(&self) -> Option<String> {
        self.record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .request_id
            .clone()
    }

    /// The prompt, built only when prompts are logged (`--log-requests`).
    pub fn set_prompt(&self, prompt: impl FnOnce() -> String) {
        self.with(|r| {
            if r.log_prompt && r.prompt.is_none() {
                r.prompt = Some(prompt());
            }
        });
    }

    /// A first output (text, reasoning, a tool call) went out now.
    pub fn output(&self) {
        self.with(|r| {
            r.first_output.get_or_insert_with(Instant::now);
        });
    }

    /// One generation of the request finished (its figures add up over `n` choices).
    pub fn finished(&self, info: &FinishInfo) {
        self.with(|r| {
            r.prompt_tokens += u64::from(info.prompt_tokens);
            r.cached_tokens += u64::from(info.cached_tokens);
            r.generated_tokens += u64::from(info.completion_tokens);
            if let Some(t) = info.timing {
                r.queued = r.queued.max(Some(t.queued));
                r.prefill = r.prefill.max(Some(t.prefill));
            }
            let reason = match info.reason {
                FinishReason::Stop | FinishReason::StopSequence(_) => "stop",
                FinishReason::Length => "length",
                FinishReason::Abort => "abort",
            };
            if !r.finish_reasons.contains(&reason) {
                r.finish_reasons.push(reason);
            }
        });
    }

    /// The request failed after its response started (a stream's error event).
    pub fn error(&self, message: &str) {
        self.with(|r| {
            r.error.get_or_insert_with(|| message.to_string());
        });
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
        let duration_ms = ms(self.start.elapsed());
        let ttft_ms = self.first_output.map(|t| ms(t - self.start));
        let queue_ms = self.queued.map(ms);
        let prefill_ms = self.prefill.map(ms);
        let finish = if self.finish_reasons.is_empty() {
            "-".to_string()
        } else {
            self.finish_reasons.join(",")
        };
        let status = self.status.unwrap_or(0);
        tracing::info!(
            target: "k3serve::access",
            request_id = self.request_id.as_deref().unwrap_or("-"),
            method = %self.method,
            path = %self.path,
            status,
            prompt_tokens = self.prompt_tokens,
            cached_tokens = self.cached_tokens,
            generated_tokens = self.generated_tokens,
            ttft_ms,
            queue_ms,
            prefill_ms,
            duration_ms,
            finish_reason = %finish,
            error = self.error.as_deref(),
            prompt = self.prompt.as_deref(),
            "{} {} {status}",
            self.method,
            self.path,
        );
    }
}
