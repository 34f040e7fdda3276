"""Conformance of the canonical renderer (k3ref.data.render) and of chat_template.jinja with it."""

from __future__ import annotations

import pytest

from k3ref.data.render import TemplateError, render
from k3ref.data.template_env import TEMPLATE_PATH, load_template

EFFORT_MAX = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>Thinking effort: max.\n'
    "The effort (low, medium, high or max) sets how much reasoning goes in the think channel; "
    "the response channel is not affected.<|close|>message<|sep|><|end_of_msg|>"
)


def msg(role: str, body: str, **attrs: str) -> str:
    extra = "".join(f' {k}="{v}"' for k, v in attrs.items())
    return f'<|open|>message role="{role}"{extra}<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter in München & \"Umgebung\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

ALL_TYPES_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {
        "name": "do_it",
        "arguments": {
            "s": 'line1\n"two" & <three>',
            "i": 42,
            "f": 2.5,
            "b": False,
            "n": None,
            "o": {"z": 1, "a": ["é", True]},
            "l": [3, "x", None],
        },
    },
}


def both(messages, tools=None, **kw):
    """Render with render.py and with the Jinja template (both whitespace settings); assert equal."""
    expected = render(messages, tools, **kw)
    for trim in (True, False):
        got = load_template(trim=trim).render(messages=messages, tools=tools, **kw)
        assert got == expected
    return expected


def test_simple_thinking_on_and_generation_prompt():
    out = both([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert out == EFFORT_MAX + msg("user", "Hi") + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'


def test_thinking_off_generation_prompt_and_no_think_block():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "dropped"},
        {"role": "user", "content": "Again"},
    ]
    out = both(messages, thinking=False, add_generation_prompt=True)
    assert out == (
        msg("user", "Hi")
        + msg("assistant", "<|open|>response<|sep|>Hello<|close|>response<|sep|>")
        + msg("user", "Again")
        + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )


def test_effort_and_reasoning_fallback():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "r"},
        {"role": "assistant", "content": None},
    ]
    out = both(messages, thinking_effort="low")
    assert "Thinking effort: low." in out
    assert out.endswith(
        msg("assistant", "<|open|>think<|sep|>r<|close|>think<|sep|><|open|>response<|sep|>a<|close|>response<|sep|>")
        + msg("assistant", "<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>")
    )


def test_tool_declare_sorted_compact_json_non_ascii_kept():
    out = both([{"role": "user", "content": "x"}], [WEATHER], thinking=False)
    assert out.startswith(
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
        "Here are the available tools, described in JSONSchema.\n\n```json\n"
        '[{"function":{"description":"Wetter in München & \\"Umgebung\\"","name":"get_weather",'
        '"parameters":{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},'
        '"type":"function"}]\n```<|close|>message<|sep|><|end_of_msg|>'
    )


