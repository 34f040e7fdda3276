//! The K3 reasoning parser: think channel → reasoning, everything else → content.
//!
//! Rules (docs/k3-format.md §5, reasoning parser):
//! - starts inside reasoning when thinking is on and the prompt opened the think channel;
//! - `<|close|>think<|sep|>` ends reasoning, a later `<|open|>think<|sep|>` re-opens it, so the
//!   end of reasoning is the last close after the last open; a close outside reasoning (stale,
//!   from history) is dropped. `<|open|>response<|sep|>` also ends reasoning (lenient);
//! - unfinished reasoning (no close) is all reasoning, content absent;
//! - thinking off: all text is content (think markers are dropped, their text kept as content);
//! - response-channel markers, `<|close|>message<|sep|>` and `<|end_of_msg|>` are dropped; other
//!   tags (a tools block) pass through verbatim in content for the tool parser; inside reasoning
//!   they are dropped so no marker reaches the client.

use k3_plugin_sdk::{Event, PluginError, ReasoningOptions, StreamingParser};

use crate::xtml::{Piece, Scanner};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
}

#[derive(Debug, Clone)]
pub struct K3ReasoningParser {
    thinking: bool,
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
            thinking: options.thinking,
            mode,
            scanner: Scanner::default(),
            pieces: Vec::new(),
        }
    }

    fn process(&mut self, out: &mut Vec<Event>) {
        for piece in self.pieces.drain(..) {
            let text = match (&piece, self.mode) {
                (Piece::Text(t), Mode::Reasoning) => {
                    push_reasoning(out, t);
                    continue;
                }
                (Piece::Text(t), Mode::Content) => t.as_str(),
                (Piece::Open(tag), _) if tag.name == "think" => {
                    if self.thinking {
                        self.mode = Mode::Reasoning;
                    }
                    continue;
                }
                (Piece::Close(tag), _) if tag.name == "think" => {
                    self.mode = Mode::Content;
                    continue;
                }
                (Piece::Open(tag), _) if tag.name == "response" => {
                    self.mode = Mode::Content;
                    continue;
                }
                (Piece::Close(tag), _) if tag.name == "response" || tag.name == "message" => {
                    continue;
                }
                (Piece::EndOfMsg | Piece::Stray(_), _) => continue,
                (Piece::Open(_) | Piece::Close(_), Mode::Reasoning) => continue,
                (Piece::Open(_) | Piece::Close(_), Mode::Content) => piece.raw(),
            };
            push_content(out, text);
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
