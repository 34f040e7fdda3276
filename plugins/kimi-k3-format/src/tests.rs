//! Conformance tests (docs/k3-format.md §5) and the chunking property test.

use k3_plugin_sdk::testing::{assert_chunking_invariant, parse_split_at};
use k3_plugin_sdk::{
    Accumulator, Event, ParseResult, ReasoningOptions, StreamingParser, ToolCall, ToolOptions,
};
use proptest::prelude::*;
use serde_json::{Value, json};

use crate::xtml::escape_attr;
use crate::{K3ReasoningParser, K3ToolParser};

/// Conformance cases for the failure classes of docs/k3-format.md §5 (cut-off and malformed
/// tags, tools inside reasoning, verbatim tools blocks, think blocks with thinking off, text after
/// the message) and for calls cut by the end of the output.
mod conformance;

fn thinking(on: bool) -> ReasoningOptions {
    ReasoningOptions {
        thinking: on,
        prompt_opens_reasoning: on,
        extra_json: None,
    }
}

fn tool_opts() -> ToolOptions {
    ToolOptions {
        tools_json: None,
        id_prefix: "call_".into(),
        extra_json: None,
    }
}

/// Reasoning parser then tool parser on its content, fed at the given char cuts: the events a
/// server streams.
fn pipeline_events(text: &str, think: bool, cuts: &[usize]) -> Vec<Event> {
    let chars: Vec<char> = text.chars().collect();
    let mut rp = K3ReasoningParser::new(&thinking(think));
    let mut tp = K3ToolParser::new(&tool_opts());
    let mut out = Vec::new();
    let route = |events: Vec<Event>, tp: &mut K3ToolParser, out: &mut Vec<Event>| {
        for e in events {
            match e {
                Event::Content(c) => out.extend(tp.feed(&c).unwrap()),
                other => out.push(other),
            }
        }
    };
    let mut start = 0;
    for &cut in cuts.iter().chain(std::iter::once(&chars.len())) {
        let cut = cut.clamp(start, chars.len());
        let delta: String = chars[start..cut].iter().collect();
        let events = rp.feed(&delta).unwrap();
        route(events, &mut tp, &mut out);
        start = cut;
    }
    let events = rp.finish().unwrap();
    route(events, &mut tp, &mut out);
    out.extend(tp.finish().unwrap());
    out
}

/// [`pipeline_events`] accumulated as a one-shot result (incomplete calls dropped).
fn pipeline(text: &str, think: bool, cuts: &[usize]) -> ParseResult {
    let mut acc = Accumulator::default();
    acc.extend(pipeline_events(text, think, cuts));
    acc.finish()
}

fn call(index: u32, name: &str, args: Value) -> ToolCall {
    ToolCall {
        index,
        id: format!("call_{index}"),
        name: name.into(),
        arguments: args.to_string(),
    }
}

fn args_of(r: &ParseResult) -> Vec<Value> {
    r.tool_calls
        .iter()
        .map(|c| serde_json::from_str(&c.arguments).unwrap())
        .collect()
}

/// Every chunking (1..=8 chars, plus whole) of the pipeline equals the one-shot result.
fn check(text: &str, think: bool) -> ParseResult {
    let whole = pipeline(text, think, &[]);
    let n = text.chars().count();
    for size in 1..=8 {
        let cuts: Vec<usize> = (size..n).step_by(size).collect();
        assert_eq!(
            pipeline(text, think, &cuts),
            whole,
            "chunks of {size} for {text:?}"
        );
    }
    // each parser alone is chunking-invariant too
    assert_chunking_invariant(|| K3ReasoningParser::new(&thinking(think)), text);
    assert_chunking_invariant(|| K3ToolParser::new(&tool_opts()), text);
    whole
}

const END: &str = "<|close|>message<|sep|><|end_of_msg|>";

#[test]
fn reasoning_then_content() {
    let text = format!(
        "Let me think.<|close|>think<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|>{END}"
    );
    let r = check(&text, true);
    assert_eq!(r.reasoning.as_deref(), Some("Let me think."));
    assert_eq!(r.content.as_deref(), Some("Hello!"));
    assert!(r.tool_calls.is_empty());
}

