"""Drop-in compatibility: unknown request fields, /tokenize and /detokenize, Anthropic's
count_tokens and error shape, access log lines, and a command line copied from `vllm serve`."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, binary, model_dir, start_server, stop_server

USER = {"role": "user", "content": "What is my lucky number?"}
MARKER = "[custom template]"


def wait_for(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def access_line(server, request_id: str) -> str | None:
    for line in server.log_path.read_text(errors="replace").splitlines():
        if request_id in line and "k3serve::access" in line:
            return line
    return None


# --- the default server: lenient, text logs ---


def test_unknown_fields_are_accepted_warned_once_and_counted(server, http, model_name):
    body = {
        "model": model_name, "max_tokens": 4, "temperature": 0,
        "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low",
        "messages": [{**USER, "provider_specific_fields": {"citations": None}}],
    }
    for _ in range(2):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    m = server.metrics()
    assert m['k3serve_ignored_request_fields_total{field="verbosity"}'] >= 2
    assert m['k3serve_ignored_request_fields_total{field="messages[].provider_specific_fields"}'] >= 2
    log = server.log_path.read_text(errors="replace")
    assert log.count("ignoring unknown request field 'safety_identifier'") == 1, log[-3000:]


def test_access_line_per_request_without_colour(server, http, model_name):
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": [USER], "max_tokens": 3})
    assert r.status_code == 200
    rid, usage = r.json()["id"], r.json()["usage"]
    line = wait_for(lambda: access_line(server, rid), "the access line")
    for field in ["method=POST", "path=/v1/chat/completions", "status=200",
                  f"prompt_tokens={usage['prompt_tokens']}",
                  f"cached_tokens={usage['prompt_tokens_details']['cached_tokens']}",
                  f"generated_tokens={usage['completion_tokens']}", "ttft_ms=", "queue_ms=",
                  "prefill_ms=", "duration_ms=", "finish_reason="]:
        assert field in line, line
    assert "prompt=" not in line.replace("prompt_tokens=", ""), "prompts are logged only with --log-requests"
    # A failed request gets its line too.
    assert http.get("/v1/nothing").status_code == 404
    wait_for(lambda: "path=/v1/nothing status=404" in server.log_path.read_text(errors="replace"),
             "the 404's access line")
    # The output is a file, not a terminal: no ANSI colour codes anywhere.
    assert "\x1b[" not in server.log_path.read_text(errors="replace")


def test_tokenize_detokenize_round_trip(http, model_name):
    r = http.post("/tokenize", json={"model": model_name, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] > 0
    assert len(body["token_strs"]) == body["count"]
    r = http.post("/detokenize", json={"model": model_name, "tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_tokenize_messages_counts_what_chat_would(http, model_name):
    messages = [{"role": "system", "content": "Be brief."}, USER]
    count = http.post("/tokenize", json={"model": model_name, "messages": messages}).json()["count"]
    chat = http.post("/v1/chat/completions", json={"model": model_name, "messages": messages, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == count
    without = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < count


def test_anthropic_count_tokens(anthropic_client, model_name):
    kwargs = dict(model=model_name, system="Be brief.", messages=[USER])
    counted = anthropic_client.messages.count_tokens(**kwargs)
    sent = anthropic_client.messages.create(max_tokens=2, **kwargs)
    assert counted.input_tokens == sent.usage.input_tokens + (sent.usage.cache_read_input_tokens or 0)


def test_anthropic_paths_answer_in_anthropic_shape(http):
    import anthropic

    for method, path, status in [("POST", "/v1/messages/batches", 404), ("GET", "/v1/messages", 405),
                                 ("GET", "/v1/messages/count_tokens", 405)]:
        r = http.request(method, path, json={})
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["message"], body
    with pytest.raises(anthropic.BadRequestError):
        anthropic.Anthropic(base_url=str(http.base_url), api_key="x", max_retries=0).messages.count_tokens(
            model="k3-mini", messages=[])


# --- a command line copied from vLLM, with strict fields and JSON logs ---


@pytest.fixture(scope="module")
def vllm_style_server():
    config = json.loads((Path(model_dir()) / "tokenizer_config.json").read_text())
    template = Path(tempfile.mkstemp(prefix="k3serve-e2e-", suffix=".jinja")[1])
    template.write_text(config["chat_template"] + MARKER)
    srv = start_server([
        "--served-model-name", "k3-mini", "k3-alias",
        "--enable-auto-tool-choice", "--enable-prefix-caching",
        "--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi-k3",
        "--chat-template", str(template),
        "--trust-remote-code", "--dtype", "auto", "--tensor-parallel-size", "1",
        "--disable-log-requests", "--uvicorn-log-level", "info", "--disable-log-stats",
        "--max-num-batched-tokens", "256",
        "--strict-request-fields", "--log-format", "json", "--log-requests",
    ], positional_model=True)
    yield srv
    stop_server(srv)
    template.unlink()


def test_vllm_command_line_is_accepted(vllm_style_server):
    ids = [m["id"] for m in httpx.get(f"{vllm_style_server.base_url}/v1/models").json()["data"]]
    assert ids == ["k3-mini", "k3-alias"]
    r = httpx.post(f"{vllm_style_server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": "k3-alias", "messages": [USER], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "k3-mini", r.text
    log = vllm_style_server.log_path.read_text(errors="replace")
    for flag in ["--trust-remote-code", "--tensor-parallel-size 1", "--disable-log-requests",
                 "--uvicorn-log-level", "--disable-log-stats", "--enable-auto-tool-choice"]:
        assert f"note: {flag} is accepted" in log, flag
    # --dtype is k3serve's own flag (the GPU precision), not an ignored one.
    assert "note: --dtype" not in log


def test_strict_fields_are_400s_naming_the_field(vllm_style_server):
    for extra, param in [({"max_token": 5}, "max_token"),
                         ({"messages": [{**USER, "mood": "happy"}]}, "messages[0].mood")]:
        body = {"model": "k3-mini", "messages": [USER], **extra}
        r = httpx.post(f"{vllm_style_server.base_url}/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "unknown_field", err


def test_chat_template_flag_is_used(vllm_style_server, http):
    base = http.post("/tokenize", json={"messages": [USER]}).json()
    r = httpx.post(f"{vllm_style_server.base_url}/tokenize", json={"messages": [USER]})
    custom = r.json()
    assert custom["count"] > base["count"], (custom, base)
    text = httpx.post(f"{vllm_style_server.base_url}/detokenize", json={"tokens": custom["tokens"]}).json()
    assert text["prompt"].endswith(MARKER), text


def test_json_logs_with_prompts(vllm_style_server):
    r = httpx.post(f"{vllm_style_server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": "k3-mini", "messages": [USER], "max_tokens": 2})
    rid = r.json()["id"]
    line = wait_for(lambda: access_line(vllm_style_server, rid), "the access line")
    lines = vllm_style_server.log_path.read_text(errors="replace").splitlines()
    records = [json.loads(ln) for ln in lines if ln.strip()]  # every line is one JSON object
    access = json.loads(line)
    assert access["target"] == "k3serve::access"
    assert access["status"] == 200 and access["path"] == "/v1/chat/completions"
    assert access["generated_tokens"] == r.json()["usage"]["completion_tokens"]
    # The engine's split of the wait for the first token fits inside the whole request.
    assert access["queue_ms"] >= 0 and access["prefill_ms"] > 0, access
    assert access["queue_ms"] + access["prefill_ms"] <= access["duration_ms"] + 0.2, access
    assert USER["content"] in access["prompt"], access
    assert any("serving" in rec.get("message", "") for rec in records)
    assert "\x1b[" not in "\n".join(lines)


def test_unknown_parser_name_is_a_clear_startup_error():
    r = subprocess.run([str(binary()), "serve", model_dir(), "--tool-call-parser", "hermes", "--port", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert re.search(r"--tool-call-parser hermes: unknown name; .* kimi_k3", r.stderr), r.stderr
