"""Greedy evaluation of a k3-mini model on held-out seeds (never used in training: seeds >= 10^6).

    python3 -m k3ref.evaluate --model models/k3-mini --per-kind 50 --out runs/eval.json
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch

from .data.tasks import EFFORTS, TASK_KINDS, check, prompt_text, sample_example
from .export import load_exported

HELD_OUT_SEED = 1_000_003
MAX_NEW = {"arithmetic": 600, "tool_use": 400, "recall": 200, "kv_retrieval": 200, "json_answer": 300,
           "prose": 300}


def held_out_examples(per_kind: int):
    """Deterministic held-out set of (example, thinking): per kind, thinking on for two of every three
    examples, efforts cycling."""
    out = []
    for kind in TASK_KINDS:
        rng = random.Random(HELD_OUT_SEED + TASK_KINDS.index(kind))
        for i in range(per_kind):
            thinking = i % 3 != 2
            out.append((sample_example(kind, rng, thinking=thinking, effort=EFFORTS[i % 4]), thinking))
    return out


@torch.no_grad()
def evaluate(model, tokenizer, per_kind: int, time_budget: float = 1e9, log=print, examples=None,
             max_new_cap: int | None = None):
    """`examples`: (example, thinking) pairs to use instead of held_out_examples(per_kind) (e.g. interleaved
    by kind, so a time budget cuts every kind evenly); `max_new_cap` bounds MAX_NEW (smoke runs)."""
    eos = tokenizer.token_to_id("<|end_of_msg|>")
    results = defaultdict(lambda: defaultdict(list))
    samples = []
    t0 = time.time()
    for ex, thinking in (held_out_examples(per_kind) if examples is None else examples):
        if time.time() - t0 > time_budget:
            log(f"eval time budget reached after {sum(len(v['_n']) for v in results.values())} examples")
            break
        ids = tokenizer.encode(prompt_text(ex), add_special_tokens=False).ids
        out = model.generate_greedy(ids, min(MAX_NEW[ex.kind], max_new_cap or 10**9), stop_ids=(eos,))
        text = tokenizer.decode(out, skip_special_tokens=False)
        metrics = check(ex, text)
        results[ex.kind]["_n"].append(1)
        for k, v in metrics.items():
            results[ex.kind][k].append(bool(v))
            # Split by mode too: answering multi-digit arithmetic without a trace is a different task.
            results[ex.kind][f"{k} (thinking {'on' if thinking else 'off'})"].append(bool(v))
        if len(samples) < 24 and (len(results[ex.kind]["_n"]) <= 2 or not all(metrics.values())):
            samples.append({"kind": ex.kind, "ok": metrics, "generated": text[:400]})
    table = {kind: {k: round(sum(v) / len(v), 4) for k, v in m.items() if k != "_n"} | {"n": len(m["_n"])}
             for kind, m in results.items()}
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
