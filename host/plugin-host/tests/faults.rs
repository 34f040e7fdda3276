//! Faults stay calls: a plugin that reaches for a denied interface, blocks, hits a limit or
//! finds the engine full ends that one call with a typed error, from any calling context the
//! server uses (a tokio worker, a current-thread runtime, `block_in_place`), never by panicking
//! the host; capacity refusals are not held against the plugin; template instances that grew
//! do not stay resident.

use std::time::Duration;

use k3_plugin_host::*;

fn config() -> PluginHostConfig {
    PluginHostConfig {
        max_instances: 16,
        ..PluginHostConfig::default()
    }
    .with_cache_dir(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("k3-plugin-cache"))
}

fn wasm(file: &str) -> Vec<u8> {
    let path = default_plugin_dir().join(file);
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} — run scripts/build-plugins", path.display()))
}

fn stats(host: &PluginHost, id: u64) -> VersionStats {
    host.list().into_iter().find(|v| v.id == id).unwrap().stats
}

fn content(events: &[ParseEvent]) -> String {
    events
        .iter()
        .map(|e| match e {
            ParseEvent::Content { text } => text.as_str(),
            other => panic!("unexpected event {other:?}"),
        })
        .collect()
}

/// Every denial of `testdata-denied-socket`, run wherever the caller runs it: each fails only
/// its call with a typed fault, counted for the version; the next stream works.
fn denied_interfaces_fail_only_their_call() {
    let host = PluginHost::new(config()).unwrap();
    let version = host
        .install(Stage::ToolParser, &wasm("testdata_denied_socket.wasm"))
        .unwrap();
    let mut s = host.tool_stream(&ToolOptions::default()).unwrap();

    // The sandbox answers the attempts with WASI error codes; nothing gets through.
    let probe = content(&s.feed("PROBE_SANDBOX").unwrap());
    assert!(probe.starts_with("tcp="), "{probe}");
    for reached in ["CONNECTED", "RESOLVED", "OPENED"] {
        assert!(!probe.contains(reached), "the sandbox let through: {probe}");
    }
    // Printing (how a panicking guest reports) works on any thread.
    assert_eq!(content(&s.feed("PRINT").unwrap()), "printed");
    s.finish().unwrap();

    // A naive plugin `expect`s its socket / lookup / file and so traps: only that call fails.
    for (word, says) in [
        ("OPEN_SOCKET", "connect to the discard port"),
        ("RESOLVE_NAME", "resolve a name"),
        ("OPEN_FILE", "open a host file"),
    ] {
        let mut s = host.tool_stream(&ToolOptions::default()).unwrap();
        assert_eq!(content(&s.feed("before").unwrap()), "before");
        let err = s.feed(&format!("then {word}")).unwrap_err();
        assert!(
            matches!(&err, PluginError::Trap { detail, .. } if detail.contains(says)),
            "{word}: {err}"
        );
        assert!(err.is_fault() && !err.is_capacity() && !err.is_resource_limit());
        assert!(matches!(
            s.feed("more"),
            Err(PluginError::StreamClosed(Stage::ToolParser))
        ));
    }
    // Waiting is refused outright (plugins have no time source to wait on).
    let mut s = host.tool_stream(&ToolOptions::default()).unwrap();
    let err = s.feed("SLEEP").unwrap_err();
    assert!(
        matches!(&err, PluginError::Denied { detail, .. } if detail.contains("would block")),
        "{err}"
    );
    assert_eq!(err.kind(), "denied");

    let st = stats(&host, version.id);
    assert_eq!(st.faults, 4, "{st:?}");
    // The same version keeps serving.
    let mut s = host.tool_stream(&ToolOptions::default()).unwrap();
    assert_eq!(content(&s.feed("still fine").unwrap()), "still fine");
    s.finish().unwrap();
    assert_eq!(stats(&host, version.id).faults, 4);
}

/// On a worker thread of the server's kind of runtime (a spawned task: the frontend feeds
/// parsers from async tasks), and in the test's own `block_on` context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_interfaces_fail_the_call_on_a_tokio_worker() {
    tokio::spawn(async { denied_interfaces_fail_only_their_call() })
        .await
        .expect("the host task must not panic");
    denied_interfaces_fail_only_their_call();
}

#[tokio::test]
async fn denied_interfaces_fail_the_call_on_a_current_thread_runtime() {
    denied_interfaces_fail_only_their_call();
}

/// Templates run inside `block_in_place`; there `block_on` is allowed, but the result must be
/// the same typed errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_interfaces_fail_the_call_in_block_in_place() {
    tokio::spawn(async { tokio::task::block_in_place(denied_interfaces_fail_only_their_call) })
        .await
        .expect("the host task must not panic");
}

#[test]
fn denied_interfaces_fail_the_call_without_a_runtime() {
    denied_interfaces_fail_only_their_call();
}

fn assert_capacity(r: Result<impl Sized, PluginError>) -> PluginError {
    let Err(e) = r else {
        panic!("expected a capacity error")
    };
    assert!(
        e.is_capacity() && !e.is_fault() && !e.is_resource_limit(),
        "{e}"
    );
    assert!(e.to_string().contains("retry later"), "{e}");
    e
}

