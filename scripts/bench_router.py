#!/usr/bin/env python3
"""Multi-turn agent traffic through `k3serve router` over several CPU replicas, one policy after another
in one run (docs/performance.md, "Routing"):

    python3 scripts/bench_router.py --out router-bench.json

Each policy gets fresh replicas (empty caches) and a fresh router. The workload: --conversations
conversations of --turns turns each, over --systems shared system prompts of about --system-tokens
tokens, each conversation's first turn bringing --context-tokens of its own context; --concurrency conversations run at once, each one's turns in order (the next turn carries the
whole history and the model's previous answers). Every request is a streamed chat completion, greedy,
--output-tokens tokens. Reported per policy: the prefix hit rate (cached / prompt tokens, as the replicas
report in `usage`), TTFT p50/p99, output tokens/s over the wall time, where requests went, and
the replicas' mean queue and prefill time per request (their /metrics). The same
workload on one replica alone (no router) gives the hit rate a single cache would have. Then the
router's overhead: the same short cached request sent directly and through a router over that one
replica, latency p50/p99 of each; and the policy call's cost from the router's /metrics.

--replica-threads N gives each replica N compute threads (`k3serve serve --threads N`); with --pin,
replica i runs under `taskset -c` on its own cores i*N .. i*N+N-1 (of the cores this process may
use), and the router and this load generator on the cores left, if any. Why: on a many-core host
each tiny k3-mini replica prefills so fast that a cache miss costs little more than a hit, which
hides the policy's effect on TTFT; one pinned core per replica (`--replica-threads 1 --pin`) makes
prefill cost realistic relative to the rest. The output records `replica_threads` and `pinning`
(the core lists).

Replicas run with --device cpu (the default): the issue's workload is CPU replicas, and on a GPU
host `k3serve serve` would otherwise pick the GPU, where k3-mini's prefill is so cheap that a hit
saves nothing measurable. --device cuda or auto measures that case on purpose.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-replica-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Proc:
    def __init__(self, cmd: list[str], url: str, ready):
        self.log = Path(tempfile.mkstemp(prefix="bench-router-", suffix=".log")[1])
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        self.url = url
        what = next((c for c in cmd if c in ("serve", "router")), cmd[0])
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"{what} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if ready(httpx.get(f"{url}/health", timeout=2)):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                sys.exit(f"{what} not ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def plan_pinning(replicas: int, threads: int) -> dict:
    """Replica i's cores (threads of them, disjoint) and the cores left for the router and the
    load generator (None: no core is left, so they share the replicas' cores)."""
    cores = sorted(os.sched_getaffinity(0))
    need = replicas * threads
    if threads < 1:
        sys.exit("--pin needs --replica-threads N (N >= 1): the cores each replica is pinned to")
    if need > len(cores):
        sys.exit(f"--pin: {replicas} replicas x {threads} threads need {need} cores; "
                 f"this process may use {len(cores)}")
    return {"replicas": [cores[i * threads:(i + 1) * threads] for i in range(replicas)],
            "router_and_load": cores[need:] or None}


def pinned(cmd: list[str], cores: list[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores)), *cmd] if cores else cmd


def start_replica(a, i: int = 0) -> Proc:
    port = free_port()
    cmd = [a.binary, "serve", "--model", a.model, "--host", "127.0.0.1", "--port", str(port),
           "--admin-token", TOKEN, "--max-num-seqs", str(a.max_num_seqs), "--device", a.device]
    if a.replica_threads:
        cmd += ["--threads", str(a.replica_threads)]
    cores = a.pinning["replicas"][i] if a.pinning else None
    return Proc(pinned(cmd, cores), f"http://127.0.0.1:{port}", lambda r: r.status_code == 200)


def start_router(a, replicas: list[Proc], policy: str) -> Proc:
    port = free_port()
    cmd = [a.binary, "router", "--model", a.model, "--host", "127.0.0.1", "--port", str(port),
           "--replica-token", TOKEN, "--router-plugin", policy]
    cmd = pinned(cmd, a.pinning["router_and_load"] if a.pinning else None)
    for r in replicas:
        cmd += ["--replica", r.url]
    ready = lambda r: r.status_code == 200 and all(x["events_synced"] for x in r.json()["replicas"])  # noqa: E731
    return Proc(cmd, f"http://127.0.0.1:{port}", ready)


