//! Integration tests of the plugin host with the real wasm plugins (built by build.rs /
//! scripts/build-plugins). One binary; compiled components are cached on disk under
//! CARGO_TARGET_TMPDIR so only the first run pays for compilation.

use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use k3_plugin_host::*;
use k3_plugin_sdk::{StreamingParser, ToolOptions as NativeToolOptions};
use kimi_k3_format::{K3ReasoningParser, K3ToolParser};
use proptest::prelude::*;
use serde_json::{Value, json};

fn cache_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("k3-plugin-cache")
}

fn config() -> PluginHostConfig {
    PluginHostConfig {
        max_instances: 64,
        ..PluginHostConfig::default()
    }
    .with_cache_dir(cache_dir())
}

fn wasm(file: &str) -> Vec<u8> {
    let path = default_plugin_dir().join(file);
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} — run scripts/build-plugins", path.display()))
}

/// A host with the default plugins active, shared by tests that do not swap.
fn shared_host() -> &'static PluginHost {
    static HOST: OnceLock<PluginHost> = OnceLock::new();
    HOST.get_or_init(|| {
        let host = PluginHost::new(config()).unwrap();
        host.load_default_plugins().unwrap();
        host
    })
}

/// Reasoning stream → its content into a tool stream, fed in `chunk`-char deltas (0 = whole).
fn pipeline(
    host: &PluginHost,
    text: &str,
    thinking: bool,
    chunk: usize,
) -> (ParseResult, Vec<ParseEvent>) {
    let ropts = ReasoningOptions {
        thinking,
        prompt_opens_reasoning: thinking,
        extra_json: None,
    };
    let mut rs = host.reasoning_stream(&ropts).unwrap();
    let mut ts = host.tool_stream(&ToolOptions::default()).unwrap();
    let mut events = Vec::new();
    let route = |evs: Vec<ParseEvent>, ts: &mut ToolStream, events: &mut Vec<ParseEvent>| {
        for e in evs {
            match e {
                ParseEvent::Content { text } => events.extend(ts.feed(&text).unwrap()),
                other => events.push(other),
            }
        }
    };
    let chars: Vec<char> = text.chars().collect();
    let chunks: Vec<String> = if chunk == 0 {
        vec![text.to_string()]
    } else {
        chars.chunks(chunk).map(|c| c.iter().collect()).collect()
    };
    for c in &chunks {
        let evs = rs.feed(c).unwrap();
        route(evs, &mut ts, &mut events);
    }
    let evs = rs.finish().unwrap();
    route(evs, &mut ts, &mut events);
    events.extend(ts.finish().unwrap());
    (ParseResult::from_events(&events), events)
}

/// The same pipeline natively (the plugin's own library).
fn native_pipeline(text: &str, thinking: bool) -> ParseResult {
    let ropts = k3_plugin_sdk::ReasoningOptions {
        thinking,
        prompt_opens_reasoning: thinking,
        extra_json: None,
    };
    let r = K3ReasoningParser::new(&ropts).parse_all(text).unwrap();
    let t = K3ToolParser::new(&NativeToolOptions::default())
        .parse_all(r.content.as_deref().unwrap_or(""))
        .unwrap();
    ParseResult {
        content: t.content,
        reasoning: r.reasoning,
        tool_calls: t
            .tool_calls
            .into_iter()
            .map(|c| ToolCall {
                index: c.index,
                id: c.id,
                name: c.name,
                arguments: c.arguments,
            })
            .collect(),
    }
}

const K3_OUTPUT: &str = "I should call both.<|close|>think<|sep|><|open|>response<|sep|>On it — é.<|close|>response<|sep|>\
<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Zürich \"ZH\"<|close|>argument<|sep|>\
<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>\
<|open|>call tool=\"a&amp;b\" index=\"2\"<|sep|><|open|>argument key=\"o\" type=\"object\"<|sep|>{\"k\": [true, null]}<|close|>argument<|sep|><|close|>call<|sep|>\
<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";

