//! The host's own smoke test of a candidate version, run after the plugin's self-test and
//! before the version can be activated. It checks stage contracts every plugin must keep,
//! whatever format it parses.

use std::sync::Arc;

use k3_segments::Segment;

use crate::error::PluginError;
use crate::media::{ImagePart, MediaOptions, run_once};
use crate::registry::PluginVersion;
use crate::router::choose_once;
use crate::runtime::Runtime;
use crate::streams::{ReasoningStream, ToolStream, parse_reasoning, parse_tools};
use crate::template::render_with;
use crate::types::{
    MediaError, ParseEvent, ParseResult, ReasoningOptions, RenderOptions, ReplicaView,
    RouteRequest, Stage, ToolOptions,
};

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
        Stage::Media => {
            // A plain PNG must come back (the host validates the output), and bytes that are
            // no image must be refused as the client's error, not trap or pass.
            let options = MediaOptions::default();
            let part = |data: Vec<u8>| ImagePart {
                index: 0,
                data,
                mime_type: Some("image/png".into()),
                detail: None,
            };
            run_once(rt, version, &part(probe_png(64, 32)), &options)
                .map_err(|e| fail(format!("a 64x32 PNG was not processed: {e}")))?;
            match run_once(rt, version, &part(b"not an image".to_vec()), &options) {
                Err(PluginError::Media(MediaError::InvalidImage(_))) => {}
                other => {
                    return Err(fail(format!(
                        "bytes that are not an image must be refused as invalid input, got \
                         {other:?}"
                    )));
                }
            }
        }
        Stage::Router => {
            // The one healthy replica must be chosen, and none healthy must be the policy's
            // refusal (an error it returns), not a trap or an invented replica.
            let request = RouteRequest {
                request_id: "smoke".into(),
                model: "smoke".into(),
                prompt_tokens: 64,
                max_tokens: 16,
                prefix_block_hashes: vec![1, 2, 3, 4],
                priority: 0,
            };
            let replica = |id: &str, healthy: bool, hit: u32| ReplicaView {
                id: id.into(),
                healthy,
                queued: 0,
                running: 0,
                kv_free_blocks: 100,
                kv_total_blocks: 100,
                prefix_hit_blocks: hit,
            };
            let replicas = [replica("down", false, 4), replica("up", true, 0)];
            match choose_once(rt, version, &request, &replicas) {
                Ok(c) if c.replica_id == "up" => {}
                other => {
                    return Err(fail(format!(
                        "with one healthy replica (\"up\") it chose {other:?}"
                    )));
                }
            }
            match choose_once(rt, version, &request, &replicas[..1]) {
                Err(PluginError::Guest { .. }) => {}
                other => {
                    return Err(fail(format!(
                        "with no healthy replica it must return a plugin-error, got {other:?}"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// An RGB PNG of `w x h` (a colour ramp), written with stored (uncompressed) deflate blocks so
/// the host needs no encoder.
fn probe_png(w: u32, h: u32) -> Vec<u8> {
    let mut raw = Vec::new();
    for y in 0..h {
        raw.push(0); // filter: none
        for x in 0..w {
            raw.extend_from_slice(&[(x * 4) as u8, (y * 8) as u8, 128]);
        }
    }
    let mut zlib = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65535).collect();
    for (i, block) in blocks.iter().enumerate() {
        zlib.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        zlib.extend_from_slice(&len.to_le_bytes());
        zlib.extend_from_slice(&(!len).to_le_bytes());
        zlib.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in &raw {
        a = (a + u32::from(byte)) % 65521;
        b = (b + a) % 65521;
    }
    zlib.extend_from_slice(&((b << 16) | a).to_be_bytes());

    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    for (kind, data) in [(b"IHDR", &ihdr), (b"IDAT", &zlib), (b"IEND", &Vec::new())] {
        png.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let start = png.len();
        png.extend_from_slice(kind);
        png.extend_from_slice(data);
        let crc = crc32(&png[start..]);
        png.extend_from_slice(&crc.to_be_bytes());
    }
    png
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
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

#[cfg(test)]
mod tests {
    #[test]
    fn the_probe_png_is_well_formed() {
        let png = super::probe_png(64, 32);
        assert_eq!(&png[12..16], b"IHDR");
        // The CRC of the IEND chunk is a well-known constant.
        assert_eq!(&png[png.len() - 4..], &[0xAE, 0x42, 0x60, 0x82]);
    }
}
