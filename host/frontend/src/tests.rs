//! The real request path over the real engine (with its deterministic toy executor), the real
//! k3-mini tokenizer and the real default plugins: events flow, stop strings cut, disconnects
//! free memory, bad input is refused, plugin admin maps errors.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use k3_engine::testing::{ToyConfig, ToyExecutor};
use k3_engine::{Engine, EngineConfig};
use k3_plugin_host::{PluginHost, PluginHostConfig};
use serde_json::{Map, Value, json};

use crate::*;

const VOCAB: usize = 8192;
const MAX_LEN: usize = 512;

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini")
}

/// One plugin host per test binary: compiling the components is the slow part.
fn plugins() -> PluginHost {
    static HOST: OnceLock<PluginHost> = OnceLock::new();
    HOST.get_or_init(|| {
        let cache = std::env::temp_dir().join("k3-frontend-test-plugin-cache");
        let _ = std::fs::create_dir_all(&cache);
        let host = PluginHost::new(PluginHostConfig::default().with_cache_dir(cache)).unwrap();
        host.load_default_plugins().unwrap();
        host
    })
    .clone()
}

/// A plugin host of the test's own, for tests that read its counters (the shared one counts
/// every test's calls).
pub(super) fn own_plugins(config: PluginHostConfig) -> PluginHost {
    let cache = std::env::temp_dir().join("k3-frontend-test-plugin-cache");
    let _ = std::fs::create_dir_all(&cache);
    let host = PluginHost::new(config.with_cache_dir(cache)).unwrap();
    host.load_default_plugins().unwrap();
    host
}

/// A frontend over the toy engine with its own plugin host.
pub(super) fn backend_with_own_plugins() -> Frontend {
    backend_with(
        own_plugins(PluginHostConfig::default()),
        EngineConfig {
            max_context: MAX_LEN,
            eos_token_ids: vec![2],
            ..EngineConfig::default()
        },
    )
}

/// Chat-template calls counted by `b`'s plugin host.
pub(super) fn template_renders(b: &Frontend) -> u64 {
    b.metrics()
        .plugins
        .iter()
        .filter(|p| p.stage == "chat-template")
        .map(|p| p.calls)
        .sum()
}

pub(super) fn backend() -> Frontend {
    backend_with(
        plugins(),
        EngineConfig {
            max_context: MAX_LEN,
            eos_token_ids: vec![2],
            ..EngineConfig::default()
        },
    )
}

/// A frontend over the toy engine with `engine` settings and the given plugin host.
pub(super) fn backend_with(plugins: PluginHost, engine: EngineConfig) -> Frontend {
    let toy = ToyConfig {
        vocab: VOCAB,
        page_tokens: 4,
        row_bytes: 16,
        state_bytes: 64,
        arena_bytes: 1 << 20,
    };
    let engine = Engine::start(Box::new(ToyExecutor::new(toy).unwrap()), engine).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(model_dir()).unwrap());
    let template = tokenizer.chat_template().unwrap().to_string();
    Frontend::new(FrontendParts {
        engine,
        tokenizer,
        plugins,
        chat_template: template,
        model: ModelInfo {
            id: "toy".into(),
            aliases: vec![],
            max_model_len: MAX_LEN as u32,
            created: 0,
        },
        eos_token_ids: vec![2],
        vocab_size: VOCAB,
        defaults: SamplingDefaults::default(),
        kv_page_bytes: toy.page_tokens * toy.row_bytes,
        state_block_bytes: toy.state_bytes,
        media: crate::MediaFetcher::new(crate::MediaSettings::default()).unwrap(),
    })
}

fn chat_request(text: &str, max_tokens: u32) -> ChatGenRequest {
    let mut kwargs = Map::new();
    kwargs.insert("thinking".into(), Value::Bool(true));
    ChatGenRequest {
        request_id: "chatcmpl-test".into(),
        messages: vec![json!({"role": "user", "content": text})],
        tools: vec![],
        tool_choice: ToolChoice::None,
        thinking: true,
        template_kwargs: kwargs,
        sampling: SamplingOptions {
            temperature: Some(0.0),
            max_tokens: Some(max_tokens),
            ..Default::default()
        },
        constraint: None,
        constraint_param: String::new(),
    }
}

