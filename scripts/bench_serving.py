#!/usr/bin/env python3
"""Serving benchmark through the HTTP API (what vLLM's and SGLang's serving benchmarks report).

    python3 scripts/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --prompt-tokens 8192 --output-tokens 1024 --concurrency 1,4,16 --out bench.json

Each request is a streamed /v1/completions call with a token-id prompt of exactly --prompt-tokens
random ids (seeded, distinct per request so the prefix cache cannot help) and `ignore_eos`, so it
generates exactly --output-tokens. For each concurrency level C it keeps C requests in flight until
--requests (default 2·C, at least 2) have finished, and reports TTFT (time to the first streamed
token), TPOT (time per output token after the first), end-to-end latency, and output / total token
throughput over the level's wall time. Only the standard library and httpx are needed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], out_tokens: int,
                      sampling: dict | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_tokens, "ignore_eos": True, "temperature": 0,
            **(sampling or {}), "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first or now
                last = now
    if usage is None or first is None:
        raise RuntimeError("stream ended without tokens or usage")
    n = usage["completion_tokens"]
    return {"ttft": first - t0, "latency": last - t0, "tpot": (last - first) / max(n - 1, 1),
            "output_tokens": n, "prompt_tokens": usage["prompt_tokens"]}


async def level(base_url: str, model: str, concurrency: int, requests: int, prompt_tokens: int,
                output_tokens: int, vocab: tuple[int, int], seed: int, timeout: float,
                sampling: dict | None = None) -> dict:
    """One concurrency level; `sampling` (e.g. {"temperature": 1.0, "top_k": 50}) goes into every
    request body, greedy (temperature 0) where it is None."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        queue = list(prompts)

        async def worker():
            while queue:
                p = queue.pop()
                results.append(await one_request(client, model, p, output_tokens, sampling))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    out = sum(r["output_tokens"] for r in results)
    total = out + sum(r["prompt_tokens"] for r in results)

    def stats(key, scale=1e3):
        xs = [r[key] * scale for r in results]
        return {"mean": statistics.fmean(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99)}

    return {"concurrency": concurrency, "requests": len(results), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "wall_s": wall, "ttft_ms": stats("ttft"), "tpot_ms": stats("tpot"),
            "latency_s": stats("latency", 1.0), "output_tok_s": out / wall, "total_tok_s": total / wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name [default: the first of /v1/models]")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--output-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=0, help="per level [default: 2 x concurrency, at least 2]")
    ap.add_argument("--token-range", default="100,8000", help="prompt ids are drawn from [lo, hi)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sampling", default="{}",
                    help='JSON of sampling fields sent with every request [default: greedy], e.g. '
                         '\'{"temperature": 1.0, "top_k": 50}\': on dummy weights greedy decoding repeats a few '
                         'tokens, which routes a batch to fewer experts than a trained model would')
    a = ap.parse_args()
    sampling = json.loads(a.sampling)
    model = a.model or httpx.get(f"{a.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    lo, hi = (int(x) for x in a.token_range.split(","))
    rows = []
    for c in (int(x) for x in a.concurrency.split(",")):
        n = a.requests or max(2, 2 * c)
        r = asyncio.run(level(a.base_url, model, c, n, a.prompt_tokens, a.output_tokens, (lo, hi),
                              a.seed + c, a.timeout, sampling))
        rows.append(r)
        print(f"concurrency {c:>3}: {r['requests']} requests, TTFT mean {r['ttft_ms']['mean']:.1f} ms "
              f"(p99 {r['ttft_ms']['p99']:.1f}), TPOT mean {r['tpot_ms']['mean']:.2f} ms "
              f"(p99 {r['tpot_ms']['p99']:.2f}), output {r['output_tok_s']:.1f} tok/s, "
              f"total {r['total_tok_s']:.1f} tok/s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": model, "base_url": a.base_url, "sampling": sampling, "levels": rows}, f, indent=1)


if __name__ == "__main__":
    main()
