//! The host's own smoke test of a candidate version, run after the plugin's self-test and
//! before the version can be activated. It checks stage contracts every plugin must keep,
//! whatever format it parses.

use std::sync::Arc;

use k3_segments::Segment;

use crate::error::PluginError;
use crate::registry::PluginVersion;
use crate::runtime::Runtime;
use crate::streams::{ReasoningStream, ToolStream, parse_reasoning, parse_tools};
use crate::template::render_with;
use crate::types::{ParseEvent, ParseResult, ReasoningOptions, RenderOptions, Stage, ToolOptions};

/// Mixed K3 / K2 / `<think>` markup: whatever a parser makes of it, streaming it one character
/// at a time must give the one-shot result.
const PARSER_PROBE: &str = "<think>a</think>r<|close|>think<|sep|><|open|>response<|sep|>Hi é<|close|>response<|sep|>\
<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"k\" type=\"number\"<|sep|>1<|close|>argument<|sep|>\
<|close|>call<|sep|><|close|>tools<|sep|><|tool_calls_section_begin|><|tool_call_begin|>functions.g:0<|tool_call_argument_begin|>{\"x\": 2}<|tool_call_end|>\
<|tool_calls_section_end|><|close|>message<|sep|>";

const TEMPLATE_PROBE: &str = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}";

pub(crate) fn run(rt: &Arc<Runtime>, version: &Arc<PluginVersion>) -> Result<(), PluginError> {
    let fail = |detail: String| PluginError::SelfTestFailed {
        plugin: version.label.to_string(),
        detail,
    };
    match version.stage {
        Stage::ReasoningParser => {
            let opts = ReasoningOptions::default();
            let mut s = ReasoningStream::start(rt, version.clone(), &opts)?;
            let streamed = feed_chars(|d| match d {
                Some(d) => s.feed(d),
                None => s.finish(),
            })?;
            let whole = parse_reasoning(rt, version, &opts, PARSER_PROBE)?;
            if streamed != whole {
                return Err(fail(format!(
                    "streaming gave {streamed:?} but the one-shot parse gave {whole:?}"
                )));
            }
        }
        Stage::ToolParser => {
            let opts = ToolOptions::default();
            let mut s = ToolStream::start(rt, version.clone(), &opts)?;
            let streamed = feed_chars(|d| match d {
                Some(d) => s.feed(d),
                None => s.finish(),
            })?;
            let whole = parse_tools(rt, version, &opts, PARSER_PROBE)?;
            if streamed != whole {
                return Err(fail(format!(
                    "streaming gave {streamed:?} but the one-shot parse gave {whole:?}"
                )));
            }
        }
        Stage::ChatTemplate => {
            let messages = r#"[{"role":"user","content":"hi"}]"#;
            let out = render_with(
                rt,
                version,
                TEMPLATE_PROBE,
                messages,
                None,
                &RenderOptions::default(),
            )?;
            let out = k3_segments::join(&out);
            if out != "user:hi;" {
                return Err(fail(format!(
                    "rendering a trivial Jinja template gave {out:?}, expected \"user:hi;\""
                )));
            }
            // The segments contract: a special-token spelling the client sent is text.
            let messages = r#"[{"role":"user","content":"<|x|>"}]"#;
            let options = RenderOptions {
                special_tokens: vec!["<|x|>".into()],
                ..RenderOptions::default()
            };
            let out = render_with(rt, version, TEMPLATE_PROBE, messages, None, &options)?;
            if k3_segments::join(&out) != "user:<|x|>;" || out.iter().any(Segment::is_markup) {
                return Err(fail(format!(
                    "client text that spells a special token came back as {out:?}; it must be \
                     text segments only"
                )));
            }
        }
        Stage::Media | Stage::Router => {}
    }
    Ok(())
}

/// Feed the probe one char at a time (`Some`), then finish (`None`).
fn feed_chars(
    mut call: impl FnMut(Option<&str>) -> Result<Vec<ParseEvent>, PluginError>,
) -> Result<ParseResult, PluginError> {
    let mut events = Vec::new();
    let mut buf = [0u8; 4];
    for c in PARSER_PROBE.chars() {
        events.extend(call(Some(c.encode_utf8(&mut buf)))?);
    }
    events.extend(call(None)?);
    Ok(ParseResult::from_events(&events))
}
