//! The output grammar (grammar.rs) checked with llguidance itself: assistant turns rendered by
//! k3-mini's own template (and hand-written ones from docs/k3-format.md) are accepted token by
//! token; wrong tools, missing required arguments and wrong types are rejected.

use std::sync::{Arc, OnceLock};

use k3_plugin_sdk::{ChatTemplate, GrammarRequest, OutputGrammar, RenderOptions, ToolChoice};
use kimi_k3_template::JinjaTemplate;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::grammar::{TOOLS_TRIGGER, output_grammar};

const SPECIALS: [&str; 4] = ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"];

/// One token per byte plus K3's markers as special tokens; `<|end_of_msg|>` is EOS.
fn factory() -> &'static ParserFactory {
    static F: OnceLock<ParserFactory> = OnceLock::new();
    F.get_or_init(|| {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for s in SPECIALS {
            let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            w.extend_from_slice(s.as_bytes());
            words.push(w);
        }
        let info = TokRxInfo::new(words.len() as u32, 256);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut f = ParserFactory::new_simple(&env).unwrap();
        f.set_stderr_log_level(0);
        f
    })
}

/// Bytes as byte tokens, marker spellings as their special tokens.
fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let mut rest = text;
    'outer: while !rest.is_empty() {
        for (i, s) in SPECIALS.iter().enumerate() {
            if let Some(r) = rest.strip_prefix(s) {
                out.push(256 + i as u32);
                rest = r;
                continue 'outer;
            }
        }
        let c = rest.chars().next().unwrap();
        out.extend(c.to_string().bytes().map(u32::from));
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Whether the grammar accepts `text` as a complete output.
fn accepts(grammar: &OutputGrammar, text: &str) -> bool {
    let parser = factory().create_parser(TopLevelGrammar::from_lark(grammar.lark.clone()));
    let parser =
        parser.unwrap_or_else(|e| panic!("grammar does not compile: {e}\n{}", grammar.lark));
    let mut m = Matcher::new(Ok(parser));
    let tokens = tokenize(text);
    // The end-of-message token is EOS: consumed as the grammar's last token.
    m.consume_tokens(&tokens).is_ok() && (m.is_stopped() || m.is_accepting().unwrap_or(false))
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1},
                "unit": {"type": "string", "enum": ["c", "f"]}
            }, "required": ["city", "days"]}}},
        {"type": "function", "function": {
            "name": "search",
            "strict": true,
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object", "properties": {"lang": {"type": "string"}},
                            "required": ["lang"], "additionalProperties": false}
            }, "required": ["query"], "additionalProperties": false}}}
    ])
}

fn request(choice: ToolChoice, reasoning: bool, content: Option<&str>) -> GrammarRequest {
    GrammarRequest {
        tools_json: Some(tools().to_string()),
        tool_choice: choice,
        prompt_opens_reasoning: reasoning,
        content_lark: content.map(str::to_owned),
        extra_json: None,
    }
}

fn grammar(choice: ToolChoice, reasoning: bool, content: Option<&str>) -> OutputGrammar {
    output_grammar(&request(choice, reasoning, content))
        .unwrap()
        .expect("a grammar")
}

/// What the model writes after the generation prompt, as k3-mini's template renders the
/// assistant turn (thinking on: after `<|open|>think<|sep|>`).
fn rendered_turn(assistant: Value) -> String {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/k3-mini/tokenizer_config.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let template = JinjaTemplate::compile(config["chat_template"].as_str().unwrap()).unwrap();
    let messages = json!([{"role": "user", "content": "hi"}, assistant]);
    let text = template
        .render(&messages.to_string(), None, &RenderOptions::default())
        .unwrap();
    let prompt = "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
    let at = text.find(prompt).expect("an assistant turn") + prompt.len();
    text[at..].to_owned()
}

