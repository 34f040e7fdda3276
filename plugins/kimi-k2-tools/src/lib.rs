//! The legacy Kimi K2 tool-call grammar (docs/k3-format.md §7):
//! `<|tool_calls_section_begin|>` ( `<|tool_call_begin|>` ID `<|tool_call_argument_begin|>` JSON
//! `<|tool_call_end|>` )+ `<|tool_calls_section_end|>`, ID = `functions.NAME:IDX`.
//!
//! Streaming: id (the model's own, kept as is) and name are emitted when
//! `<|tool_call_argument_begin|>` arrives; the JSON text then streams through verbatim, without
//! its surrounding whitespace; `<|tool_call_end|>` ends the call. Markers never reach content
//! and partial markers are held back ([`MarkerSplitter`]).

use k3_plugin_sdk::text::{MarkerSplitter, Split};
use k3_plugin_sdk::{Event, Info, Plugin, PluginError, StreamingParser, ToolOptions, ToolParser};

const MARKERS: [&str; 8] = [
    "<|tool_calls_section_begin|>",
    "<|tool_call_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_end|>",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    SectionBegin,
    SectionEnd,
    CallBegin,
    ArgBegin,
    CallEnd,
    ImEnd,
}

fn marker(i: usize) -> Marker {
    match i {
        0 | 1 => Marker::SectionBegin,
        2 | 3 => Marker::SectionEnd,
        4 => Marker::CallBegin,
        5 => Marker::ArgBegin,
        6 => Marker::CallEnd,
        _ => Marker::ImEnd,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Content,
    Section,
    CallId(String),
    /// Streaming arguments; `started` once non-whitespace was seen, `pending` = held whitespace.
    Args {
        index: u32,
        started: bool,
        pending: String,
    },
}

pub struct KimiK2Tools {
    id_prefix: String,
    next_index: u32,
    state: State,
    splitter: MarkerSplitter,
}

/// `functions.get_weather:0` → `get_weather`.
pub fn name_from_id(id: &str) -> &str {
    let id = id.strip_prefix("functions.").unwrap_or(id);
    id.rsplit_once(':').map_or(id, |(name, _)| name)
}

impl KimiK2Tools {
    fn start_call(&mut self, raw_id: &str, out: &mut Vec<Event>) -> u32 {
        let index = self.next_index;
        self.next_index += 1;
        let raw_id = raw_id.trim();
        let id = if raw_id.is_empty() {
            format!("{}{index}", self.id_prefix)
        } else {
            raw_id.to_string()
        };
        out.push(Event::ToolCallStart {
            index,
            id,
            name: name_from_id(raw_id).to_string(),
        });
        index
    }

    fn end_call(&mut self, complete: bool, out: &mut Vec<Event>) {
        if let State::Args { index, started, .. } = self.state {
            if !started {
                out.push(Event::ToolCallArguments {
                    index,
                    delta: "{}".into(),
                });
            }
            out.push(Event::ToolCallEnd { index, complete });
        }
    }

    fn step(&mut self, piece: Split, out: &mut Vec<Event>) {
        let state = std::mem::replace(&mut self.state, State::Content);
        self.state = match (state, piece) {
            (State::Content, Split::Text(t)) => {
                push_content(out, &t);
                State::Content
            }
            (State::Content, Split::Marker(i)) => match marker(i) {
                Marker::SectionBegin => State::Section,
                Marker::CallBegin => State::CallId(String::new()),
                _ => State::Content,
            },
            (State::Section, Split::Marker(i)) => match marker(i) {
                Marker::CallBegin => State::CallId(String::new()),
                Marker::SectionEnd | Marker::ImEnd => State::Content,
                _ => State::Section,
            },
            (State::Section, Split::Text(_)) => State::Section,
            (State::CallId(mut id), Split::Text(t)) => {
                id.push_str(&t);
                State::CallId(id)
            }
            (State::CallId(id), Split::Marker(i)) => match marker(i) {
                Marker::ArgBegin => {
                    let index = self.start_call(&id, out);
                    State::Args {
                        index,
                        started: false,
                        pending: String::new(),
                    }
                }
                Marker::CallEnd => {
                    let index = self.start_call(&id, out);
                    self.state = State::Args {
                        index,
                        started: false,
                        pending: String::new(),
                    };
                    self.end_call(true, out);
                    State::Section
                }
                Marker::SectionEnd | Marker::ImEnd => State::Content,
                _ => State::CallId(id),
            },
            (
                State::Args {
                    index,
                    mut started,
                    mut pending,
                },
                Split::Text(t),
            ) => {
                // Stream the JSON without surrounding whitespace: whitespace waits until more
                // non-whitespace follows, so chunking cannot change the result.
                let t = if started { t.as_str() } else { t.trim_start() };
                if !t.is_empty() {
                    started = true;
                    let body = t.trim_end();
                    if !body.is_empty() {
                        let mut delta = std::mem::take(&mut pending);
                        delta.push_str(body);
                        push_args(out, index, &delta);
                    }
                    pending.push_str(&t[body.len()..]);
                }
                State::Args {
                    index,
                    started,
                    pending,
                }
            }
            (args @ State::Args { .. }, Split::Marker(i)) => {
                self.state = args;
                match marker(i) {
                    Marker::CallEnd => {
                        self.end_call(true, out);
                        State::Section
                    }
                    Marker::SectionEnd | Marker::ImEnd => {
                        self.end_call(true, out);
                        State::Content
                    }
                    Marker::CallBegin => {
                        self.end_call(true, out);
                        State::CallId(String::new())
                    }
                    _ => std::mem::replace(&mut self.state, State::Content),
                }
            }
        };
    }
}

fn push_content(out: &mut Vec<Event>, text: &str) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(Event::Content(c)) => c.push_str(text),
        _ => out.push(Event::Content(text.to_string())),
    }
}