#[test]
fn thinking_off_everything_is_content() {
    let text = format!("Plain answer<|close|>response<|sep|>{END}");
    let r = check(&text, false);
    assert_eq!(r.reasoning, None);
    assert_eq!(r.content.as_deref(), Some("Plain answer"));
}

#[test]
fn unfinished_reasoning_is_all_reasoning() {
    let r = check("still thinking about <|open|>call", true);
    assert_eq!(r.reasoning.as_deref(), Some("still thinking about "));
    assert_eq!(r.content, None);
}

#[test]
fn last_close_after_last_open_ends_reasoning() {
    // Output that opens think itself (prompt did not), a stale close before it is dropped.
    let opts = ReasoningOptions {
        thinking: true,
        prompt_opens_reasoning: false,
        extra_json: None,
    };
    let text = "<|close|>think<|sep|>pre<|open|>think<|sep|>r1<|close|>think<|sep|>mid<|open|>think<|sep|>r2<|close|>think<|sep|>post";
    let r = K3ReasoningParser::new(&opts).parse_all(text).unwrap();
    assert_eq!(r.reasoning.as_deref(), Some("r1r2"));
    assert_eq!(r.content.as_deref(), Some("premidpost"));
    let again = assert_chunking_invariant(|| K3ReasoningParser::new(&opts), text);
    assert_eq!(again, r);
}

#[test]
fn every_argument_type() {
    let text = format!(
        "ok<|close|>think<|sep|><|open|>response<|sep|>Calling.<|close|>response<|sep|><|open|>tools<|sep|>\
<|open|>call tool=\"all_types\" index=\"1\"<|sep|>\
<|open|>argument key=\"s\" type=\"string\"<|sep|>line1\nline \"2\" \\ é<|close|>argument<|sep|>\
<|open|>argument key=\"n\" type=\"number\"<|sep|>-12.5<|close|>argument<|sep|>\
<|open|>argument key=\"i\" type=\"number\"<|sep|>42<|close|>argument<|sep|>\
<|open|>argument key=\"b\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|>\
<|open|>argument key=\"z\" type=\"null\"<|sep|>null<|close|>argument<|sep|>\
<|open|>argument key=\"o\" type=\"object\"<|sep|>{{\"a\": [1, {{\"b\": null}}]}}<|close|>argument<|sep|>\
<|open|>argument key=\"a\" type=\"array\"<|sep|>[\"x\", 2]<|close|>argument<|sep|>\
<|open|>argument key=\"bad\" type=\"number\"<|sep|>twelve<|close|>argument<|sep|>\
<|close|>call<|sep|><|close|>tools<|sep|>{END}"
    );
    let r = check(&text, true);
    assert_eq!(r.content.as_deref(), Some("Calling."));
    assert_eq!(r.tool_calls.len(), 1);
    assert_eq!(r.tool_calls[0].name, "all_types");
    assert_eq!(r.tool_calls[0].id, "call_0");
    assert_eq!(
        args_of(&r)[0],
        json!({"s": "line1\nline \"2\" \\ é", "n": -12.5, "i": 42, "b": true, "z": null,
               "o": {"a": [1, {"b": null}]}, "a": ["x", 2], "bad": "twelve"})
    );
}

#[test]
fn multiple_calls_escaped_names_and_json_block() {
    let name = escape_attr("we\"ird&name");
    let text = format!(
        "<|open|>tools<|sep|>\n<|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>\n\
<|open|>call tool=\"{name}\" index=\"2\"<|sep|><|close|>call<|sep|>\
<|open|>call tool=\"raw\" index=\"3\"<|sep|><|open|>json type=\"object\"<|sep|>{{\"q\": \"a<b\", \"k\": [1]}}<|close|>json<|sep|><|close|>call<|sep|>\
<|close|>tools<|sep|>{END}"
    );
    let r = check(&text, false);
    assert_eq!(r.content, None);
    assert_eq!(
        r.tool_calls,
        vec![
            call(0, "get_weather", json!({"city": "Paris"})),
            call(1, "we\"ird&name", json!({})),
            call(2, "raw", json!({"q": "a<b", "k": [1]})),
        ]
    );
}

