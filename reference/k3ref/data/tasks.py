"""Seeded synthetic chat tasks for k3-mini: generation, rendering helpers, loss masks, checking.

Every generator is a pure function of the ``random.Random`` it is given, so a seed fixes the corpus.
The tasks are small, regular and exactly checkable so a ~20M-parameter model can learn them in
minutes: arithmetic with digit-by-digit think traces, tool calls with arguments copied from the
request, recall of facts from earlier turns, key/value retrieval from a long message, JSON answers
under ``response_format``, and short templated prose.
"""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from . import tools_catalog
from .render import CLOSE, END_OF_MSG, OPEN, SEP, render, to_json

TASK_KINDS = ["arithmetic", "tool_use", "recall", "kv_retrieval", "json_answer", "prose"]
EFFORTS = ["low", "medium", "high", "max"]
# Mix for training: tool use and arithmetic carry most of the signal; kv_retrieval is long
# (2-3k tokens each) so it gets a small share of conversations.
TRAINING_WEIGHTS = {
    "arithmetic": 0.26,
    "tool_use": 0.28,
    "recall": 0.12,
    "kv_retrieval": 0.07,
    "json_answer": 0.13,
    "prose": 0.14,
}
THINKING_RATE = 0.7


@dataclass
class Example:
    kind: str
    messages: list[dict]  # the whole conversation, final assistant message included
    tools: list[dict] | None
    options: dict  # render kwargs: thinking, thinking_effort, tool_choice, response_format
    expected: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# rendering helpers


def render_kwargs(ex: Example) -> dict:
    return {
        "thinking": ex.options.get("thinking", True),
        "thinking_effort": ex.options.get("thinking_effort", "max"),
        "tool_choice": ex.options.get("tool_choice"),
        "response_format": ex.options.get("response_format"),
    }


def prompt_text(ex: Example) -> str:
    """The evaluation prompt: everything before the final assistant message, plus the
    generation prompt."""
    return render(ex.messages[:-1], ex.tools, add_generation_prompt=True, **render_kwargs(ex))


def full_text(ex: Example) -> str:
    """The training text: the whole conversation."""
    return render(ex.messages, ex.tools, **render_kwargs(ex))


_ASSISTANT_OPEN = re.compile(
    re.escape(OPEN) + r'message role="assistant"(?: [a-z_]+="[^"]*")*' + re.escape(SEP)
)


def train_segments(ex: Example) -> list[tuple[str, bool]]:
    """``full_text`` cut into consecutive segments; True marks loss-bearing text (each assistant
    turn's body after its opening marker, up to and including ``<|end_of_msg|>``).  Every cut is
    next to a special marker, so tokenizing the segments separately equals tokenizing the whole."""
    text = full_text(ex)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for match in _ASSISTANT_OPEN.finditer(text):
        if match.start() < pos:
            continue
        end = text.find(END_OF_MSG, match.end())
        if end < 0:
            raise ValueError("assistant message without <|end_of_msg|>")
        end += len(END_OF_MSG)
        segments.append((text[pos : match.end()], False))
        segments.append((text[match.end() : end], True))
        pos = end
    if pos < len(text):
        segments.append((text[pos:], False))
    return [(s, m) for s, m in segments if s]


# ----------------------------------------------------------------------------------------------
# small helpers

