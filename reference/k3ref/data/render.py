"""Canonical renderer of the Kimi K3 chat format ("XTML") for k3-mini.

This is the reference the Jinja chat template (``chat_template.jinja``) must match byte for byte.
Format: docs/k3-format.md §1-4.  Choices this file fixes (documented
because the format leaves them open):

* JSON (tool declarations, response-format schemas, non-string tool-call argument values) is
  written with every object's keys sorted, arrays in order, non-ASCII kept, and the compact
  separators ``","`` and ``":"`` (no spaces).  NaN/Infinity are rejected.
* Request-scoped internal system messages (``tool-choice``, ``response-format``) are placed after
  the last non-assistant message, i.e. right before the trailing assistant turn(s) or the
  generation prompt.  For a request (history ending in user/tool) this is "after all messages";
  for a training conversation it keeps the prompt a prefix of the full text.
* A run of tool messages is re-ordered to the order of the preceding assistant's ``tool_calls``
  when every message of the run matches a call by ``tool_call_id``; ``index`` is then the matched
  call's 1-based index.  Otherwise the run keeps its order and ``index`` is the 1-based position in
  the run (the name may then come from the call at that position).
* Tool-call arguments given as a JSON string must parse to a JSON object; the string is written
  as given inside one ``json`` block.
* ``thinking_effort`` is validated even with thinking off; ``None`` means the default ``max``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

THINKING_EFFORTS = ("low", "medium", "high", "max")

TOOL_DECLARE_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
NEW_TOOLS_HEADER = (
    "## New Tools Available\nMore tools were added to the conversation; the earlier tools remain "
    "available.\n\n```json\n"
)
CODE_FENCE_END = "\n```"


class TemplateError(ValueError):
    """A conversation that cannot be rendered (a server turns this into HTTP 400)."""


def escape_attr(value: Any) -> str:
    """Escape an attribute value: ``&`` first, then ``"``."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> str:
    return OPEN + tag + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs) + SEP


def close_tag(tag: str) -> str:
    return CLOSE + tag + SEP


def _check_finite(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise TemplateError(f"JSON cannot carry the non-finite number {value!r}")
    if isinstance(value, dict):
        for item in value.values():
            _check_finite(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_finite(item)


def to_json(value: Any) -> str:
    """The one JSON form used by the format: sorted keys, compact, non-ASCII kept."""
    _check_finite(value)
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise TemplateError(f"value is not JSON-serialisable: {err}") from err


def json_type(value: Any) -> str:
    """XTML argument type of a JSON value (bool is checked before number)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def _message(attrs: list[tuple[str, Any]], body: str) -> str:
    return open_tag("message", attrs) + body + close_tag("message") + END_OF_MSG


def _internal(kind: str, body: str) -> str:
    return _message([("role", "system"), ("type", kind)], body)


def _content(content: Any) -> str:
    """Message content: a string, a list of parts (text / image), or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict):
                raise TemplateError("content parts must be objects")
            if part.get("type") in ("image", "image_url"):
                out.append(IMAGE_PLACEHOLDER)
            else:
                text = part.get("text")
                out.append("" if text is None else str(text))
        return "".join(out)
    raise TemplateError("message content must be a string, a list of parts or null")


def _tool_declare(tools: list, dynamic: bool) -> str:
    header = NEW_TOOLS_HEADER if dynamic else TOOL_DECLARE_HEADER
    return _internal("tool-declare", header + to_json(tools) + CODE_FENCE_END)


def thinking_effort_body(effort: str) -> str:
    return (
        f"Thinking effort: {effort}.\n"
        "The effort (low, medium, high or max) sets how much reasoning goes in the think "
        "channel; the response channel is not affected."
    )


TOOL_CHOICE_BODIES = {
    "required": "Tool choice: required.\nThe next message MUST call at least one tool.",
    "none": "Tool choice: none.\nThe next message MUST NOT call any tool.",
}

RESPONSE_FORMAT_JSON_OBJECT = (
    "Response format: json_object.\nThe response must be one raw JSON object, "
    "without code fences or any other text."
)
RESPONSE_FORMAT_JSON_SCHEMA = (
    "Response format: json_schema.\nThe response must be one raw JSON value, "
    "without code fences or any other text, that matches this JSON schema:\n"
)


def _call_function(call: Any) -> dict:
    if not isinstance(call, dict):
        raise TemplateError("a tool call must be an object")
    fn = call.get("function")
    return fn if isinstance(fn, dict) else call


def _render_call(call: Any, index: int) -> str:
    fn = _call_function(call)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise TemplateError(f"tool call {index} has no function name")
    out = [open_tag("call", [("tool", name), ("index", index)])]
    arguments = fn.get("arguments")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, dict):
        for key, value in arguments.items():
            text = value if isinstance(value, str) else to_json(value)
            out.append(open_tag("argument", [("key", key), ("type", json_type(value))]))
            out.append(text + close_tag("argument"))
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise TemplateError(
                f"arguments of tool call {index} ({name}) are a string that is not a JSON object"
            )
        out.append(open_tag("json", [("type", "object")]) + arguments + close_tag("json"))
    else:
        raise TemplateError(
            f"arguments of tool call {index} ({name}) must be an object or a JSON-object string"
        )
    out.append(close_tag("call"))
    return "".join(out)


