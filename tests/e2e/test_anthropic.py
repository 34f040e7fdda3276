"""The Anthropic Messages API (/v1/messages) through the official `anthropic` client."""

from __future__ import annotations

import json

import pytest

from helpers import RECALL_ANSWERS, TOOLS, answer_number, arithmetic, recall_messages


def anthropic_tools():
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]


@pytest.mark.model_quality
def test_message_with_thinking(anthropic_client, model_name):
    question, expected = arithmetic(61, "+", 27)
    m = anthropic_client.messages.create(
        model=model_name,
        max_tokens=600,
        extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 500},
        messages=[{"role": "user", "content": question}],
    )
    kinds = [b.type for b in m.content]
    assert kinds == ["thinking", "text"], m.content
    assert m.stop_reason == "end_turn"
    assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0
    assert answer_number(m.content[1].text) == expected


@pytest.mark.model_quality
def test_streaming_without_thinking(anthropic_client, model_name):
    with anthropic_client.messages.stream(
        model=model_name,
        max_tokens=300,
        extra_body={"temperature": 0},
        system="You are a helpful assistant.",
        messages=recall_messages(),
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text"]
    assert final.stop_reason == "end_turn"
    assert final.content[0].text == text
    assert text == RECALL_ANSWERS["What is my lucky number?"]


def tool_round_trip(anthropic_client, model_name):
    messages = [{"role": "user", "content": "Get me the latest ZETA stock price."}]
    m = anthropic_client.messages.create(
        model=model_name, max_tokens=600, extra_body={"temperature": 0}, tools=anthropic_tools(),
        messages=messages,
    )
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id
    assert uses[0].name in {t["name"] for t in anthropic_tools()}
    assert isinstance(uses[0].input, dict)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": uses[0].id,
                    # Compact, as in training (MODEL_CARD.md: spaced JSON is not copied reliably).
                    "content": json.dumps({"price": 123.45, "symbol": "ZETA"}, separators=(",", ":")),
                }
            ],
        },
    ]
    final = anthropic_client.messages.create(
        model=model_name, max_tokens=600, extra_body={"temperature": 0}, tools=anthropic_tools(),
        messages=messages,
    )
    assert final.stop_reason == "end_turn", final
    text = "".join(b.text for b in final.content if b.type == "text")
    assert text
    return uses[0], text


def test_tool_use_round_trip(anthropic_client, model_name):
    tool_round_trip(anthropic_client, model_name)


@pytest.mark.model_quality
def test_tool_use_round_trip_is_right(anthropic_client, model_name):
    use, text = tool_round_trip(anthropic_client, model_name)
    assert use.name == "get_stock_price" and use.input == {"symbol": "ZETA"}
    assert "123.45" in text, text


def test_error_shape(anthropic_client, model_name):
    import anthropic

    try:
        anthropic_client.messages.create(
            model=model_name, max_tokens=0, messages=[{"role": "user", "content": "hi"}]
        )
    except anthropic.BadRequestError as e:
        assert e.status_code == 400
        assert "max_tokens" in str(e)
    else:
        raise AssertionError("max_tokens=0 must be rejected")