#[test]
fn unclosed_tools_block_keeps_complete_calls() {
    let text = "<|open|>tools<|sep|><|open|>call tool=\"a\" index=\"1\"<|sep|><|close|>call<|sep|>\
<|open|>call tool=\"b\" index=\"2\"<|sep|><|open|>argument key=\"x\" type=\"string\"<|sep|>partial";
    let r = check(text, false);
    assert_eq!(r.tool_calls, vec![call(0, "a", json!({}))]);
    // The streamed events still say the second call started and ended incomplete.
    let mut p = K3ToolParser::new(&tool_opts());
    let mut events = p.feed(text).unwrap();
    events.extend(p.finish().unwrap());
    assert!(events.contains(&Event::ToolCallEnd {
        index: 1,
        complete: false
    }));
}

#[test]
fn malformed_calls_are_skipped_not_fatal() {
    let text = "before<|open|>tools<|sep|>junk<|open|>call index=\"1\"<|sep|><|open|>argument key=\"x\" type=\"string\"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|>\
<|open|>call tool=\"ok\" index=\"2\"<|sep|><|open|>argument type=\"string\"<|sep|>nokey<|close|>argument<|sep|><|open|>argument key=\"k\" type=\"string\"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|>\
<|close|>tools<|sep|>after";
    let r = check(text, false);
    assert_eq!(r.content.as_deref(), Some("beforeafter"));
    assert_eq!(r.tool_calls, vec![call(0, "ok", json!({"k": "v"}))]);
}

#[test]
fn markers_never_leak_and_partial_markers_are_held_back() {
    let mut p = K3ToolParser::new(&tool_opts());
    // A delta ending in a marker prefix must not emit the prefix.
    assert_eq!(
        p.feed("Hi <|clo").unwrap(),
        vec![Event::Content("Hi ".into())]
    );
    assert_eq!(
        p.feed("se|>response<|sep|> there").unwrap(),
        vec![Event::Content(" there".into())]
    );
    // Stray and unknown markers are dropped from content; non-marker `<|` text is kept.
    let r = check(
        "a<|sep|>b<|open|>weird x=\"1\"<|sep|>c<|open|>d <|x|> e",
        false,
    );
    assert_eq!(r.content.as_deref(), Some("abcd <|x|> e"));
}

#[test]
fn streaming_emits_name_first_then_argument_deltas() {
    let mut p = K3ToolParser::new(&ToolOptions {
        id_prefix: "req7-".into(),
        ..tool_opts()
    });
    let e = p
        .feed("<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>")
        .unwrap();
    assert_eq!(
        e,
        vec![Event::ToolCallStart {
            index: 0,
            id: "req7-0".into(),
            name: "f".into()
        }]
    );
    let e = p
        .feed("<|open|>argument key=\"q\" type=\"string\"<|sep|>ab")
        .unwrap();
    assert_eq!(
        e,
        vec![Event::ToolCallArguments {
            index: 0,
            delta: "{\"q\":\"ab".into()
        }]
    );
    let e = p
        .feed("c<|close|>argument<|sep|><|close|>call<|sep|>")
        .unwrap();
    assert_eq!(
        e,
        vec![
            Event::ToolCallArguments {
                index: 0,
                delta: "c\"}".into()
            },
            Event::ToolCallEnd {
                index: 0,
                complete: true
            }
        ]
    );
}

// ------------------------------------------------------------------ property test

/// A generated model output and what parsing it must give.
#[derive(Debug, Clone)]
struct Sample {
    think: bool,
    reasoning: String,
    content: String,
    calls: Vec<(String, Vec<(String, Value)>)>,
}

const MARKERS: [&str; 4] = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];

fn free_text() -> impl Strategy<Value = String> {
    let atoms = prop::sample::select(vec![
        "a", "b", "xyz", " ", "\n", "<", "|", ">", "<|", "|>", "op", "en", "se", "p", "\"", "&",
        "é", "中", "\\", "{", "}", "think", "<|open", "<|clo", "sep|>",
    ]);
    prop::collection::vec(atoms, 0..12)
        .prop_map(|v| v.concat())
        .prop_filter("no full markers", |s| {
            !MARKERS.iter().any(|m| s.contains(m))
        })
}

