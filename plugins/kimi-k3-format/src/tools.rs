//! The K3 tool-call parser: reads the tools channel, passes other text through as content.
//!
//! Streaming choice: a call's id and name are emitted when its open tag
//! (`<|open|>call tool="NAME" index="i"<|sep|>`) completes; its arguments then stream as JSON
//! deltas: `{"key":"` + the escaped string value as it arrives + `"`, non-string values once
//! their `<|close|>argument<|sep|>` arrives (JSON-parsed, else kept as a string), `}` at
//! `<|close|>call<|sep|>`, followed by the end event. The pieces of one call concatenate to a
//! compact JSON object. Id = the options' id prefix + the 0-based call index in this response.
//!
//! Malformed input never fails the stream: a call without a `tool` name and an argument without
//! a `key` are skipped; text and unknown tags inside the tools block are ignored; a call the
//! text ends inside is ended with `complete: false`, its arguments closed as far as they came
//! (one-shot results drop it; the server returns it, docs/k3-format.md §5). A tag the end of the
//! text cut off is dropped, also inside a value; any other marker inside a string value is
//! value text. `<|close|>message<|sep|>` and `<|end_of_msg|>` end the message (and an open
//! call, as complete): nothing after them counts. In content, every marker is dropped: markers
//! never reach the client.

use k3_plugin_sdk::{Event, PluginError, StreamingParser, ToolOptions};

use crate::xtml::{Piece, Scanner, Tag};

#[derive(Debug, Clone, PartialEq, Eq)]
enum ArgKind {
    /// String value streamed as escaped JSON.
    Str,
    /// Any other type: buffered, JSON-parsed at the close tag.
    Value { raw: String },
    /// A `json` block holding the whole arguments object.
    Json { raw: String },
    /// An argument without a key: ignored.
    Skip,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Content,
    /// Inside `<|open|>tools<|sep|>`, between calls.
    Tools,
    /// Inside a call. `index` is `None` for a skipped (nameless) call.
    Call {
        index: Option<u32>,
        args: u32,
        arg: Option<(String, ArgKind)>,
    },
    /// After the end of the message.
    Done,
}

#[derive(Debug, Clone)]
pub struct K3ToolParser {
    id_prefix: String,
    next_index: u32,
    state: State,
    scanner: Scanner,
    pieces: Vec<Piece>,
}

impl K3ToolParser {
    pub fn new(options: &ToolOptions) -> Self {
        Self {
            id_prefix: options.id_prefix.clone(),
            next_index: 0,
            state: State::Content,
            scanner: Scanner::default(),
            pieces: Vec::new(),
        }
    }

    fn process(&mut self, out: &mut Vec<Event>) {
        let pieces = std::mem::take(&mut self.pieces);
        for piece in &pieces {
            self.step(piece, out);
        }
        self.pieces = pieces;
        self.pieces.clear();
    }

    fn step(&mut self, piece: &Piece, out: &mut Vec<Event>) {
        let ends_message =
            matches!(piece, Piece::Close(t) if t.name == "message") || *piece == Piece::EndOfMsg;
        if ends_message && self.state != State::Done {
            if let State::Call { .. } = self.state {
                self.end_argument(out);
                self.end_call(true, out);
            }
            self.state = State::Done;
            return;
        }
        match &mut self.state {
            State::Done => {}
            State::Content => match piece {
                Piece::Text(t) => push_content(out, t),
                Piece::Open(tag) if tag.name == "tools" => self.state = State::Tools,
                // A call outside a tools block: accept it as if the block had opened.
                Piece::Open(tag) if tag.name == "call" => self.open_call(tag, out),
                _ => {}
            },
            State::Tools => match piece {
                Piece::Open(tag) if tag.name == "call" => self.open_call(tag, out),
                Piece::Close(tag) if tag.name == "tools" => self.state = State::Content,
                _ => {}
            },
            State::Call { arg: Some(_), .. } => self.in_argument(piece, out),
            State::Call {
                index,
                args,
                arg: None,
            } => match piece {
                Piece::Open(tag) if tag.name == "argument" || tag.name == "json" => {
                    let kind = if tag.name == "json" {
                        ArgKind::Json { raw: String::new() }
                    } else {
                        match (tag.attr("key"), tag.attr("type").unwrap_or("string")) {
                            (None, _) => ArgKind::Skip,
                            (Some(_), "string") => ArgKind::Str,
                            (Some(_), _) => ArgKind::Value { raw: String::new() },
                        }
                    };
                    let key = tag.attr("key").unwrap_or_default().to_string();
                    if let (Some(i), ArgKind::Str) = (*index, &kind) {
                        let sep = if *args == 0 { "{" } else { "," };
                        push_args(out, i, &format!("{sep}{}:\"", json_string(&key)));
                        *args += 1;
                    }
                    self.state = State::Call {
                        index: *index,
                        args: *args,
                        arg: Some((key, kind)),
                    };
                }
                Piece::Close(tag) if tag.name == "call" => self.end_call(true, out),
                Piece::Close(tag) if tag.name == "tools" => {
                    self.end_call(true, out);
                    self.state = State::Content;
                }
                _ => {}
            },
        }
    }

