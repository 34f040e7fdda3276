"""Speculative decoding through the HTTP API: a server with --speculative-config answers greedy
requests exactly as the plain session server does (chat and completions, streamed or not,
batched, multi-turn, with stop strings and logprobs), sampled requests still work (they keep
the target's distribution, not a seed's exact tokens: whether a step drafts depends on load), /metrics
reports drafts and acceptance, and a bad configuration stops the start with a clear message.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ROOT, binary, model_dir, start_server, stop_server
from helpers import TOOLS, arithmetic, recall_messages

DSPARK = ROOT / "models" / "k3-mini-dspark"
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module", params=["ngram", "dspark"])
def spec_server(request, tmp_path_factory):
    if request.param == "ngram":
        config = NGRAM
    else:
        if not (DSPARK / "model.safetensors").exists():
            pytest.skip("no DSpark drafter in models/k3-mini-dspark")
        config = {"method": "dspark", "model": str(DSPARK), "num_speculative_tokens": 7}
    profile = tmp_path_factory.mktemp("spec") / "cost.json"
    config = {**config, "cost_profile": str(profile)}
    srv = start_server(["--speculative-config", json.dumps(config), "--max-num-seqs", "8",
                        "--shutdown-timeout", "10"])
    srv.config = config
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def spec_client(spec_server):
    return openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key="unused", timeout=300, max_retries=0)


def chat(client, model, messages, **kw):
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    return r.choices[0].message


CONVERSATIONS = [
    [{"role": "user", "content": arithmetic(4821, "+", 377)[0]}],
    recall_messages(turns=2),
    [{"role": "user", "content": "Write two sentences about the sea."}],
]


def test_greedy_chat_is_identical_with_speculation(client, spec_client, model_name):
    for messages in CONVERSATIONS:
        plain = chat(client, model_name, messages, max_tokens=160)
        spec = chat(spec_client, model_name, messages, max_tokens=160)
        assert spec.content == plain.content
        assert getattr(spec, "reasoning_content", None) == getattr(plain, "reasoning_content", None)


def test_tool_calls_and_multi_turn_are_identical(client, spec_client, model_name):
    messages = [{"role": "user", "content": "What is the weather in Oslo in celsius?"}]
    plain = chat(client, model_name, messages, tools=TOOLS, max_tokens=200)
    spec = chat(spec_client, model_name, messages, tools=TOOLS, max_tokens=200)
    assert [c.function.model_dump() for c in spec.tool_calls or []] == \
        [c.function.model_dump() for c in plain.tool_calls or []]
    # The next turn continues a conversation the prefix cache holds (its state was
    # checkpointed only at committed positions).
    follow = messages + [{"role": "assistant", "content": plain.content or ""},
                         {"role": "user", "content": "And what is 12 + 30?"}]
    assert chat(spec_client, model_name, follow, max_tokens=120).content == \
        chat(client, model_name, follow, max_tokens=120).content


def test_streamed_batched_stop_strings_and_logprobs(client, spec_client, model_name):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"

    def completion(c, **kw):
        return c.completions.create(model=model_name, prompt=prompt, max_tokens=48, temperature=0, **kw)

    plain = completion(client, logprobs=2)
    spec = completion(spec_client, logprobs=2)
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
    for a, b in zip(spec.choices[0].logprobs.token_logprobs, plain.choices[0].logprobs.token_logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    # A stop string inside what a draft may cover ends the text at the same place.
    text = plain.choices[0].text
    if len(text) > 12:
        stop = text[8:12]
        assert completion(spec_client, stop=[stop]).choices[0].text == completion(client, stop=[stop]).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in completion(spec_client, stream=True) if ch.choices)
    assert streamed == text
    # Eight at once: every answer is still the plain one.
    prompts = [f"Count: {i}, {i + 1}, {i + 2}," for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        specs = list(pool.map(lambda p: spec_client.completions.create(
            model=model_name, prompt=p, max_tokens=32, temperature=0).choices[0].text, prompts))
    plains = [client.completions.create(model=model_name, prompt=p, max_tokens=32, temperature=0).choices[0].text
              for p in prompts]
    assert specs == plains


def test_sampled_requests_and_n_choices(spec_client, model_name):
    r = spec_client.chat.completions.create(
        model=model_name, messages=CONVERSATIONS[2], temperature=1.0, seed=7, n=3, max_tokens=40)
    # Sampled requests keep the target's distribution (the engine's chi-square test checks it);
    # they need not repeat a seed token for token, since whether a step drafts depends on load.
    assert len(r.choices) == 3 and all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert all(c.message.content or (c.message.model_extra or {}).get("reasoning_content") for c in r.choices)


def test_metrics_report_drafts_and_acceptance(spec_server, spec_client, model_name):
    spec_client.completions.create(model=model_name, prompt="a b c d a b c d a b c d a b", max_tokens=24,
                                   temperature=0)
    m = spec_server.metrics()
    assert m[f'k3serve_spec_decode_info{{method="{spec_server.config["method"]}"}}'] == 1
    # Drafts were verified (the first rounds always draft; the early exit may close the gate
    # after them on a CPU where drafting does not pay, so acceptance may be anything).
    assert m["k3serve_spec_decode_num_drafts_total"] > 0
    assert 0 <= m["k3serve_spec_decode_num_accepted_tokens_total"] <= m["k3serve_spec_decode_num_draft_tokens_total"]
    assert 1.0 <= m["k3serve_spec_decode_mean_acceptance_length"] <= 1 + spec_server.config["num_speculative_tokens"]
    assert any(k.startswith("k3serve_spec_decode_verify_length_total") for k in m)
    # The measured step costs were written for the next start.
    profile = json.loads(Path(spec_server.config["cost_profile"]).read_text())
    assert len(profile["points"]) >= 2 and all(s > 0 for _, s in profile["points"])
    log = spec_server.log_tail(200)
    assert "speculative decoding on" in log and "speculative decoding:" in log


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle", "num_speculative_tokens": 3}', "not supported"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "at least 1"),
    ('{"method": "ngram", "num_speculative_tokens": 64}', "more than this model verifies"),
    ('{"method": "dspark", "num_speculative_tokens": 3}', "needs \"model\""),
    ('{"method": "dspark", "model": "/nonexistent", "num_speculative_tokens": 3}', "nonexistent"),
    ("{not json", "not valid"),
])
def test_bad_configurations_stop_the_start(config, message):
    p = subprocess.run([str(binary()), "serve", "--model", model_dir(), "--port", "0",
                        "--speculative-config", config], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert message in p.stderr + p.stdout, p.stderr[-2000:]


def test_constrained_and_anthropic_requests_beside_speculation(spec_server, spec_client, model_name):
    # A JSON-schema request keeps its own sampler (it does not speculate) in the same batches.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = spec_client.chat.completions.create(
        model=model_name, messages=CONVERSATIONS[2], temperature=0, max_tokens=160, reasoning_effort="none",
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
    assert set(json.loads(r.choices[0].message.content)) == {"ok"}
    import anthropic

    a = anthropic.Anthropic(base_url=spec_server.base_url, api_key="unused", timeout=300, max_retries=0)
    msg = a.messages.create(model=model_name, max_tokens=64, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": arithmetic(12, "+", 30)[0]}])
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.content
