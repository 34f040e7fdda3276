"""Hostile connections: idle, slow-header and stalled-body sockets are closed on time while the
server keeps answering; the connection cap holds extra sockets without hurting open ones; a
declared oversize body is refused at its headers (also under `Expect: 100-continue`); Anthropic
routes answer errors in Anthropic's shape; SIGTERM with streams in flight ends every stream with
an error event and `[DONE]`. Each server here runs with short limits so the module takes seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time

import httpx
import pytest

from conftest import start_server, stop_server

API_KEY = "e2e-hostile-key"
TIMEOUT_S = 2.0  # header, keep-alive and body timeouts of the short-limit server
BODY_LIMIT = 65536
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def short():
    key_file = tempfile.NamedTemporaryFile("w", prefix="k3serve-key-", delete=False)
    key_file.write(API_KEY + "\n")
    key_file.close()
    srv = start_server([
        "--api-key-file", key_file.name,
        "--request-header-timeout", str(TIMEOUT_S),
        "--keep-alive-timeout", str(TIMEOUT_S),
        "--request-body-timeout", str(TIMEOUT_S),
        "--max-request-body-bytes", str(BODY_LIMIT),
    ])
    yield srv
    stop_server(srv)
    os.unlink(key_file.name)


def _addr(srv) -> tuple[str, int]:
    host, port = srv.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_by(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closed `sock` (EOF or reset) before `deadline`; reads and drops any
    bytes it sends first."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except (socket.timeout, TimeoutError):
            return False


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything until the server closes the socket (or `timeout`)."""
    deadline = time.monotonic() + timeout
    out = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        out += chunk
    return out


