"""Shared test data: tools from the k3-mini training catalogue, a JSON-schema check, answers."""

from __future__ import annotations

import re
from typing import Any


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


GET_WEATHER = tool(
    "get_weather",
    "Current weather for a city.",
    {
        "city": {"type": "string", "description": "City name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    ["city", "unit"],
)
GET_STOCK_PRICE = tool(
    "get_stock_price",
    "Latest price of a stock.",
    {"symbol": {"type": "string", "description": "Ticker symbol."}},
    ["symbol"],
)
SET_TIMER = tool(
    "set_timer",
    "Start a countdown timer.",
    {
        "minutes": {"type": "integer", "description": "Duration in minutes."},
        "label": {"type": "string"},
        "repeat": {"type": "boolean", "description": "Restart when it ends."},
    },
    ["minutes", "label", "repeat"],
)
TOOLS = [GET_STOCK_PRICE, GET_WEATHER, SET_TIMER]
TOOLS_BY_NAME = {t["function"]["name"]: t for t in TOOLS}


def _is_type(value: Any, type_name: str) -> bool:
    return {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }.get(type_name, lambda v: False)(value)


def validates(value: Any, schema: dict) -> bool:
    """The JSON-schema subset the catalogue uses: type, enum, properties, required,
    additionalProperties: false, items."""
    types = schema.get("type")
    if types is not None:
        options = types if isinstance(types, list) else [types]
        if not any(_is_type(value, t) for t in options):
            return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        for k, v in value.items():
            if k in props:
                if not validates(v, props[k]):
                    return False
            elif schema.get("additionalProperties") is False:
                return False
    if isinstance(value, list) and "items" in schema:
        return all(validates(v, schema["items"]) for v in value)
    return True


def answer_number(text: str | None) -> int | None:
    """The number in k3-mini's "The answer is N." reply."""
    m = re.search(r"answer is (-?\d+)", text or "")
    return int(m.group(1)) if m else None


def arithmetic(a: int, op: str, b: int) -> tuple[str, int]:
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op if op != '*' else '×'} {b}?", value