    fn open_call(&mut self, tag: &Tag, out: &mut Vec<Event>) {
        let index = match tag.attr("tool").filter(|n| !n.is_empty()) {
            Some(name) => {
                let index = self.next_index;
                self.next_index += 1;
                out.push(Event::ToolCallStart {
                    index,
                    id: format!("{}{index}", self.id_prefix),
                    name: name.to_string(),
                });
                Some(index)
            }
            None => None,
        };
        self.state = State::Call {
            index,
            args: 0,
            arg: None,
        };
    }

    fn in_argument(&mut self, piece: &Piece, out: &mut Vec<Event>) {
        let State::Call {
            index,
            arg: Some((_, kind)),
            ..
        } = &mut self.state
        else {
            return;
        };
        let is_close =
            |names: &[&str]| matches!(piece, Piece::Close(t) if names.contains(&t.name.as_str()));
        if is_close(&["argument", "json"]) {
            self.end_argument(out);
        } else if is_close(&["call"]) {
            self.end_argument(out);
            self.end_call(true, out);
        } else if is_close(&["tools"]) {
            self.end_argument(out);
            self.end_call(true, out);
            self.state = State::Content;
        } else if let Piece::Unfinished(_) = piece {
            // Cut off by the end of the text: not part of the value.
        } else {
            // Known ambiguity: a marker inside a value is kept as value text.
            let text = piece.raw();
            match kind {
                ArgKind::Str => {
                    if let Some(i) = *index {
                        push_args(out, i, &json_string_body(text));
                    }
                }
                ArgKind::Value { raw } | ArgKind::Json { raw } => raw.push_str(text),
                ArgKind::Skip => {}
            }
        }
    }

    fn end_argument(&mut self, out: &mut Vec<Event>) {
        let State::Call { index, args, arg } = &mut self.state else {
            return;
        };
        let Some((key, kind)) = arg.take() else {
            return;
        };
        let Some(i) = *index else { return };
        match kind {
            ArgKind::Str => push_args(out, i, "\""),
            ArgKind::Value { raw } => {
                let value = serde_json::from_str::<serde_json::Value>(&raw)
                    .unwrap_or(serde_json::Value::String(raw));
                let sep = if *args == 0 { "{" } else { "," };
                push_args(out, i, &format!("{sep}{}:{value}", json_string(&key)));
                *args += 1;
            }
            ArgKind::Json { raw } => {
                // The whole arguments given as one JSON object: its entries become arguments.
                if let Ok(serde_json::Value::Object(map)) =
                    serde_json::from_str::<serde_json::Value>(&raw)
                {
                    for (k, v) in map {
                        let sep = if *args == 0 { "{" } else { "," };
                        push_args(out, i, &format!("{sep}{}:{v}", json_string(&k)));
                        *args += 1;
                    }
                }
            }
            ArgKind::Skip => {}
        }
    }

    fn end_call(&mut self, complete: bool, out: &mut Vec<Event>) {
        if let State::Call {
            index: Some(i),
            args,
            ..
        } = self.state
        {
            push_args(out, i, if args == 0 { "{}" } else { "}" });
            out.push(Event::ToolCallEnd { index: i, complete });
        }
        self.state = State::Tools;
    }
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// The escaped body of a JSON string (no quotes). Escaping is per character, so escaping the
/// pieces of a string and concatenating equals escaping the whole.
fn json_string_body(s: &str) -> String {
    let quoted = json_string(s);
    quoted[1..quoted.len() - 1].to_string()
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

fn push_args(out: &mut Vec<Event>, index: u32, delta: &str) {
    if delta.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(Event::ToolCallArguments { index: i, delta: d }) if *i == index => d.push_str(delta),
        _ => out.push(Event::ToolCallArguments {
            index,
            delta: delta.to_string(),
        }),
    }
}

impl StreamingParser for K3ToolParser {
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
        if let State::Call { .. } = self.state {
            self.end_argument(&mut out);
            self.end_call(false, &mut out);
        }
        self.state = State::Done;
        Ok(out)
    }
}
