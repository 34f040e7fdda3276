"""Structured outputs (constrained decoding with llguidance): JSON schemas k3-mini never saw come
back valid every time, regex / choice / grammar constraints hold on completions, and
`tool_choice` "required" / named always produce calls.
The tool_choice constraint comes from the tool parser's output grammar (the kimi-k3-tools plugin's
WIT 0.3 `output-grammar` export).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from helpers import TOOLS, TOOLS_BY_NAME

# Schemas of shapes and topics outside k3-mini's training data. Strings carry maxLength where a
# small greedy model could otherwise ramble inside one until max_tokens.
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 500}},
     "required": ["count"], "additionalProperties": False},
    {"type": "object", "properties": {"planet": {"enum": ["mercury", "venus", "earth", "mars"]},
                                      "moons": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["planet", "moons"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                      "pages": {"type": "integer", "minimum": 1}},
     "required": ["title", "pages"], "additionalProperties": False},
    {"type": "object", "properties": {"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                                              "minItems": 3, "maxItems": 3}},
     "required": ["rgb"], "additionalProperties": False},
    {"type": "object", "properties": {"temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                                      "humid": {"type": "boolean"}},
     "required": ["temperature_c", "humid"], "additionalProperties": False},
    {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                      "in_stock": {"type": "boolean"}},
     "required": ["sku", "in_stock"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "unsure"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"ingredients": {"type": "array", "maxItems": 3,
                                                      "items": {"type": "string", "maxLength": 16}}},
     "required": ["ingredients"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object",
                                                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "string", "enum": ["north", "south", "east", "west"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"],
     "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "tag": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["level", "tag"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"circle_r": {"type": "number", "minimum": 0}}, "required": ["circle_r"],
         "additionalProperties": False},
        {"type": "object", "properties": {"square_side": {"type": "integer", "minimum": 1}}, "required": ["square_side"],
         "additionalProperties": False}]}},
     "required": ["shape"], "additionalProperties": False},
    {"type": "object", "properties": {"version": {"const": "v2"}, "debug": {"type": "boolean"}},
     "required": ["version", "debug"], "additionalProperties": False},
    {"type": "object", "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}},
                                          "required": ["id"], "additionalProperties": False}},
     "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 6,
                                               "pattern": "^[a-z]+$"}},
     "required": ["word"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
                                      "passed": {"type": "boolean"}},
     "required": ["score", "passed"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2,
                                                 "items": {"type": "array", "items": {"type": "integer", "minimum": -99, "maximum": 99},
                                                           "minItems": 2, "maxItems": 2}}},
     "required": ["matrix"], "additionalProperties": False},
]

PROMPTS = [
    "Describe the request as JSON.",
    "Give me the data for my spaceship inventory.",
    "What did the parrot say?",
]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_output_is_always_valid(client, model_name, i):
    """response_format json_schema (strict): the content parses and validates, every schema."""
    schema = SCHEMAS[i]
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        reasoning_effort="none",
        temperature=0,
        max_tokens=160,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
    value = json.loads(choice.message.content)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def test_json_schema_with_thinking_and_non_strict(client, model_name):
    """Reasoning stays free; the content after it follows the (non-strict) schema."""
    schema = SCHEMAS[2]
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Pick a planet."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        temperature=0,
        max_tokens=400,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_structured_outputs_on_chat(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Say hi."}],
        response_format={"type": "json_object"},
        reasoning_effort="none",
        temperature=0,
        max_tokens=120,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        reasoning_effort="none",
        temperature=0,
        # Room for a choice spelt a character per token (the constraint admits any spelling).
        max_tokens=32,
        extra_body={"structured_outputs": {"choice": ["affirmative", "negative"]}},
    )
    assert r.choices[0].message.content in ("affirmative", "negative")


def test_completions_regex_choice_json_and_grammar(client, model_name):
    """Raw completions: the constraint applies to the generated text itself."""
    r = client.completions.create(
        model=model_name, prompt="The code is", max_tokens=12, temperature=0,
        extra_body={"guided_regex": r" [A-F0-9]{4}-[0-9]{2}"},
    )
    assert re.fullmatch(r" [A-F0-9]{4}-[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model=model_name, prompt="The best season is", max_tokens=16, temperature=0,
        extra_body={"guided_choice": [" winter", " summer"], "guided_decoding_backend": "xgrammar"},
    )
    assert r.choices[0].text in (" winter", " summer")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"],
              "additionalProperties": False}
    r = client.completions.create(
        model=model_name, prompt="JSON:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    )
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = client.completions.create(
        model=model_name, prompt="Answer:", max_tokens=8, temperature=0.7, seed=1,
        extra_body={"structured_outputs": {"grammar": 'start: "A" DIGIT DIGIT\nDIGIT: /[0-9]/'}},
    )
    assert re.fullmatch(r"A[0-9]{2}", r.choices[0].text), r.choices[0].text


def test_streaming_completion_follows_the_constraint(client, model_name):
    stream = client.completions.create(
        model=model_name, prompt="Pick:", max_tokens=8, temperature=0, stream=True,
        extra_body={"guided_choice": ["alpha", "beta", "gamma"]},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text in ("alpha", "beta", "gamma")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "not-a-type"}}}}, "guided_json"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(base_url, model_name, body, param):
    r = httpx.post(f"{base_url}/v1/completions", timeout=30,
                   json={"model": model_name, "prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# --- tool_choice: constrained by the tool parser's output grammar (WIT 0.3 `output-grammar`) ---

TEXT_PROMPTS = [
    "Hello! How are you today?",
    "Tell me a joke about cats.",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
]


@pytest.mark.parametrize("prompt", TEXT_PROMPTS)
def test_tool_choice_required_always_calls(client, model_name, prompt):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
        tool_choice="required", reasoning_effort="none", temperature=0, max_tokens=200,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        schema = TOOLS_BY_NAME[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("prompt", TEXT_PROMPTS)
def test_named_tool_choice_calls_that_function(client, model_name, prompt):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_timer"}},
        reasoning_effort="none", temperature=0, max_tokens=200,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "set_timer" for c in calls), r.choices[0]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments),
                            TOOLS_BY_NAME["set_timer"]["function"]["parameters"])


def test_named_tool_choice_must_be_declared(base_url, model_name):
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=30, json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice.function.name"
