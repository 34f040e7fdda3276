//! Conformance cases written from the rules of docs/k3-format.md §5, one group per failure class,
//! each checked for every chunking by [`check`].

use k3_plugin_sdk::{Event, ReasoningOptions, StreamingParser};
use proptest::prelude::*;
use serde_json::{Value, json};

use super::{END, call, check, pipeline_events, render, sample, thinking};
use crate::K3ReasoningParser;

const CALL_F: &str = "<|open|>call tool=\"f\" index=\"1\"<|sep|>\
<|open|>argument key=\"q\" type=\"string\"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|>";

/// What a server returns from the streamed events: text, and every call that started, with
/// whether it completed (a call cut short keeps the arguments it streamed).
#[derive(Debug, Default, PartialEq)]
struct Served {
    content: String,
    reasoning: String,
    calls: Vec<(String, String, bool)>,
}

fn served(events: &[Event]) -> Served {
    let mut s = Served::default();
    for e in events {
        match e {
            Event::Content(t) => s.content += t,
            Event::Reasoning(t) => s.reasoning += t,
            Event::ToolCallStart { name, .. } => s.calls.push((name.clone(), String::new(), false)),
            Event::ToolCallArguments { delta, .. } => s.calls.last_mut().unwrap().1 += delta,
            Event::ToolCallEnd { complete, .. } => s.calls.last_mut().unwrap().2 = *complete,
        }
    }
    s
}

// ---------------------------------------------------------------- 1. cut-off and malformed tags

#[test]
fn tag_cut_off_at_the_end_leaves_no_tag_word() {
    // (thinking, text, reasoning, content): the output stopped inside a tag (max_tokens).
    let cases = [
        (
            false,
            "the answer<|close|>message",
            None,
            Some("the answer"),
        ),
        (false, "the answer<|close|>mess", None, Some("the answer")),
        (
            false,
            "the answer<|close|>response",
            None,
            Some("the answer"),
        ),
        (
            false,
            "the answer<|close|>response<|sep|><|open|>tools",
            None,
            Some("the answer"),
        ),
        (
            false,
            "the answer<|open|>call tool=\"get_w",
            None,
            Some("the answer"),
        ),
        (
            false,
            "the answer<|open|>call tool=\"f\" index=\"1\"",
            None,
            Some("the answer"),
        ),
        (
            false,
            "the answer<|close|>response<|se",
            None,
            Some("the answer"),
        ),
        (true, "reasoning<|close|>think", Some("reasoning"), None),
        (
            true,
            "reasoning<|close|>think<|sep|><|open|>response",
            Some("reasoning"),
            None,
        ),
        (
            true,
            "reasoning<|close|>think<|sep|><|open|>resp",
            Some("reasoning"),
            None,
        ),
    ];
    for (think, text, reasoning, content) in cases {
        let r = check(text, think);
        assert_eq!(r.reasoning.as_deref(), reasoning, "{text:?}");
        assert_eq!(r.content.as_deref(), content, "{text:?}");
        assert!(r.tool_calls.is_empty(), "{text:?}");
        // the cut-off call tag never started a call, not even an incomplete one
        assert!(served(&pipeline_events(text, think, &[])).calls.is_empty());
    }
}

#[test]
fn malformed_tag_mid_stream_is_dropped_with_its_tag_word() {
    // `<|sep|>` missing: the marker and its tag word go, the text around them stays.
    let r = check("the answer<|close|>message<|end_of_msg|>", false);
    assert_eq!(r.content.as_deref(), Some("the answer"));
    let r = check(
        "plan<|close|>think<|open|>response<|sep|>the answer<|close|>response\n<|close|>message<|sep|>",
        true,
    );
    assert_eq!(r.reasoning.as_deref(), Some("plan"));
    assert_eq!(r.content.as_deref(), Some("the answer\n"));
    // A malformed tools opener: the call after it still counts (a call outside a block is
    // accepted), and nothing of the opener shows.
    let text = format!(
        "ok<|close|>response<|sep|><|open|>tools<|open|>{}{END}",
        &CALL_F[8..]
    );
    let r = check(&text, false);
    assert_eq!(r.content.as_deref(), Some("ok"));
    assert_eq!(r.tool_calls, vec![call(0, "f", json!({"q": "v"}))]);
    // A call tag with its attributes but no `<|sep|>`: dropped whole, no call.
    let r = check(
        "a<|open|>call tool=\"f\" index=\"1\"<|open|>argument key=\"q\" type=\"string\"<|sep|>b",
        false,
    );
    assert_eq!((r.content.as_deref(), r.tool_calls.len()), (Some("ab"), 0));
}

