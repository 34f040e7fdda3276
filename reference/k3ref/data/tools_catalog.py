"""A fixed catalogue of tools (OpenAI function format) used by the synthetic corpus.

Together the parameters cover every JSON type: string, number (integer and float), boolean,
null (as ``["string", "null"]``), object and array.  ``validate`` is the small JSON-schema subset
check used to score generated tool calls.
"""

from __future__ import annotations

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


TOOLS: list[dict] = [
    tool(
        "get_weather",
        "Current weather for a city.",
        {
            "city": {"type": "string", "description": "City name."},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        ["city", "unit"],
    ),
    tool(
        "convert_currency",
        "Convert an amount of money between currencies.",
        {
            "amount": {"type": "number", "description": "Amount to convert."},
            "from_currency": {"type": "string", "description": "ISO code, e.g. EUR."},
            "to_currency": {"type": "string", "description": "ISO code, e.g. USD."},
        },
        ["amount", "from_currency", "to_currency"],
    ),
    tool(
        "set_timer",
        "Start a countdown timer.",
        {
            "minutes": {"type": "integer", "description": "Duration in minutes."},
            "label": {"type": "string"},
            "repeat": {"type": "boolean", "description": "Restart when it ends."},
        },
        ["minutes", "label", "repeat"],
    ),
    tool(
        "create_event",
        "Add an event to the calendar.",
        {
            "title": {"type": "string"},
            "date": {"type": "string", "description": "YYYY-MM-DD."},
            "attendees": {"type": "array", "items": {"type": "string"}},
            "all_day": {"type": "boolean"},
        },
        ["title", "date", "attendees", "all_day"],
    ),
    tool(
        "search_products",
        "Search the shop catalogue.",
        {
            "query": {"type": "string"},
            "max_price": {"type": "number", "description": "Upper price limit in dollars."},
            "in_stock": {"type": "boolean"},
            "limit": {"type": "integer", "description": "How many results."},
        },
        ["query", "max_price", "in_stock", "limit"],
    ),
    tool(
        "update_settings",
        "Change display settings.",
        {
            "settings": {
                "type": "object",
                "properties": {
                    "theme": {"type": "string", "enum": ["dark", "light", "sepia"]},
                    "font_size": {"type": "integer"},
                },
                "required": ["theme", "font_size"],
                "additionalProperties": False,
            },
            "reset": {"type": "boolean", "description": "Reset everything else first."},
        },
        ["settings", "reset"],
    ),
    tool(
        "send_message",
        "Send a chat message to a contact.",
        {
            "recipient": {"type": "string"},
            "text": {"type": "string"},
            "priority": {"type": "integer", "description": "1 (low) to 5 (urgent)."},
            "reply_to": {"type": ["string", "null"], "description": "Message id or null."},
        },
        ["recipient", "text", "priority", "reply_to"],
    ),
    tool(
        "log_measurement",
        "Record a sensor reading.",
        {
            "sensor": {"type": "string"},
            "value": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "note": {"type": ["string", "null"]},
        },
        ["sensor", "value", "tags", "note"],
    ),
    tool(
        "get_stock_price",
        "Latest price of a stock.",
        {"symbol": {"type": "string", "description": "Ticker symbol."}},
        ["symbol"],
    ),
]

TOOLS_BY_NAME: dict[str, dict] = {t["function"]["name"]: t for t in TOOLS}


def _is_type(value: Any, type_name: str) -> bool:
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "null":
        return value is None
    if type_name == "object":
        return isinstance(value, dict)
    if type_name == "array":
        return isinstance(value, list)
    return False


def validate(value: Any, schema: dict) -> bool:
    """Check ``value`` against a JSON schema (type, enum, properties, required,
    additionalProperties=false, items).  Enough for the catalogue's schemas."""
    types = schema.get("type")
    if types is not None:
        options = types if isinstance(types, list) else [types]
        if not any(_is_type(value, t) for t in options):
            return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(key not in value for key in schema.get("required", [])):
            return False
        for key, item in value.items():
            if key in props:
                if not validate(item, props[key]):
                    return False
            elif schema.get("additionalProperties") is False:
                return False
    if isinstance(value, list) and "items" in schema:
        return all(validate(item, schema["items"]) for item in value)
    return True
