#!/usr/bin/env python3
"""Time to first token of an image prompt, cold (an image the server has not seen) against warm
(the same prompt again: the image's tokens come from the prefix cache), in one run against a
running server:

    python3 scripts/image_ttft.py --base-url http://127.0.0.1:8000 [--side 256] [--reps 8]

Each rep draws a fresh random image (so the cold request cannot hit the cache), sends it, then
sends the same request again. Prints one JSON object: median and p90 TTFT of each, the ratio, and
the prompt's token count. Needs numpy, Pillow and httpx.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time

import httpx
import numpy as np
from PIL import Image

SYSTEM = "You are k3-mini. You answer questions about images and about text. " * 6


def ttft(client: httpx.Client, model: str, url: str) -> tuple[float, int]:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 4,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What color is the shape?"},
            ]},
        ],
    }
    t0 = time.perf_counter()
    first = None
    prompt_tokens = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            # The first chunk only names the role: the first token is the first with text.
            delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
            if first is None and any(v for k, v in delta.items() if k != "role"):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return first if first is not None else float("nan"), prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--side", type=int, default=256)
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=a.base_url, timeout=300) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        cold, warm, tokens = [], [], 0
        for _ in range(a.reps + 1):  # the first pair warms the server up and is dropped
            img = rng.integers(0, 255, (a.side, a.side, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            t_cold, tokens = ttft(c, model, url)
            t_warm, _ = ttft(c, model, url)
            cold.append(t_cold)
            warm.append(t_warm)
        cold, warm = cold[1:], warm[1:]

    def p90(v):
        return sorted(v)[min(len(v) - 1, int(0.9 * len(v)))]

    print(json.dumps({
        "side": a.side,
        "prompt_tokens": tokens,
        "ttft_cold_ms": {"p50": round(1e3 * statistics.median(cold), 1), "p90": round(1e3 * p90(cold), 1)},
        "ttft_cached_ms": {"p50": round(1e3 * statistics.median(warm), 1), "p90": round(1e3 * p90(warm), 1)},
        "cold_over_cached": round(statistics.median(cold) / statistics.median(warm), 2),
    }))


if __name__ == "__main__":
    main()