const K2_OUTPUT: &str = "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>{\"id\": 7}<|tool_call_end|><|tool_calls_section_end|>";

const K3_SPECIALS: [&str; 8] = [
    "<|pad|>",
    "<|bos|>",
    "<|end_of_msg|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|kimi_image_placeholder|>",
    "<|media_pad|>",
];

#[test]
fn default_plugins_load_activate_and_list() {
    let host = shared_host();
    let list = host.list();
    for (stage, name) in [
        (Stage::ChatTemplate, "kimi-k3-template"),
        (Stage::ReasoningParser, "kimi-k3-reasoning"),
        (Stage::ToolParser, "kimi-k3-tools"),
        (Stage::Media, "kimi-k3-media"),
    ] {
        let v = list
            .iter()
            .find(|v| v.stage == stage && v.active)
            .unwrap_or_else(|| panic!("{stage} not active"));
        assert_eq!(v.metadata.name, name);
        assert_eq!(v.metadata.stage, stage);
        assert_eq!(v.metadata.wit_version, "0.3.0");
        assert_eq!(v.sha256.len(), 64);
    }
    assert!(host.active(Stage::Router).is_none());
    assert!(matches!(
        host.rollback(Stage::Router),
        Err(PluginError::NothingToRollBack(Stage::Router))
    ));
    // Precompiled components landed in the disk cache.
    let cached = std::fs::read_dir(cache_dir())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "cwasm")
        })
        .count();
    assert!(cached >= 3, "expected cached .cwasm files, found {cached}");
}

#[test]
fn template_renders_k3_mini_byte_identical_to_reference() {
    let host = shared_host();
    let fixture: Value =
        serde_json::from_str(include_str!("fixtures/template_k3_mini.json")).unwrap();
    let config_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../models/k3-mini/tokenizer_config.json"
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(config_path).unwrap()).unwrap();
    let template = config["chat_template"].as_str().unwrap();
    let templates = host.chat_template();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let o = &case["options"];
        let opt_json = |k: &str| o.get(k).filter(|v| !v.is_null()).map(|v| v.to_string());
        let options = RenderOptions {
            add_generation_prompt: o["add_generation_prompt"].as_bool().unwrap_or(false),
            thinking: o["thinking"].as_bool(),
            thinking_effort: o["thinking_effort"].as_str().map(str::to_string),
            tool_choice_json: opt_json("tool_choice"),
            response_format_json: opt_json("response_format"),
            ..RenderOptions::default()
        };
        let tools = (!case["tools"].is_null()).then(|| case["tools"].to_string());
        let got = templates.render(
            template,
            &case["messages"].to_string(),
            tools.as_deref(),
            &options,
        );
        // Taint substitution (the special tokens given) changes nothing in the text.
        let with_specials = RenderOptions {
            special_tokens: K3_SPECIALS.iter().map(|s| s.to_string()).collect(),
            ..options.clone()
        };
        let segmented = templates.render(
            template,
            &case["messages"].to_string(),
            tools.as_deref(),
            &with_specials,
        );
        assert_eq!(got, segmented, "{name}");
        match (case["expected"].as_str(), case["error"].as_str()) {
            (Some(expected), _) => {
                let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(
                    got, expected,
                    "{name}: rendering differs from reference/k3ref/data/render.py"
                );
            }
            (None, Some(error)) => match got {
                Err(PluginError::Template(e @ TemplateError::Raised(_))) => {
                    assert_eq!(e.to_string(), error, "{name}");
                    assert!(e.is_client_error());
                }
                other => panic!("{name}: expected the template to raise {error:?}, got {other:?}"),
            },
            _ => panic!("{name}: fixture case has neither expected nor error"),
        }
    }
    // A long agent conversation renders well inside the template time limit.
    let mut long = vec![json!({"role": "system", "content": "You are terse."})];
    for i in 0..100 {
        long.push(
            json!({"role": "user", "content": format!("question {i} with \"quotes\" and é")}),
        );
        long.push(json!({"role": "assistant", "reasoning_content": "think ".repeat(20), "content": "",
            "tool_calls": [{"id": format!("c{i}"), "function": {"name": "search", "arguments": {"q": format!("q{i}"), "n": i}}}]}));
        long.push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "result ".repeat(10)}));
    }
    let started = Instant::now();
    let prompt = templates
        .render(
            template,
            &Value::Array(long).to_string(),
            None,
            &RenderOptions::default(),
        )
        .unwrap();
    assert_eq!(prompt.matches("<|open|>call tool=\"search\"").count(), 100);
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "300-message render took {took:?}"
    );
    // A template that does not parse is a syntax error, not a trap.
    let bad = templates.render("{% if %}", "[]", None, &RenderOptions::default());
    assert!(
        matches!(bad, Err(PluginError::Template(TemplateError::Syntax(_)))),
        "{bad:?}"
    );
}

