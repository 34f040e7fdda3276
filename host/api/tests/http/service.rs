//! Auth, admin, models, health and metrics, the Anthropic route, disconnects and the
//! concurrency limit.

use super::*;

#[tokio::test]
async fn api_key_is_required_when_configured() {
    let h = harness_with(ApiConfig {
        api_key: Some("sekret".into()),
        ..Default::default()
    });
    let body = json!({"model": "k3-mini", "messages": [user("x")]}).to_string();
    let (status, resp) = h.post_raw("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let resp: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(resp["error"]["type"], "authentication_error");
    let (status, _) = h
        .send(
            Request::post("/v1/chat/completions")
                .header("authorization", "Bearer wrong")
                .body(Body::from(body.clone()))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = h
        .send(
            Request::post("/v1/chat/completions")
                .header("authorization", "Bearer sekret")
                .body(Body::from(body.clone()))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = h
        .send(
            Request::post("/v1/chat/completions")
                .header("x-api-key", "sekret")
                .body(Body::from(body))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(h.get("/health").await.0, StatusCode::OK);
    // No admin token configured: the admin API is off.
    assert_eq!(h.get("/admin/plugins").await.0, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn admin_lists_uploads_and_rolls_back() {
    let h = harness();
    assert_eq!(h.get("/admin/plugins").await.0, StatusCode::UNAUTHORIZED);
    let authed = |req: axum::http::request::Builder| req.header("authorization", "Bearer admintok");
    let (status, body) = h
        .send(
            authed(Request::get("/admin/plugins"))
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["stages"].as_array().unwrap().len(), 3);

    let upload = |bytes: &'static [u8]| {
        authed(Request::put("/admin/plugins/tool-parser"))
            .header("content-type", "application/wasm")
            .body(Body::from(bytes))
            .unwrap()
    };
    let (status, _) = h
        .send(
            Request::put("/admin/plugins/tool-parser")
                .body(Body::from(&b"\0asm"[..]))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, body) = h.send(upload(b"not wasm")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["code"], "plugin_rejected");
    let (status, body) = h.send(upload(b"\0asm\x0d\0\x01\0")).await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["activated"]["id"], "tool-parser@d8");
    let (status, body) = h
        .send(
            authed(Request::post("/admin/plugins/tool-parser/rollback"))
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["activated"]["id"], "tool-parser@builtin");
    let (status, _) = h
        .send(
            authed(Request::post("/admin/plugins/tool-parser/rollback"))
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = h
        .send(
            authed(Request::put("/admin/plugins/nope"))
                .body(Body::from(&b"\0asm"[..]))
                .unwrap(),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn models_health_and_metrics() {
    let h = harness();
    let (status, body) = h.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["data"][0]["id"], "k3-mini");
    assert_eq!(body["data"][0]["max_model_len"], MAX_MODEL_LEN);
    assert_eq!(h.get("/v1/models/k3-mini").await.0, StatusCode::OK);
    assert_eq!(h.get("/v1/models/other").await.0, StatusCode::NOT_FOUND);
    assert_eq!(h.get("/health").await.0, StatusCode::OK);

    h.post(
        "/v1/chat/completions",
        json!({"model": "k3-mini", "messages": [user("m")]}),
    )
    .await;
    h.post("/v1/chat/completions", json!({"model": "k3-mini"}))
        .await;
    let (status, text) = h.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(text.to_vec()).unwrap();
    for needle in [
        "k3serve_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 1",
        "k3serve_http_requests_total{route=\"/v1/chat/completions\",status=\"400\"} 1",
        "k3serve_time_to_first_token_seconds_count 1",
        "k3serve_e2e_request_latency_seconds_count 1",
        "k3serve_request_queue_time_seconds_bucket{le=\"0.001\"} 0",
        "k3serve_request_queue_time_seconds_bucket{le=\"0.005\"} 1",
        "k3serve_request_prefill_time_seconds_bucket{le=\"0.02\"} 0",
        "k3serve_request_prefill_time_seconds_bucket{le=\"0.04\"} 1",
        "k3serve_generation_tokens_total 9",
        "k3serve_prefix_cache_hit_rate 0.4",
        "k3serve_pool_used_bytes{kind=\"kv\"} 0",
        "k3serve_plugin_calls_total{stage=\"tool-parser\",version=\"kimi-k3@builtin\"} 7",
        "k3serve_plugin_instances_in_use 3",
        "k3serve_plugin_capacity_refusals_total 2",
        "k3serve_num_requests_running 0",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[tokio::test]
async fn anthropic_messages_plain_tools_and_streaming() {
    let h = harness();
    let (status, resp) = h
        .post(
            "/v1/messages",
            json!({"model": "k3-mini", "max_tokens": 100, "messages": [user("hey")]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["type"], "message");
    assert_eq!(
        resp["content"],
        json!([{"type": "text", "text": "echo: hey"}])
    );
    assert_eq!(resp["stop_reason"], "end_turn");
    assert_eq!(resp["usage"]["output_tokens"], 9);

    let (_, resp) = h
        .post(
            "/v1/messages",
            json!({"model": "k3-mini", "max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 50},
                "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                "messages": [user("weather?")]}),
        )
        .await;
    assert_eq!(resp["stop_reason"], "tool_use");
    assert_eq!(resp["content"][0]["type"], "thinking");
    assert_eq!(resp["content"][1]["type"], "tool_use");
    assert_eq!(resp["content"][1]["input"], json!({"city": "Paris"}));
    // cut by max_tokens: the partial tool_use is returned as streamed, stop_reason max_tokens
    let (_, resp) = h
        .post(
            "/v1/messages",
            json!({"model": "k3-mini", "max_tokens": 100,
                "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                "messages": [user("weather, cut")]}),
        )
        .await;
    assert_eq!(resp["stop_reason"], "max_tokens", "{resp}");
    assert_eq!(resp["content"][0]["type"], "tool_use");
    assert_eq!(resp["content"][0]["input"], json!({"city": "Par"}));

    let (status, bytes) = h
        .post_raw(
            "/v1/messages",
            json!({"model": "k3-mini", "max_tokens": 100, "stream": true, "stop_sequences": ["o"],
                   "thinking": {"type": "enabled", "budget_tokens": 50}, "messages": [user("hello")]})
            .to_string(),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(events[0], "message_start");
    assert_eq!(events[1], "content_block_start");
    assert_eq!(*events.last().unwrap(), "message_stop");
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == "content_block_start")
            .count(),
        2
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == "content_block_stop")
            .count(),
        2
    );
    let data = sse_data(&bytes);
    let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence");
    assert_eq!(delta["delta"]["stop_sequence"], "o");

    let (status, resp) = h
        .post(
            "/v1/messages",
            json!({"model": "k3-mini", "messages": [user("x")]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(resp["type"], "error");
    assert_eq!(resp["error"]["type"], "invalid_request_error");
    assert!(
        resp["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens")
    );
}

#[tokio::test]
async fn a_client_that_disconnects_aborts_its_generation() {
    let h = harness();
    let resp = h
        .app
        .clone()
        .oneshot(
            Request::post("/v1/chat/completions")
                .body(Body::from(
                    json!({"model": "k3-mini", "messages": [user("slow please")], "stream": true})
                        .to_string(),
                ))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    for _ in 0..3 {
        body.next().await.unwrap().unwrap();
    }
    assert_eq!(h.fake.counters.live.load(Ordering::SeqCst), 1);
    drop(body);
    for _ in 0..100 {
        if h.fake.counters.live.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.fake.counters.live.load(Ordering::SeqCst), 0);
    assert_eq!(h.fake.counters.cancelled.load(Ordering::SeqCst), 1);
    let (_, text) = h.get("/metrics").await;
    assert!(String::from_utf8_lossy(&text).contains("k3serve_client_disconnects_total 1"));
}

#[tokio::test]
async fn requests_past_the_concurrency_limit_get_429() {
    let h = harness_with(ApiConfig {
        max_concurrent_requests: 2,
        ..Default::default()
    });
    // More generations than the server ever runs at once can never succeed: a 400.
    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("x")], "n": 3}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{resp}");
    assert_eq!(resp["error"]["param"], "n");
    let resp = h
        .app
        .clone()
        .oneshot(
            Request::post("/v1/completions")
                .body(Body::from(
                    json!({"model": "k3-mini", "prompt": "slow", "stream": true}).to_string(),
                ))
                .unwrap(),
        )
        .await
        .unwrap();
    let mut held = resp.into_body().into_data_stream();
    held.next().await.unwrap().unwrap();
    // One slot is taken; two choices do not fit now but will later: a 429 with Retry-After.
    let full = h
        .app
        .clone()
        .oneshot(
            Request::post("/v1/chat/completions")
                .body(Body::from(
                    json!({"model": "k3-mini", "messages": [user("x")], "n": 2}).to_string(),
                ))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(full.headers()["retry-after"], "1");
    let body = axum::body::to_bytes(full.into_body(), 1 << 20)
        .await
        .unwrap();
    let resp: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(resp["error"]["code"], "too_many_requests");
    drop(held);
    let mut status = StatusCode::TOO_MANY_REQUESTS;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        status = h
            .post(
                "/v1/chat/completions",
                json!({"model": "k3-mini", "messages": [user("x")], "n": 2}),
            )
            .await
            .0;
        if status == StatusCode::OK {
            break;
        }
    }
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_non_streaming_client_that_goes_away_aborts_too() {
    let h = harness();
    let req = Request::post("/v1/chat/completions")
        .body(Body::from(
            json!({"model": "k3-mini", "messages": [user("slow and quiet")]}).to_string(),
        ))
        .unwrap();
    // Hyper drops the handler's future when the connection closes; a timeout does the same here.
    let gone = tokio::time::timeout(Duration::from_millis(50), h.app.clone().oneshot(req)).await;
    assert!(gone.is_err(), "the slow request cannot have finished");
    assert_eq!(h.fake.counters.live.load(Ordering::SeqCst), 0);
    assert_eq!(h.fake.counters.cancelled.load(Ordering::SeqCst), 1);
    let (_, text) = h.get("/metrics").await;
    assert!(String::from_utf8_lossy(&text).contains("k3serve_client_disconnects_total 1"));
}
