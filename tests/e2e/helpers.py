"""Shared test data: tools from the k3-mini training catalogue, a JSON-schema check, answers."""

from __future__ import annotations

import re
import sys
from pathlib import Path

# the JSON-schema check the training data uses (reference/k3ref/data/tools_catalog.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "reference"))
from k3ref.data.tools_catalog import tool  # noqa: E402
from k3ref.data.tools_catalog import validate as validates  # noqa: E402,F401


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


def answer_number(text: str | None) -> int | None:
    """The number in k3-mini's "The answer is N." reply."""
    m = re.search(r"answer is (-?\d+)", text or "")
    return int(m.group(1)) if m else None


def arithmetic(a: int, op: str, b: int) -> tuple[str, int]:
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op if op != '*' else '×'} {b}?", value


def recall_messages(question: str = "What is my lucky number?", number: int = 417, turns: int = 1) -> list[dict]:
    """A multi-turn conversation whose last question is answered from the first turn, with `turns`
    answered sums in between (the training data's recall conversations have 1 to 3; with none,
    the model's wording drifts: MODEL_CARD.md, "Vision").

    Thinking-off tests use it: k3-mini answers recall without a trace, while multi-digit arithmetic
    needs its think trace (MODEL_CARD.md gives both accuracies)."""
    messages = [
        {"role": "user", "content": f"Hi! My name is Rosa. I live in Oslo. My lucky number is {number}."},
        {"role": "assistant", "content": "Nice to meet you. I will remember that."},
    ]
    for i in range(turns):
        a, b = 1200 + 37 * i, 3400 + 11 * i
        messages += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"The answer is {a + b}."},
        ]
    return messages + [{"role": "user", "content": question}]


RECALL_ANSWERS = {
    "What is my name?": "Your name is Rosa.",
    "Which city do I live in?": "You live in Oslo.",
    "What is my lucky number?": "Your lucky number is 417.",
}
