"""`k3serve serve` with an API key and a TOML config file (flags win over the file)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest

from conftest import _free_port, start_server, stop_server

KEY = "e2e-secret-key"


@pytest.fixture(scope="module")
def keyed_server():
    file_port, flag_port = _free_port(), _free_port()
    config = Path(tempfile.mkstemp(prefix="k3serve-e2e-", suffix=".toml")[1])
    config.write_text(
        f'port = {file_port}\napi_key = "{KEY}"\nmax-num-seqs = 4\nreasoning-parser = "kimi_k3"\n'
    )
    # The port flag wins over the file's port; the key comes from the file.
    srv = start_server(["--config", str(config)], port=flag_port)
    yield srv
    stop_server(srv)
    config.unlink()


def test_api_key_is_enforced(keyed_server):
    import anthropic
    import openai

    body = {"model": "k3-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{keyed_server.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key=KEY, max_retries=0)
    r = good.chat.completions.create(**body)
    assert r.choices[0].finish_reason in ("stop", "length")
    # The Anthropic client sends the key as x-api-key.
    m = anthropic.Anthropic(base_url=keyed_server.base_url, api_key=KEY, max_retries=0).messages.create(
        model="k3-mini", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert m.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed_server.base_url, api_key="nope", max_retries=0).messages.create(
            model="k3-mini", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    # Probes stay open; the admin API is off without --admin-token.
    assert httpx.get(f"{keyed_server.base_url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.base_url}/metrics").status_code == 200
    r = httpx.get(f"{keyed_server.base_url}/admin/plugins", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 403


def test_bad_config_is_refused_at_start():
    import subprocess

    from conftest import ROOT, binary

    config = Path(tempfile.mkstemp(prefix="k3serve-e2e-", suffix=".toml")[1])
    config.write_text("max-modle-len = 5\n")
    out = subprocess.run([str(binary()), "serve", "--config", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    config.unlink()
    assert out.returncode != 0
    assert "max-modle-len" in out.stderr


def test_warmup_request_leaves_nothing_behind():
    """`--warmup-tokens N` (the CUDA default; on the CPU only when asked) runs one throwaway
    request through the engine before the server takes traffic: it is announced in the log, it
    is not counted as a request, the prefix cache gives its pages back (the pools are empty), and
    the server then serves normally."""
    srv = start_server(["--warmup-tokens", "200", "--max-num-seqs", "2"])
    try:
        assert "warm-up: one 200-token request" in srv.log_path.read_text(errors="replace"), srv.log_tail()
        m = srv.metrics()
        assert m["k3serve_prompt_tokens_total"] == 0, m
        used = {k: v for k, v in m.items() if k.startswith("k3serve_pool_used_bytes")}
        assert used and all(v == 0 for v in used.values()), used
        r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60,
                       json={"model": "k3-mini", "prompt": [3, 5, 2], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert srv.metrics()["k3serve_prompt_tokens_total"] == 3
    finally:
        stop_server(srv)
