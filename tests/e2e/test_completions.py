"""Raw completions (/v1/completions): text and token-id prompts, echo, logprobs, streaming."""

from __future__ import annotations

import pytest

from helpers import RECALL_ANSWERS, recall_messages
from k3ref.data.render import render  # noqa: E402 (helpers puts reference/ on the path)

# k3-mini's own format with thinking off (what the chat template renders for one user turn).
PROMPT = (
    '<|open|>message role="user"<|sep|>What is 2 + 3?<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
)


# The same conversation as the chat tests' recall turn, rendered by the reference's K3 renderer with
# thinking off (k3-mini answers recall without a trace).
RECALL_PROMPT = render(recall_messages(), thinking=False, add_generation_prompt=True)


@pytest.mark.model_quality
def test_text_prompt(client, model_name):
    r = client.completions.create(model=model_name, prompt=RECALL_PROMPT, max_tokens=40, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert r.usage.prompt_tokens > 10
    assert c.text.startswith(RECALL_ANSWERS["What is my lucky number?"]), c.text


def test_echo_logprobs_and_token_ids(client, model_name, http):
    r = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2
    )
    c = r.choices[0]
    assert c.text.startswith(PROMPT)
    assert c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 6
    assert len(c.logprobs.top_logprobs[0]) == 2
    assert c.logprobs.text_offset[0] == len(PROMPT)

    # Token-id prompts: k3-mini's fixed special ids 3 <|open|>, 5 <|sep|>, 2 <|end_of_msg|>.
    r = http.post(
        "/v1/completions",
        json={"model": model_name, "prompt": [3, 5, 2], "max_tokens": 3, "temperature": 0, "echo": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"].startswith("<|open|><|sep|><|end_of_msg|>")
    assert body["usage"]["prompt_tokens"] == 3
    bad = http.post("/v1/completions", json={"model": model_name, "prompt": [999999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


@pytest.mark.model_quality
def test_streaming(client, model_name):
    text, finish = "", None
    for chunk in client.completions.create(
        model=model_name, prompt=RECALL_PROMPT, max_tokens=40, temperature=0, stream=True
    ):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert text.startswith(RECALL_ANSWERS["What is my lucky number?"]), text


def test_min_tokens_holds_back_the_end(client, model_name):
    """`min_tokens` (vLLM's extra): EOS is not sampled before that many tokens are out."""
    free = client.completions.create(model=model_name, prompt=RECALL_PROMPT, max_tokens=64, temperature=0)
    n = free.usage.completion_tokens
    assert free.choices[0].finish_reason == "stop" and n < 40, (n, free.choices[0].text)
    held = client.completions.create(
        model=model_name, prompt=RECALL_PROMPT, max_tokens=64, temperature=0, extra_body={"min_tokens": n + 8}
    )
    assert held.usage.completion_tokens >= n + 8, held.usage
    assert held.choices[0].text.startswith(free.choices[0].text[: max(1, len(free.choices[0].text) // 2)])


@pytest.mark.model_quality
def test_model_card_evaluation_through_the_server(base_url, tmp_path):
    """scripts/eval_server.py (the model card's evaluation over HTTP, the check for any --device /
    --dtype) on three held-out examples per kind, for the kinds the card scores 1.0 on every example:
    the subset must score 1.0 too, i.e. match the card exactly (--compare, tolerance 0)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "eval.json"
    r = subprocess.run(
        [sys.executable, str(root / "scripts/eval_server.py"), "--base-url", base_url, "--per-kind", "3",
         "--kinds", "recall,json_answer", "--out", str(out),
         "--compare", str(root / "reference/runs-log/k3-mini-eval-after-vision.json")],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    table = json.loads(out.read_text())["table"]
    assert {k: v["n"] for k, v in table.items()} == {"recall": 3, "json_answer": 3}
    assert table["recall"]["exact"] == 1.0 and table["json_answer"]["exact"] == 1.0, table
    assert "DIFFERS" not in r.stdout and "recall       exact" in r.stdout, r.stdout
