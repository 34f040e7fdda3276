"""Many concurrent streams, and a client that disconnects mid-stream (its memory is freed)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from helpers import recall_messages


@pytest.fixture(scope="module")
def concurrent_results(base_url, model_name):
    """32 streaming clients at once, each recalling its own lucky number (thinking off)."""
    import openai

    async def one(client, i):
        number = 100 + 7 * i
        stream = await client.chat.completions.create(
            model=model_name,
            messages=recall_messages(number=number),
            temperature=0,
            max_tokens=300,
            reasoning_effort="none",
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, ids, usage = "", None, set(), None
        async for chunk in stream:
            ids.add(chunk.id)
            usage = chunk.usage or usage
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return {"expected": f"Your lucky number is {number}.", "text": text, "finish": finish, "ids": ids, "usage": usage}

    async def run():
        client = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="unused", timeout=600, max_retries=0
        )
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    return asyncio.run(run())


def test_32_concurrent_streaming_clients(concurrent_results):
    assert len(concurrent_results) == 32
    ids = set()
    for r in concurrent_results:
        assert r["finish"] == "stop", r
        assert len(r["ids"]) == 1, "one id per stream"
        ids |= r["ids"]
        assert r["usage"] is not None and r["usage"].completion_tokens > 0
        assert r["text"].startswith("Your lucky number is "), r["text"]
    assert len(ids) == 32


@pytest.mark.model_quality
def test_32_concurrent_answers_are_right(concurrent_results, client, model_name):
    # Batched answers equal the same requests run alone, token for token; and nearly all are
    # right (k3-mini's held-out recall is 30/30; an odd digit slips on these prompts).
    for i, r in enumerate(concurrent_results):
        alone = client.chat.completions.create(
            model=model_name, messages=recall_messages(number=100 + 7 * i), temperature=0,
            max_tokens=300, reasoning_effort="none")
        assert r["text"] == alone.choices[0].message.content, (i, r["text"])
    wrong = [(r["expected"], r["text"]) for r in concurrent_results if r["text"] != r["expected"]]
    assert len(wrong) <= 2, wrong


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
        # Greedy, so the stream surely has 20 chunks: a sampled one can go silent inside
        # tool-call markup the parser holds.
        "temperature": 0,
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


def test_serving_benchmark_measures_what_it_claims(base_url, model_name):
    """scripts/bench_serving.py (the seeds' TTFT / TPOT / throughput workload) on a tiny size: every
    request yields exactly the asked-for tokens and the derived figures are consistent."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts/bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = asyncio.run(bench.level(base_url, model_name, concurrency=3, requests=5, prompt_tokens=40,
                                output_tokens=7, vocab=(100, 8000), seed=1, timeout=300))
    assert r["requests"] == 5
    assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
    assert r["tpot_ms"]["mean"] > 0
    assert r["latency_s"]["p50"] * 1e3 >= r["ttft_ms"]["p50"]
    # throughput = tokens / wall: 5 × 7 output tokens and 5 × (40 + 7) in total
    assert abs(r["output_tok_s"] * r["wall_s"] - 35) < 1e-6
    assert abs(r["total_tok_s"] * r["wall_s"] - 235) < 1e-6
    # --sampling's fields reach the server: sampled requests still yield exactly the asked-for
    # tokens, and a field the server refuses fails the run instead of being dropped.
    r = asyncio.run(bench.level(base_url, model_name, concurrency=2, requests=2, prompt_tokens=40,
                                output_tokens=7, vocab=(100, 8000), seed=2, timeout=300,
                                sampling={"temperature": 1.0, "top_k": 50}))
    assert abs(r["output_tok_s"] * r["wall_s"] - 14) < 1e-6
    with pytest.raises(RuntimeError, match="HTTP 400"):
        asyncio.run(bench.level(base_url, model_name, concurrency=1, requests=1, prompt_tokens=40,
                                output_tokens=7, vocab=(100, 8000), seed=3, timeout=300,
                                sampling={"top_k": "many"}))
