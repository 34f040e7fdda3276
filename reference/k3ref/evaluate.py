"""Greedy evaluation of a k3-mini model on held-out seeds (never used in training: seeds >= 10^6).

    python3 -m k3ref.evaluate --model models/k3-mini --per-kind 50 --out runs/eval.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from .data.heldout import HELD_OUT_SEED, MAX_NEW, Tally, held_out_examples  # noqa: F401 (re-exported)
from .data.tasks import check, prompt_text
from .export import load_exported


@torch.no_grad()
def evaluate(model, tokenizer, per_kind: int, time_budget: float = 1e9, log=print, examples=None,
             max_new_cap: int | None = None):
    """`examples`: (example, thinking) pairs to use instead of held_out_examples(per_kind) (e.g. interleaved
    by kind, so a time budget cuts every kind evenly); `max_new_cap` bounds MAX_NEW (smoke runs)."""
    eos = tokenizer.token_to_id("<|end_of_msg|>")
    tally = Tally()
    samples = []
    t0 = time.time()
    for ex, thinking in (held_out_examples(per_kind) if examples is None else examples):
        if time.time() - t0 > time_budget:
            log(f"eval time budget reached after {tally.count()} examples")
            break
        ids = tokenizer.encode(prompt_text(ex), add_special_tokens=False).ids
        out = model.generate_greedy(ids, min(MAX_NEW[ex.kind], max_new_cap or 10**9), stop_ids=(eos,))
        text = tokenizer.decode(out, skip_special_tokens=False)
        metrics = check(ex, text)
        tally.add(ex.kind, thinking, metrics)
        if len(samples) < 24 and (tally.count(ex.kind) <= 2 or not all(metrics.values())):
            samples.append({"kind": ex.kind, "ok": metrics, "generated": text[:400]})
    table = tally.table()
    return table, samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/k3-mini")
    ap.add_argument("--per-kind", type=int, default=50)
    ap.add_argument("--time-budget", type=float, default=1e9)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from tokenizers import Tokenizer
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_exported(a.model).to(dev)
    tok = Tokenizer.from_file(f"{a.model}/tokenizer.json")
    table, samples = evaluate(model, tok, a.per_kind, a.time_budget)
    print(json.dumps(table, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"table": table, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
