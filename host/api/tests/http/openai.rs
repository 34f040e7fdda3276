//! OpenAI chat and text completions: streaming and not, tools, sampling options, bad input.

use super::*;

#[tokio::test]
async fn chat_non_streaming_with_and_without_thinking() {
    let h = harness();
    let (status, body) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("hi")]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "chat.completion");
    let msg = &body["choices"][0]["message"];
    assert_eq!(msg["content"], "echo: hi");
    assert_eq!(msg["reasoning_content"], "Let me think.");
    assert_eq!(msg["reasoning"], "Let me think.");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["completion_tokens"], 10);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let (_, body) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "models/k3-mini", "messages": [user("hi")], "reasoning_effort": "none"}),
        )
        .await;
    let msg = &body["choices"][0]["message"];
    assert!(msg.get("reasoning_content").is_none(), "{msg}");
    let last = h.fake.last_chat.lock().unwrap().clone().unwrap();
    assert_eq!(last.template_kwargs["thinking"], false);

    // A repeated prompt is served (partly) from the cache.
    let long = json!({"model": "k3-mini", "messages": [user("a longer prompt to cache")]});
    let (_, body) = h.post("/v1/chat/completions", long.clone()).await;
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, body) = h.post("/v1/chat/completions", long).await;
    assert!(body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
}

#[tokio::test]
async fn chat_streaming_chunks_follow_the_openai_shape() {
    let h = harness();
    let chunks = h
        .stream(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("yo")], "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let first = &chunks[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut finish = None;
    for c in &chunks[1..chunks.len() - 2] {
        let d = &c["choices"][0]["delta"];
        if let Some(r) = d["reasoning_content"].as_str() {
            assert_eq!(d["reasoning"], d["reasoning_content"]);
            reasoning.push_str(r);
        }
        content.push_str(d["content"].as_str().unwrap_or(""));
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        assert!(c["usage"].is_null());
    }
    assert_eq!(reasoning, "Let me think.");
    assert_eq!(content, "echo: yo");
    assert_eq!(finish.as_deref(), Some("stop"));
    let usage_chunk = &chunks[chunks.len() - 2];
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 10);
}