fn ident() -> impl Strategy<Value = String> {
    "[a-z_][a-z0-9_.\"&-]{0,10}"
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i32>().prop_map(|i| json!(i)),
        (-1000i32..1000).prop_map(|i| json!(f64::from(i) / 8.0)),
        free_text().prop_map(Value::String),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::vec(("[a-z]{1,4}", inner), 0..3)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn sample() -> impl Strategy<Value = Sample> {
    let arg = (
        ident(),
        prop_oneof![free_text().prop_map(Value::String), json_value()],
    );
    let one_call = (ident(), prop::collection::vec(arg, 0..4));
    (
        any::<bool>(),
        free_text(),
        free_text(),
        prop::collection::vec(one_call, 0..3),
    )
        .prop_map(|(think, reasoning, content, calls)| Sample {
            think,
            reasoning,
            content,
            calls,
        })
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Write the sample as the model would (docs/k3-format.md §2, §4).
fn render(s: &Sample) -> String {
    let mut out = String::new();
    if s.think {
        out += &s.reasoning;
        out += "<|close|>think<|sep|><|open|>response<|sep|>";
    }
    out += &s.content;
    out += "<|close|>response<|sep|>";
    if !s.calls.is_empty() {
        out += "<|open|>tools<|sep|>";
        for (i, (name, args)) in s.calls.iter().enumerate() {
            out += &format!(
                "<|open|>call tool=\"{}\" index=\"{}\"<|sep|>",
                escape_attr(name),
                i + 1
            );
            for (k, v) in args {
                let t = json_type(v);
                let body = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                out += &format!(
                    "<|open|>argument key=\"{}\" type=\"{t}\"<|sep|>{body}<|close|>argument<|sep|>",
                    escape_attr(k)
                );
            }
            out += "<|close|>call<|sep|>";
        }
        out += "<|close|>tools<|sep|>";
    }
    out += END;
    out
}

fn expected(s: &Sample) -> ParseResult {
    ParseResult {
        reasoning: (s.think && !s.reasoning.is_empty()).then(|| s.reasoning.clone()),
        content: (!s.content.is_empty()).then(|| s.content.clone()),
        tool_calls: s
            .calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| {
                let mut obj = serde_json::Map::new();
                for (k, v) in args {
                    obj.insert(k.clone(), v.clone());
                }
                call(i as u32, name, Value::Object(obj))
            })
            .collect(),
    }
}

/// Arguments compare as JSON (duplicate keys: the last wins, as a JSON reader sees them).
fn normalise(mut r: ParseResult) -> ParseResult {
    for c in &mut r.tool_calls {
        let v: Value = serde_json::from_str(&c.arguments).expect("arguments are JSON");
        c.arguments = v.to_string();
    }
    r
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn any_chunking_equals_one_shot(s in sample(), cuts in prop::collection::vec(0usize..400, 0..40)) {
        let text = render(&s);
        let whole = pipeline(&text, s.think, &[]);
        prop_assert_eq!(normalise(whole.clone()), normalise(expected(&s)));
        let mut cuts = cuts;
        cuts.sort_unstable();
        prop_assert_eq!(&pipeline(&text, s.think, &cuts), &whole);
        let singles: Vec<usize> = (1..text.chars().count()).collect();
        prop_assert_eq!(&pipeline(&text, s.think, &singles), &whole);
        // each parser alone, random cuts
        let rp = parse_split_at(K3ReasoningParser::new(&thinking(s.think)), &text, &cuts).unwrap();
        prop_assert_eq!(rp, K3ReasoningParser::new(&thinking(s.think)).parse_all(&text).unwrap());
        let tp = parse_split_at(K3ToolParser::new(&tool_opts()), &text, &cuts).unwrap();
        prop_assert_eq!(tp, K3ToolParser::new(&tool_opts()).parse_all(&text).unwrap());
    }
}