NAMES = [
    "Alice", "Bruno", "Chen", "Dara", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
    "Kira", "Luca", "Maya", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara",
    "Umar", "Vera", "Wen", "Yara", "Zoe",
]
CITIES = [
    "Paris", "Tokyo", "Oslo", "Lima", "Cairo", "Berlin", "Madrid", "Seoul", "Austin", "Dublin",
    "Lagos", "Hanoi", "Quito", "Prague", "Perth", "Denver", "Milan", "Nairobi", "Kyoto", "Porto",
]
COLOURS = ["red", "blue", "green", "teal", "amber", "violet", "orange", "silver", "pink", "olive"]
FRUITS = ["mango", "apple", "cherry", "kiwi", "pear", "plum", "banana", "fig", "lime", "peach"]
ANIMALS = {
    "fox": ("clever", "forests"),
    "otter": ("playful", "rivers"),
    "camel": ("patient", "deserts"),
    "penguin": ("hardy", "cold coasts"),
    "owl": ("quiet", "woodlands"),
    "dolphin": ("friendly", "the sea"),
    "goat": ("curious", "mountains"),
    "beaver": ("busy", "wetlands"),
}
ITEMS = ["book", "scarf", "lamp", "mug", "plant", "map", "pen", "clock", "kite", "puzzle"]
EVENTS = ["team meeting", "dentist visit", "yoga class", "book club", "piano lesson", "field trip"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD"]
SYMBOLS = ["ACME", "GLOBX", "NOVA", "ZETA", "ORBT", "KITE", "LUMA", "VOLT"]
PRODUCTS = ["headphones", "running shoes", "desk lamp", "backpack", "coffee grinder", "keyboard"]
SENSORS = ["thermo-1", "hygro-2", "baro-3", "lux-4", "flow-5"]
TAGS = ["lab", "roof", "cellar", "north", "south", "daily", "test", "field"]
LABELS = ["tea", "pasta", "laundry", "break", "study", "bread", "nap", "workout"]
TITLES = ["Planning", "Lunch", "Review", "Kickoff", "Retro", "Workshop", "Demo", "Sync"]
JOBS = ["nurse", "baker", "pilot", "teacher", "chemist", "carpenter", "designer", "farmer"]
PETS = ["Biscuit", "Pixel", "Mochi", "Rex", "Luna", "Pepper", "Ziggy", "Nemo"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are k3-mini, a small and precise assistant."]


def _maybe_system(rng: random.Random) -> list[dict]:
    if rng.random() < 0.2:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    return []


def _assistant(think: str, response: str, thinking: bool, calls: list | None = None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": response}
    if thinking:
        msg["reasoning_content"] = think
    if calls:
        msg["tool_calls"] = calls
    return msg


def _by_effort(effort: str, low: list[str], medium: list[str], high: list[str], top: list[str]) -> str:
    """Join trace pieces: low < medium < high < max, each adding lines."""
    lines = list(low)
    if effort in ("medium", "high", "max"):
        lines = medium + lines
    if effort in ("high", "max"):
        lines = lines + high
    if effort == "max":
        lines = lines + top
    return "\n".join(lines)


def _options(thinking: bool, effort: str, tool_choice: Any = None, response_format: Any = None) -> dict:
    return {
        "thinking": thinking,
        "thinking_effort": effort,
        "tool_choice": tool_choice,
        "response_format": response_format,
    }


# ----------------------------------------------------------------------------------------------
# arithmetic


def _column_add(a: int, b: int) -> tuple[list[str], int]:
    """Digit-by-digit addition lines, least significant column first."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, lines, digits = 0, [], []
    for k in range(max(len(da), len(db))):
        x = int(da[k]) if k < len(da) else 0
        y = int(db[k]) if k < len(db) else 0
        s = x + y + carry
        lines.append(f"column {k + 1}: {x} + {y} + {carry} = {s}, write {s % 10}, carry {s // 10}")
        digits.append(str(s % 10))
        carry = s // 10
    if carry:
        lines.append(f"final carry: write {carry}")
        digits.append(str(carry))
    lines.append("digits right to left: " + " ".join(digits))
    return lines, a + b


def _column_sub(a: int, b: int) -> tuple[list[str], int]:
    """Digit-by-digit subtraction (a >= b) with borrows, least significant column first."""
    da, db = str(a)[::-1], str(b)[::-1]
    borrow, lines, digits = 0, [], []
    for k in range(len(da)):
        x = int(da[k])
        y = int(db[k]) if k < len(db) else 0
        d = x - y - borrow
        if d < 0:
            lines.append(f"column {k + 1}: {x} - {y} - {borrow} < 0, borrow: {x + 10} - {y} - {borrow} = {d + 10}, write {d + 10}, borrow 1")
            digits.append(str(d + 10))
            borrow = 1
        else:
            lines.append(f"column {k + 1}: {x} - {y} - {borrow} = {d}, write {d}, borrow 0")
            digits.append(str(d))
            borrow = 0
    lines.append("digits right to left: " + " ".join(digits))
    return lines, a - b


def _column_mul_digit(a: int, d: int) -> tuple[list[str], int]:
    da = str(a)[::-1]
    carry, lines, digits = 0, [], []
    for k, ch in enumerate(da):
        x = int(ch)
        p = x * d + carry
        lines.append(f"{x} * {d} + {carry} = {p}, write {p % 10}, carry {p // 10}")
        digits.append(str(p % 10))
        carry = p // 10
    if carry:
        lines.append(f"final carry: write {carry}")
        digits.append(str(carry))
    lines.append("digits right to left: " + " ".join(digits))
    return lines, a * d


ARITH_PROMPTS = {
    "+": ["What is {a} + {b}?", "Compute {a} plus {b}.", "Add {a} and {b}.", "Calculate {a} + {b}."],
    "-": ["What is {a} - {b}?", "Compute {a} minus {b}.", "Subtract {b} from {a}.", "Calculate {a} - {b}."],
    "*": ["What is {a} × {b}?", "Compute {a} times {b}.", "Multiply {a} by {b}.", "Calculate {a} * {b}."],
}


def arithmetic_trace(a: int, op: str, b: int, effort: str) -> tuple[str, int]:
    """The think trace and result of ``a op b``."""
    head: list[str] = []
    if op == "+":
        steps, result = _column_add(a, b)
        head = [f"Add {a} + {b} column by column from the right."]
    elif op == "-":
        if a >= b:
            steps, result = _column_sub(a, b)
            head = [f"Subtract {a} - {b} column by column from the right."]
        else:
            steps, r = _column_sub(b, a)
            result = -r
            steps = [f"{a} is smaller than {b}, so compute {b} - {a} and negate."] + steps
            head = [f"Subtract {a} - {b}."]
    else:
        steps = []
        partials = []
        for k, ch in enumerate(str(b)[::-1]):
            lines, p = _column_mul_digit(a, int(ch))
            shifted = p * 10**k
            steps.append(f"partial {k + 1}: {a} * {ch}" + (f" shifted {k}" if k else ""))
            steps.extend(lines)
            steps.append(f"partial {k + 1} = {shifted}")
            partials.append(shifted)
        if len(partials) == 2:
            steps.append(f"sum the partials: {partials[0]} + {partials[1]}")
            add_lines, _ = _column_add(partials[0], partials[1])
            steps.extend(add_lines)
        result = a * b
        head = [f"Multiply {a} * {b} one digit of {b} at a time, from the right."]
    ops = {"+": "+", "-": "-", "*": "*"}
    trace = _by_effort(
        effort,
        steps + [f"result: {result}"],
        head,
        [f"So {a} {ops[op]} {b} = {result}."],
        ["The digits were checked column by column."],
    )
    return trace, result


def _arith_operands(rng: random.Random) -> tuple[int, str, int]:
    op = rng.choice(["+", "+", "-", "-", "*", "*"])
    if op == "*":
        a = rng.randint(10, 999)
        b = rng.randint(2, 99)
    else:
        a = rng.randint(10, 9999)
        b = rng.randint(10, 9999)
    return a, op, b


def _arithmetic_turn(rng: random.Random, thinking: bool, effort: str) -> tuple[dict, dict, int]:
    a, op, b = _arith_operands(rng)
    question = rng.choice(ARITH_PROMPTS[op]).format(a=a, b=b)
    trace, result = arithmetic_trace(a, op, b, effort)
    response = f"The answer is {result}."
    return {"role": "user", "content": question}, _assistant(trace, response, thinking), result


def gen_arithmetic(rng: random.Random, thinking: bool, effort: str) -> Example:
    user, reply, result = _arithmetic_turn(rng, thinking, effort)
    messages = _maybe_system(rng) + [user, reply]
    return Example(
        "arithmetic", messages, None, _options(thinking, effort),
        {"response": reply["content"], "answer": result},
    )


# ----------------------------------------------------------------------------------------------
# tool use: each request generator returns (request sentence, arguments, result, final sentence)


def _money(rng: random.Random, low: int, high: int) -> float | int:
    if rng.random() < 0.3:
        return rng.randint(low, high)
    return round(rng.randint(low * 100, high * 100) / 100, 2)


def _req_weather(rng):
    city, unit = rng.choice(CITIES), rng.choice(["celsius", "fahrenheit"])
    text = rng.choice([
        "What is the weather in {c} in {u}?", "Check the weather for {c}, in {u} please.",
        "How warm is it in {c}? Use {u}.",
    ]).format(c=city, u=unit)
    temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(25, 95)
    cond = rng.choice(CONDITIONS)
    result = {"city": city, "condition": cond, "temperature": temp}
    final = f"It is {temp} degrees {unit} and {cond} in {city}."
    return text, {"city": city, "unit": unit}, result, final


def _req_currency(rng):
    amount = _money(rng, 5, 900)
    src, dst = rng.sample(CURRENCIES, 2)
    text = rng.choice([
        "Convert {a} {s} to {d}.", "How much is {a} {s} in {d}?", "Please change {a} {s} into {d}.",
    ]).format(a=amount, s=src, d=dst)
    converted = round(amount * rng.uniform(0.5, 1.6), 2)
    result = {"amount": converted, "currency": dst}
    final = f"{amount} {src} is {converted} {dst}."
    return text, {"amount": amount, "from_currency": src, "to_currency": dst}, result, final


def _req_timer(rng):
    minutes, label, repeat = rng.randint(1, 120), rng.choice(LABELS), rng.random() < 0.4
    kind = "a repeating timer" if repeat else "a one-time timer"
    text = rng.choice([
        "Set {k} for {m} minutes called {l}.", "Start {k} named {l} for {m} minutes.",
    ]).format(k=kind, m=minutes, l=label)
    tid = f"t-{rng.randint(100, 999)}"
    result = {"ok": True, "timer_id": tid}
    final = f"The timer {label} is set for {minutes} minutes (id {tid})."
    return text, {"minutes": minutes, "label": label, "repeat": repeat}, result, final


def _req_event(rng):
    title = rng.choice(TITLES)
    date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    people = rng.sample(NAMES, rng.randint(1, 3))
    all_day = rng.random() < 0.5
    who = people[0] if len(people) == 1 else ", ".join(people[:-1]) + " and " + people[-1]
    text = "Create {k} event called {t} on {d} with {w}.".format(
        k="an all-day" if all_day else "a timed", t=title, d=date, w=who
    )
    eid = f"ev-{rng.randint(1000, 9999)}"
    result = {"event_id": eid, "status": "created"}
    final = f"The event {title} on {date} is created (id {eid})."
    args = {"title": title, "date": date, "attendees": people, "all_day": all_day}
    return text, args, result, final


def _req_products(rng):
    query, price, stock, limit = rng.choice(PRODUCTS), _money(rng, 20, 400), rng.random() < 0.6, rng.randint(1, 10)
    text = "Find {q} under {p} dollars, {s}, and show {n} results.".format(
        q=query, p=price, s="in stock only" if stock else "including out of stock", n=limit
    )
    count = rng.randint(0, limit)
    result = {"count": count, "query": query}
    final = f"I found {count} matching {query} under {price} dollars."
    return text, {"query": query, "max_price": price, "in_stock": stock, "limit": limit}, result, final


def _req_settings(rng):
    theme, size, reset = rng.choice(["dark", "light", "sepia"]), rng.randint(10, 24), rng.random() < 0.3
    text = "Switch to the {t} theme with font size {s}{r}.".format(
        t=theme, s=size, r=", and reset everything else first" if reset else ", keeping my other settings"
    )
    result = {"ok": True}
    final = f"Your display now uses the {theme} theme at font size {size}."
    return text, {"settings": {"theme": theme, "font_size": size}, "reset": reset}, result, final


def _req_message(rng):
    who = rng.choice(NAMES)
    body = rng.choice([
        "see you at noon", "the report is ready", "call me back", "running late", "thanks for today",
    ])
    prio = rng.randint(1, 5)
    reply = f"m-{rng.randint(100, 999)}" if rng.random() < 0.4 else None
    text = f'Send {who} the message "{body}" with priority {prio}' + (
        f", as a reply to {reply}." if reply else ", not as a reply."
    )
    mid = f"m-{rng.randint(1000, 9999)}"
    result = {"delivered": True, "message_id": mid}
    final = f"Your message to {who} was delivered (id {mid})."
    return text, {"recipient": who, "text": body, "priority": prio, "reply_to": reply}, result, final


def _req_measure(rng):
    sensor = rng.choice(SENSORS)
    value = round(rng.uniform(-20, 120), 1)
    tags = rng.sample(TAGS, rng.randint(1, 2))
    note = rng.choice(["after calibration", "manual reading", "sensor moved"]) if rng.random() < 0.4 else None
    text = f"Log a reading of {value} from sensor {sensor} tagged {' and '.join(tags)}" + (
        f', with the note "{note}".' if note else ", with no note."
    )
    rid = f"r-{rng.randint(1000, 9999)}"
    result = {"reading_id": rid, "stored": True}
    final = f"The reading {value} from {sensor} is stored (id {rid})."
    return text, {"sensor": sensor, "value": value, "tags": tags, "note": note}, result, final


def _req_stock(rng):
    sym = rng.choice(SYMBOLS)
    text = rng.choice(["What is the price of {s}?", "Get me the latest {s} stock price."]).format(s=sym)
    price = round(rng.uniform(5, 500), 2)
    result = {"price": price, "symbol": sym}
    final = f"{sym} trades at {price} dollars."
    return text, {"symbol": sym}, result, final


REQUESTS: dict[str, Callable] = {
    "get_weather": _req_weather,
    "convert_currency": _req_currency,
    "set_timer": _req_timer,
    "create_event": _req_event,
    "search_products": _req_products,
    "update_settings": _req_settings,
    "send_message": _req_message,
    "log_measurement": _req_measure,
    "get_stock_price": _req_stock,
}
TOOL_PURPOSE = {
    "get_weather": "the weather",
    "convert_currency": "a currency conversion",
    "set_timer": "a timer",
    "create_event": "a calendar event",
    "search_products": "a product search",
    "update_settings": "a settings change",
    "send_message": "a message to send",
    "log_measurement": "a sensor reading to log",
    "get_stock_price": "a stock price",
}


def _arg_text(args: dict) -> str:
    return ", ".join(f"{k}={v if isinstance(v, str) else to_json(v)}" for k, v in args.items())


def _declared_tools(rng: random.Random, needed: list[str]) -> list[dict]:
    others = [n for n in REQUESTS if n not in needed]
    names = list(dict.fromkeys(needed)) + rng.sample(others, rng.randint(1, 2))
    rng.shuffle(names)
    return [copy.deepcopy(tools_catalog.TOOLS_BY_NAME[n]) for n in names]


def _call_id(rng: random.Random) -> str:
    return "call_" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))


def gen_tool_use(rng: random.Random, thinking: bool, effort: str, *, round_trip: bool) -> Example:
    """A tool request.  ``round_trip``: the conversation goes on through the tool results to the
    final answer (training); otherwise it ends with the assistant's call (evaluation)."""
    r = rng.random()
    system = _maybe_system(rng)
    if r < 0.15:  # tools declared but none needed
        tools = _declared_tools(rng, [])
        if rng.random() < 0.5:
            user, reply, result = _arithmetic_turn(rng, thinking, effort)
            answer = reply["content"]
        else:
            prose = _prose_turn(rng, thinking, effort)
            user, reply, answer = prose[0], prose[1], prose[1]["content"]
        low = "No tool is needed for this."
        reply = dict(reply)
        if thinking:
            reply["reasoning_content"] = low + "\n" + reply["reasoning_content"]
        tool_choice = "none" if rng.random() < 0.3 else None
        return Example(
            "tool_use", system + [user, reply], tools, _options(thinking, effort, tool_choice),
            {"calls": [], "response": answer},
        )
    n_calls = 2 if r > 0.8 else 1
    names = [rng.choice(list(REQUESTS)) for _ in range(n_calls)]
    reqs = [REQUESTS[n](rng) for n in names]
    text = reqs[0][0] if n_calls == 1 else reqs[0][0] + " Also: " + reqs[1][0]
    tools = _declared_tools(rng, names)
    calls, plan = [], []
    for name, (_, args, _, _) in zip(names, reqs):
        calls.append({"id": _call_id(rng), "type": "function", "function": {"name": name, "arguments": args}})
        plan.append(f"Call {name} with {_arg_text(args)}.")
    think = _by_effort(
        effort,
        plan,
        ["The user wants " + " and ".join(TOOL_PURPOSE[n] for n in names) + "."],
        ["Every argument is given in the request."],
        ["Then answer from the tool result."],
    )
    lead = "Let me check." if n_calls == 1 else "Let me do both."
    call_msg = _assistant(think, lead, thinking, calls)
    messages = system + [{"role": "user", "content": text}, call_msg]
    expected = {"calls": [{"name": n, "arguments": q[1]} for n, q in zip(names, reqs)]}
    tool_choice = None
    if round_trip:
        results = [
            {"role": "tool", "tool_call_id": c["id"], "content": json.dumps(q[2], separators=(",", ":"))}
            for c, q in zip(calls, reqs)
        ]
        if len(results) == 2 and rng.random() < 0.3:
            results.reverse()  # the renderer puts them back in call order
        final = " ".join(q[3] for q in reqs)
        think2 = _by_effort(
            effort,
            ["Report the result."] if n_calls == 1 else ["Report both results."],
            ["The tool returned " + "; ".join(_arg_text(q[2]) for q in reqs) + "."],
            [],
            [],
        )
        messages += results + [_assistant(think2, final, thinking)]
        expected = {"calls": [], "response": final}
    elif rng.random() < 0.3:
        tool_choice = "required"
    return Example("tool_use", messages, tools, _options(thinking, effort, tool_choice), expected)


# ----------------------------------------------------------------------------------------------
# prose


def _prose_turn(rng: random.Random, thinking: bool, effort: str) -> tuple[dict, dict]:
    pattern = rng.randrange(4)
    if pattern == 0:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        ask = f"Write a short thank-you note to {name} for the {item}."
        reply = f"Dear {name}, thank you so much for the {item}. It made my day. Best wishes."
        plan = f"A thank-you note to {name} about the {item}."
    elif pattern == 1:
        animal = rng.choice(list(ANIMALS))
        adj, home = ANIMALS[animal]
        ask = f"Describe the {animal} in one sentence."
        reply = f"The {animal} is a {adj} animal that lives in {home}."
        plan = f"One sentence about the {animal}: {adj}, lives in {home}."
    elif pattern == 2:
        event, day = rng.choice(EVENTS), rng.choice(DAYS)
        ask = f"Write a two-line reminder about the {event} on {day}."
        reply = f"Reminder: the {event} is on {day}.\nPlease be on time."
        plan = f"Two lines: the {event}, {day}, be on time."
    else:
        name = rng.choice(NAMES)
        ask = f"Say hello to {name}."
        reply = f"Hello, {name}! It is nice to meet you."
        plan = f"A greeting for {name}."
    think = _by_effort(effort, [plan], [], ["Keep it short and friendly."], ["No tools are needed."])
    return {"role": "user", "content": ask}, _assistant(think, reply, thinking)


def gen_prose(rng: random.Random, thinking: bool, effort: str) -> Example:
    user, reply = _prose_turn(rng, thinking, effort)
    return Example(
        "prose", _maybe_system(rng) + [user, reply], None, _options(thinking, effort),
        {"response": reply["content"]},
    )


# ----------------------------------------------------------------------------------------------
# recall

FACTS = {
    # key: (statement, question, answer template, pool)
    "name": ("My name is {v}.", "What is my name?", "Your name is {v}.", NAMES),
    "city": ("I live in {v}.", "Which city do I live in?", "You live in {v}.", CITIES),
    "colour": ("My favourite colour is {v}.", "What is my favourite colour?", "Your favourite colour is {v}.", COLOURS),
    "fruit": ("My favourite fruit is {v}.", "What is my favourite fruit?", "Your favourite fruit is {v}.", FRUITS),
    "number": ("My lucky number is {v}.", "What is my lucky number?", "Your lucky number is {v}.", None),
    "pet": ("My dog is called {v}.", "What is my dog called?", "Your dog is called {v}.", PETS),
    "job": ("I work as a {v}.", "What is my job?", "You work as a {v}.", JOBS),
}


def gen_recall(rng: random.Random, thinking: bool, effort: str) -> Example:
    keys = rng.sample(list(FACTS), rng.randint(3, 5))
    values = {k: (str(rng.randint(1, 999)) if FACTS[k][3] is None else rng.choice(FACTS[k][3])) for k in keys}
    intro = "Hi! " + " ".join(FACTS[k][0].format(v=values[k]) for k in keys)
    ack_think = _by_effort(
        effort, ["Facts: " + ", ".join(f"{k}={values[k]}" for k in keys) + "."],
        [], ["Remember them for later."], [],
    )
    messages = _maybe_system(rng) + [
        {"role": "user", "content": intro},
        _assistant(ack_think, "Nice to meet you. I will remember that.", thinking),
    ]
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.5:
            user, reply, _ = _arithmetic_turn(rng, thinking, "low")
        else:
            user, reply = _prose_turn(rng, thinking, "low")
        messages += [user, reply]
    key = rng.choice(keys)
    _, question, answer_t, _ = FACTS[key]
    answer = answer_t.format(v=values[key])
    think = _by_effort(
        effort, [f"The user told me their {key}: {values[key]}."], ["Look back at the first message."], [], [],
    )
    messages += [{"role": "user", "content": question}, _assistant(think, answer, thinking)]
    return Example(
        "recall", messages, None, _options(thinking, effort), {"response": answer, "answer": values[key]},
    )


# ----------------------------------------------------------------------------------------------
# key/value retrieval from a long message

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_ALNUM = "abcdefghijkmnpqrstuvwxyz23456789"


def gen_kv_retrieval(rng: random.Random, thinking: bool, effort: str, n_pairs: int | None = None) -> Example:
    n = n_pairs if n_pairs is not None else rng.randint(140, 270)
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < n:
        k = "".join(rng.choice(_LETTERS) for _ in range(3)) + "-" + str(rng.randint(10, 99))
        if k not in seen:
            seen.add(k)
            keys.append(k)
    values = ["".join(rng.choice(_ALNUM) for _ in range(4)) for _ in keys]
    target = rng.randrange(n)
    key, value = keys[target], values[target]
    body = "\n".join(f"{k}: {v}" for k, v in zip(keys, values))
    ask = f"Here is a list of records.\n{body}\nWhat is the value of {key}?"
    answer = f"The value of {key} is {value}."
    think = _by_effort(effort, [f"{key}: {value}"], [f"Find the line for {key}."], [f"So the value is {value}."], [])
    messages = [{"role": "user", "content": ask}, _assistant(think, answer, thinking)]
    return Example(
        "kv_retrieval", messages, None, _options(thinking, effort), {"response": answer, "answer": value},
    )


# ----------------------------------------------------------------------------------------------
# JSON answers under response_format


def _compact(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def gen_json_answer(rng: random.Random, thinking: bool, effort: str) -> Example:
    pattern = rng.randrange(3)
    if pattern == 0:
        name, age, city, active = rng.choice(NAMES), rng.randint(18, 90), rng.choice(CITIES), rng.random() < 0.5
        ask = f"Make a JSON record for {name}, age {age}, from {city}, {'active' if active else 'not active'}."
        obj = {"name": name, "age": age, "city": city, "active": active}
        schema = {
            "type": "object",
            "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"},
                "city": {"type": "string"}, "active": {"type": "boolean"},
            },
            "required": ["name", "age", "city", "active"],
        }
    elif pattern == 1:
        item, qty, price = rng.choice(ITEMS), rng.randint(1, 20), _money(rng, 1, 90)
        ask = f"Return JSON for an order of {qty} of the item {item} at {price} dollars each."
        obj = {"item": item, "quantity": qty, "unit_price": price}
        schema = {
            "type": "object",
            "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}, "unit_price": {"type": "number"}},
            "required": ["item", "quantity", "unit_price"],
        }
    else:
        colours = rng.sample(COLOURS, rng.randint(2, 4))
        ask = "Give me JSON listing the colours " + ", ".join(colours) + " under colors, with their count."
        obj = {"colors": colours, "count": len(colours)}
        schema = {
            "type": "object",
            "properties": {"colors": {"type": "array", "items": {"type": "string"}}, "count": {"type": "integer"}},
            "required": ["colors", "count"],
        }
    if rng.random() < 0.5:
        response_format: dict = {"type": "json_object"}
    else:
        response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    answer = _compact(obj)
    think = _by_effort(
        effort, ["Fields: " + _arg_text(obj) + "."], ["Build one JSON object."],
        ["No code fences."], ["Keys in the order they were asked."],
    )
    messages = _maybe_system(rng) + [{"role": "user", "content": ask}, _assistant(think, answer, thinking)]
    return Example(
        "json_answer", messages, None, _options(thinking, effort, None, response_format),
        {"object": obj, "response": answer},
    )


# ----------------------------------------------------------------------------------------------
# sampling API


def sample_example(kind: str, rng: random.Random, *, thinking: bool, effort: str) -> Example:
    """One evaluation example of ``kind`` (tool_use stops at the assistant's call)."""
    if effort not in EFFORTS:
        raise ValueError(f"unknown effort {effort!r}")
    if kind == "arithmetic":
        return gen_arithmetic(rng, thinking, effort)
    if kind == "tool_use":
        return gen_tool_use(rng, thinking, effort, round_trip=False)
    if kind == "recall":
        return gen_recall(rng, thinking, effort)
    if kind == "kv_retrieval":
        return gen_kv_retrieval(rng, thinking, effort)
    if kind == "json_answer":
        return gen_json_answer(rng, thinking, effort)
    if kind == "prose":
        return gen_prose(rng, thinking, effort)
    raise ValueError(f"unknown task kind {kind!r}; expected one of {TASK_KINDS}")


def sample_training_conversation(rng: random.Random, weights: dict[str, float] | None = None) -> Example:
    """One training conversation: kinds mixed by `weights` (default TRAINING_WEIGHTS), thinking on 70% of the
    time, efforts uniform; tool use is the whole round trip 85% of the time."""
    weights = weights or TRAINING_WEIGHTS
    kind = rng.choices(TASK_KINDS, weights=[weights.get(k, 0.0) for k in TASK_KINDS])[0]
    thinking = rng.random() < THINKING_RATE
    effort = rng.choice(EFFORTS)
    if kind == "tool_use":
        return gen_tool_use(rng, thinking, effort, round_trip=rng.random() < 0.85)
    return sample_example(kind, rng, thinking=thinking, effort=effort)


# ----------------------------------------------------------------------------------------------
# parsing and checking generated text


@dataclass
class ParsedTurn:
    well_formed: bool
    has_think: bool = False
    think: str | None = None
    response: str | None = None
    calls: list[dict] = field(default_factory=list)  # {"name", "arguments"}; arguments typed
    calls_ok: bool = True  # every call block parsed (name present, argument values decodable)
    error: str = ""


_MARKER = re.compile(
    re.escape(OPEN) + r'([a-z_]+)((?: [a-z_]+="[^"]*")*)' + re.escape(SEP)
    + "|" + re.escape(CLOSE) + r"([a-z_]+)" + re.escape(SEP)
)
_ATTR = re.compile(r' ([a-z_]+)="([^"]*)"')


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _lex(text: str) -> list[tuple]:
    """Tokens: ("open", tag, attrs) / ("close", tag) / ("text", str)."""
    out: list[tuple] = []
    pos = 0
    for m in _MARKER.finditer(text):
        if m.start() > pos:
            out.append(("text", text[pos : m.start()]))
        if m.group(1) is not None:
            attrs = {k: _unescape(v) for k, v in _ATTR.findall(m.group(2))}
            out.append(("open", m.group(1), attrs))
        else:
            out.append(("close", m.group(3)))
        pos = m.end()
    if pos < len(text):
        out.append(("text", text[pos:]))
    return out


def parse_assistant_turn(generated: str, *, thinking: bool) -> ParsedTurn:
    """Parse a generated assistant turn (the continuation of the generation prompt, which opened
    the think block, or the response block when thinking is off)."""
    text = generated
    cut = text.find(END_OF_MSG)
    if cut >= 0:
        text = text[:cut]
    text = OPEN + ("think" if thinking else "response") + SEP + text
    toks = _lex(text)
    turn = ParsedTurn(well_formed=False)
    i = 0

    def block(tag: str) -> str | None:
        """Read  open(tag) [text] close(tag)  at i; return the text or None."""
        nonlocal i
        if i < len(toks) and toks[i][0] == "open" and toks[i][1] == tag:
            j = i + 1
            body = ""
            if j < len(toks) and toks[j][0] == "text":
                body = toks[j][1]
                j += 1
            if j < len(toks) and toks[j] == ("close", tag):
                i = j + 1
                return body
        return None

    if i < len(toks) and toks[i][0] == "open" and toks[i][1] == "think":
        turn.has_think = True
        turn.think = block("think")
        if turn.think is None:
            turn.error = "unclosed think block"
            return turn
    turn.response = block("response")
    if turn.response is None:
        turn.error = "missing or unclosed response block"
        return turn
    if i < len(toks) and toks[i][:2] == ("open", "tools"):
        i += 1
        while i < len(toks) and toks[i][:2] == ("open", "call"):
            attrs = toks[i][2]
            i += 1
            args: dict[str, Any] = {}
            while i < len(toks) and toks[i][0] == "open" and toks[i][1] in ("argument", "json"):
                tag, aattrs = toks[i][1], toks[i][2]
                value_text = block(tag)
                if value_text is None:
                    turn.error = f"unclosed {tag} block"
                    return turn
                if tag == "json":
                    try:
                        parsed = json.loads(value_text)
                        args.update(parsed if isinstance(parsed, dict) else {})
                        turn.calls_ok &= isinstance(parsed, dict)
                    except ValueError:
                        turn.calls_ok = False
                    continue
                if aattrs.get("type") == "string":
                    args[aattrs.get("key", "")] = value_text
                else:
                    try:
                        args[aattrs.get("key", "")] = json.loads(value_text)
                    except ValueError:
                        turn.calls_ok = False
                        args[aattrs.get("key", "")] = value_text
                if "key" not in aattrs:
                    turn.calls_ok = False
            if i < len(toks) and toks[i] == ("close", "call"):
                i += 1
            else:
                turn.error = "unclosed call block"
                return turn
            if not attrs.get("tool"):
                turn.calls_ok = False
            turn.calls.append({"name": attrs.get("tool", ""), "arguments": args})
        if i < len(toks) and toks[i] == ("close", "tools"):
            i += 1
        else:
            turn.error = "unclosed tools block"
            return turn
        if not turn.calls:
            turn.error = "empty tools block"
            return turn
    if i < len(toks) and toks[i] == ("close", "message") and i + 1 == len(toks):
        turn.well_formed = True
    else:
        turn.error = "expected <|close|>message<|sep|> at the end of the turn"
    return turn


def _schema_valid(calls: list[dict], tools: list[dict] | None) -> bool:
    declared = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools or []}
    return all(c["name"] in declared and tools_catalog.validate(c["arguments"], declared[c["name"]]) for c in calls)


def _calls_key(calls: list[dict]) -> list[str]:
    return sorted(json.dumps([c["name"], c["arguments"]], sort_keys=True) for c in calls)


def check(ex: Example, generated: str) -> dict[str, bool]:
    """Score ``generated`` (the raw continuation of ``prompt_text(ex)``, markers included)."""
    thinking = bool(ex.options.get("thinking", True))
    turn = parse_assistant_turn(generated, thinking=thinking)
    response = (turn.response or "").strip() if turn.well_formed else None
    out: dict[str, bool] = {}
    if ex.kind in ("arithmetic", "recall", "kv_retrieval"):
        out["exact"] = response == ex.expected["response"] and not turn.calls
    elif ex.kind == "tool_use":
        expected_calls = ex.expected["calls"]
        out["well_formed"] = turn.well_formed and turn.calls_ok
        if expected_calls:
            out["schema_valid"] = out["well_formed"] and bool(turn.calls) and _schema_valid(turn.calls, ex.tools)
            out["args_exact"] = out["well_formed"] and _calls_key(turn.calls) == _calls_key(expected_calls)
        else:
            out["schema_valid"] = out["well_formed"] and not turn.calls
            out["args_exact"] = out["schema_valid"] and response == ex.expected.get("response")
    elif ex.kind == "json_answer":
        try:
            value = json.loads(response) if response is not None else None
        except ValueError:
            value = None
        out["valid_json"] = isinstance(value, dict)
        out["exact"] = out["valid_json"] and value == ex.expected["object"]
    elif ex.kind == "prose":
        out["well_formed"] = turn.well_formed and bool(response) and not turn.calls
    else:
        raise ValueError(f"unknown task kind {ex.kind!r}")
    if not thinking:
        out["no_think"] = OPEN + "think" not in generated
    return out


def reference_continuation(ex: Example) -> str:
    """The conversation's own final assistant message as a model continuation of prompt_text."""
    prompt, full = prompt_text(ex), full_text(ex)
    if not full.startswith(prompt):
        raise ValueError("prompt_text is not a prefix of full_text")
    return full[len(prompt) :]
