"""Fixtures for the end-to-end suite.

Builds nothing: starts the release binary (``target/release/k3serve``, or ``$K3SERVE_BIN``) as
``k3serve serve`` on a free local port with the model in ``models/k3-mini`` (or
``$K3SERVE_MODEL``), waits for ``/health``, and stops it with SIGTERM at the end (checking that it
shuts down cleanly). One server serves the whole session.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "e2e-admin-token"
# Small enough that the 413 test stays cheap, large enough for every other request.
MAX_BODY_BYTES = 1 << 20
START_TIMEOUT_S = float(os.environ.get("K3SERVE_START_TIMEOUT", "300"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base_url: str, proc: subprocess.Popen, log_path: Path):
        self.base_url = base_url
        self.proc = proc
        self.log_path = log_path

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def metrics(self) -> dict[str, float]:
        """The /metrics page as {"name{labels}": value}."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
        return out


def binary() -> Path:
    path = Path(os.environ.get("K3SERVE_BIN", ROOT / "target" / "release" / "k3serve"))
    if not path.exists():
        pytest.fail(f"{path} does not exist: build it first (cargo build --release -p k3serve)")
    return path


def model_dir() -> str:
    return os.environ.get("K3SERVE_MODEL", str(ROOT / "models" / "k3-mini"))


def start_server(extra_args: list[str], port: int | None = None, positional_model: bool = False) -> Server:
    """Start `k3serve serve` on 127.0.0.1 (a free port unless given) and wait for /health. The
    model goes as `--model DIR`, or first on the line as `vllm serve DIR` takes it."""
    port = port or _free_port()
    log_path = Path(tempfile.mkstemp(prefix="k3serve-e2e-", suffix=".log")[1])
    model = [model_dir()] if positional_model else ["--model", model_dir()]
    cmd = [str(binary()), "serve", *model, "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"k3serve exited with {proc.returncode} during start-up:\n{srv.log_tail()}")
        try:
            if httpx.get(f"{srv.base_url}/health", timeout=2).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"k3serve did not become healthy in {START_TIMEOUT_S} s:\n{srv.log_tail()}")
        time.sleep(0.25)


def stop_server(srv: Server) -> None:
    """SIGTERM, then check it stopped cleanly."""
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        pytest.fail(f"k3serve did not stop within 60 s of SIGTERM:\n{srv.log_tail()}")
    assert code == 0, f"k3serve exited with {code}:\n{srv.log_tail()}"
    assert re.search(r"stopped", srv.log_tail()), srv.log_tail()


@pytest.fixture(scope="session")
def server():
    srv = start_server([
        "--admin-token", ADMIN_TOKEN,
        "--max-num-seqs", "40",
        "--max-request-body-bytes", str(MAX_BODY_BYTES),
        "--shutdown-timeout", "10",
    ])
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url


@pytest.fixture(scope="session")
def model_name(base_url) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="session")
def anthropic_client(base_url):
    import anthropic

    return anthropic.Anthropic(base_url=base_url, api_key="unused", timeout=300, max_retries=0)


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=300) as c:
        yield c
