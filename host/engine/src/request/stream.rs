//! The per-request event stream.

use super::{RequestError, RequestId, TokenEvent};
use crate::engine::Command;
use std::pin::Pin;
use std::sync::mpsc::Sender;
use std::task::{Context, Poll};
use tokio::sync::mpsc::UnboundedReceiver;

/// Token events of one request, ending after the event with `finish` set or an error.
/// Dropping it before the end cancels the request (client disconnect).
pub struct RequestStream {
    id: RequestId,
    rx: UnboundedReceiver<Result<TokenEvent, RequestError>>,
    commands: Sender<Command>,
    done: bool,
}

impl RequestStream {
    pub(crate) fn new(
        id: RequestId,
        rx: UnboundedReceiver<Result<TokenEvent, RequestError>>,
        commands: Sender<Command>,
    ) -> Self {
        Self {
            id,
            rx,
            commands,
            done: false,
        }
    }

    pub fn id(&self) -> RequestId {
        self.id
    }

    fn note(&mut self, item: &Option<Result<TokenEvent, RequestError>>) {
        match item {
            Some(Ok(ev)) if ev.finish.is_none() => {}
            _ => self.done = true,
        }
    }

    /// The next event; `None` after the last one.
    pub async fn next(&mut self) -> Option<Result<TokenEvent, RequestError>> {
        if self.done {
            return None;
        }
        let item = self.rx.recv().await;
        self.note(&item);
        item
    }

    /// Blocking variant for callers outside an async runtime (must not be called inside one).
    pub fn blocking_next(&mut self) -> Option<Result<TokenEvent, RequestError>> {
        if self.done {
            return None;
        }
        let item = self.rx.blocking_recv();
        self.note(&item);
        item
    }

    /// Drain to the end: the generated tokens and how it ended.
    pub fn blocking_collect(
        mut self,
    ) -> Result<(Vec<TokenEvent>, super::FinishReason), RequestError> {
        let mut events = Vec::new();
        while let Some(item) = self.blocking_next() {
            let ev = item?;
            let finish = ev.finish.clone();
            events.push(ev);
            if let Some(f) = finish {
                return Ok((events, f));
            }
        }
        Err(RequestError::Shutdown)
    }
}

impl futures::Stream for RequestStream {
    type Item = Result<TokenEvent, RequestError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = self.rx.poll_recv(cx);
        if let Poll::Ready(item) = &polled {
            let item = item.clone();
            self.note(&item);
        }
        polled
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            // The engine may already be gone; nothing to free then.
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}