fn push_args(out: &mut Vec<Event>, index: u32, delta: &str) {
    match out.last_mut() {
        Some(Event::ToolCallArguments { index: i, delta: d }) if *i == index => d.push_str(delta),
        _ => out.push(Event::ToolCallArguments {
            index,
            delta: delta.to_string(),
        }),
    }
}

impl StreamingParser for KimiK2Tools {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError> {
        let mut pieces = Vec::new();
        self.splitter.push(delta, &mut pieces);
        let mut out = Vec::new();
        for p in pieces {
            self.step(p, &mut out);
        }
        Ok(out)
    }

    fn finish(&mut self) -> Result<Vec<Event>, PluginError> {
        let mut pieces = Vec::new();
        self.splitter.finish(&mut pieces);
        let mut out = Vec::new();
        for p in pieces {
            self.step(p, &mut out);
        }
        self.end_call(false, &mut out);
        self.state = State::Content;
        Ok(out)
    }
}

impl ToolParser for KimiK2Tools {
    fn new(options: ToolOptions) -> Self {
        Self {
            id_prefix: options.id_prefix,
            next_index: 0,
            state: State::Content,
            splitter: MarkerSplitter::new(MARKERS),
        }
    }
}

impl Plugin for KimiK2Tools {
    const INFO: Info = Info::new(
        "kimi-k2-tools",
        env!("CARGO_PKG_VERSION"),
        "Legacy Kimi K2 tool calls (<|tool_calls_section_begin|> grammar)",
    );

    fn self_test() -> Result<(), String> {
        let r = KimiK2Tools::new(ToolOptions::default())
            .parse_all("ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\":1}<|tool_call_end|><|tool_calls_section_end|>")
            .map_err(|e| e.to_string())?;
        match (r.content.as_deref(), r.tool_calls.as_slice()) {
            (Some("ok"), [c])
                if c.name == "f" && c.id == "functions.f:0" && c.arguments == "{\"a\":1}" =>
            {
                Ok(())
            }
            _ => Err(format!("self-test parse gave {r:?}")),
        }
    }
}

k3_plugin_sdk::export_tool_parser!(KimiK2Tools);

#[cfg(test)]
mod tests {
    use super::*;
    use k3_plugin_sdk::testing::{assert_chunking_invariant, parse_split_at};
    use proptest::prelude::*;

    fn make() -> KimiK2Tools {
        KimiK2Tools::new(ToolOptions::default())
    }

    #[test]
    fn self_test_passes() {
        KimiK2Tools::self_test().unwrap();
    }

    #[test]
    fn two_calls_with_whitespace_and_content() {
        let text = "Let me check.<|tool_calls_section_begin|>\n<|tool_call_begin|> functions.get_weather:0 <|tool_call_argument_begin|> {\"city\": \"Paris\"} \n<|tool_call_end|>\
<|tool_call_begin|>functions.noargs:1<|tool_call_end|><|tool_calls_section_end|><|im_end|>";
        let r = assert_chunking_invariant(make, text);
        assert_eq!(r.content.as_deref(), Some("Let me check."));
        assert_eq!(r.tool_calls.len(), 2);
        assert_eq!(
            (r.tool_calls[0].id.as_str(), r.tool_calls[0].name.as_str()),
            ("functions.get_weather:0", "get_weather")
        );
        assert_eq!(r.tool_calls[0].arguments, "{\"city\": \"Paris\"}");
        assert_eq!(
            (
                r.tool_calls[1].name.as_str(),
                r.tool_calls[1].arguments.as_str()
            ),
            ("noargs", "{}")
        );
    }

    #[test]
    fn unclosed_section_keeps_complete_calls() {
        let text = "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{\"x\":";
        let r = assert_chunking_invariant(make, text);
        assert_eq!(r.tool_calls.len(), 1);
        assert_eq!(r.tool_calls[0].name, "a");
    }

    #[test]
    fn k3_markup_is_just_content() {
        let r = make().parse_all("<|open|>tools<|sep|>x").unwrap();
        assert_eq!(r.content.as_deref(), Some("<|open|>tools<|sep|>x"));
        assert!(r.tool_calls.is_empty());
    }

    proptest! {
        #[test]
        fn chunking_invariant(content in "[a-z <|>{}\" ]{0,20}", calls in prop::collection::vec(("[a-z_]{1,8}", "[ \n]{0,2}", "[a-z0-9 ]{0,6}"), 0..3),
                              cuts in prop::collection::vec(0usize..200, 0..30)) {
            let mut text = content.replace("<|", "<");
            if !calls.is_empty() {
                text.push_str("<|tool_calls_section_begin|>");
                for (i, (name, ws, val)) in calls.iter().enumerate() {
                    text.push_str(&format!("<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{ws}{{\"v\": \"{val}\"}}{ws}<|tool_call_end|>"));
                }
                text.push_str("<|tool_calls_section_end|>");
            }
            let mut cuts = cuts;
            cuts.sort_unstable();
            let whole = make().parse_all(&text).unwrap();
            prop_assert_eq!(parse_split_at(make(), &text, &cuts).unwrap(), whole.clone());
            prop_assert_eq!(whole.tool_calls.len(), calls.len());
            for (c, (name, _, val)) in whole.tool_calls.iter().zip(&calls) {
                prop_assert_eq!(&c.name, name);
                let v: serde_json::Value = serde_json::from_str(&c.arguments).unwrap();
                prop_assert_eq!(v["v"].as_str(), Some(val.as_str()));
            }
        }
    }
}
