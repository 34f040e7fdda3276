//! Running generations for a request: starting `n` of them, merging their event streams,
//! collecting results, driving a stream to the client, and the per-request metrics clock.

use std::time::Instant;

use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::AppState;
use crate::access_log::AccessLog;
use crate::backend::{
    BackendError, ChatGenRequest, CompletionGenRequest, FinishInfo, FinishReason, GenEvent,
    Generation, TokenLogprob,
};
use crate::error::{ApiError, ErrorStyle};
use crate::metrics::HttpMetrics;
use crate::sse;

/// Start `n` chat generations of one request (the prompt is rendered once; choice `i` gets
/// seed + i so choices differ yet stay reproducible).
pub async fn start_chat(
    state: &AppState,
    request: ChatGenRequest,
    n: usize,
    style: ErrorStyle,
) -> Result<Vec<Generation>, ApiError> {
    if let Some(log) = AccessLog::current() {
        log.set_request_id(&request.request_id);
        log.set_prompt(|| serde_json::Value::Array(request.messages.clone()).to_string());
    }
    state
        .backend()
        .chat_n(request, n)
        .await
        .map_err(|e| ApiError::from(e).styled(style))
}

pub async fn start_completion(
    state: &AppState,
    request: CompletionGenRequest,
    n: usize,
) -> Result<Vec<Generation>, ApiError> {
    if let Some(log) = AccessLog::current() {
        // Several prompts are `<id>-<p>`: the access line names the request's own id.
        let id = request
            .request_id
            .rsplit_once('-')
            .map_or(&*request.request_id, |(id, _)| id);
        log.set_request_id(id);
        log.set_prompt(|| match &request.prompt {
            crate::backend::PromptInput::Text(t) => t.clone(),
            crate::backend::PromptInput::Tokens(ids) => format!("{ids:?}"),
        });
    }
    let mut gens = Vec::with_capacity(n);
    for i in 0..n {
        let mut r = request.clone();
        if n > 1 {
            r.request_id = format!("{}-{i}", request.request_id);
            r.sampling.seed = request.sampling.seed.map(|s| s.wrapping_add(i as u64));
        }
        gens.push(state.backend().complete(r).await.map_err(|e| {
            let mut err = ApiError::from(e);
            if err.code == Some("context_length_exceeded") {
                err.param = Some("prompt".into());
            }
            err
        })?);
    }
    Ok(gens)
}

/// Merge the generations' events, tagging each with its choice index (its position here).
pub fn merge(gens: Vec<Generation>) -> BoxStream<'static, (usize, GenEvent)> {
    futures::stream::select_all(
        gens.into_iter()
            .enumerate()
            .map(|(i, g)| g.events.map(move |e| (i, e)).boxed()),
    )
    .boxed()
}

/// With `parallel_tool_calls: false` only the first call is returned.
pub fn keep_event(event: &GenEvent, parallel_tool_calls: bool) -> bool {
    if parallel_tool_calls {
        return true;
    }
    match event {
        GenEvent::ToolCallStart { index, .. }
        | GenEvent::ToolCallArguments { index, .. }
        | GenEvent::ToolCallEnd { index, .. } => *index == 0,
        _ => true,
    }
}

/// Latency bookkeeping for one request (TTFT, gaps between outputs, end to end), also fed
/// to the request's access line.
pub struct RequestClock {
    start: Instant,
    last_output: Option<Instant>,
    access: Option<AccessLog>,
}

impl RequestClock {
    /// Started at `start`, writing to the current request's access line (when there is one).
    pub fn new(start: Instant) -> Self {
        RequestClock {
            start,
            last_output: None,
            access: AccessLog::current(),
        }
    }