// ---------------------------------------------------------------- 2. tools inside reasoning

#[test]
fn tools_block_before_think_closes_ends_reasoning_and_keeps_its_calls() {
    let text = format!("I need the weather.<|open|>tools<|sep|>{CALL_F}<|close|>tools<|sep|>{END}");
    let r = check(&text, true);
    assert_eq!(r.reasoning.as_deref(), Some("I need the weather."));
    assert_eq!(r.content, None);
    assert_eq!(r.tool_calls, vec![call(0, "f", json!({"q": "v"}))]);
    // a bare call in reasoning opens the block too; a stale think close after it is dropped
    let text = format!("hmm{CALL_F}<|close|>tools<|sep|><|close|>think<|sep|>done{END}");
    let r = check(&text, true);
    assert_eq!(r.reasoning.as_deref(), Some("hmm"));
    assert_eq!(r.content.as_deref(), Some("done"));
    assert_eq!(r.tool_calls.len(), 1);
}

// ---------------------------------------------------------------- 3. tools block verbatim

#[test]
fn tools_block_reaches_the_tool_parser_byte_for_byte() {
    let values = [
        "a<|close|>b",
        "x<|close|>response<|sep|>y",
        "<|open|>think<|sep|>not reasoning<|close|>think<|sep|>",
        "lone <|sep|> and <|open|>weird<|sep|> and <|close|>thinkish",
    ];
    for value in values {
        let block = format!(
            "<|open|>tools<|sep|><|open|>call tool=\"run\" index=\"1\"<|sep|>\
<|open|>argument key=\"code\" type=\"string\"<|sep|>{value}<|close|>argument<|sep|>\
<|close|>call<|sep|><|close|>tools<|sep|>"
        );
        let text = format!(
            "r<|close|>think<|sep|><|open|>response<|sep|>c<|close|>response<|sep|>{block}{END}"
        );
        let reasoning_only = K3ReasoningParser::new(&thinking(true))
            .parse_all(&text)
            .unwrap();
        assert_eq!(
            reasoning_only.content,
            Some(format!("c{block}")),
            "{value:?}"
        );
        let r = check(&text, true);
        assert_eq!(r.reasoning.as_deref(), Some("r"));
        assert_eq!(r.content.as_deref(), Some("c"));
        assert_eq!(
            r.tool_calls,
            vec![call(0, "run", json!({"code": value}))],
            "{value:?}"
        );
    }
}

// ---------------------------------------------------------------- 4. think with thinking off

#[test]
fn think_block_with_thinking_off_is_reasoning() {
    let r = check("<|open|>think<|sep|>hmm<|close|>think<|sep|>ok", false);
    assert_eq!(r.reasoning.as_deref(), Some("hmm"));
    assert_eq!(r.content.as_deref(), Some("ok"));
    // after the prompt's `<|open|>response<|sep|>`, the model opens think anyway
    let text = format!(
        "<|open|>think<|sep|>plan<|close|>think<|sep|><|open|>response<|sep|>answer<|close|>response<|sep|>{END}"
    );
    let r = check(&text, false);
    assert_eq!(r.reasoning.as_deref(), Some("plan"));
    assert_eq!(r.content.as_deref(), Some("answer"));
    // cut off inside it: all reasoning so far, no content
    let r = check("<|open|>think<|sep|>still going", false);
    assert_eq!(
        (r.reasoning.as_deref(), r.content),
        (Some("still going"), None)
    );
}

// ---------------------------------------------------------------- 5. after the message

#[test]
fn nothing_after_the_end_of_the_message_is_returned() {
    let cases = [
        (
            false,
            "answer<|close|>response<|sep|><|close|>message<|sep|>extra text",
        ),
        (
            false,
            "answer<|close|>message<|sep|><|end_of_msg|>more<|open|>think<|sep|>x",
        ),
        (false, "answer<|end_of_msg|>junk"),
        (
            true,
            "r<|close|>think<|sep|><|open|>response<|sep|>answer<|close|>message<|sep|>more",
        ),
    ];
    for (think, text) in cases {
        let r = check(text, think);
        assert_eq!(r.content.as_deref(), Some("answer"), "{text:?}");
        assert_eq!(r.reasoning.as_deref(), think.then_some("r"), "{text:?}");
    }
    // inside reasoning: the message ends there, nothing becomes content
    let r = check("r<|close|>message<|sep|>x", true);
    assert_eq!((r.reasoning.as_deref(), r.content), (Some("r"), None));
    // calls after the end are not read; one closed by the end of the message counts
    let g = CALL_F.replace("\"f\"", "\"g\"");
    let text = format!(
        "<|open|>tools<|sep|>{CALL_F}<|close|>tools<|sep|>{END}after<|open|>tools<|sep|>{g}"
    );
    assert_eq!(
        check(&text, false).tool_calls,
        vec![call(0, "f", json!({"q": "v"}))]
    );
    let text = format!(
        "<|open|>tools<|sep|>{}<|close|>message<|sep|>after",
        &CALL_F[..CALL_F.len() - 20]
    );
    assert_eq!(
        check(&text, false).tool_calls,
        vec![call(0, "f", json!({"q": "v"}))]
    );
}