fn call(name: &str, arguments: Value) -> Value {
    json!({"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}})
}

#[test]
fn rendered_calls_are_accepted_by_required_and_named() {
    let one = rendered_turn(
        json!({"role": "assistant", "reasoning_content": "think a bit",
        "content": "Let me check.",
        "tool_calls": [call("get_weather", json!({"city": "Paris \"Nord\"", "days": 3}))]}),
    );
    assert!(one.contains("type=\"number\"<|sep|>3<|close|>"), "{one}");
    let two = rendered_turn(json!({"role": "assistant", "content": "",
        "tool_calls": [call("get_weather", json!({"city": "Oslo", "days": 1, "unit": "c"})),
                       call("search", json!({"query": "news <b>", "filters": {"lang": "en"}}))]}));
    // Arguments as a JSON string render as one json block.
    let block = rendered_turn(json!({"role": "assistant", "content": "x",
        "tool_calls": [call("search", json!("{\"query\": \"q\", \"filters\": {\"lang\": \"en\"}}"))]}));
    assert!(
        block.contains("<|open|>json type=\"object\"<|sep|>"),
        "{block}"
    );
    let required = grammar(ToolChoice::Required, true, None);
    for text in [&one, &two, &block] {
        assert!(accepts(&required, text), "required rejects {text}");
    }
    let named = grammar(ToolChoice::Function("get_weather".into()), true, None);
    assert!(accepts(&named, &one));
    assert!(!accepts(&named, &two), "a call to another function");
    assert!(!accepts(&named, &block));
}

#[test]
fn wrong_calls_are_rejected() {
    let required = grammar(ToolChoice::Required, true, None);
    let turn = |calls: &str| {
        format!(
            "r<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>\
             <|open|>tools<|sep|>{calls}<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        )
    };
    let arg = |k: &str, t: &str, v: &str| {
        format!("<|open|>argument key=\"{k}\" type=\"{t}\"<|sep|>{v}<|close|>argument<|sep|>")
    };
    let call = |name: &str, args: &str| {
        format!("<|open|>call tool=\"{name}\" index=\"1\"<|sep|>{args}<|close|>call<|sep|>")
    };
    let good = call(
        "get_weather",
        &(arg("city", "string", "Rome") + &arg("days", "number", "2")),
    );
    assert!(accepts(&required, &turn(&good)));
    let cases = [
        (
            "unknown tool",
            call("delete_all", &arg("city", "string", "x")),
        ),
        (
            "missing required argument",
            call("get_weather", &arg("city", "string", "Rome")),
        ),
        (
            "wrong type",
            call(
                "get_weather",
                &(arg("city", "string", "Rome") + &arg("days", "string", "two")),
            ),
        ),
        (
            "value outside the schema",
            call(
                "get_weather",
                &(arg("city", "string", "Rome") + &arg("days", "number", "0")),
            ),
        ),
        (
            "not in the enum",
            call(
                "get_weather",
                &(arg("city", "string", "Rome")
                    + &arg("days", "number", "2")
                    + &arg("unit", "string", "k")),
            ),
        ),
        (
            "an undeclared argument of a strict tool",
            call(
                "search",
                &(arg("query", "string", "q") + &arg("page", "number", "2")),
            ),
        ),
        (
            "a nested object breaking its schema",
            call(
                "search",
                &(arg("query", "string", "q") + &arg("filters", "object", "{\"lang\":1}")),
            ),
        ),
        ("no call", String::new()),
    ];
    for (what, calls) in cases {
        assert!(!accepts(&required, &turn(&calls)), "accepted {what}");
    }
    // No tools block at all, and text after the end of the message.
    let plain = "r<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>\
                 <|close|>message<|sep|><|end_of_msg|>";
    assert!(!accepts(&required, plain));
    assert!(!accepts(&required, &format!("{}more", turn(&good))));
}

#[test]
fn thinking_off_starts_in_the_response() {
    let g = grammar(ToolChoice::Required, false, None);
    let text = "ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"search\" \
                index=\"1\"<|sep|><|open|>argument key=\"query\" type=\"string\"<|sep|>q\
                <|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>\
                <|close|>message<|sep|><|end_of_msg|>";
    assert!(accepts(&g, text));
    assert!(!accepts(
        &g,
        &format!("r<|close|>think<|sep|><|open|>response<|sep|>{text}")
    ));
}

#[test]
fn auto_with_strict_tools_constrains_the_tools_block_after_its_trigger() {
    let g = grammar(ToolChoice::Auto, true, None);
    assert_eq!(g.trigger.as_deref(), Some(TOOLS_TRIGGER));
    let body =
        |calls: &str| format!("{calls}<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>");
    let strict_ok = "<|open|>call tool=\"search\" index=\"1\"<|sep|><|open|>argument \
                     key=\"query\" type=\"string\"<|sep|>q<|close|>argument<|sep|><|close|>call<|sep|>";
    let strict_bad = "<|open|>call tool=\"search\" index=\"1\"<|sep|><|open|>argument \
                      key=\"q\" type=\"string\"<|sep|>q<|close|>argument<|sep|><|close|>call<|sep|>";
    // A non-strict tool takes any arguments (its schema is a hint, as without a grammar).
    let loose = "<|open|>call tool=\"get_weather\" index=\"2\"<|sep|><|open|>argument \
                 key=\"town\" type=\"boolean\"<|sep|>anything<|close|>argument<|sep|><|close|>call<|sep|>";
    let unknown = "<|open|>call tool=\"nope\" index=\"1\"<|sep|><|close|>call<|sep|>";
    assert!(accepts(&g, &body(strict_ok)));
    assert!(accepts(&g, &body(&format!("{strict_ok}{loose}"))));
    assert!(!accepts(&g, &body(strict_bad)));
    assert!(!accepts(&g, &body(unknown)));
    // Without strict tools and without a content constraint: no grammar.
    let loose_tools = json!([{"type": "function", "function": {"name": "f"}}]).to_string();
    let req = GrammarRequest {
        tools_json: Some(loose_tools),
        ..request(ToolChoice::Auto, true, None)
    };
    assert_eq!(output_grammar(&req).unwrap(), None);
    assert_eq!(
        output_grammar(&request(ToolChoice::None, true, None)).unwrap(),
        None
    );
}

#[test]
fn content_lark_constrains_the_response() {
    let schema =
        r#"%json {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}"#;
    let g = grammar(ToolChoice::None, true, Some(schema));
    assert_eq!(g.trigger, None);
    let turn = |content: &str| {
        format!(
            "hm<|close|>think<|sep|><|open|>response<|sep|>{content}<|close|>response<|sep|>\
             <|close|>message<|sep|><|end_of_msg|>"
        )
    };
    assert!(accepts(&g, &turn("{\"a\":1}")));
    assert!(!accepts(&g, &turn("{\"a\":\"x\"}")));
    assert!(!accepts(&g, &turn("sure")));
    // `auto` with a content constraint: the content, then an optional tools block.
    let auto = grammar(ToolChoice::Auto, true, Some(schema));
    assert!(accepts(&auto, &turn("{\"a\":1}")));
}

#[test]
fn bad_requests_are_refused() {
    let named = output_grammar(&request(ToolChoice::Function("nope".into()), true, None));
    assert!(matches!(
        named,
        Err(k3_plugin_sdk::PluginError::InvalidInput(_))
    ));
    let no_tools = GrammarRequest {
        tools_json: None,
        ..request(ToolChoice::Required, true, None)
    };
    assert!(output_grammar(&no_tools).is_err());
    let not_json = GrammarRequest {
        tools_json: Some("[{".into()),
        ..request(ToolChoice::Required, true, None)
    };
    assert!(output_grammar(&not_json).is_err());
}
