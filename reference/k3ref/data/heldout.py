"""The model card's held-out evaluation set and its scoring, without torch: k3ref.evaluate runs it on
the reference model, scripts/eval_server.py through a server's HTTP API."""
from __future__ import annotations

import random
from collections import defaultdict

from .tasks import EFFORTS, TASK_KINDS, sample_example

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


class Tally:
    """Per-kind scores: each metric's mean over the examples, also split by thinking on / off."""

    def __init__(self):
        self.results = defaultdict(lambda: defaultdict(list))

    def add(self, kind: str, thinking: bool, metrics: dict[str, bool]) -> None:
        self.results[kind]["_n"].append(1)
        for k, v in metrics.items():
            self.results[kind][k].append(bool(v))
            # Split by mode too: answering multi-digit arithmetic without a trace is a different task.
            self.results[kind][f"{k} (thinking {'on' if thinking else 'off'})"].append(bool(v))

    def count(self, kind: str | None = None) -> int:
        return sum(len(m["_n"]) for k, m in self.results.items() if kind in (None, k))

    def table(self) -> dict:
        return {kind: {k: round(sum(v) / len(v), 4) for k, v in m.items() if k != "_n"} | {"n": len(m["_n"])}
                for kind, m in self.results.items()}
