#!/usr/bin/env python3
"""Hostile-load figures for docs/performance.md, for one or more k3serve binaries in one run.

For each binary: start `serve --model models/k3-mini` (default limits) on a free port, then
  1. N concurrent streaming chats (default 600): counts of each HTTP status and of streams that
     ended in an error event;
  2. a 6.6 MB chat message, --oversize-repeats times (5): the slowest refusal, and the server's
     RSS growth over them;
  3. 1,000 idle sockets: how many the server still holds after --idle-wait seconds.
Prints one JSON line per binary. Usage:
  scripts/hostile-load.py --bin target/release/k3serve [--bin /tmp/k3serve-before] [--streams 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start(binary: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="k3serve-hostile-", suffix=".log", delete=False)
    cmd = [binary, "serve", "--model", str(ROOT / "models/k3-mini"), "--host", "127.0.0.1",
           "--port", str(port), "--shutdown-timeout", "2", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            sys.exit(f"{binary} exited during start-up; log: {log.name}")
        time.sleep(0.25)
    proc.kill()
    sys.exit(f"{binary} did not start; log: {log.name}")


async def stream_chat(client: httpx.AsyncClient, i: int) -> tuple[int, bool]:
    body = {"model": "k3-mini", "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": f"Story number {i}, please."}]}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, False
            errored = False
            async for line in r.aiter_lines():
                errored |= line.startswith("data: ") and '"error"' in line
            return 200, errored
    except httpx.HTTPError:
        return -1, True


async def concurrent_chats(url: str, n: int) -> dict:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        results = await asyncio.gather(*(stream_chat(client, i) for i in range(n)))
    return {"statuses": dict(Counter(s for s, _ in results)),
            "error_events": sum(1 for _, e in results if e)}


def oversize(url: str, pid: int, repeats: int) -> dict:
    message = "All work and no play makes Jack a dull boy. " * 150_000
    body = json.dumps({"model": "k3-mini", "messages": [{"role": "user", "content": message}]})
    before, worst, codes = rss(pid), 0.0, Counter()
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(repeats):
            t = time.monotonic()
            r = http.post("/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
            worst = max(worst, time.monotonic() - t)
            codes[r.status_code] += 1
    return {"worst_s": round(worst, 3), "statuses": dict(codes),
            "rss_growth_mib": round((rss(pid) - before) / 2**20, 1)}


def idle_sockets(url: str, count: int, wait_s: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        s = socket.create_connection((host, int(port)), timeout=5)
        socks.append(s)
    time.sleep(wait_s)
    held = 0
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(1)
            held += 0 if data == b"" else 1
        except BlockingIOError:
            held += 1
        except OSError:
            pass
        s.close()
    return {"sockets": count, "held_after_s": wait_s, "held": held}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", action="append", required=True)
    ap.add_argument("--streams", type=int, default=600)
    ap.add_argument("--idle-wait", type=float, default=20.0)
    ap.add_argument("--oversize-repeats", type=int, default=5,
                    help="oversize prompts sent (RSS growth is measured over all of them)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra serve flag (repeat), e.g. --serve-arg=--header-read-timeout=10")
    args = ap.parse_args()
    for binary in args.bin:
        proc, url = start(binary, args.serve_arg)
        try:
            out = {"bin": binary}
            out["chats"] = asyncio.run(concurrent_chats(url, args.streams))
            out["oversize"] = oversize(url, proc.pid, args.oversize_repeats)
            out["idle"] = idle_sockets(url, 1000, args.idle_wait)
            print(json.dumps(out), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
    main()