// ---------------------------------------------------------------- calls cut by the end

#[test]
fn call_cut_mid_argument_streams_closed_json_and_ends_incomplete() {
    let head = "<|open|>tools<|sep|><|open|>call tool=\"search\" index=\"1\"<|sep|>\
<|open|>argument key=\"n\" type=\"number\"<|sep|>3<|close|>argument<|sep|>\
<|open|>argument key=\"q\" type=\"string\"<|sep|>weather in Par";
    for tail in [
        "",
        "<|close|>",
        "<|close|>argu",
        "<|close|>argument",
        "<|close|>argument<|se",
    ] {
        let text = format!("{head}{tail}");
        for cuts in [vec![], (1..text.chars().count()).collect::<Vec<_>>()] {
            let s = served(&pipeline_events(&text, false, &cuts));
            assert_eq!(s.calls.len(), 1, "{text:?}");
            let (name, args, complete) = &s.calls[0];
            assert_eq!((name.as_str(), *complete), ("search", false));
            let args: Value = serde_json::from_str(args).expect("arguments are closed JSON");
            assert_eq!(args, json!({"n": 3, "q": "weather in Par"}), "{text:?}");
        }
    }
    // a non-string value cut short is kept as the string it got to
    let text = "<|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"o\" type=\"object\"<|sep|>{\"a\": [1";
    let s = served(&pipeline_events(text, false, &[]));
    assert_eq!(
        serde_json::from_str::<Value>(&s.calls[0].1).unwrap(),
        json!({"o": "{\"a\": [1"})
    );
}

/// Markers are single tokens: cut a text only outside them, as `max_tokens` does.
fn token_cuts(text: &str) -> Vec<usize> {
    let mut cuts = Vec::new();
    let mut chars = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let marker = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
            .into_iter()
            .find(|m| rest.starts_with(m));
        let step = marker.map_or_else(|| rest.chars().next().unwrap().len_utf8(), str::len);
        chars += rest[..step].chars().count();
        rest = &rest[step..];
        cuts.push(chars);
    }
    cuts
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// An output cut at any token gives a prefix of the whole output's reasoning and content (no
    /// tag word glued on), the whole output's complete calls, and closed JSON for a cut call.
    #[test]
    fn output_cut_anywhere_is_a_prefix_of_the_whole(s in sample()) {
        let text = render(&s);
        let whole = served(&pipeline_events(&text, s.think, &[]));
        let chars: Vec<char> = text.chars().collect();
        for cut in token_cuts(&text) {
            let prefix: String = chars[..cut].iter().collect();
            let part = served(&pipeline_events(&prefix, s.think, &[]));
            prop_assert!(whole.content.starts_with(&part.content), "{:?}: {:?}", prefix, part);
            prop_assert!(whole.reasoning.starts_with(&part.reasoning), "{:?}: {:?}", prefix, part);
            prop_assert!(part.calls.len() <= whole.calls.len());
            for (i, (name, args, complete)) in part.calls.iter().enumerate() {
                prop_assert_eq!(name, &whole.calls[i].0);
                prop_assert!(serde_json::from_str::<Value>(args).is_ok_and(|v| v.is_object()));
                if *complete {
                    prop_assert_eq!(args, &whole.calls[i].1);
                }
            }
        }
    }
}

#[test]
fn options_decide_only_where_parsing_starts() {
    // thinking on but the prompt did not open think: content until the model opens it
    let opts = ReasoningOptions {
        thinking: true,
        prompt_opens_reasoning: false,
        extra_json: None,
    };
    let mut p = K3ReasoningParser::new(&opts);
    let mut events = p.feed("a<|open|>think<|sep|>b").unwrap();
    events.extend(p.finish().unwrap());
    assert_eq!(
        events,
        vec![Event::Content("a".into()), Event::Reasoning("b".into())]
    );
}
