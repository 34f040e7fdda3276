"""`/v1/responses` through the official `openai` client: text, reasoning items, streaming events,
a function-call round trip, and the stateless 400s."""

from __future__ import annotations

import json

import openai
import pytest

from helpers import RECALL_ANSWERS, TOOLS, TOOLS_BY_NAME, arithmetic, recall_messages, validates

# Responses' function tools are flat: {"type": "function", "name", "description", "parameters"}.
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def create(client, model, input, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 600)
    return client.responses.create(model=model, input=input, **kw)


def items_of(response, kind):
    return [item for item in response.output if item.type == kind]


def test_text_with_reasoning(client, model_name):
    question, _ = arithmetic(23, "+", 45)
    r = create(client, model_name, question, instructions="Answer briefly.")
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "completed" and r.incomplete_details is None
    assert r.model == model_name
    reasoning = items_of(r, "reasoning")
    assert len(reasoning) == 1, "thinking is on by default: one reasoning item"
    assert reasoning[0].content and reasoning[0].content[0].type == "reasoning_text"
    assert reasoning[0].content[0].text and "<|" not in reasoning[0].content[0].text
    messages = items_of(r, "message")
    assert len(messages) == 1 and messages[0].role == "assistant"
    assert messages[0].content[0].type == "output_text"
    assert r.output_text and "<|" not in r.output_text
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0


@pytest.mark.model_quality
def test_reasoning_effort_none_and_history_items(client, model_name):
    """`reasoning.effort: none` turns thinking off; a conversation given as items is answered
    from its first turn."""
    history = [
        {"role": m["role"], "content": m["content"]}
        for m in recall_messages("Which city do I live in?", turns=1)
    ]
    r = create(client, model_name, history, reasoning={"effort": "none"}, max_output_tokens=200)
    assert not items_of(r, "reasoning")
    assert r.output_text == RECALL_ANSWERS["Which city do I live in?"], r.output_text


def test_max_output_tokens_makes_it_incomplete(client, model_name):
    r = create(client, model_name, "What is 1234 + 4321?", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    assert r.output[-1].status == "incomplete"


def test_streaming_events_match_non_streaming(client, model_name):
    question, _ = arithmetic(402, "+", 311)
    full = create(client, model_name, question)
    events = list(create(client, model_name, question, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert events[0].response.status == "in_progress"
    assert events[0].response.id == events[-1].response.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == full.output_text
    assert reasoning == items_of(full, "reasoning")[0].content[0].text
    done_text = [e.text for e in events if e.type == "response.output_text.done"]
    assert done_text == [text]
    # every added item is done, with the same id, and the final response lists them in order
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == done
    final = events[-1].response
    assert [item.id for item in final.output] == added
    assert final.output_text == text
    assert final.usage.output_tokens == full.usage.output_tokens


def test_stream_helper_accumulates(client, model_name):
    """The client's own stream accumulator (strict about item identities) accepts the events."""
    with client.responses.stream(
        model=model_name, input="What is 12 + 30?", temperature=0, max_output_tokens=600
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == deltas and deltas


def test_function_call_round_trip(client, model_name):
    """A declared tool is called with schema-valid arguments; the call and its output go back as
    input items (the previous output reused as is) and the model answers in text."""
    input_items = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]
    r = create(client, model_name, input_items, tools=RESPONSE_TOOLS)
    assert r.status == "completed"
    calls = items_of(r, "function_call")
    assert len(calls) == 1, r.output
    call = calls[0]
    assert call.call_id and call.id and call.status == "completed"
    assert call.name in TOOLS_BY_NAME
    args = json.loads(call.arguments)
    assert validates(args, TOOLS_BY_NAME[call.name]["function"]["parameters"]), args

    output = json.dumps({"city": "Paris", "condition": "sunny", "temperature": 21}, separators=(",", ":"))
    input_items += r.output
    input_items.append({"type": "function_call_output", "call_id": call.call_id, "output": output})
    final = create(client, model_name, input_items, tools=RESPONSE_TOOLS)
    assert final.status == "completed"
    assert not items_of(final, "function_call"), final.output
    assert final.output_text


def test_streamed_function_call(client, model_name):
    events = list(create(
        client, model_name, "What is the price of NOVA?", tools=RESPONSE_TOOLS, stream=True
    ))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert len(added) == 1
    item_id = added[0].item.id
    deltas = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == item_id
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [d.arguments for d in done] == [deltas]
    final = events[-1].response
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.id == item_id and call.arguments == deltas
    assert validates(json.loads(deltas), TOOLS_BY_NAME[call.name]["function"]["parameters"])


def test_previous_response_id_is_a_clear_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model_name, input="hi", previous_response_id="resp_abc")
    body = err.value.body
    assert body["param"] == "previous_response_id" and body["code"] == "not_supported"
    assert "does not store" in body["message"]


@pytest.mark.parametrize(
    "fields,param,code",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0].type", "not_supported"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "not_supported"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_parameter"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]},
         "input[0].call_id", "invalid_parameter"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
         "text.format.name", "invalid_parameter"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(http, model_name, fields, param, code):
    r = http.post("/v1/responses", json={"model": model_name, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code, err
    # A refusal names what is not supported (the part or tool type); the others name the field.
    assert param in err["message"] or code == "not_supported", err