async fn run_to_end(g: Generation) -> (String, Vec<GenEvent>) {
    let events: Vec<GenEvent> = g.events.collect().await;
    let text = events
        .iter()
        .map(|e| match e {
            GenEvent::Content(t) | GenEvent::Reasoning(t) => t.as_str(),
            _ => "",
        })
        .collect();
    (text, events)
}

fn finish(events: &[GenEvent]) -> &FinishInfo {
    match events.last() {
        Some(GenEvent::Finished(f)) => f,
        other => panic!("the stream must end with Finished, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_runs_and_stop_strings_cut() {
    let b = backend();
    let request = |stop: Vec<String>| CompletionGenRequest {
        request_id: "cmpl-test".into(),
        prompt: PromptInput::Text("Once upon a time".into()),
        sampling: SamplingOptions {
            temperature: Some(0.0),
            max_tokens: Some(24),
            logprobs: Some(2),
            stop,
            ..Default::default()
        },
        echo: true,
        constraint: None,
        constraint_param: String::new(),
    };
    let g = b.complete(request(vec![])).await.unwrap();
    assert_eq!(g.prompt_text.as_deref(), Some("Once upon a time"));
    let (text, events) = run_to_end(g).await;
    let f = finish(&events);
    assert!(f.completion_tokens >= 1 && f.completion_tokens <= 24);
    let logprobs: usize = events
        .iter()
        .map(|e| match e {
            GenEvent::Logprobs(l) => l.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(logprobs, f.completion_tokens as usize);

    // Greedy is deterministic: stopping on a piece of the text ends right before it.
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 6 {
        let stop: String = chars[3..6].iter().collect();
        let cut = text.find(&stop).unwrap();
        let (again, events) =
            run_to_end(b.complete(request(vec![stop.clone()])).await.unwrap()).await;
        assert_eq!(again, text[..cut]);
        assert_eq!(finish(&events).reason, FinishReason::StopSequence(stop));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_finishes_and_reports_usage_and_cache_hits() {
    let b = backend();
    // A shared prefix with different questions: the second request leaves a checkpoint at the
    // branch point, which the third restores from.
    let prefix = "tell me about the weather in Paris and Tokyo ".repeat(8);
    let mut finishes = Vec::new();
    for question in ["first?", "second?", "third?"] {
        let text = format!("{prefix}{question}");
        let (_, events) = run_to_end(b.chat(chat_request(&text, 8)).await.unwrap()).await;
        finishes.push(finish(&events).clone());
    }
    assert!(finishes[0].prompt_tokens > 32);
    assert!(matches!(
        finishes[0].reason,
        FinishReason::Length | FinishReason::Stop
    ));
    assert_eq!(finishes[0].cached_tokens, 0);
    assert!(finishes[2].cached_tokens > 0, "{finishes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_generation_frees_its_memory() {
    let b = backend();
    let mut g = b
        .complete(CompletionGenRequest {
            request_id: "cmpl-drop".into(),
            prompt: PromptInput::Tokens(vec![10, 11, 12, 13]),
            sampling: SamplingOptions {
                temperature: Some(0.0),
                max_tokens: Some(400),
                ignore_eos: true,
                ..Default::default()
            },
            echo: false,
            constraint: None,
            constraint_param: String::new(),
        })
        .await
        .unwrap();
    let mut seen = 0;
    while seen < 3 {
        if let Some(GenEvent::Content(_)) = g.events.next().await {
            seen += 1;
        }
    }
    assert_eq!(b.metrics().running, 1);
    drop(g);
    let requests_bytes = |m: &BackendMetrics| {
        m.pool
            .iter()
            .find(|p| p.kind == "requests")
            .unwrap()
            .used_bytes
    };
    for _ in 0..200 {
        let m = b.metrics();
        if m.running == 0 && requests_bytes(&m) == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the dropped request still holds memory: {:?}", b.metrics());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_the_right_kind() {
    let b = backend();
    let long = "word ".repeat(MAX_LEN * 2);
    assert!(matches!(
        b.chat(chat_request(&long, 8)).await.unwrap_err(),
        BackendError::ContextLengthExceeded(_)
    ));
    assert!(matches!(
        b.chat(chat_request("hi", MAX_LEN as u32))
            .await
            .unwrap_err(),
        BackendError::ContextLengthExceeded(_)
    ));
    let mut bad_effort = chat_request("hi", 4);
    bad_effort
        .template_kwargs
        .insert("thinking_effort".into(), json!("extreme"));
    assert!(matches!(
        b.chat(bad_effort).await.unwrap_err(),
        BackendError::Template(_)
    ));
    let bad_token = CompletionGenRequest {
        request_id: "x".into(),
        prompt: PromptInput::Tokens(vec![VOCAB as u32 + 5]),
        sampling: SamplingOptions::default(),
        echo: false,
        constraint: None,
        constraint_param: String::new(),
    };
    assert!(matches!(
        b.complete(bad_token).await.unwrap_err(),
        BackendError::InvalidRequest { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_admin_maps_errors() {
    let b = backend();
    let stages: Vec<String> = b.list_plugins().into_iter().map(|s| s.stage).collect();
    for stage in ["chat-template", "reasoning-parser", "tool-parser"] {
        assert!(stages.iter().any(|s| s == stage), "{stages:?}");
    }
    assert!(matches!(
        b.load_plugin("tool-parser".into(), Bytes::from_static(b"nope"))
            .await
            .unwrap_err(),
        BackendError::PluginRejected(_)
    ));
    assert!(matches!(
        b.load_plugin("nonsense".into(), Bytes::from_static(b"\0asm"))
            .await
            .unwrap_err(),
        BackendError::NotFound(_)
    ));
    assert!(b.health().is_ok());
}

fn constrained_completion(
    constraint: OutputConstraint,
    param: &str,
    max_tokens: u32,
) -> CompletionGenRequest {
    CompletionGenRequest {
        request_id: "cmpl-constrained".into(),
        prompt: PromptInput::Text("Contact:".into()),
        sampling: SamplingOptions {
            temperature: Some(0.0),
            max_tokens: Some(max_tokens),
            ..Default::default()
        },
        echo: false,
        constraint: Some(constraint),
        constraint_param: param.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_completions_match_their_constraint() {
    let b = backend();
    // The toy model's choices are pseudo-random: only the grammar makes these hold.
    let rx = OutputConstraint::Regex(r"[a-z]{3,6}@example\.(com|org)".into());
    let g = b
        .complete(constrained_completion(rx, "guided_regex", 40))
        .await
        .unwrap();
    let (text, events) = run_to_end(g).await;
    let (user, domain) = text.split_once("@example.").expect(&text);
    assert!((3..=6).contains(&user.len()) && user.bytes().all(|c| c.is_ascii_lowercase()));
    assert!(["com", "org"].contains(&domain), "{text}");
    assert_eq!(finish(&events).reason, FinishReason::Stop);

    let choice = OutputConstraint::Choice(vec!["red".into(), "green".into()]);
    let (text, _) = run_to_end(
        b.complete(constrained_completion(choice, "guided_choice", 10))
            .await
            .unwrap(),
    )
    .await;
    assert!(["red", "green"].contains(&text.as_str()), "{text}");

    let bad = OutputConstraint::Regex("(unclosed".into());
    let e = b
        .complete(constrained_completion(bad, "guided_regex", 5))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, BackendError::InvalidRequest { param: Some(p), .. } if p == "guided_regex"),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_content_follows_a_json_schema() {
    let b = backend();
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let mut req = chat_request("Who are you?", 60);
    req.thinking = false;
    req.template_kwargs
        .insert("thinking".into(), Value::Bool(false));
    req.constraint = Some(OutputConstraint::JsonSchema {
        schema,
        strict: true,
    });
    req.constraint_param = "response_format".into();
    let (content, events) = run_to_end(b.chat(req).await.unwrap()).await;
    let v: Value = serde_json::from_str(&content).expect(&content);
    assert!(v["name"].is_string() && v["age"].is_i64(), "{v}");
    assert_eq!(finish(&events).reason, FinishReason::Stop, "{content}");
}

/// The default K3 tool parser exports its output grammar; the frontend passes the request
/// through and maps the parser's refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_grammar_comes_from_the_tool_parser() {
    let b = backend();
    let tools = vec![json!({"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}})];
    let required = b
        .output_grammar(&tools, &ToolChoice::Required, true, None)
        .unwrap()
        .expect("required needs a grammar");
    assert_eq!(required.trigger, None);
    assert!(
        required.lark.contains("call tool=\\\"get_weather\\\""),
        "{}",
        required.lark
    );
    assert!(
        required.lark.contains("<|close|> \"think\" <|sep|>"),
        "{}",
        required.lark
    );
    let named = b
        .output_grammar(
            &tools,
            &ToolChoice::Function("get_weather".into()),
            false,
            None,
        )
        .unwrap()
        .unwrap();
    assert!(!named.lark.contains("\"think\""), "{}", named.lark);
    // `auto` without strict tools and without a content constraint: nothing to constrain.
    assert_eq!(
        b.output_grammar(&tools, &ToolChoice::Auto, true, None),
        Ok(None)
    );
    let strict = vec![json!({"type": "function", "function": {
        "name": "f", "strict": true, "parameters": {"type": "object"}}})];
    let auto = b
        .output_grammar(&strict, &ToolChoice::Auto, true, None)
        .unwrap()
        .unwrap();
    assert_eq!(auto.trigger.as_deref(), Some("<|open|>tools<|sep|>"));
    let content = b
        .output_grammar(
            &[],
            &ToolChoice::None,
            true,
            Some("%json {\"type\": \"object\"}"),
        )
        .unwrap()
        .unwrap();
    assert!(content.lark.contains("content: %json"), "{}", content.lark);
    // A named function that is not a tool is the client's mistake: a 400 on `tools`.
    let unknown = b
        .output_grammar(&tools, &ToolChoice::Function("nope".into()), true, None)
        .unwrap_err();
    assert!(
        matches!(unknown, FrontendError::InvalidRequest(_)),
        "{unknown:?}"
    );
    assert!(matches!(
        BackendError::from(unknown),
        BackendError::InvalidRequest { .. }
    ));
}

#[test]
fn a_parser_without_output_grammar_is_a_distinct_not_supported_error() {
    let e = FrontendError::from(k3_plugin_host::PluginError::NoOutputGrammar {
        plugin: "kimi-k2-tools@0.1.0".into(),
    });
    assert!(matches!(&e, FrontendError::NoOutputGrammar { .. }));
    assert!(e.to_string().contains("kimi-k2-tools@0.1.0"), "{e}");
    match BackendError::from(e) {
        BackendError::NotSupported { message, param } => {
            assert!(message.contains("no output grammar"), "{message}");
            assert_eq!(param.as_deref(), Some("tool_choice"));
        }
        other => panic!("{other:?}"),
    }
}

/// `n` choices share one rendering of the prompt (the template runs once) and each runs to the
/// end with its own id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_render_the_prompt_once() {
    let b = backend_with_own_plugins();
    let renders = template_renders;
    let before = renders(&b);
    let mut request = chat_request("Count to three.", 8);
    request.sampling.temperature = Some(1.0);
    request.sampling.seed = Some(7);
    let gens = b.chat_n(request, 4).await.unwrap();
    assert_eq!(gens.len(), 4);
    assert_eq!(renders(&b), before + 1, "one render for four choices");
    for g in gens {
        let (_, events) = run_to_end(g).await;
        assert!(finish(&events).completion_tokens >= 1);
    }
}
