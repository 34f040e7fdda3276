//! The K3 reasoning parser: think channel → reasoning, everything else → content.
//!
//! Rules (docs/k3-format.md §5, reasoning parser):
//! - starts inside reasoning when thinking is on and the prompt opened the think channel;
//! - `<|open|>think<|sep|>` opens reasoning, also with thinking off (a think block the model
//!   writes anyway is still reasoning, never content); `<|close|>think<|sep|>` ends it, so the
//!   end of reasoning is the last close after the last open; a close outside reasoning (stale,
//!   from history) is dropped. `<|open|>response<|sep|>` also ends reasoning (lenient);
//! - unfinished reasoning (no close) is all reasoning, content absent;
//! - a tools block (`<|open|>tools<|sep|>`, or a `call` outside one) ends reasoning and passes
//!   through to the content byte for byte, whatever it holds, until `<|close|>tools<|sep|>`: the
//!   tool parser alone reads it;
//! - `<|close|>message<|sep|>` and `<|end_of_msg|>` end the message: nothing after them is
//!   returned;
//! - response-channel markers, stray markers and cut-off tags are dropped; other tags pass
//!   through verbatim in content for the tool parser; inside reasoning they are dropped so no
//!   marker reaches the client.

use k3_plugin_sdk::{Event, PluginError, ReasoningOptions, StreamingParser};

use crate::xtml::{Piece, Scanner};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
    /// Inside a tools block: every piece goes to content verbatim.
    Tools,
    /// After the end of the message: everything is dropped.
    Done,
}

#[derive(Debug, Clone)]
pub struct K3ReasoningParser {
    mode: Mode,
    scanner: Scanner,
    pieces: Vec<Piece>,
}

impl K3ReasoningParser {
    pub fn new(options: &ReasoningOptions) -> Self {
        let mode = if options.thinking && options.prompt_opens_reasoning {
            Mode::Reasoning
        } else {
            Mode::Content
        };
        Self {
            mode,
            scanner: Scanner::default(),
            pieces: Vec::new(),
        }
    }

    fn process(&mut self, out: &mut Vec<Event>) {
        for piece in self.pieces.drain(..) {
            let (open, close) = match &piece {
                Piece::Open(tag) => (Some(tag.name.as_str()), None),
                Piece::Close(tag) => (None, Some(tag.name.as_str())),
                _ => (None, None),
            };
            let ends_message = close == Some("message") || piece == Piece::EndOfMsg;
            match self.mode {
                Mode::Done => {}
                Mode::Tools => {
                    push_content(out, piece.raw());
                    if ends_message {
                        self.mode = Mode::Done;
                    } else if close == Some("tools") {
                        self.mode = Mode::Content;
                    }
                }
                _ if ends_message => self.mode = Mode::Done,
                _ if matches!(open, Some("tools" | "call")) => {
                    push_content(out, piece.raw());
                    self.mode = Mode::Tools;
                }
                _ if open == Some("think") => self.mode = Mode::Reasoning,
                _ if close == Some("think") || open == Some("response") => {
                    self.mode = Mode::Content
                }
                Mode::Reasoning => {
                    if let Piece::Text(t) = &piece {
                        push_reasoning(out, t);
                    }
                }
                Mode::Content => match &piece {
                    Piece::Text(t) => push_content(out, t),
                    Piece::Open(_) | Piece::Close(_) if close != Some("response") => {
                        push_content(out, piece.raw())
                    }
                    _ => {}
                },
            }
        }
    }
}

fn push_reasoning(out: &mut Vec<Event>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(Event::Reasoning(r)) = out.last_mut() {
        r.push_str(text);
    } else {
        out.push(Event::Reasoning(text.to_string()));
    }
}

fn push_content(out: &mut Vec<Event>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(Event::Content(c)) = out.last_mut() {
        c.push_str(text);
    } else {
        out.push(Event::Content(text.to_string()));
    }
}

impl StreamingParser for K3ReasoningParser {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError> {
        let mut out = Vec::new();
        self.scanner.push(delta, &mut self.pieces);
        self.process(&mut out);
        Ok(out)
    }

    fn finish(&mut self) -> Result<Vec<Event>, PluginError> {
        let mut out = Vec::new();
        self.scanner.finish(&mut self.pieces);
        self.process(&mut out);
        Ok(out)
    }
}