def test_secret_from_a_file_stays_off_the_command_line(short):
    with open(f"/proc/{short.proc.pid}/cmdline", "rb") as f:
        assert API_KEY.encode() not in f.read()
    assert httpx.get(f"{short.base_url}/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_idle_and_slow_header_sockets_are_closed_on_time(short):
    before = short.metrics()
    addr = _addr(short)
    start = time.monotonic()
    idle = [socket.create_connection(addr) for _ in range(200)]
    slow = [socket.create_connection(addr) for _ in range(20)]
    for s in slow:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    stop = threading.Event()

    def drip():
        # A header line every 0.5 s: each one is progress, none completes the head.
        n = 0
        while not stop.wait(0.5):
            n += 1
            for s in slow:
                try:
                    s.sendall(f"X-Drip-{n}: {n}\r\n".encode())
                except OSError:
                    pass

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        # The server answers while the hostile sockets are open.
        r = httpx.get(f"{short.base_url}/v1/models", headers=AUTH, timeout=10)
        assert r.status_code == 200
        deadline = start + TIMEOUT_S + 3.0
        still_open = [i for i, s in enumerate(idle + slow) if not _closed_by(s, deadline)]
        assert not still_open, f"{len(still_open)} sockets still open {deadline - start:.1f} s in"
    finally:
        stop.set()
        dripper.join()
        for s in idle + slow:
            s.close()
    r = httpx.get(f"{short.base_url}/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200
    after = short.metrics()
    cut = 'k3serve_http_connections_timed_out_total{timeout="header"}'
    assert after[cut] - before[cut] >= 220, (before[cut], after[cut])
    # Only this check's own connection (and perhaps the previous one, closing) is left.
    assert after["k3serve_http_connections_open"] <= 3


def test_idle_keep_alive_connection_is_closed(short):
    before = short.metrics()['k3serve_http_connections_timed_out_total{timeout="idle"}']
    with socket.create_connection(_addr(short)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert _closed_by(s, t0 + TIMEOUT_S + 3.0)
        assert time.monotonic() - t0 >= TIMEOUT_S - 0.5
    after = short.metrics()['k3serve_http_connections_timed_out_total{timeout="idle"}']
    assert after >= before + 1


def test_stalled_body_gets_408_and_close(short):
    before = short.metrics()['k3serve_http_connections_timed_out_total{timeout="body"}']
    with socket.create_connection(_addr(short)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {API_KEY}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"model\": "
        )
        t0 = time.monotonic()
        reply = _read_all(s, TIMEOUT_S + 5)
        took = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"connection: close" in reply.lower()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert TIMEOUT_S - 0.5 <= took < TIMEOUT_S + 3, took
    after = short.metrics()['k3serve_http_connections_timed_out_total{timeout="body"}']
    assert after == before + 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_declared_oversize_body_gets_413_instead_of_100_continue(short, path):
    with socket.create_connection(_addr(short)) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {50 * BODY_LIMIT}\r\n"
            "Expect: 100-continue\r\n\r\n".encode()
        )
        t0 = time.monotonic()
        reply = _read_all(s, 5)
        assert time.monotonic() - t0 < 2, "the connection should close right after the 413"
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"100 Continue" not in reply
    body = json.loads(reply.partition(b"\r\n\r\n")[2])
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large", body
    else:
        assert body["error"]["code"] == "request_too_large", body


def test_anthropic_routes_answer_in_anthropic_shape(short):
    base = short.base_url
    cases = [
        ("GET", "/v1/messages", AUTH, 405),
        ("POST", "/v1/messages/nope", AUTH, 404),
        ("POST", "/v1/messages", {"Authorization": "Bearer wrong"}, 401),
        ("POST", "/v1/messages/count_tokens", {}, 401),
    ]
    for method, path, headers, status in cases:
        r = httpx.request(method, base + path, headers=headers, json={}, timeout=10)
        assert r.status_code == status, (path, r.text)
        body = r.json()
        assert body["type"] == "error" and "message" in body["error"], (path, body)
    # OpenAI routes keep OpenAI's shape.
    r = httpx.get(base + "/v1/nothing", headers=AUTH, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"
    # Each auth failure is logged, without the key that was tried.
    log = short.log_path.read_text(errors="replace")
    assert "authentication failed" in log and "credential" in log
    assert "Bearer wrong" not in log and API_KEY not in log


def test_connection_cap_holds_extra_sockets(tmp_path):
    srv = start_server(["--max-connections", "50", "--request-header-timeout", "30",
                        "--keep-alive-timeout", "30"])
    try:
        addr = _addr(srv)
        with httpx.Client(base_url=srv.base_url, timeout=10) as existing:
            assert existing.get("/health").status_code == 200
            # 49 more fill the cap; the rest wait in the kernel's backlog, unaccepted.
            hostile = [socket.create_connection(addr) for _ in range(70)]
            time.sleep(0.5)
            r = existing.get("/metrics")
            assert r.status_code == 200, "an open connection keeps working at the cap"
            assert "k3serve_http_connections_open 50" in r.text
            with pytest.raises(httpx.TimeoutException):
                httpx.get(f"{srv.base_url}/health", timeout=1.0)
            for s in hostile:
                s.close()
            t0 = time.monotonic()
            r = httpx.get(f"{srv.base_url}/health", timeout=10)
            assert r.status_code == 200 and time.monotonic() - t0 < 5
            m = existing.get("/metrics").text
            assert "k3serve_http_connection_cap_reached_total 0" not in m
    finally:
        stop_server(srv)
    assert "Too many open files" not in srv.log_tail(400)


def test_sigterm_ends_every_stream_with_an_error_event_and_done():
    # Each stream starts in well under a second; the deadline leaves room for a busy CI host.
    START_S = 120
    srv = start_server(["--shutdown-timeout", "1", "--max-num-seqs", "16"])
    model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
        # Greedy: a sampled stream can open with tool-call markup, which the tool parser holds
        # (and, with no tools in the request, drops), so its second line may never come.
        "temperature": 0,
    }
    started = threading.Barrier(9)
    results: list[list[str] | BaseException] = [[] for _ in range(8)]

    def stream(i: int):
        lines: list[str] = []
        results[i] = lines
        try:
            with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body,
                              timeout=START_S) as r:
                assert r.status_code == 200
                signalled = False
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if not signalled and len(lines) >= 2:
                        signalled = True
                        started.wait(timeout=START_S)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        started.wait(timeout=START_S)
    except threading.BrokenBarrierError:
        # What each stream had and what the engine was doing, before the kill hides both.
        progress = [r if isinstance(r, BaseException) else len(r) for r in results]
        try:
            engine = [m for m in httpx.get(f"{srv.base_url}/metrics", timeout=5).text.splitlines()
                      if m.startswith(("k3serve_num_", "k3serve_pool_", "k3serve_plugin_",
                                       "k3serve_generation_tokens"))]
        except httpx.HTTPError as e:
            engine = [f"/metrics failed: {e!r}"]
        srv.proc.kill()
        pytest.fail(f"the streams did not all start in {START_S} s; lines per stream: {progress}\n"
                    + "\n".join(engine) + f"\n{srv.log_tail()}")
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(timeout=30)
    took = time.monotonic() - t0
    for t in threads:
        t.join(timeout=10)
    assert code == 0, srv.log_tail()
    # The grace period, then the backend stops and the streams get their last event at once.
    assert took < 1 + 5, took
    for i, lines in enumerate(results):
        assert not isinstance(lines, BaseException), f"stream {i}: {lines!r}"
        assert lines and lines[-1] == "data: [DONE]", f"stream {i} ended with {lines[-3:]}"
        last = json.loads(lines[-2].removeprefix("data: "))
        finished = any(c.get("finish_reason") for c in last.get("choices", []))
        assert "error" in last or finished, f"stream {i}: {last}"