def _render_assistant(message: dict, thinking: bool) -> str:
    attrs: list[tuple[str, Any]] = [("role", "assistant")]
    if message.get("name"):
        attrs.append(("name", message["name"]))
    body = []
    if thinking:
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = message.get("reasoning")
        body.append(open_tag("think") + ("" if reasoning is None else str(reasoning)))
        body.append(close_tag("think"))
    body.append(open_tag("response") + _content(message.get("content")) + close_tag("response"))
    calls = message.get("tool_calls") or []
    if calls:
        body.append(open_tag("tools"))
        body.extend(_render_call(call, i) for i, call in enumerate(calls, start=1))
        body.append(close_tag("tools"))
    return _message(attrs, "".join(body))


def _tool_message_name(message: dict) -> Any:
    for key in ("name", "tool"):
        if message.get(key):
            return message[key]
    return None


def _render_tool_run(run: list[dict], calls: list) -> str:
    call_ids = [c.get("id") if isinstance(c, dict) else None for c in calls]
    all_matched = all(
        m.get("tool_call_id") is not None and m.get("tool_call_id") in call_ids for m in run
    )
    ordered: list[tuple[dict, int, Any]] = []  # (message, index, call)
    if all_matched:
        seen: set = set()
        for i, call in enumerate(calls, start=1):
            cid = call_ids[i - 1]
            if cid is None or cid in seen:
                continue
            seen.add(cid)
            ordered.extend((m, i, call) for m in run if m.get("tool_call_id") == cid)
    else:
        for pos, m in enumerate(run, start=1):
            ordered.append((m, pos, calls[pos - 1] if pos <= len(calls) else None))
    out = []
    for message, index, call in ordered:
        name = _tool_message_name(message)
        if name is None and call is not None:
            fn = _call_function(call)
            name = fn.get("name") or None
        if name is None:
            raise TemplateError(
                "a tool message has no name and none can be resolved from a matching tool call"
            )
        attrs = [("role", "tool"), ("tool", name), ("index", index)]
        out.append(_message(attrs, _content(message.get("content"))))
    return "".join(out)


def render(
    messages: list[dict],
    tools: list | None = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    tool_choice: Any = None,
    response_format: Any = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render a conversation (OpenAI-style messages) to K3 text."""
    if thinking_effort is None:
        thinking_effort = "max"
    if thinking_effort not in THINKING_EFFORTS:
        raise TemplateError(
            f"unknown thinking_effort {thinking_effort!r}; expected one of low, medium, high, max"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TemplateError(f"message {i} is not an object")
        if message.get("role") is None:
            raise TemplateError(f"message {i} has no role")
        if message["role"] not in ("system", "user", "assistant", "tool"):
            raise TemplateError(f"message {i} has unknown role {message['role']!r}")

    # Request-scoped internal messages go after the last non-assistant message.
    split = len(messages)
    while split > 0 and messages[split - 1]["role"] == "assistant":
        split -= 1

    out: list[str] = []
    if tools:
        out.append(_tool_declare(tools, dynamic=False))
    if thinking:
        out.append(_internal("thinking-effort", thinking_effort_body(thinking_effort)))

    calls: list = []
    i = 0
    while i <= len(messages):
        if i == split:
            out.append(_request_messages(tool_choice, response_format))
        if i == len(messages):
            break
        message = messages[i]
        role = message["role"]
        if role == "tool":
            j = i
            while j < len(messages) and messages[j]["role"] == "tool" and j != split:
                j += 1
            out.append(_render_tool_run(messages[i:j], calls))
            i = j
            continue
        if role == "assistant":
            calls = message.get("tool_calls") or []
            out.append(_render_assistant(message, thinking))
        elif role == "system" and message.get("tools"):
            out.append(_tool_declare(message["tools"], dynamic=True))
        else:
            attrs: list[tuple[str, Any]] = [("role", role)]
            if message.get("name"):
                attrs.append(("name", message["name"]))
            out.append(_message(attrs, _content(message.get("content"))))
        i += 1

    if add_generation_prompt:
        out.append(open_tag("message", [("role", "assistant")]))
        out.append(open_tag("think" if thinking else "response"))
    return "".join(out)


def _request_messages(tool_choice: Any, response_format: Any) -> str:
    out = []
    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_BODIES:  # a named choice renders nothing
        out.append(_internal("tool-choice", TOOL_CHOICE_BODIES[tool_choice]))
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind == "json_object":
        out.append(_internal("response-format", RESPONSE_FORMAT_JSON_OBJECT))
    elif kind == "json_schema":
        wrapper = response_format.get("json_schema") if isinstance(response_format, dict) else None
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if schema is None:
            raise TemplateError("response_format json_schema needs json_schema.schema")
        body = RESPONSE_FORMAT_JSON_SCHEMA + "```json\n" + to_json(schema) + CODE_FENCE_END
        out.append(_internal("response-format", body))
    return "".join(out)
