//! Folding streaming events into a [`ParseResult`], the way a client accumulates a stream.

use crate::{Event, ParseResult, ToolCall};

/// Accumulates events: text is concatenated, calls collected by index, and a call only counts
/// once its end event says it is complete.
#[derive(Debug, Default, Clone)]
pub struct Accumulator {
    content: String,
    reasoning: String,
    calls: Vec<(ToolCall, Option<bool>)>,
}

impl Accumulator {
    pub fn push(&mut self, event: Event) {
        match event {
            Event::Content(text) => self.content.push_str(&text),
            Event::Reasoning(text) => self.reasoning.push_str(&text),
            Event::ToolCallStart { index, id, name } => {
                self.calls.push((
                    ToolCall {
                        index,
                        id,
                        name,
                        arguments: String::new(),
                    },
                    None,
                ));
            }
            Event::ToolCallArguments { index, delta } => {
                if let Some((call, _)) = self.calls.iter_mut().rev().find(|(c, _)| c.index == index)
                {
                    call.arguments.push_str(&delta);
                }
            }
            Event::ToolCallEnd { index, complete } => {
                if let Some((_, done)) = self.calls.iter_mut().rev().find(|(c, _)| c.index == index)
                {
                    *done = Some(complete);
                }
            }
        }
    }

    pub fn extend(&mut self, events: impl IntoIterator<Item = Event>) {
        for event in events {
            self.push(event);
        }
    }

    /// The result; empty text becomes `None`, calls that never completed are dropped.
    pub fn finish(self) -> ParseResult {
        ParseResult {
            content: (!self.content.is_empty()).then_some(self.content),
            reasoning: (!self.reasoning.is_empty()).then_some(self.reasoning),
            tool_calls: self
                .calls
                .into_iter()
                .filter(|(_, done)| *done == Some(true))
                .map(|(call, _)| call)
                .collect(),
        }
    }
}