def test_every_argument_type():
    out = both([{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok", "tool_calls": [ALL_TYPES_CALL]}], thinking=False)
    assert (
        '<|open|>tools<|sep|><|open|>call tool="do_it" index="1"<|sep|>'
        '<|open|>argument key="s" type="string"<|sep|>line1\n"two" & <three><|close|>argument<|sep|>'
        '<|open|>argument key="i" type="number"<|sep|>42<|close|>argument<|sep|>'
        '<|open|>argument key="f" type="number"<|sep|>2.5<|close|>argument<|sep|>'
        '<|open|>argument key="b" type="boolean"<|sep|>false<|close|>argument<|sep|>'
        '<|open|>argument key="n" type="null"<|sep|>null<|close|>argument<|sep|>'
        '<|open|>argument key="o" type="object"<|sep|>{"a":["é",true],"z":1}<|close|>argument<|sep|>'
        '<|open|>argument key="l" type="array"<|sep|>[3,"x",null]<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    ) in out


def test_json_string_arguments_and_escaped_attributes():
    call = {"id": "c", "function": {"name": 'a&"b', "arguments": '{"k": [1, 2]}'}}
    out = both([{"role": "user", "content": "u", "name": 'Jo "J" & co'}, {"role": "assistant", "content": "", "tool_calls": [call]}], thinking=False)
    assert msg("user", "u", name="Jo &quot;J&quot; &amp; co") in out
    assert '<|open|>call tool="a&amp;&quot;b" index="1"<|sep|><|open|>json type="object"<|sep|>{"k": [1, 2]}<|close|>json<|sep|><|close|>call<|sep|>' in out


def test_json_string_control_characters_escaped_like_python():
    call = {"id": "c", "function": {"name": "f", "arguments": {"o": {"k": "a\u0001b\tc\\d\u001f\u2028"}}}}
    out = both([{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert '{"k":"a\\u0001b\\tc\\\\d\\u001f\u2028"}' in out


def test_tool_results_reordered_by_id_and_names_resolved():
    calls = [
        {"id": "A", "function": {"name": "first", "arguments": {}}},
        {"id": "B", "function": {"name": "second", "arguments": {}}},
    ]
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "B", "content": "rb"},
        {"role": "tool", "tool_call_id": "A", "content": "ra"},
    ]
    out = both(messages, thinking=False, add_generation_prompt=True)
    assert out.endswith(
        msg("tool", "ra", tool="first", index="1")
        + msg("tool", "rb", tool="second", index="2")
        + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    assert "call_id" not in out and '"A"' not in out


def test_tool_results_without_ids_keep_order_and_use_own_or_positional_name():
    calls = [{"function": {"name": "first", "arguments": {}}}, {"function": {"name": "second", "arguments": {}}}]
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": "explicit", "content": "r1"},
        {"role": "tool", "content": "r2"},
    ]
    out = both(messages, thinking=False)
    assert out.endswith(msg("tool", "r1", tool="explicit", index="1") + msg("tool", "r2", tool="second", index="2"))


def test_images_and_text_parts():
    content = [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": "u"}}, {"type": "image"}]
    out = both([{"role": "user", "content": content}], thinking=False)
    assert msg("user", "look: <|kimi_image_placeholder|><|kimi_image_placeholder|>") in out


def test_tool_choice_and_response_format_before_trailing_assistant():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "{}"}]
    kw = dict(thinking=False, tool_choice="required", response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    out = both(messages, **kw)
    assert out == (
        msg("user", "u")
        + msg("system", "Tool choice: required.\nThe next message MUST call at least one tool.", type="tool-choice")
        + msg(
            "system",
            "Response format: json_schema.\nThe response must be one raw JSON value, without code fences or any "
            'other text, that matches this JSON schema:\n```json\n{"properties":{"a":{"type":"string"},"b":'
            '{"type":"integer"}},"type":"object"}\n```',
            type="response-format",
        )
        + msg("assistant", "<|open|>response<|sep|>{}<|close|>response<|sep|>")
    )
    prompt = both(messages[:1], add_generation_prompt=True, **kw)
    assert out.startswith(prompt)
    none = both(messages[:1], thinking=False, tool_choice="none", response_format={"type": "json_object"})
    assert "MUST NOT call any tool" in none and "Response format: json_object." in none


def test_system_message_with_tools_is_new_tools_variant():
    out = both([{"role": "system", "tools": [WEATHER]}, {"role": "user", "content": "u"}], thinking=False)
    assert out.startswith('<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\n')


@pytest.mark.parametrize(
    "messages,kwargs,needle",
    [
        ([{"content": "no role"}], {}, "has no role"),
        ([{"role": "robot", "content": "x"}], {}, "unknown role"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}], {}, "no function name"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}], {}, "not a JSON object"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 7}}]}], {}, "must be an object"),
        ([{"role": "user", "content": "x"}], {"thinking_effort": "extreme"}, "unknown thinking_effort"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], {}, "no name"),
        ([{"role": "user", "content": {"a": 1}}], {}, "content must be"),
    ],
)
def test_errors(messages, kwargs, needle):
    with pytest.raises(TemplateError, match=needle):
        render(messages, **kwargs)
    with pytest.raises(TemplateError, match=needle):
        load_template().render(messages=messages, **kwargs)


def test_error_is_value_error():
    assert issubclass(TemplateError, ValueError)


def test_template_works_with_minijinja_if_available():
    minijinja = pytest.importorskip("minijinja")

    def raise_exception(message):
        raise TemplateError(message)

    env = minijinja.Environment(templates={"t": TEMPLATE_PATH.read_text()}, globals={"raise_exception": raise_exception})
    calls = [dict(ALL_TYPES_CALL, id="B"), {"id": "A", "function": {"name": "x", "arguments": '{"q": 1}'}}]
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
        {"role": "assistant", "content": "c", "reasoning_content": "r", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "A", "content": "ra"},
        {"role": "tool", "tool_call_id": "B", "content": "rb"},
        {"role": "assistant", "content": "done"},
    ]
    for kw in ({}, {"thinking": False, "tool_choice": "none"}, {"response_format": {"type": "json_object"}}):
        for m in (messages, messages[:-1]):
            assert env.render_template("t", messages=m, tools=[WEATHER], add_generation_prompt=m is not messages, **kw) == render(
                m, [WEATHER], add_generation_prompt=m is not messages, **kw
            )