    pub fn on_event(&mut self, metrics: &HttpMetrics, event: &GenEvent) {
        let is_output = matches!(
            event,
            GenEvent::Content(_)
                | GenEvent::Reasoning(_)
                | GenEvent::ToolCallStart { .. }
                | GenEvent::ToolCallArguments { .. }
        );
        if is_output {
            let now = Instant::now();
            match self.last_output {
                None => metrics.ttft.observe((now - self.start).as_secs_f64()),
                Some(prev) => metrics.inter_token.observe((now - prev).as_secs_f64()),
            }
            self.last_output = Some(now);
            if let Some(log) = &self.access {
                log.output();
            }
        }
        if let (Some(log), GenEvent::Error(e)) = (&self.access, event) {
            log.error(&e.to_string());
        }
        if let GenEvent::Finished(f) = event {
            if let Some(log) = &self.access {
                log.finished(f);
            }
            metrics.record_usage(f.prompt_tokens, f.completion_tokens, f.cached_tokens);
            if let Some(t) = f.timing {
                metrics.queue_time.observe(t.queued.as_secs_f64());
                metrics.prefill_time.observe(t.prefill.as_secs_f64());
            }
            metrics.record_finish(match f.reason {
                FinishReason::Stop | FinishReason::StopSequence(_) => "stop",
                FinishReason::Length => "length",
                FinishReason::Abort => "abort",
            });
        }
    }

    pub fn end(&self, metrics: &HttpMetrics) {
        metrics.e2e.observe(self.start.elapsed().as_secs_f64());
    }
}

/// One choice's complete result.
#[derive(Debug, Default, Clone)]
pub struct ChoiceResult {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCallResult>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<FinishInfo>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallResult {
    pub index: u32,
    pub id: String,
    pub name: String,
    pub arguments: String,
    /// False when the output ended inside the call (`max_tokens`, a stop string): the call is
    /// still returned, with its arguments as far as they came (the parser closes the JSON), as
    /// streaming already sent them (docs/k3-format.md §5).
    pub complete: bool,
}

impl ChoiceResult {
    /// Whether the response ends in tool calls: there are calls and none was cut short (a cut
    /// call means the output hit its limit, which the finish reason then says).
    pub fn ends_in_tool_calls(&self) -> bool {
        !self.tool_calls.is_empty() && self.tool_calls.iter().all(|c| c.complete)
    }