#[test]
fn parsers_through_wasm_conform_for_every_chunking() {
    let host = shared_host();
    let native = native_pipeline(K3_OUTPUT, true);
    assert_eq!(native.reasoning.as_deref(), Some("I should call both."));
    assert_eq!(native.content.as_deref(), Some("On it — é."));
    assert_eq!(native.tool_calls.len(), 2);
    assert_eq!(native.tool_calls[1].name, "a&b");
    let args: Value = serde_json::from_str(&native.tool_calls[0].arguments).unwrap();
    assert_eq!(args, json!({"city": "Zürich \"ZH\"", "days": 3}));
    for chunk in [0, 1, 3, 7, 23] {
        let (result, events) = pipeline(host, K3_OUTPUT, true, chunk);
        assert_eq!(result, native, "chunk {chunk}");
        // id and name come once, in the call's first event, before its arguments
        let starts: Vec<_> = events
            .iter()
            .filter(|e| matches!(e, ParseEvent::ToolCallStart { .. }))
            .collect();
        assert_eq!(starts.len(), 2);
        for e in &events {
            if let ParseEvent::Content { text } | ParseEvent::Reasoning { text } = e {
                assert!(!text.contains("<|"), "marker leaked: {text:?}");
            }
        }
    }
    // One-shot parses through wasm agree too.
    let r = host
        .parse_reasoning(&ReasoningOptions::default(), K3_OUTPUT)
        .unwrap();
    assert_eq!(r.reasoning, native.reasoning);
    let t = host
        .parse_tools(&ToolOptions::default(), r.content.as_deref().unwrap())
        .unwrap();
    assert_eq!(t.tool_calls, native.tool_calls);
    // thinking off: all content, no reasoning
    let (off, _) = pipeline(host, "Just text<|close|>response<|sep|>", false, 2);
    assert_eq!(
        (off.reasoning, off.content.as_deref()),
        (None, Some("Just text"))
    );
}

/// One output per parser-fidelity rule of docs/k3-format.md §5 (thinking, text, reasoning,
/// content, call names): the wasm builds, fed in any chunking, agree with the expectation.
/// (thinking, model output, expected reasoning, expected content, expected call names)
type FidelityCase = (
    bool,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
    &'static [&'static str],
);

