"""Tool use: the model calls the right tool with schema-valid arguments, gets the result back
and answers from it; streaming tool-call deltas accumulate the way K2-Vendor-Verifier reads them."""

from __future__ import annotations

import json

import pytest

from helpers import TOOLS, TOOLS_BY_NAME, validates


@pytest.mark.model_quality
def test_tool_round_trip(client, model_name):
    messages = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]
    r = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, temperature=0, max_tokens=600
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert validates(args, TOOLS_BY_NAME["get_weather"]["function"]["parameters"]), args
    assert args == {"city": "Paris", "unit": "celsius"}, args

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append(
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": "Paris", "condition": "sunny", "temperature": 21}),
        }
    )
    final = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, temperature=0, max_tokens=600
    )
    answer = final.choices[0]
    assert answer.finish_reason == "stop", answer
    assert not answer.message.tool_calls
    assert "21" in answer.message.content and "sunny" in answer.message.content, answer.message


@pytest.mark.model_quality
def test_streamed_tool_call(client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What is the price of NOVA?"}],
        tools=TOOLS,
        temperature=0,
        max_tokens=600,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert entry["id"] is None, "a call's id is sent once"
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                assert entry["name"] is None, "a call's name is sent once"
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        if ch.finish_reason:
            finish = ch.finish_reason
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["id"] and calls[0]["name"] == "get_stock_price"
    args = json.loads(calls[0]["arguments"])
    assert validates(args, TOOLS_BY_NAME["get_stock_price"]["function"]["parameters"]), args
    assert args == {"symbol": "NOVA"}


@pytest.mark.model_quality
def test_no_tool_needed_and_tool_choice_none(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What is 15 + 27?"}],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=600,
    )
    assert r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    assert "42" in r.choices[0].message.content
