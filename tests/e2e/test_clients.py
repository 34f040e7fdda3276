"""The clients people already use, pointed at k3serve unchanged: litellm (its OpenAI-compatible
provider) and langchain-openai's ChatOpenAI. Both add fields of their own to what they send back
(litellm: `provider_specific_fields` on messages), which the server accepts and ignores."""

from __future__ import annotations

import json
import os

import pytest

from helpers import TOOLS, TOOLS_BY_NAME, validates

# litellm fetches a model price list from the internet at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

WEATHER_QUESTION = "What is the weather in Paris in celsius?"


def weather_result() -> str:
    # Compact JSON, as k3-mini's training data renders tool results (see test_tools.py).
    return json.dumps({"city": "Paris", "condition": "sunny", "temperature": 21}, separators=(",", ":"))


# --- litellm ---


@pytest.fixture(scope="module")
def litellm_kwargs(base_url, model_name):
    import litellm

    litellm.telemetry = False
    return {"model": f"openai/{model_name}", "api_base": f"{base_url}/v1", "api_key": "unused",
            "temperature": 0, "timeout": 300}


def test_litellm_chat(litellm_kwargs):
    import litellm

    r = litellm.completion(messages=[{"role": "user", "content": "Hi! My name is Rosa."}],
                           max_tokens=40, **litellm_kwargs)
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


def test_litellm_tool_round_trip(litellm_kwargs):
    """Assistant tool call → tool result → answer, sending back the message object litellm
    returned (with the fields litellm adds to it)."""
    import litellm

    messages = [{"role": "user", "content": WEATHER_QUESTION}]
    r = litellm.completion(messages=messages, tools=TOOLS, max_tokens=600, **litellm_kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name in TOOLS_BY_NAME
    args = json.loads(call.function.arguments)
    assert validates(args, TOOLS_BY_NAME[call.function.name]["function"]["parameters"]), args
    sent_back = choice.message.model_dump()
    assert "provider_specific_fields" in sent_back, "litellm no longer adds its own field"
    messages += [sent_back, {"role": "tool", "tool_call_id": call.id, "content": weather_result()}]
    final = litellm.completion(messages=messages, tools=TOOLS, max_tokens=600, **litellm_kwargs)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content


# --- langchain-openai ---


@pytest.fixture(scope="module")
def chat_model(base_url, model_name):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model_name, base_url=f"{base_url}/v1", api_key="unused", temperature=0,
                      max_tokens=600, timeout=300, max_retries=0)


def test_langchain_invoke_and_stream(chat_model):
    reply = chat_model.invoke("Hi! My name is Rosa.")
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata["input_tokens"] > 0
    chunks = list(chat_model.stream("Hi! My name is Rosa."))
    assert len(chunks) > 1
    assert "".join(c.content for c in chunks if isinstance(c.content, str))


def test_langchain_bind_tools_round_trip(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage

    with_tools = chat_model.bind_tools(TOOLS)
    messages = [HumanMessage(WEATHER_QUESTION)]
    ai = with_tools.invoke(messages)
    assert ai.tool_calls, ai
    call = ai.tool_calls[0]
    assert call["name"] in TOOLS_BY_NAME
    assert validates(call["args"], TOOLS_BY_NAME[call["name"]]["function"]["parameters"]), call
    messages += [ai, ToolMessage(weather_result(), tool_call_id=call["id"])]
    answer = with_tools.invoke(messages)
    assert not answer.tool_calls and answer.content


def _weather_report_schema():
    from pydantic import BaseModel

    class WeatherReport(BaseModel):
        """A city's weather."""

        city: str
        temperature: int
        sunny: bool

    return WeatherReport


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(base_url, model_name, method):
    from langchain_openai import ChatOpenAI

    # Thinking off: k3-mini's think trace drifts on this prompt (MODEL_CARD.md, "Vision") and
    # can run to the token limit before the forced call starts.
    chat_model = ChatOpenAI(model=model_name, base_url=f"{base_url}/v1", api_key="unused",
                            temperature=0, max_tokens=600, timeout=300, max_retries=0,
                            extra_body={"reasoning_effort": "none"})
    schema = _weather_report_schema()
    structured = chat_model.with_structured_output(schema, method=method)
    report = structured.invoke("Paris is sunny at 21 degrees. Report its weather.")
    assert isinstance(report, schema)
    assert report.city
