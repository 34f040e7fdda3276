#!/usr/bin/env python3
"""Held-out fixtures for the Rust model tests (host/model/tests/golden.rs), from the committed k3-mini.

    PYTHONPATH=reference python3 reference/scripts/make_heldout_fixtures.py --model models/k3-mini

Writes host/model/tests/fixtures/{tool_use,arithmetic}_heldout.json: prompts from seeds the trainer never
uses (>= 2·10^6), their token ids, and the reference's greedy continuation. The Rust test must reproduce the
continuation exactly and then check its *content* (the tools called; the arithmetic result, which the test
computes itself from the operands). Arithmetic cases are taken with thinking on, in seed order, keeping those
the reference answers correctly (the note records how many were skipped): the test is about the trained
behaviour showing through the Rust engine, the accuracy figure itself lives in MODEL_CARD.md.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer

from k3ref.data.tasks import ARITH_PROMPTS, EFFORTS, check, prompt_text, sample_example
from k3ref.export import load_exported

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "host/model/tests/fixtures"


def operands(question: str) -> tuple[int, str, int]:
    """Invert ARITH_PROMPTS: the question's (a, op, b)."""
    for op, templates in ARITH_PROMPTS.items():
        for t in templates:
            pat = "^" + re.escape(t).replace(r"\{a\}", r"(?P<a>-?\d+)").replace(r"\{b\}", r"(?P<b>-?\d+)") + "$"
            m = re.match(pat, question)
            if m:
                return int(m["a"]), op, int(m["b"])
    raise ValueError(f"not an arithmetic question: {question!r}")


def greedy(model, tok, text: str, max_new: int) -> tuple[list[int], list[int]]:
    ids = tok.encode(text, add_special_tokens=False).ids
    out = model.generate_greedy(ids, max_new, stop_ids=(tok.token_to_id("<|end_of_msg|>"),))
    return ids, out


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/k3-mini")
    ap.add_argument("--arithmetic", type=int, default=3)
    ap.add_argument("--tool-use", type=int, default=4)
    a = ap.parse_args()
    model = load_exported(a.model).eval()
    tok = Tokenizer.from_file(f"{a.model}/tokenizer.json")

    tools_out = []
    rng = random.Random(2_000_001)
    for i in range(a.tool_use):
        ex = sample_example("tool_use", rng, thinking=i % 2 == 0, effort="medium")
        text = prompt_text(ex)
        ids, out = greedy(model, tok, text, 300)
        tools_out.append({
            "prompt": text, "tools": ex.tools,
            "expected_tools": [c["name"] for c in ex.expected["calls"]],
            "reference_continuation_ids": out, "prompt_ids": ids,
            "note": "held-out seed 2000001; the reference's greedy continuation; regenerate with "
                    "reference/scripts/make_heldout_fixtures.py after retraining",
        })
        print(f"tool_use {i}: {check(ex, tok.decode(out, skip_special_tokens=False))}", flush=True)

    arith_out, skipped = [], 0
    rng = random.Random(2_000_002)
    k = 0
    while len(arith_out) < a.arithmetic and k < 40:
        ex = sample_example("arithmetic", rng, thinking=True, effort=EFFORTS[k % 4])
        k += 1
        text = prompt_text(ex)
        ids, out = greedy(model, tok, text, 600)
        ok = check(ex, tok.decode(out, skip_special_tokens=False)).get("exact", False)
        print(f"arithmetic {k}: {ex.messages[-2]['content']!r} -> {ok}", flush=True)
        if not ok:
            skipped += 1
            continue
        x, op, y = operands(ex.messages[-2]["content"])
        arith_out.append({
            "prompt": text, "prompt_ids": ids, "a": x, "op": op, "b": y,
            "reference_continuation_ids": out,
            "note": f"held-out seed 2000002, thinking on; {skipped} earlier case(s) skipped because the reference "
                    "answered them wrongly (see MODEL_CARD.md for the accuracy)",
        })
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / "tool_use_heldout.json").write_text(json.dumps(tools_out, indent=1) + "\n")
    (FIXTURES / "arithmetic_heldout.json").write_text(json.dumps(arith_out, indent=1) + "\n")
    print(f"wrote {len(tools_out)} tool-use and {len(arith_out)} arithmetic cases ({skipped} skipped)")


if __name__ == "__main__":
    main()
