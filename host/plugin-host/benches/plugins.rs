//! Plugin costs (docs/performance.md, "## Plugins"):
//!   cargo bench -p k3-plugin-host --bench plugins
//! - per-delta cost of the K3 tool and reasoning parsers through wasm vs the same parser
//!   compiled natively (each iteration = one whole output fed in 4-char deltas, then finish);
//! - stream instantiation (store + instance + parser resource);
//! - a warm chat-template render of a k3-mini conversation.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use k3_plugin_host::*;
use k3_plugin_sdk::StreamingParser;
use kimi_k3_format::{K3ReasoningParser, K3ToolParser};

fn output() -> String {
    let reasoning = "The user wants the weather in two cities, so I will call the tool twice and then summarise. ".repeat(3);
    let content = "Let me look that up for you — one moment, checking both cities now. ".repeat(3);
    format!(
        "{reasoning}<|close|>think<|sep|><|open|>response<|sep|>{content}<|close|>response<|sep|><|open|>tools<|sep|>\
<|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Zürich<|close|>argument<|sep|>\
<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>\
<|open|>call tool=\"get_weather\" index=\"2\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
}

fn deltas(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(4).map(|c| c.iter().collect()).collect()
}

fn host() -> PluginHost {
    let cache = std::env::temp_dir().join("k3-plugin-bench-cache");
    let host =
        PluginHost::new(PluginHostConfig::default().with_cache_dir(cache)).expect("plugin host");
    host.load_default_plugins()
        .expect("default plugins (run scripts/build-plugins)");
    host
}

fn parsers(c: &mut Criterion) {
    let host = host();
    let text = output();
    let deltas = deltas(&text);
    let mut g = c.benchmark_group("parser_per_delta");
    g.throughput(Throughput::Elements(deltas.len() as u64));
    g.bench_function("tool/wasm", |b| {
        b.iter_batched(
            || host.tool_stream(&ToolOptions::default()).unwrap(),
            |mut s| {
                for d in &deltas {
                    black_box(s.feed(d).unwrap());
                }
                black_box(s.finish().unwrap());
                s
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("tool/native", |b| {
        b.iter_batched(
            || K3ToolParser::new(&k3_plugin_sdk::ToolOptions::default()),
            |mut p| {
                for d in &deltas {
                    black_box(p.feed(d).unwrap());
                }
                black_box(p.finish().unwrap());
                p
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("reasoning/wasm", |b| {
        b.iter_batched(
            || host.reasoning_stream(&ReasoningOptions::default()).unwrap(),
            |mut s| {
                for d in &deltas {
                    black_box(s.feed(d).unwrap());
                }
                black_box(s.finish().unwrap());
                s
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("reasoning/native", |b| {
        b.iter_batched(
            || K3ReasoningParser::new(&k3_plugin_sdk::ReasoningOptions::default()),
            |mut p| {
                for d in &deltas {
                    black_box(p.feed(d).unwrap());
                }
                black_box(p.finish().unwrap());
                p
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();

    let mut g = c.benchmark_group("stream_instantiate");
    g.bench_function("tool", |b| {
        b.iter(|| black_box(host.tool_stream(&ToolOptions::default()).unwrap()))
    });
    g.bench_function("reasoning", |b| {
        b.iter(|| black_box(host.reasoning_stream(&ReasoningOptions::default()).unwrap()))
    });
    g.finish();

    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/k3-mini/tokenizer_config.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let template = config["chat_template"].as_str().unwrap().to_string();
    let messages = r#"[{"role":"system","content":"You are terse."},{"role":"user","content":"Weather in Paris?"},
        {"role":"assistant","reasoning_content":"Call the tool.","content":"","tool_calls":[{"id":"c1","function":{"name":"get_weather","arguments":{"city":"Paris","days":2}}}]},
        {"role":"tool","tool_call_id":"c1","content":"21C"},{"role":"user","content":"Thanks"}]"#;
    let tools = r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}}}}}]"#;
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..RenderOptions::default()
    };
    let templates = host.chat_template();
    let mut g = c.benchmark_group("chat_template");
    g.bench_function("render_warm/k3-mini", |b| {
        b.iter(|| {
            black_box(
                templates
                    .render(&template, messages, Some(tools), &opts)
                    .unwrap(),
            )
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2)).sample_size(20);
    targets = parsers
}
criterion_main!(benches);