const FIDELITY_CASES: [FidelityCase; 6] = [
    // a tag cut off by max_tokens leaves no tag word behind
    (
        false,
        "the answer<|close|>message",
        None,
        Some("the answer"),
        &[],
    ),
    // a malformed one mid-stream neither
    (
        true,
        "r<|close|>think<|open|>response<|sep|>the answer<|close|>message<|end_of_msg|>",
        Some("r"),
        Some("the answer"),
        &[],
    ),
    // a tools block inside the think channel ends reasoning and keeps its calls
    (
        true,
        "plan<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"q\" type=\"string\"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        Some("plan"),
        None,
        &["f"],
    ),
    // markers inside a string argument reach the tool parser unchanged
    (
        false,
        "c<|open|>tools<|sep|><|open|>call tool=\"g\" index=\"1\"<|sep|><|open|>argument key=\"code\" type=\"string\"<|sep|>a<|close|>b<|close|>response<|sep|><|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        None,
        Some("c"),
        &["g"],
    ),
    // a think block with thinking off is reasoning
    (
        false,
        "<|open|>think<|sep|>hmm<|close|>think<|sep|>ok",
        Some("hmm"),
        Some("ok"),
        &[],
    ),
    // nothing after the end of the message
    (
        false,
        "answer<|close|>message<|sep|>extra<|end_of_msg|>more",
        None,
        Some("answer"),
        &[],
    ),
];

#[test]
fn parser_fidelity_rules_hold_through_wasm() {
    let host = shared_host();
    for (think, text, reasoning, content, names) in FIDELITY_CASES {
        let native = native_pipeline(text, think);
        assert_eq!(native.reasoning.as_deref(), reasoning, "{text:?}");
        assert_eq!(native.content.as_deref(), content, "{text:?}");
        let got: Vec<&str> = native.tool_calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(got, names, "{text:?}");
        for chunk in [0, 1, 2, 5] {
            assert_eq!(
                pipeline(host, text, think, chunk).0,
                native,
                "{text:?} chunk {chunk}"
            );
        }
    }
    let (_, code_case, ..) = FIDELITY_CASES[3];
    let args: Value =
        serde_json::from_str(&native_pipeline(code_case, false).tool_calls[0].arguments).unwrap();
    assert_eq!(args, json!({"code": "a<|close|>b<|close|>response<|sep|>"}));
}

