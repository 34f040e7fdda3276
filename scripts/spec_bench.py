#!/usr/bin/env python3
"""Speculative decoding through the HTTP API: decode throughput with and without it, in one run.

    python3 scripts/spec_bench.py --bin target/release/k3serve \\
        --spec '{"method": "ngram", "num_speculative_tokens": 5}' --concurrency 1,4,16,64 \\
        --out spec.json

Starts the server twice on the same model and settings: once plain, once with --spec as its
--speculative-config (extra server flags: --serve-arg, repeatable). Prompts are k3-mini's held-out
task conversations (reference/k3ref/data/tasks.py, seeds >= 10^6, kinds cycling), sent as text
to /v1/completions, greedy unless --temperature, each generating until its end-of-message token
or --max-tokens. For each concurrency level C it keeps C requests in flight over the whole prompt
set and reports output tokens per second of wall time; with speculation it adds the mean
acceptance length (tokens committed per verify round, from /metrics) per level and per task kind
(at concurrency 1), and the planner's chosen draft lengths. Greedy outputs of the two servers are
compared text for text (they must be identical). Needs httpx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "reference"))
from k3ref.data.tasks import EFFORTS, TASK_KINDS, prompt_text, sample_example  # noqa: E402

HELD_OUT_SEED = 1_000_003


def prompts(per_kind: int) -> list[tuple[str, str]]:
    """(kind, prompt text), kinds interleaved so every level sees the same mix."""
    import random

    by_kind = []
    for kind in TASK_KINDS:
        rng = random.Random(HELD_OUT_SEED + TASK_KINDS.index(kind))
        by_kind.append([(kind, prompt_text(sample_example(kind, rng, thinking=i % 3 != 2, effort=EFFORTS[i % 4])))
                        for i in range(per_kind)])
    return [p for group in zip(*by_kind) for p in group]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary: str, args: list[str]):
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "serve", "--port", str(self.port), "--host", "127.0.0.1", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: list[str] = []
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.proc.stdout.read())
            time.sleep(0.3)
        raise RuntimeError("server did not become ready")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            m = re.match(r"^(k3serve_spec_decode_[a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self):
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.log = [line for line in out.splitlines() if "speculative" in line or "ready" in line]


async def run_level(url: str, items: list[tuple[str, str]], concurrency: int, max_tokens: int,
                    temperature: float) -> tuple[float, int, list[str]]:
    texts = [""] * len(items)
    tokens = 0
    queue = list(enumerate(items))
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def worker():
            nonlocal tokens
            while queue:
                i, (_, prompt) = queue.pop(0)
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                        "skip_special_tokens": False}
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()
                data = r.json()
                texts[i] = data["choices"][0]["text"]
                tokens += data["usage"]["completion_tokens"]
        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.perf_counter() - t0, tokens, texts


def acceptance(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = d.get("k3serve_spec_decode_num_drafts_total", 0.0)
    acc = d.get("k3serve_spec_decode_num_accepted_tokens_total", 0.0)
    lengths = {re.search(r'"(\d+)"', k).group(1): v for k, v in d.items()
               if k.startswith("k3serve_spec_decode_verify_length_total") and v}
    return {"verify_rounds": drafts, "accepted_tokens": acc,
            "draft_tokens": d.get("k3serve_spec_decode_num_draft_tokens_total", 0.0),
            "mean_acceptance_length": (acc + drafts) / drafts if drafts else None,
            "chosen_lengths": lengths}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/k3serve"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models/k3-mini"))
    ap.add_argument("--spec", required=True, help="the --speculative-config JSON of the second server")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra server flag (repeatable)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--per-kind", type=int, default=4, help="prompts per task kind (x6 kinds)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    items = prompts(a.per_kind)
    levels = [int(c) for c in a.concurrency.split(",")]
    serve = ["--model", a.model, "--max-num-seqs", str(max(levels)), *a.serve_arg]
    result = {"spec": json.loads(a.spec), "prompts": len(items), "max_tokens": a.max_tokens,
              "temperature": a.temperature, "levels": {}}
    outputs = {}
    for name, extra in [("plain", []), ("spec", ["--speculative-config", a.spec])]:
        server = Server(a.bin, serve + extra)
        try:
            for c in levels:
                before = server.metrics()
                secs, tokens, texts = asyncio.run(run_level(server.url, items, c, a.max_tokens, a.temperature))
                entry = {"seconds": secs, "output_tokens": tokens, "output_tok_s": tokens / secs}
                if name == "spec":
                    entry |= acceptance(before, server.metrics())
                result["levels"].setdefault(str(c), {})[name] = entry
                outputs.setdefault(name, {})[c] = texts
                print(f"{name:5s} c={c:3d}: {tokens} tokens in {secs:.2f} s = {tokens / secs:.1f} tok/s"
                      + (f", acceptance {entry['mean_acceptance_length']}" if name == "spec" else ""), flush=True)
            if name == "spec":
                per_kind = {}
                for kind in TASK_KINDS:
                    subset = [it for it in items if it[0] == kind]
                    before = server.metrics()
                    asyncio.run(run_level(server.url, subset, 1, a.max_tokens, a.temperature))
                    per_kind[kind] = acceptance(before, server.metrics())["mean_acceptance_length"]
                result["acceptance_by_kind"] = per_kind
                print("acceptance by kind:", per_kind, flush=True)
        finally:
            server.stop()
            result.setdefault("server_lines", {})[name] = server.log
    for c in levels:
        lv = result["levels"][str(c)]
        lv["speedup"] = lv["spec"]["output_tok_s"] / lv["plain"]["output_tok_s"]
        if a.temperature == 0:
            same = sum(x == y for x, y in zip(outputs["plain"][c], outputs["spec"][c]))
            lv["identical_outputs"] = f"{same}/{len(items)}"
        print(f"c={c}: speedup {lv['speedup']:.2f}x" + (f", identical {lv.get('identical_outputs')}" if a.temperature == 0 else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