def system_prompts(n: int, tokens: int) -> list[str]:
    out = []
    for k in range(n):
        rng = random.Random(k)
        # About 12 tokens per fact in k3-mini's tokenizer.
        facts = " ".join(f"Record {i}: item {rng.randint(100, 999)} sits in bin {rng.randint(1, 99)}."
                         for i in range(max(1, tokens // 12)))
        out.append(f"You are agent {k}, a careful inventory assistant. {facts}")
    return out


def own_context(c: int, tokens: int) -> str:
    rng = random.Random(10_000 + c)
    lines = " ".join(f"Line {i}: crate {rng.randint(1000, 9999)} holds {rng.randint(1, 500)} parts."
                     for i in range(max(0, tokens // 12)))
    return f"Here is the manifest for this job. {lines}\n" if tokens else ""


async def one_turn(client: httpx.AsyncClient, model: str, messages: list[dict], out_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": out_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "reasoning_effort": "none"}
    t0 = time.perf_counter()
    first = None
    text, usage, replica = [], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        replica = r.headers.get("x-k3-replica", "direct")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft": (first or end) - t0, "latency": end - t0, "text": "".join(text), "replica": replica,
            "prompt": usage["prompt_tokens"], "cached": details.get("cached_tokens") or 0,
            "output": usage["completion_tokens"]}


async def workload(a, base_url: str, model: str, systems: list[str]) -> dict:
    sem = asyncio.Semaphore(a.concurrency)
    turns: list[dict] = []

    async def conversation(c: int, client: httpx.AsyncClient):
        async with sem:
            messages = [{"role": "system", "content": systems[c % len(systems)]}]
            for t in range(a.turns):
                # The first turn brings the conversation's own context (an agent's file or tool
                # output): what only the replica that served this conversation holds.
                context = own_context(c, a.context_tokens) if t == 0 else ""
                messages.append({"role": "user",
                                 "content": f"{context}Conversation {c}, step {t}: where is item {100 + 37 * c + t}?"})
                res = await one_turn(client, model, messages, a.output_tokens)
                messages.append({"role": "assistant", "content": res["text"] or "(none)"})
                turns.append(res)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await asyncio.gather(*(conversation(c, client) for c in range(a.conversations)))
    wall = time.perf_counter() - t0
    ttft = [x["ttft"] for x in turns]
    placed: dict[str, int] = {}
    for x in turns:
        placed[x["replica"]] = placed.get(x["replica"], 0) + 1
    # TTFT by how much of the prompt was cached: whether a hit is what sets TTFT on this host.
    hits = [x["ttft"] for x in turns if x["cached"] >= x["prompt"] / 2]
    misses = [x["ttft"] for x in turns if x["cached"] < x["prompt"] / 2]
    return {
        "requests": len(turns),
        "hit_rate": sum(x["cached"] for x in turns) / max(1, sum(x["prompt"] for x in turns)),
        "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "output_tok_s": sum(x["output"] for x in turns) / wall, "wall_s": wall,
        "prompt_tokens": sum(x["prompt"] for x in turns), "placed": dict(sorted(placed.items())),
        "uncached_tokens_mean": sum(x["prompt"] - x["cached"] for x in turns) / max(1, len(turns)),
        "ttft_p50_ms_mostly_cached": 1000 * percentile(hits, 50) if hits else None,
        "ttft_p50_ms_mostly_uncached": 1000 * percentile(misses, 50) if misses else None,
        "mostly_cached_requests": len(hits),
    }


async def latencies(base_url: str, model: str, n: int) -> list[float]:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1,
            "temperature": 0, "reasoning_effort": "none"}
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for i in range(n + 3):
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            if i >= 3:  # warm-up: the first requests fill the cache
                out.append(time.perf_counter() - t0)
    return out


def metrics(base_url: str, *prefixes: str) -> list[float]:
    """Per prefix, the sum of the /metrics samples whose names start with it (one fetch)."""
    lines = httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines()
    return [sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(p)) for p in prefixes]


def engine_split(urls: list[str]) -> tuple[float, ...]:
    """(first tokens, queue seconds, prefill seconds) so far, summed over the replicas' /metrics."""
    per = [metrics(u, "k3serve_request_prefill_time_seconds_count", "k3serve_request_queue_time_seconds_sum",
                   "k3serve_request_prefill_time_seconds_sum") for u in urls]
    return tuple(map(sum, zip(*per)))


def split_ms(before: tuple, after: tuple, prefix: str = "") -> dict:
    """Mean engine queue and prefill time per request between two `engine_split`s: where a
    request's time to its first token went on the replica."""
    n = after[0] - before[0]
    return {f"{prefix}queue_ms_mean": 1000 * (after[1] - before[1]) / n if n else None,
            f"{prefix}prefill_ms_mean": 1000 * (after[2] - before[2]) / n if n else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "k3serve"))
    ap.add_argument("--model", default=str(ROOT / "models" / "k3-mini"))
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--context-tokens", type=int, default=1500,
                    help="tokens of context unique to each conversation, in its first turn")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--policies", default="kv-aware,round-robin,least-load")
    ap.add_argument("--overhead-requests", type=int, default=200)
    ap.add_argument("--replica-threads", type=int, default=0,
                    help="compute threads per replica (k3serve serve --threads; 0: one per core)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                    help="the replicas' device (k3serve serve --device)")
    ap.add_argument("--pin", action="store_true",
                    help="run each replica on its own --replica-threads cores (taskset), the router "
                         "and the load generator on the cores left")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.replica_threads < 0:
        sys.exit("--replica-threads must be >= 0")
    a.pinning = plan_pinning(a.replicas, a.replica_threads) if a.pin else None
    if a.pinning and a.pinning["router_and_load"]:
        os.sched_setaffinity(0, a.pinning["router_and_load"])
    systems = system_prompts(a.systems, a.system_tokens)
    args = {k: v for k, v in vars(a).items() if k != "pinning"}
    result: dict = {"args": args, "replica_threads": a.replica_threads, "pinning": a.pinning,
                    "policies": {}}
    if a.pinning:
        print("pinning", json.dumps(a.pinning), flush=True)

    def save():  # after every phase, so a run cut short keeps what it measured
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")

    one = start_replica(a)
    try:
        model = httpx.get(f"{one.url}/v1/models").json()["data"][0]["id"]
        result["single_replica"] = asyncio.run(workload(a, one.url, model, systems))
        result["single_replica"].update(split_ms((0, 0, 0), engine_split([one.url])))
        print("single replica", json.dumps(result["single_replica"]), flush=True)
        router = start_router(a, [one], "kv-aware")
        try:
            s0 = engine_split([one.url])
            direct = asyncio.run(latencies(one.url, model, a.overhead_requests))
            s1 = engine_split([one.url])
            routed = asyncio.run(latencies(router.url, model, a.overhead_requests))
            s2 = engine_split([one.url])
            calls, spent = metrics(router.url, "k3router_policy_call_seconds_count",
                                   "k3router_policy_call_seconds_sum")
        finally:
            router.stop()
        result["overhead"] = {
            "direct_p50_ms": 1000 * percentile(direct, 50), "direct_p99_ms": 1000 * percentile(direct, 99),
            "routed_p50_ms": 1000 * percentile(routed, 50), "routed_p99_ms": 1000 * percentile(routed, 99),
            "added_p50_ms": 1000 * (percentile(routed, 50) - percentile(direct, 50)),
            "added_p99_ms": 1000 * (percentile(routed, 99) - percentile(direct, 99)),
            "policy_call_mean_us": 1e6 * spent / calls if calls else None,
            # The replica's own queue and prefill time, direct and routed: whether the router's
            # added latency is spent in the replica or on the way to it.
            **split_ms(s0, s1, "direct_"), **split_ms(s1, s2, "routed_"),
        }
        print("overhead", json.dumps(result["overhead"]), flush=True)
        save()
    finally:
        one.stop()

    for policy in a.policies.split(","):
        replicas = [start_replica(a, i) for i in range(a.replicas)]
        try:
            router = start_router(a, replicas, policy)
            try:
                result["policies"][policy] = asyncio.run(workload(a, router.url, model, systems))
                result["policies"][policy].update(split_ms((0, 0, 0), engine_split([r.url for r in replicas])))
            finally:
                router.stop()
        finally:
            for r in replicas:
                r.stop()
        print(policy, json.dumps(result["policies"][policy]), flush=True)
        save()

    single = result["single_replica"]["hit_rate"]
    rr = result["policies"].get("round-robin")
    kv = result["policies"].get("kv-aware")
    if kv and single:
        result["kv_aware_hit_share_of_single"] = kv["hit_rate"] / single
    if kv and rr:
        result["kv_aware_ttft_p50_gain_over_round_robin"] = rr["ttft_p50_ms"] / kv["ttft_p50_ms"]
    print(json.dumps({k: v for k, v in result.items() if k not in ("args", "policies")}, indent=1))
    save()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
