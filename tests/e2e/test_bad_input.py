"""Bad input gets the right status and a message naming the problem; the server keeps serving."""

from __future__ import annotations

import pytest

from conftest import MAX_BODY_BYTES
from helpers import GET_WEATHER, answer_number

USER = {"role": "user", "content": "What is 2 + 2?"}


def chat(http, model, **fields):
    return http.post("/v1/chat/completions", json={"model": model, "messages": [USER], **fields})


def expect(resp, status, param=None, code=None, type_=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if type_ is not None:
        assert err["type"] == type_, err
    return err


def test_malformed_json(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "k3-mini", "messages": [',
                  headers={"Content-Type": "application/json"})
    expect(r, 400, code="invalid_json", type_="invalid_request_error")
    r = http.post("/v1/chat/completions", content=b"[1, 2]")
    expect(r, 400, code="invalid_json")


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 7}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": [1, 2]}, "stop[0]"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
        ({"messages": "hello"}, "messages"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters.type",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "text"}}}}}]},
            "tools[0].function.parameters.properties.a.type",
        ),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        (
            {"messages": [USER, {"role": "tool", "tool_call_id": "call_missing", "content": "1"}]},
            "messages[1].tool_call_id",
        ),
        (
            {"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "not json"}}]}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
    ],
)
def test_invalid_parameters_are_named(http, model_name, fields, param):
    messages = fields.pop("messages", [USER])
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": messages, **fields})
    expect(r, 400, param=param, type_="invalid_request_error")


def test_missing_model_field_and_unknown_model(http, model_name):
    r = http.post("/v1/chat/completions", json={"messages": [USER]})
    expect(r, 400, param="model", code="missing_field")
    r = http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": [USER]})
    expect(r, 404, param="model", code="model_not_found", type_="not_found_error")


def test_unknown_route_and_method(http):
    expect(http.get("/v1/nothing-here"), 404, type_="not_found_error")
    assert http.get("/v1/chat/completions").status_code == 405


def test_not_supported_yet_is_a_clear_400(http, model_name):
    err = expect(chat(http, model_name, structured_outputs={"structural_tag": {"triggers": []}}), 400,
                 code="not_supported")
    assert "structural_tag" in err["message"]


def test_oversized_prompt_and_body(http, model_name):
    long_text = "apple banana cherry " * 3000  # far past the 4096-token context
    r = http.post("/v1/chat/completions",
                  json={"model": model_name, "messages": [{"role": "user", "content": long_text}]})
    err = expect(r, 400, code="context_length_exceeded")
    assert "context length" in err["message"]
    r = chat(http, model_name, max_tokens=1_000_000)
    expect(r, 400, code="context_length_exceeded")
    huge = "x" * (MAX_BODY_BYTES + 1)
    r = http.post("/v1/chat/completions",
                  json={"model": model_name, "messages": [{"role": "user", "content": huge}]})
    expect(r, 413, type_="request_too_large")


def test_template_error_is_422(http, model_name):
    r = chat(http, model_name, chat_template_kwargs={"thinking_effort": "extreme"})
    err = expect(r, 422, type_="template_error")
    assert "extreme" in err["message"] or "thinking_effort" in err["message"]


def test_server_keeps_serving(client, model_name, http):
    for body in [b"{", b"null", b'{"model": 1}']:
        assert http.post("/v1/chat/completions", content=body).status_code == 400
    r = client.chat.completions.create(
        model=model_name, messages=[USER], temperature=0, max_tokens=300, reasoning_effort="none"
    )
    assert r.choices[0].finish_reason == "stop"
    assert answer_number(r.choices[0].message.content) is not None, r.choices[0].message
    assert http.get("/health").status_code == 200