#[tokio::test]
async fn tool_calls_non_streaming_and_streaming() {
    let h = harness();
    let body = json!({"model": "k3-mini", "messages": [user("weather in two cities")],
        "tools": weather_tools()});
    let (status, resp) = h.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK);
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert!(choice["message"]["content"].is_null());
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    let mut single = body.clone();
    single["parallel_tool_calls"] = json!(false);
    let (_, resp) = h.post("/v1/chat/completions", single).await;
    assert_eq!(
        resp["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let chunks = h.stream("/v1/chat/completions", streaming).await;
    let mut calls: HashMap<u64, (String, String, String)> = HashMap::new();
    let mut finish = None;
    for c in chunks.iter().filter(|c| c.is_object()) {
        for tc in c["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let entry = calls.entry(tc["index"].as_u64().unwrap()).or_default();
            if let Some(id) = tc["id"].as_str() {
                assert!(entry.0.is_empty(), "id sent twice");
                entry.0 = id.to_string();
                entry.1 = tc["function"]["name"].as_str().unwrap().to_string();
            } else {
                assert!(tc["function"].get("name").is_none(), "name sent twice");
            }
            entry.2 += tc["function"]["arguments"].as_str().unwrap_or("");
        }
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[&1].0, "call_1");
    assert_eq!(calls[&1].2, "{\"city\": \"Paris\"}");

    // A call cut short by max_tokens: streamed as far as it came, so non-streaming returns it
    // too, identically; the finish reason is `length`, not `tool_calls`.
    let mut cut = body.clone();
    cut["messages"] = json!([user("weather, but cut")]);
    let (_, resp) = h.post("/v1/chat/completions", cut.clone()).await;
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{resp}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{resp}");
    assert_eq!(calls[0]["id"], "call_0");
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Par\"}");
    cut["stream"] = json!(true);
    let chunks = h.stream("/v1/chat/completions", cut).await;
    let streamed: String = chunks
        .iter()
        .filter(|c| c.is_object())
        .flat_map(|c| {
            c["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|tc| {
            tc["function"]["arguments"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(
        streamed,
        calls[0]["function"]["arguments"].as_str().unwrap()
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_string())
        .collect();
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");

    // tool_choice none: the model is told not to call tools and none are returned.
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    let (_, resp) = h.post("/v1/chat/completions", none).await;
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn n_choices_stop_strings_length_and_logprobs() {
    let h = harness();
    let (_, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("abc")], "n": 3, "seed": 5}),
        )
        .await;
    let choices = resp["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "echo: abc");
    }
    // 2 reasoning events + 9 content characters per choice.
    assert_eq!(resp["usage"]["completion_tokens"], 33);

    let chunks = h
        .stream(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("abc")], "n": 2, "stream": true}),
        )
        .await;
    let finishes: Vec<u64> = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_string())
        .map(|c| c["choices"][0]["index"].as_u64().unwrap())
        .collect();
    assert_eq!(finishes.len(), 2);

    let (_, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("abcdef")], "stop": ["cd"],
                   "reasoning_effort": "none"}),
        )
        .await;
    assert_eq!(resp["choices"][0]["message"]["content"], "echo: ab");
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");

    let (_, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("abcdef")], "max_tokens": 4,
                   "reasoning_effort": "none"}),
        )
        .await;
    assert_eq!(resp["choices"][0]["message"]["content"], "echo");
    assert_eq!(resp["choices"][0]["finish_reason"], "length");

    let (_, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("ab")], "logprobs": true,
                   "top_logprobs": 2, "reasoning_effort": "none"}),
        )
        .await;
    let lp = resp["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(lp.len(), 8);
    assert_eq!(lp[0]["token"], "e");
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn bad_input_gets_the_right_status_and_names_the_problem() {
    let h = harness();
    let (status, body) = h.post_raw("/v1/chat/completions", "{\"model\": ").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "invalid_json");

    let cases = [
        (
            json!({"model": "k3-mini", "messages": [user("x")], "temperature": "hot"}),
            "temperature",
        ),
        (json!({"model": "k3-mini", "messages": []}), "messages"),
        (json!({"model": "k3-mini"}), "messages"),
        (
            json!({"model": "k3-mini", "messages": [user("x")], "tools": [{"type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]}),
            "tools[0].function.parameters.properties.a.type",
        ),
        (
            json!({"model": "k3-mini", "messages": [user("x"), {"role": "tool", "tool_call_id": "nope", "content": "1"}]}),
            "messages[1].tool_call_id",
        ),
        (
            json!({"model": "k3-mini", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}),
            "messages[0].content[0].text",
        ),
    ];
    for (body, param) in cases {
        let (status, resp) = h.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {resp}");
        assert_eq!(resp["error"]["param"], param, "{resp}");
        assert!(
            resp["error"]["message"].as_str().unwrap().contains(param),
            "{resp}"
        );
    }

    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "gpt-9", "messages": [user("x")]}),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(resp["error"]["code"], "model_not_found");

    let long = "word ".repeat(200);
    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user(&long)]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(resp["error"]["code"], "context_length_exceeded");

    let (status, _) = h
        .post_raw(
            "/v1/chat/completions",
            format!(
                "{{\"model\":\"k3-mini\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
                "a".repeat(5000)
            ),
        )
        .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);

    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("TEMPLATE_ERROR")]}),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(resp["error"]["type"], "template_error");

    let (status, resp) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("OVERLOAD")]}),
        )
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(resp["error"]["type"], "rate_limit_error");

    let (status, body) = h.get("/v2/nothing").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["type"], "not_found_error");

    let (status, _) = h.get("/v1/chat/completions").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    // Still serving.
    let (status, _) = h
        .post(
            "/v1/chat/completions",
            json!({"model": "k3-mini", "messages": [user("ok")]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn completions_text_tokens_echo_and_stream() {
    let h = harness();
    let (status, resp) = h
        .post(
            "/v1/completions",
            json!({"model": "k3-mini", "prompt": "Once", "echo": true, "logprobs": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["object"], "text_completion");
    assert_eq!(resp["choices"][0]["text"], "Once and so on");
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    let lp = &resp["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 10);
    assert_eq!(lp["text_offset"][0], 4);

    let (_, resp) = h
        .post(
            "/v1/completions",
            json!({"model": "k3-mini", "prompt": [[1, 2], [3]], "max_tokens": 50}),
        )
        .await;
    assert_eq!(resp["choices"].as_array().unwrap().len(), 2);
    assert_eq!(resp["choices"][1]["text"], " and so on");
    assert_eq!(resp["choices"][1]["finish_reason"], "stop");

    let chunks = h
        .stream(
            "/v1/completions",
            json!({"model": "k3-mini", "prompt": "Hi", "stream": true, "max_tokens": 3}),
        )
        .await;
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, " an");
    assert_eq!(chunks.last().unwrap(), "[DONE]");

    let (status, resp) = h
        .post(
            "/v1/completions",
            json!({"model": "k3-mini", "prompt": [1, -1]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(resp["error"]["param"], "prompt[1]");
}