/// A call cut by the end of the output streams closed JSON and ends incomplete, for every
/// chunking (the server returns it so, streaming or not).
#[test]
fn cut_call_streams_closed_arguments_through_wasm() {
    let host = shared_host();
    let text = "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"q\" type=\"string\"<|sep|>Par<|close|>argu";
    for chunk in [0, 1, 3] {
        let (_, events) = pipeline(host, text, false, chunk);
        let args: String = events
            .iter()
            .filter_map(|e| match e {
                ParseEvent::ToolCallArguments { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(args, "{\"q\":\"Par\"}", "chunk {chunk}");
        assert!(matches!(
            events.last(),
            Some(ParseEvent::ToolCallEnd {
                complete: false,
                ..
            })
        ));
    }
}

fn arb_output() -> impl Strategy<Value = (bool, String)> {
    let text = prop::collection::vec(
        prop::sample::select(vec![
            "a", " ", "é", "<", "|", ">", "\"", "&", "\n", "<|op", "sep|>",
        ]),
        0..8,
    )
    .prop_map(|v| v.concat())
    .prop_filter("no markers", |s| {
        !["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
            .iter()
            .any(|m| s.contains(m))
    });
    let arg = (
        "[a-z]{1,5}",
        prop_oneof![
            text.clone().prop_map(Value::String),
            any::<i16>().prop_map(|i| json!(i)),
            any::<bool>().prop_map(Value::Bool)
        ],
    );
    let call = ("[a-z_]{1,6}", prop::collection::vec(arg, 0..3));
    (any::<bool>(), text.clone(), text, prop::collection::vec(call, 0..3)).prop_map(|(think, r, c, calls)| {
        let mut out = String::new();
        if think {
            out += &format!("{r}<|close|>think<|sep|><|open|>response<|sep|>");
        }
        out += &format!("{c}<|close|>response<|sep|>");
        if !calls.is_empty() {
            out += "<|open|>tools<|sep|>";
            for (i, (name, args)) in calls.iter().enumerate() {
                out += &format!("<|open|>call tool=\"{name}\" index=\"{}\"<|sep|>", i + 1);
                for (k, v) in args {
                    let (ty, body) = match v {
                        Value::String(s) => ("string", s.clone()),
                        Value::Bool(_) => ("boolean", v.to_string()),
                        _ => ("number", v.to_string()),
                    };
                    out += &format!("<|open|>argument key=\"{k}\" type=\"{ty}\"<|sep|>{body}<|close|>argument<|sep|>");
                }
                out += "<|close|>call<|sep|>";
            }
            out += "<|close|>tools<|sep|>";
        }
        out += "<|close|>message<|sep|><|end_of_msg|>";
        (think, out)
    })
}

proptest! {
    // The full property test runs natively in plugins/kimi-k3-format; this smaller one checks
    // the wasm builds agree with the native library for random outputs and chunkings.
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn wasm_streaming_matches_native_one_shot((think, text) in arb_output(), chunk in 1usize..9) {
        let host = shared_host();
        let native = native_pipeline(&text, think);
        prop_assert_eq!(pipeline(host, &text, think, chunk).0, native.clone());
        prop_assert_eq!(pipeline(host, &text, think, 1).0, native);
    }
}

#[test]
fn bad_components_are_refused_at_load() {
    let host = PluginHost::new(config()).unwrap();
    let garbage = host.load(Stage::ToolParser, b"definitely not wasm");
    assert!(
        matches!(&garbage, Err(PluginError::InvalidComponent(m)) if m.contains("bad magic")),
        "{garbage:?}"
    );
    let core = host.load(Stage::ToolParser, b"\0asm\x01\0\0\0");
    assert!(
        matches!(&core, Err(PluginError::InvalidComponent(m)) if m.contains("core WebAssembly module")),
        "{core:?}"
    );
    let mut truncated = wasm("kimi_k3_tools.wasm");
    truncated.truncate(truncated.len() / 2);
    assert!(matches!(
        host.load(Stage::ToolParser, &truncated),
        Err(PluginError::InvalidComponent(_))
    ));

    let other = host.load(Stage::ToolParser, &wasm("testdata_wrong_world.wasm"));
    match &other {
        Err(
            e @ PluginError::WrongWorld {
                world: "tool-parser-plugin",
                detail,
                ..
            },
        ) => {
            assert!(detail.contains("k3serve-test:other/greeter"), "{e}");
        }
        _ => panic!("{other:?}"),
    }
    // A valid plugin of another stage does not fit this slot.
    let misfit = host.load(Stage::ToolParser, &wasm("kimi_k3_reasoning.wasm"));
    assert!(
        matches!(
            misfit,
            Err(PluginError::WrongWorld {
                stage: Stage::ToolParser,
                ..
            })
        ),
        "{misfit:?}"
    );
    let future = host.load(Stage::ToolParser, &wasm("testdata_wit_v0_4.wasm"));
    assert!(
        matches!(&future, Err(PluginError::UnsupportedWitVersion { found }) if found == "k3serve:plugin@0.4.0"),
        "{future:?}"
    );
    assert!(
        future
            .unwrap_err()
            .to_string()
            .contains("@0.2.x and @0.3.x")
    );
    // Passes its own self-test, but streaming and one-shot disagree: the host's smoke test says no.
    let inconsistent = host.load(Stage::ReasoningParser, &wasm("testdata_inconsistent.wasm"));
    assert!(
        matches!(&inconsistent, Err(PluginError::SelfTestFailed { plugin, detail }) if plugin.starts_with("testdata-inconsistent") && detail.contains("one-shot")),
        "{inconsistent:?}"
    );
    assert!(
        host.list().is_empty(),
        "refused components must not be registered"
    );
    assert!(matches!(
        host.tool_stream(&ToolOptions::default()),
        Err(PluginError::NoActivePlugin(Stage::ToolParser))
    ));
}

#[test]
fn faults_fail_only_the_call_that_hit_them() {
    let cfg = PluginHostConfig {
        memory_limit: 32 << 20,
        call_timeout: Duration::from_millis(100),
        ..config()
    };
    let host = PluginHost::new(cfg).unwrap();
    let faulty = host
        .install(Stage::ToolParser, &wasm("testdata_faulty.wasm"))
        .unwrap();
    host.install(Stage::ReasoningParser, &wasm("kimi_k3_reasoning.wasm"))
        .unwrap();
    let good_calls_work = |host: &PluginHost| {
        let mut s = host.tool_stream(&ToolOptions::default()).unwrap();
        assert_eq!(
            s.feed("fine").unwrap(),
            vec![ParseEvent::Content {
                text: "fine".into()
            }]
        );
        s.finish().unwrap();
        let r = host
            .parse_reasoning(&ReasoningOptions::default(), "r<|close|>think<|sep|>c")
            .unwrap();
        assert_eq!(
            (r.reasoning.as_deref(), r.content.as_deref()),
            (Some("r"), Some("c"))
        );
    };

    let mut s = host.tool_stream(&ToolOptions::default()).unwrap();
    s.feed("before").unwrap();
    let trap = s.feed("@@trap@@").unwrap_err();
    assert!(
        matches!(&trap, PluginError::Trap { detail, .. } if detail.contains("deliberate trap")),
        "{trap}"
    );
    assert!(matches!(
        s.feed("more"),
        Err(PluginError::StreamClosed(Stage::ToolParser))
    ));
    good_calls_work(&host);

    let mut s = host.tool_stream(&ToolOptions::default()).unwrap();
    let started = Instant::now();
    let timeout = s.feed("@@loop@@").unwrap_err();
    assert!(
        matches!(timeout, PluginError::Timeout { limit_ms: 100, .. }),
        "{timeout}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "timeout took {:?}",
        started.elapsed()
    );
    good_calls_work(&host);

    let mut s = host.tool_stream(&ToolOptions::default()).unwrap();
    let oom = s.feed("@@bomb@@").unwrap_err();
    assert!(
        matches!(oom, PluginError::MemoryLimit { limit_bytes, .. } if limit_bytes == 32 << 20),
        "{oom}"
    );
    good_calls_work(&host);

    // A plugin-returned error is not a fault: the stream goes on.
    let mut s = host.tool_stream(&ToolOptions::default()).unwrap();
    let err = s.feed("@@error@@").unwrap_err();
    assert!(
        matches!(
            &err,
            PluginError::Guest {
                error: GuestError::InvalidInput(_),
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(s.feed("ok").unwrap().len(), 1);

    let stats = host
        .list()
        .into_iter()
        .find(|v| v.id == faulty.id)
        .unwrap()
        .stats;
    assert_eq!(stats.faults, 3, "{stats:?}");
    assert_eq!(stats.errors, 1, "{stats:?}");
    assert!(
        stats.sessions >= 7 && stats.calls > stats.sessions,
        "{stats:?}"
    );
}

#[test]
fn hot_swap_mid_stream_old_streams_finish_on_old_version() {
    let host = PluginHost::new(config()).unwrap();
    let k3 = host
        .install(Stage::ToolParser, &wasm("kimi_k3_tools.wasm"))
        .unwrap();
    let k2 = host
        .load(Stage::ToolParser, &wasm("kimi_k2_tools.wasm"))
        .unwrap();
    assert!(!k2.active);
    let (half_a, half_b) =
        K3_OUTPUT.split_at(K3_OUTPUT.find("<|open|>argument key=\"days\"").unwrap());

    // Deterministic part: streams started before the swap keep K3 semantics.
    let mut old: Vec<ToolStream> = (0..4)
        .map(|_| host.tool_stream(&ToolOptions::default()).unwrap())
        .collect();
    let mut old_events: Vec<Vec<ParseEvent>> =
        old.iter_mut().map(|s| s.feed(half_a).unwrap()).collect();
    host.activate(Stage::ToolParser, k2.id).unwrap();
    let mut new = host.tool_stream(&ToolOptions::default()).unwrap();
    assert_eq!(new.version().0, k2.id);
    let mut new_events = new.feed(K2_OUTPUT).unwrap();
    new_events.extend(new.finish().unwrap());
    let new_result = ParseResult::from_events(&new_events);
    assert_eq!(new_result.tool_calls[0].id, "functions.lookup:0");
    assert_eq!(new_result.content.as_deref(), Some("Sure."));
    for (s, events) in old.iter_mut().zip(&mut old_events) {
        assert_eq!(s.version().0, k3.id);
        events.extend(s.feed(half_b).unwrap());
        events.extend(s.finish().unwrap());
        let r = ParseResult::from_events(events.iter());
        assert_eq!(
            r.tool_calls.len(),
            2,
            "old stream must finish with K3 grammar"
        );
    }

    // Concurrent part: streams on other threads while the slot is swapped back and forth.
    let versions = [k3.id, k2.id];
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(4));
    let workers: Vec<_> = (0..3)
        .map(|_| {
            let (host, stop, barrier) = (host.clone(), stop.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut done = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || done < 20 {
                    let mut s = host
                        .tool_stream(&ToolOptions::default())
                        .expect("stream start never fails");
                    let (id, _) = s.version();
                    let text = if id == versions[0] {
                        K3_OUTPUT
                    } else {
                        K2_OUTPUT
                    };
                    let mut events = Vec::new();
                    let chars: Vec<char> = text.chars().collect();
                    for c in chars.chunks(5) {
                        events.extend(
                            s.feed(&c.iter().collect::<String>())
                                .expect("no call fails during a swap"),
                        );
                    }
                    events.extend(s.finish().expect("no call fails during a swap"));
                    let r = ParseResult::from_events(&events);
                    let want = if id == versions[0] { 2 } else { 1 };
                    assert_eq!(
                        r.tool_calls.len(),
                        want,
                        "stream on version {id} parsed with another version"
                    );
                    done += 1;
                }
                done
            })
        })
        .collect();
    barrier.wait();
    for i in 0..20 {
        if i % 2 == 0 {
            host.rollback(Stage::ToolParser).unwrap();
        } else {
            host.activate(Stage::ToolParser, versions[(i / 2) % 2])
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let total: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(total >= 60);

    // Rollback restores the previous version and makes the current one the rollback target.
    let active = host.active(Stage::ToolParser).unwrap();
    let back = host.rollback(Stage::ToolParser).unwrap();
    assert_ne!(back.id, active.id);
    let listed = host.list();
    assert!(listed.iter().any(|v| v.id == active.id && v.previous));
    let stats: u64 = listed.iter().map(|v| v.stats.faults + v.stats.errors).sum();
    assert_eq!(stats, 0, "no call failed");
}

#[test]
fn third_party_plugin_installs_and_runs() {
    let host = PluginHost::new(config()).unwrap();
    let v = host
        .install(Stage::ReasoningParser, &wasm("think_tags_reasoning.wasm"))
        .unwrap();
    assert_eq!(v.metadata.name, "think-tags-reasoning");
    let opts = ReasoningOptions {
        thinking: true,
        prompt_opens_reasoning: false,
        extra_json: None,
    };
    let mut s = host.reasoning_stream(&opts).unwrap();
    let mut events = Vec::new();
    for d in ["<thi", "nk>plan</th", "ink>answer"] {
        events.extend(s.feed(d).unwrap());
    }
    events.extend(s.finish().unwrap());
    let r = ParseResult::from_events(&events);
    assert_eq!(
        (r.reasoning.as_deref(), r.content.as_deref()),
        (Some("plan"), Some("answer"))
    );
    // Loading the same bytes again is deduplicated.
    assert_eq!(
        host.load(Stage::ReasoningParser, &wasm("think_tags_reasoning.wasm"))
            .unwrap()
            .id,
        v.id
    );
}
