"""Hostile load against a server with small admission limits: more concurrent chats than it
admits get only 200s and 429s (never a plugin 500), an oversize prompt is refused in well under a
second without growing the server's memory, oversize tool lists or impossible `n` / stop ids are
4xx, and a plugin that reaches for a denied interface fails only its own calls, counted."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from conftest import ADMIN_TOKEN, start_server, stop_server
from test_admin import plugin_file

MAX_NUM_SEQS = 4
MAX_WAITING = 12
BODY_LIMIT = 16_000_000


@pytest.fixture(scope="module")
def srv():
    s = start_server([
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-waiting-requests", str(MAX_WAITING),
        "--max-request-body-bytes", str(BODY_LIMIT),
        "--shutdown-timeout", "5",
        "--admin-token", ADMIN_TOKEN,
    ])
    yield s
    stop_server(s)


def plugin_errors(srv) -> float:
    return sum(v for k, v in srv.metrics().items() if k.startswith("k3serve_plugin_errors_total"))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def one_stream(client: httpx.AsyncClient, n: int) -> dict:
    body = {
        "model": "k3-mini",
        "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
        "max_tokens": 24,
        "n": n,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        out = {"status": r.status_code, "retry_after": r.headers.get("retry-after"), "events": []}
        if r.status_code != 200:
            out["body"] = json.loads(await r.aread())
            return out
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
        return out


def test_chats_past_capacity_get_only_200_and_429(srv):
    errors_before = plugin_errors(srv)

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
            return await asyncio.gather(*(one_stream(client, 1 + i % 3) for i in range(60)))

    results = asyncio.run(run())
    statuses = sorted({r["status"] for r in results})
    assert set(statuses) <= {200, 429}, [r for r in results if r["status"] not in (200, 429)]
    assert 200 in statuses and 429 in statuses, statuses
    for r in results:
        if r["status"] == 429:
            assert r["retry_after"] is not None
            assert r["body"]["error"]["code"] in ("too_many_requests", "overloaded")
            continue
        assert r["events"][-1] == "[DONE]", r["events"][-3:]
        assert not any('"error"' in e for e in r["events"]), r["events"]
    assert plugin_errors(srv) == errors_before
    # Every slot came back: a burst of the full admitted size is served again.
    again = asyncio.run(run_n(srv, MAX_NUM_SEQS + MAX_WAITING))
    assert {r["status"] for r in again} == {200}, [r.get("body") for r in again]


async def run_n(srv, count: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
        return await asyncio.gather(*(one_stream(client, 1) for _ in range(count)))


def test_oversize_prompt_is_refused_fast_and_memory_returns(srv):
    message = "All work and no play makes Jack a dull boy. " * 150_000  # 6.6 MB
    body = json.dumps({"model": "k3-mini", "messages": [{"role": "user", "content": message}]})
    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        rss_before = rss_bytes(srv.proc.pid)
        worst = 0.0
        for _ in range(10):
            t = time.monotonic()
            r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            worst = max(worst, time.monotonic() - t)
            assert r.status_code == 400, r.text[:300]
            assert r.json()["error"]["code"] == "context_length_exceeded"
        grown = rss_bytes(srv.proc.pid) - rss_before
    assert worst < 1.0, f"refusing took {worst:.2f} s"
    assert grown < 200 << 20, f"RSS grew by {grown >> 20} MiB over 10 refusals"


def test_huge_tool_list_is_a_4xx(srv):
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Looks something up. " * 20,
                "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "x" * 200}}},
            },
        }
        for i in range(5_000)
    ]
    body = {"model": "k3-mini", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 4}
    payload = json.dumps(body)
    assert len(payload) > 3_000_000
    t = time.monotonic()
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", content=payload,
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 400, r.text[:400]
    err = r.json()["error"]
    assert err["code"] in ("context_length_exceeded", "input_too_large"), err
    assert time.monotonic() - t < 10
    # And the server still answers.
    ok = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
        "model": "k3-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert ok.status_code == 200, ok.text


def test_impossible_n_and_stop_token_ids_are_400(srv):
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=30, json={
        "model": "k3-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "n": MAX_NUM_SEQS + MAX_WAITING + 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=30, json={
        "model": "k3-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "stop_token_ids": [3, 10_000_000]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop_token_ids[1]"


def test_denied_interface_fails_the_call_cleanly(srv):
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    up = httpx.put(f"{srv.base_url}/admin/plugins/tool-parser", headers=auth, timeout=120,
                   content=plugin_file("testdata_denied_socket.wasm"))
    assert up.status_code == 200, up.text
    # Declared tools that mention OPEN_SOCKET arm the plugin: its first delta opens a socket.
    armed = {"model": "k3-mini", "max_tokens": 24, "reasoning_effort": "none",
             "messages": [{"role": "user", "content": "Say hello."}],
             "tools": [{"type": "function", "function": {"name": "OPEN_SOCKET", "parameters": {"type": "object"}}}]}
    try:
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=armed, timeout=60)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "plugin_error", r.text
        with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", json={**armed, "stream": True},
                          timeout=60) as s:
            assert s.status_code == 200
            data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]", data[-3:]
        assert '"error"' in data[-2], data[-3:]
        errors = {k: v for k, v in srv.metrics().items()
                  if k.startswith("k3serve_plugin_errors_total") and "testdata-denied-socket" in k}
        assert errors and sum(errors.values()) >= 2, errors
        # The same version serves a request that does not reach for the socket.
        plain = {k: v for k, v in armed.items() if k != "tools"}
        ok = httpx.post(f"{srv.base_url}/v1/chat/completions", json=plain, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        back = httpx.post(f"{srv.base_url}/admin/plugins/tool-parser/rollback", headers=auth, timeout=60)
        assert back.status_code == 200, back.text
