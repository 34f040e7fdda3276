"""Many concurrent streams, and a client that disconnects mid-stream (its memory is freed)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from helpers import answer_number


@pytest.mark.model_quality
def test_32_concurrent_streaming_clients(base_url, model_name):
    import openai

    async def one(client, i):
        a, b = 100 + i, 200 + 3 * i
        stream = await client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
            temperature=0,
            max_tokens=300,
            reasoning_effort="none",
            stream=True,
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return a + b, text, finish

    async def run():
        client = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="unused", timeout=600, max_retries=0
        )
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == 32
    for expected, text, finish in results:
        assert finish == "stop", text
    wrong = [(expected, text) for expected, text, _ in results if answer_number(text) != expected]
    assert not wrong, wrong


def _running_and_request_bytes(server) -> tuple[float, float]:
    m = server.metrics()
    return m["k3serve_num_requests_running"], m['k3serve_pool_used_bytes{kind="requests"}']


def test_disconnect_frees_memory(server, model_name):
    # Let earlier tests' requests drain first, then take the idle baseline.
    deadline = time.monotonic() + 60
    while _running_and_request_bytes(server)[0] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    _, baseline = _running_and_request_bytes(server)
    disconnects_before = server.metrics()["k3serve_client_disconnects_total"]

    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "What is 1234 × 56?"}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            # Keep the iterator: dropping it early would already close the connection.
            lines = r.iter_lines()
            chunks = 0
            for line in lines:
                if line.startswith("data: "):
                    chunks += 1
                if chunks >= 20:
                    break
            # The metrics snapshot follows engine steps: poll briefly while the stream runs.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                running, held = _running_and_request_bytes(server)
                if running >= 1 and held > baseline:
                    break
                time.sleep(0.05)
            assert running >= 1 and held > baseline, (running, held, baseline)
        # Leaving the block closes the connection mid-stream.

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running, held = _running_and_request_bytes(server)
        if running == 0 and held <= baseline:
            break
        time.sleep(0.2)
    assert (running, held) == (0, baseline)
    assert server.metrics()["k3serve_client_disconnects_total"] >= disconnects_before + 1
