"""`k3serve router` in front of three k3-mini replicas on the CPU (docs/routing.md, docs/deploy.md):
the official clients through it, streaming passed through, conversations sent to the replica that
holds their prefix, a replica killed and brought back, the policy hot-swapped with requests in
flight, and a policy that traps or loops falling back to least-load.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import anthropic
import httpx
import openai
import pytest

from conftest import ROOT, Server, _free_port, binary, model_dir, start_server

REPLICA_TOKEN = "e2e-replica-token"
ROUTER_ADMIN = "e2e-router-admin"
PLUGINS = ROOT / "plugins" / "target" / "wasm32-wasip2" / "release"
REPLICA_ARGS = ["--admin-token", REPLICA_TOKEN, "--max-num-seqs", "8", "--max-model-len", "4096"]


def start_router(replicas: list[str], port: int | None = None) -> Server:
    port = port or _free_port()
    log_path = Path(tempfile.mkstemp(prefix="k3router-e2e-", suffix=".log")[1])
    cmd = [str(binary()), "router", "--model", model_dir(), "--host", "127.0.0.1",
           "--port", str(port), "--replica-token", REPLICA_TOKEN, "--admin-token", ROUTER_ADMIN,
           "--health-interval", "0.2", "--eject-after", "2"]
    for r in replicas:
        cmd += ["--replica", r]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"k3serve router exited with {proc.returncode}:\n{srv.log_tail()}")
        try:
            h = httpx.get(f"{srv.base_url}/health", timeout=2)
            if h.status_code == 200 and all(r["healthy"] and r["events_synced"]
                                            for r in h.json()["replicas"]):
                return srv
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the router did not see its replicas in 60 s:\n{srv.log_tail()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet():
    replicas = [start_server(REPLICA_ARGS) for _ in range(3)]
    router = start_router([r.base_url for r in replicas])
    state = {"replicas": replicas, "router": router}
    yield state
    router.proc.send_signal(signal.SIGTERM)
    router.proc.wait(timeout=30)
    for r in state["replicas"]:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
            r.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def rclient(fleet):
    return openai.OpenAI(base_url=f"{fleet['router'].base_url}/v1", api_key="unused", timeout=300,
                         max_retries=0)


@pytest.fixture(scope="module")
def name(fleet):
    return httpx.get(f"{fleet['router'].base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def system_prompt(k: int) -> str:
    # About 400 tokens: several checkpoint intervals deep.
    facts = " ".join(f"Fact {i} of file {k}: the value of key-{k}-{i} is {i * 7 + k}." for i in range(40))
    return f"You are assistant number {k}. Remember these facts. {facts}"


def chat(client, name, messages, **kw):
    raw = client.chat.completions.with_raw_response.create(
        model=name, messages=messages, temperature=0, max_tokens=kw.pop("max_tokens", 12),
        reasoning_effort="none", **kw)
    r = raw.parse()
    details = r.usage.prompt_tokens_details
    return r, raw.headers.get("x-k3-replica"), (details.cached_tokens if details else 0) or 0


def replica_ids(fleet) -> dict[str, str]:
    """Replica base URL → the router's id for it."""
    h = httpx.get(f"{fleet['router'].base_url}/health", timeout=5).json()
    return {r["url"]: r["id"] for r in h["replicas"]}


def replica_state(fleet, url: str) -> dict:
    """The router's /health entry for the replica at `url`."""
    h = httpx.get(f"{fleet['router'].base_url}/health", timeout=5).json()
    return next(r for r in h["replicas"] if r["url"] == url)