#[test]
fn a_full_instance_pool_is_capacity_not_a_plugin_fault() {
    let host = PluginHost::new(PluginHostConfig {
        max_instances: 2,
        ..config()
    })
    .unwrap();
    if !host.uses_pooling_allocator() {
        eprintln!("no pooling allocator here: no instance limit to test");
        return;
    }
    let tools = host
        .install(Stage::ToolParser, &wasm("kimi_k3_tools.wasm"))
        .unwrap();
    let opts = ToolOptions::default();
    let mut first = host.tool_stream(&opts).unwrap();
    let _second = host.tool_stream(&opts).unwrap();
    assert_eq!(host.instances_in_use(), Some(2));
    assert_capacity(host.tool_stream(&opts));
    assert_capacity(host.parse_tools(&opts, "hi"));
    assert_eq!(host.capacity_refusals(), 2);
    let st = stats(&host, tools.id);
    assert_eq!((st.errors, st.faults), (0, 0), "{st:?}");

    // The streams that did start are untouched; ending one frees its slot.
    assert_eq!(first.feed("hello").unwrap().len(), 1);
    first.finish().unwrap();
    drop(first);
    let mut third = host.tool_stream(&opts).unwrap();
    third.feed("works").unwrap();
    third.finish().unwrap();
    let st = stats(&host, tools.id);
    assert_eq!((st.errors, st.faults), (0, 0), "{st:?}");
}

#[test]
fn warm_templates_yield_their_slots_and_renders_report_capacity() {
    // Three slots: enough for the default plugins' load-time checks (a stream and a one-shot
    // parse at once), one of them then held by the warm template instance.
    let host = PluginHost::new(PluginHostConfig {
        max_instances: 3,
        ..config()
    })
    .unwrap();
    if !host.uses_pooling_allocator() {
        return;
    }
    host.load_default_plugins().unwrap();
    assert_eq!(host.instances_in_use(), Some(1), "the warm template");
    let templates = host.chat_template();
    let render = || {
        templates.render(
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            r#"[{"role":"user","content":"hi"}]"#,
            None,
            &RenderOptions::default(),
        )
    };
    let _r = host.reasoning_stream(&ReasoningOptions::default()).unwrap();
    let _t1 = host.tool_stream(&ToolOptions::default()).unwrap();
    // The pool is full, but a warm template is only a cache: it gives its slot up.
    let t2 = host.tool_stream(&ToolOptions::default()).unwrap();
    assert_eq!(host.instances_in_use(), Some(3));
    assert_capacity(host.tool_stream(&ToolOptions::default()));
    assert_capacity(render());
    for v in host.list() {
        assert_eq!((v.stats.errors, v.stats.faults), (0, 0), "{v:?}");
    }
    drop(t2);
    assert_eq!(render().unwrap(), "hi");
}

fn k3_mini_template() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../models/k3-mini/tokenizer_config.json"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    config["chat_template"].as_str().unwrap().to_string()
}

fn one_message(bytes: usize) -> String {
    serde_json::json!([{"role": "user", "content": "x".repeat(bytes)}]).to_string()
}

#[test]
fn a_huge_prompt_hits_the_template_memory_limit_as_a_resource_limit() {
    let host = PluginHost::new(PluginHostConfig {
        memory_limit: 16 << 20,
        template_timeout: Duration::from_secs(10),
        ..config()
    })
    .unwrap();
    let version = host
        .install(Stage::ChatTemplate, &wasm("kimi_k3_template.wasm"))
        .unwrap();
    let template = k3_mini_template();
    let templates = host.chat_template();
    let options = RenderOptions {
        add_generation_prompt: true,
        ..RenderOptions::default()
    };
    let err = templates
        .render(&template, &one_message(8 << 20), None, &options)
        .unwrap_err();
    assert!(
        matches!(err, PluginError::MemoryLimit { limit_bytes, .. } if limit_bytes == 16 << 20),
        "{err}"
    );
    assert!(err.is_resource_limit() && err.is_fault(), "{err}");
    assert_eq!(err.kind(), "memory_limit");
    assert_eq!(stats(&host, version.id).faults, 1);
    // The instance that hit the limit is gone; the next render works.
    let ok = templates
        .render(&template, &one_message(10), None, &options)
        .unwrap();
    assert!(ok.contains("xxxxxxxxxx"), "{ok}");
}

#[test]
fn a_template_instance_that_grew_is_not_kept_warm() {
    let host = PluginHost::new(PluginHostConfig {
        template_keep_memory: 8 << 20,
        ..config()
    })
    .unwrap();
    if !host.uses_pooling_allocator() {
        return;
    }
    host.install(Stage::ChatTemplate, &wasm("kimi_k3_template.wasm"))
        .unwrap();
    let template = k3_mini_template();
    let templates = host.chat_template();
    let options = RenderOptions::default();
    let small = || templates.render(&template, &one_message(10), None, &options);
    small().unwrap();
    assert_eq!(
        host.instances_in_use(),
        Some(1),
        "a small render stays warm"
    );

    // A 6 MB prompt grows the instance well past 8 MiB: it renders, then is dropped, and its
    // slot keeps at most the configured resident prefix, not the grown heap.
    let big = templates
        .render(&template, &one_message(6 << 20), None, &options)
        .unwrap();
    assert!(big.len() > 6 << 20);
    assert_eq!(
        host.instances_in_use(),
        Some(0),
        "the grown instance was dropped"
    );
    let resident = host.idle_memory_resident().unwrap();
    assert!(resident <= 4 << 20, "idle slots keep {resident} bytes");
    small().unwrap();
    assert_eq!(host.instances_in_use(), Some(1));
}

#[test]
fn instances_for_covers_two_streams_per_choice_and_the_template_pools() {
    let cfg = PluginHostConfig::default();
    let pools = 2 * cfg.template_pool_size as u32;
    assert_eq!(cfg.instances_for(0), pools + 64);
    assert_eq!(cfg.instances_for(100), 200 + pools + 64);
    assert_eq!(cfg.instances_for(4096), 8192 + pools + 512);
    assert_eq!(cfg.instances_for(usize::MAX), u32::MAX);
}