    pub fn apply(&mut self, event: GenEvent) -> Result<(), BackendError> {
        match event {
            GenEvent::Content(t) => self.content.push_str(&t),
            GenEvent::Reasoning(t) => self.reasoning.push_str(&t),
            GenEvent::ToolCallStart { index, id, name } => self.tool_calls.push(ToolCallResult {
                index,
                id,
                name,
                arguments: String::new(),
                complete: true,
            }),
            GenEvent::ToolCallArguments { index, delta } => {
                match self.tool_calls.iter_mut().find(|c| c.index == index) {
                    Some(call) => call.arguments.push_str(&delta),
                    None => {
                        return Err(BackendError::Internal(format!(
                            "tool call arguments for index {index} arrived before its start"
                        )));
                    }
                }
            }
            GenEvent::ToolCallEnd { index, complete } => {
                if let Some(call) = self.tool_calls.iter_mut().find(|c| c.index == index) {
                    call.complete = complete;
                }
            }
            GenEvent::Logprobs(lp) => self.logprobs.extend(lp),
            GenEvent::Finished(f) => self.finish = Some(f),
            GenEvent::Error(e) => return Err(e),
        }
        Ok(())
    }
}

/// Run every generation to its end (non-streaming). Dropping this future (client gone) drops
/// the generations, which aborts them.
pub async fn collect(
    state: &AppState,
    gens: Vec<Generation>,
    start: Instant,
    parallel_tool_calls: bool,
    style: ErrorStyle,
) -> Result<Vec<ChoiceResult>, ApiError> {
    let n = gens.len();
    let mut results = vec![ChoiceResult::default(); n];
    let mut events = merge(gens);
    let mut clock = RequestClock::new(start);
    let mut gone = DisconnectGuard {
        state: state.clone(),
        armed: true,
    };
    while let Some((i, event)) = events.next().await {
        if !keep_event(&event, parallel_tool_calls) {
            continue;
        }
        clock.on_event(state.metrics(), &event);
        if let Err(e) = results[i].apply(event) {
            gone.armed = false;
            return Err(ApiError::from(e).styled(style));
        }
    }
    gone.armed = false;
    clock.end(state.metrics());
    if results.iter().any(|r| r.finish.is_none()) {
        return Err(ApiError::from(BackendError::Internal(
            "a generation ended without finishing".into(),
        ))
        .styled(style));
    }
    Ok(results)
}

/// Counts a client disconnect when a non-streaming request's future is dropped (hyper drops it
/// when the connection closes) before the generations ended.
struct DisconnectGuard {
    state: AppState,
    armed: bool,
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        if self.armed && !std::thread::panicking() {
            self.state
                .metrics()
                .client_disconnects
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// Turns one request's events into wire chunks.
pub trait StreamFormat: Send + 'static {
    /// Chunks before any event (role chunk, message_start).
    fn start(&mut self) -> Vec<Bytes>;
    /// Chunks for one event of choice `choice` (including its `Finished`).
    fn event(&mut self, choice: usize, event: GenEvent) -> Vec<Bytes>;
    /// Chunks after every choice finished (usage, `[DONE]`, message_stop).
    fn end(&mut self) -> Vec<Bytes>;
    /// Chunks reporting a failure mid-stream; the stream ends after them.
    fn error(&mut self, error: ApiError) -> Vec<Bytes>;
}

/// Stream `gens` to the client as SSE. A task drives the generations; if the client goes away
/// the task stops at once and drops them, which aborts them in the engine.
pub fn stream_response(
    state: AppState,
    permit: OwnedSemaphorePermit,
    gens: Vec<Generation>,
    start: Instant,
    parallel_tool_calls: bool,
    mut format: impl StreamFormat,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    // Made here, not in the task: it picks up this request's access line.
    let mut clock = RequestClock::new(start);
    tokio::spawn(async move {
        let _permit = permit;
        let n = gens.len();
        let mut finished = 0;
        let mut events = merge(gens);
        if !send_all(&tx, format.start()).await {
            state
                .metrics()
                .client_disconnects
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        loop {
            let next = tokio::select! {
                biased;
                _ = tx.closed() => {
                    state.metrics().client_disconnects.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::debug!("client disconnected; aborting its generations");
                    if let Some(log) = &clock.access {
                        log.error("client disconnected");
                    }
                    return;
                }
                next = events.next() => next,
            };
            let chunks = match next {
                None => {
                    let err = ApiError::from(BackendError::Internal(
                        "a generation ended without finishing".into(),
                    ));
                    format.error(err)
                }
                Some((_, GenEvent::Error(e))) => {
                    clock.on_event(state.metrics(), &GenEvent::Error(e.clone()));
                    format.error(ApiError::from(e))
                }
                Some((i, event)) => {
                    if !keep_event(&event, parallel_tool_calls) {
                        continue;
                    }
                    clock.on_event(state.metrics(), &event);
                    let is_finish = matches!(event, GenEvent::Finished(_));
                    let mut chunks = format.event(i, event);
                    if is_finish {
                        finished += 1;
                        if finished == n {
                            chunks.extend(format.end());
                        }
                    }
                    if !send_all(&tx, chunks).await {
                        state
                            .metrics()
                            .client_disconnects
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        return;
                    }
                    if finished == n {
                        break;
                    }
                    continue;
                }
            };
            // An error: report it and end the stream.
            let _ = send_all(&tx, chunks).await;
            break;
        }
        clock.end(state.metrics());
    });
    sse::response(rx)
}

async fn send_all(tx: &mpsc::Sender<Bytes>, chunks: Vec<Bytes>) -> bool {
    for chunk in chunks {
        if tx.send(chunk).await.is_err() {
            return false;
        }
    }
    true
}
