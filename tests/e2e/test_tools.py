"""Tool use: the model calls the right tool with schema-valid arguments, gets the result back
and answers from it; streaming tool-call deltas accumulate the way K2-Vendor-Verifier reads them."""

from __future__ import annotations

import json

import pytest

from helpers import TOOLS, TOOLS_BY_NAME, validates


def paris_weather_result(call_id: str) -> dict:
    """The get_weather result message, as compact JSON: k3-mini's training data renders tool results
    that way (MODEL_CARD.md: with spaces after the separators it does not copy the values)."""
    content = json.dumps({"city": "Paris", "condition": "sunny", "temperature": 21}, separators=(",", ":"))
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def test_tool_round_trip(client, model_name):
    """The model calls a declared tool with schema-valid arguments, the result goes back, and
    the model answers (finish_reason stop, no more calls)."""
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
    assert call.function.name in TOOLS_BY_NAME
    args = json.loads(call.function.arguments)
    assert validates(args, TOOLS_BY_NAME[call.function.name]["function"]["parameters"]), args

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append(paris_weather_result(call.id))
    final = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, temperature=0, max_tokens=600
    )
    answer = final.choices[0]
    assert answer.finish_reason == "stop", answer
    assert not answer.message.tool_calls
    assert answer.message.content


@pytest.mark.model_quality
def test_tool_round_trip_is_right(client, model_name):
    """The right tool, the arguments copied from the request, the answer from the result."""
    messages = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]
    r = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, temperature=0, max_tokens=600
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append(paris_weather_result(call.id))
    final = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, temperature=0, max_tokens=600
    )
    content = final.choices[0].message.content
    assert "21" in content and "sunny" in content, content


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
    assert calls[0]["id"] and calls[0]["name"] in TOOLS_BY_NAME
    args = json.loads(calls[0]["arguments"])
    assert validates(args, TOOLS_BY_NAME[calls[0]["name"]]["function"]["parameters"]), args
    # The streamed call equals the non-streamed one.
    full = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What is the price of NOVA?"}],
        tools=TOOLS,
        temperature=0,
        max_tokens=600,
    )
    call = full.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (calls[0]["name"], args)


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


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        if ch.finish_reason:
            finish = ch.finish_reason
    return calls, finish


def test_call_cut_by_max_tokens_is_the_same_streamed_or_not(client, model_name):
    """docs/k3-format.md §5: a call cut mid-argument by max_tokens is returned with its arguments
    as far as they came (JSON closed) and finish_reason length, identically with and without
    streaming."""
    request = dict(
        model=model_name,
        messages=[{"role": "user", "content": "What is the weather in Paris in celsius?"}],
        tools=TOOLS,
        temperature=0,
    )
    full = client.chat.completions.create(**request, max_tokens=600, logprobs=True)
    assert full.choices[0].finish_reason == "tool_calls", full.choices[0]
    whole_call = full.choices[0].message.tool_calls[0]
    whole_args = json.loads(whole_call.function.arguments)
    # The token that ends a string argument's open tag: cut one value token after it.
    tokens = [t.token for t in full.choices[0].logprobs.content]
    text, cut = "", None
    for i, token in enumerate(tokens):
        text += token
        tag_start = text.rfind("<|open|>")
        if "<|open|>call" in text and text.endswith("<|sep|>") and tag_start >= 0:
            tag = text[tag_start:]
            if tag.startswith("<|open|>argument") and 'type="string"' in tag:
                cut = i + 2
                break
    assert cut is not None, f"no string argument in {text!r}"

    r = client.chat.completions.create(**request, max_tokens=cut)
    choice = r.choices[0]
    assert choice.finish_reason == "length", choice
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == whole_call.function.name
    # every argument so far, the last one cut short
    assert list(args) == list(whole_args)[: len(args)], (args, whole_args)
    last = list(args)[-1]
    assert isinstance(args[last], str) and whole_args[last].startswith(args[last]), (args, whole_args)

    streamed, finish = _streamed_calls(client.chat.completions.create(**request, max_tokens=cut, stream=True))
    assert finish == "length"
    assert list(streamed) == [0]
    assert streamed[0] == {"name": call.function.name, "arguments": call.function.arguments}
