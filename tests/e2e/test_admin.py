"""Plugin admin: listing, a live swap of the tool parser to the K2 parser, rollback, auth."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import ADMIN_TOKEN, ROOT
from helpers import TOOLS

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def plugin_file(name: str) -> bytes:
    dirs = [os.environ.get("K3_PLUGIN_DIR"), ROOT / "plugins" / "target" / "wasm32-wasip2" / "release"]
    for d in dirs:
        if d and (Path(d) / name).exists():
            return (Path(d) / name).read_bytes()
    raise FileNotFoundError(f"{name} not found in {dirs} (build the plugins)")


def active(http, stage):
    stages = {s["stage"]: s for s in http.get("/admin/plugins", headers=AUTH).json()["stages"]}
    s = stages[stage]
    return next(v for v in s["versions"] if v["id"] == s["active"])


def weather_call(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Oslo in fahrenheit?"}],
        tools=TOOLS,
        temperature=0,
        max_tokens=600,
    )
    return r.choices[0]


def test_admin_needs_the_token(http):
    assert http.get("/admin/plugins").status_code == 401
    assert http.get("/admin/plugins", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = http.put("/admin/plugins/tool-parser", content=b"\0asm")
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert http.post("/admin/plugins/tool-parser/rollback").status_code == 401


def test_list_shows_stages_and_counters(http):
    body = http.get("/admin/plugins", headers=AUTH).json()
    stages = {s["stage"]: s for s in body["stages"]}
    assert {"chat-template", "reasoning-parser", "tool-parser"} <= set(stages)
    for s in stages.values():
        assert s["active"] is not None
        v = next(v for v in s["versions"] if v["active"])
        assert v["digest"] and v["name"] and "calls" in v and "errors" in v


def test_live_swap_to_k2_parser_and_rollback(http, client, model_name, server):
    before = active(http, "tool-parser")
    assert before["name"] == "kimi-k3-tools"
    # The model calls the tool (its arguments are test_tools.py's business).
    choice = weather_call(client, model_name)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    json.loads(choice.message.tool_calls[0].function.arguments)

    r = http.put(
        "/admin/plugins/tool-parser",
        content=plugin_file("kimi_k2_tools.wasm"),
        headers={**AUTH, "Content-Type": "application/wasm"},
    )
    assert r.status_code == 200, r.text
    try:
        swapped = r.json()["activated"]
        assert swapped["name"] != before["name"] and swapped["active"]
        assert active(http, "tool-parser")["id"] == swapped["id"]
        # The K2 parser does not understand K3's tool markup: no tool calls come back now.
        choice = weather_call(client, model_name)
        assert choice.finish_reason != "tool_calls"
        assert not choice.message.tool_calls
        metrics = http.get("/metrics").text
        assert 'k3serve_plugin_calls_total{stage="tool-parser",version="kimi-k2' in metrics
    finally:
        r = http.post("/admin/plugins/tool-parser/rollback", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["activated"]["id"] == before["id"]
    choice = weather_call(client, model_name)
    assert choice.finish_reason == "tool_calls"


def test_bad_uploads_are_rejected(http):
    r = http.put("/admin/plugins/tool-parser", content=b"definitely not wasm", headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "plugin_rejected"
    # A valid component for another stage does not type-check as a tool parser.
    r = http.put(
        "/admin/plugins/tool-parser", content=plugin_file("kimi_k3_reasoning.wasm"), headers=AUTH
    )
    assert r.status_code == 400, r.text
    r = http.put("/admin/plugins/no-such-stage", content=b"\0asm", headers=AUTH)
    assert r.status_code == 404
    assert active(http, "tool-parser")["name"] == "kimi-k3-tools"