def wait_for(predicate: Callable[[], object], timeout: float, what: str):
    """Poll `predicate` every 100 ms until it is truthy, and return its value; fail naming `what`
    (and the last value or error seen) after `timeout` seconds. An HTTP error counts as not yet:
    a replica or the router may be restarting."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = predicate()
            if last:
                return last
        except httpx.HTTPError as e:
            last = e
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what} (last seen: {last!r})")
        time.sleep(0.1)


def replica_cache(url: str) -> tuple[int, int]:
    """(blocks, checkpoints) the replica's prefix cache holds now, from its events' snapshot."""
    with httpx.stream("GET", f"{url}/internal/cache-events", timeout=10,
                      headers={"Authorization": f"Bearer {REPLICA_TOKEN}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            # The stream opens with its snapshot (docs/routing.md): a router rebuilds from it.
            assert event["type"] == "snapshot", f"first cache event is {event['type']!r}, not the snapshot"
            blocks = {b["hash"]: b["checkpoint"] for b in event["blocks"]}
            return len(blocks), sum(blocks.values())
    raise AssertionError(f"{url}/internal/cache-events ended without a snapshot")


def wait_synced(fleet, timeout: float = 10):
    """Until the router's index of every live replica holds what that replica's cache holds."""
    for r in fleet["replicas"]:
        if r.proc.poll() is not None:
            continue

        def same(url=r.base_url):
            s = replica_state(fleet, url)
            return s["events_synced"] and (s["index_blocks"], s["index_checkpoints"]) == replica_cache(url)

        wait_for(same, timeout, f"the router's index of {r.base_url} to match its cache")


def in_flight(fleet, url: str | None = None) -> int:
    """Requests the router has open (to the replica at `url`, or to all)."""
    h = httpx.get(f"{fleet['router'].base_url}/health", timeout=5).json()
    return sum(r["in_flight"] for r in h["replicas"] if url is None or r["url"] == url)


def test_clients_through_the_router(fleet, rclient, name):
    msgs = [{"role": "user", "content": "What is 12 + 30?"}]
    plain, replica, _ = chat(rclient, name, msgs, max_tokens=24)
    assert replica in {"r0", "r1", "r2"}
    stream = rclient.chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=24,
                                             reasoning_effort="none", stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 2, "streamed in pieces"
    assert "".join(chunks) == plain.choices[0].message.content
    ac = anthropic.Anthropic(base_url=fleet["router"].base_url, api_key="unused", max_retries=0)
    m = ac.messages.create(model=name, max_tokens=24, messages=msgs, extra_body={"temperature": 0})
    with ac.messages.stream(model=name, max_tokens=24, messages=msgs,
                            extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
    assert text == m.content[0].text
    # A body the replica refuses comes back in the protocol's own error shape.
    bad = httpx.post(f"{fleet['router'].base_url}/v1/chat/completions", json={"model": name},
                     timeout=30)
    assert bad.status_code == 400 and "error" in bad.json(), bad.text


def test_conversations_return_to_the_replica_holding_them(fleet, rclient, name):
    ids = replica_ids(fleet)
    urls = [r.base_url for r in fleet["replicas"]]
    # Turn 1 of conversation k goes straight to replica k; turn 2 goes through the router. (The
    # template puts a tool-choice message after the last user turn, so turn 2 diverges from turn
    # 1 there; the replica left a KDA checkpoint at that point for it: docs/routing.md.)
    convs = []
    for k, url in enumerate(urls):
        direct = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "system", "content": system_prompt(k)},
                {"role": "user", "content": f"What is the value of key-{k}-3?"}]
        r, _, _ = chat(direct, name, msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"And of key-{k}-5?"}]
        convs.append((ids[url], msgs))
    wait_synced(fleet)
    for home, msgs in convs:
        r, replica, cached = chat(rclient, name, msgs)
        assert replica == home, (replica, home)
        assert cached >= 1024, cached
    metrics = fleet["router"].metrics()
    assert metrics["k3router_prefix_blocks_hit_total"] >= 3 * 1024 / 16, metrics


def put_policy(fleet, wasm: Path) -> httpx.Response:
    return httpx.put(f"{fleet['router'].base_url}/admin/plugins/router", content=wasm.read_bytes(),
                     headers={"Authorization": f"Bearer {ROUTER_ADMIN}",
                              "Content-Type": "application/wasm"}, timeout=60)


def rollback_policy(fleet) -> httpx.Response:
    return httpx.post(f"{fleet['router'].base_url}/admin/plugins/router/rollback",
                      headers={"Authorization": f"Bearer {ROUTER_ADMIN}"}, timeout=60)


def test_policy_hot_swap_with_requests_in_flight(fleet, rclient, name):
    assert httpx.put(f"{fleet['router'].base_url}/admin/plugins/router", content=b"x",
                     timeout=10).status_code == 401
    # Long enough to leave KDA checkpoints: kv-aware then has a usable hit to keep it on one replica.
    msgs = [{"role": "system", "content": system_prompt(9)},
            {"role": "user", "content": "Tell me a short story about a fox."}]
    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(chat, rclient, name, msgs, max_tokens=48) for _ in range(8)]
        wait_for(lambda: in_flight(fleet), 10, "requests in flight through the router")
        swap = put_policy(fleet, PLUGINS / "router_round_robin.wasm")
        results = [f.result() for f in futs]
    assert swap.status_code == 200, swap.text
    assert all(r.choices[0].finish_reason for r, _, _ in results)
    # Round-robin spreads the same prompt over every replica; kv-aware would keep it on one.
    seen = {chat(rclient, name, msgs, max_tokens=2)[1] for _ in range(3)}
    assert seen == {"r0", "r1", "r2"}, seen
    assert rollback_policy(fleet).status_code == 200
    wait_synced(fleet)
    seen = set()
    for _ in range(3):
        seen.add(chat(rclient, name, msgs, max_tokens=2)[1])
        wait_synced(fleet)
    assert len(seen) == 1, seen


def test_a_failing_policy_falls_back_and_is_reported(fleet, rclient, name):
    assert put_policy(fleet, PLUGINS / "testdata_router_faulty.wasm").status_code == 200
    try:
        before = fleet["router"].metrics()
        # The test policy traps on max_tokens 13 and loops forever on 17.
        for max_tokens in (13, 17, 13):
            r, replica, _ = chat(rclient, name, [{"role": "user", "content": "Hi"}],
                                 max_tokens=max_tokens)
            assert r.choices[0].message.content is not None and replica
        after = fleet["router"].metrics()
        fallbacks = lambda m: sum(v for k, v in m.items() if k.startswith("k3router_policy_errors_total"))  # noqa: E731
        assert fallbacks(after) - fallbacks(before) == 3, (before, after)
        # The plugin still answers ordinary requests (re-instantiated after its trap).
        chat(rclient, name, [{"role": "user", "content": "Hi"}], max_tokens=3)
    finally:
        assert rollback_policy(fleet).status_code == 200


def test_a_killed_replica_loses_no_unstarted_request_and_comes_back(fleet, rclient, name):
    victim = fleet["replicas"][1]
    port = int(victim.base_url.rsplit(":", 1)[1])
    ids = replica_ids(fleet)
    prompts = [[{"role": "user", "content": f"Count from {i} to {i + 20}."}] for i in range(12)]
    with cf.ThreadPoolExecutor(12) as pool:
        futs = [pool.submit(chat, rclient, name, p, max_tokens=64) for p in prompts]
        wait_for(lambda: in_flight(fleet, victim.base_url), 10, "requests open to the victim")
        victim.proc.kill()
        results = [f.result() for f in futs]  # a non-streaming request has not started: retried
    assert all(r.choices[0].finish_reason for r, _, _ in results)
    wait_for(lambda: not replica_state(fleet, victim.base_url)["healthy"], 10,
             "the dead replica to be ejected")
    for p in prompts[:4]:
        _, replica, _ = chat(rclient, name, p, max_tokens=4)
        assert replica != ids[victim.base_url]
    # Back on the same port: re-admitted and resynced.
    fleet["replicas"][1] = start_server(REPLICA_ARGS, port=port)
    wait_for(lambda: (s := replica_state(fleet, victim.base_url))["healthy"] and s["events_synced"],
             20, "the restarted replica to be re-admitted and resynced")
