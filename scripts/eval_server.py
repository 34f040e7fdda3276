#!/usr/bin/env python3
"""k3-mini's model-card evaluation (models/k3-mini/MODEL_CARD.md, "Evaluation") through a running
server's HTTP API instead of the PyTorch reference: the same held-out examples, token budgets and
scoring (reference/k3ref/data/heldout.py, tasks.check), greedy, each prompt sent as token ids to
/v1/completions with its markers kept in the output. So any device and --dtype can be checked
against the card:

    k3serve serve --model models/k3-mini --device cuda --dtype bfloat16 --port 8000 &
    python3 scripts/eval_server.py --base-url http://127.0.0.1:8000 --per-kind 30 \\
        --compare reference/runs-log/k3-mini-eval-after-vision.json --out eval.json

--compare prints each score beside the reference run's and exits 1 if any differs by more than
--tolerance (default 0: the same answers). --kinds limits the task kinds (smoke runs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "reference"))
from k3ref.data.heldout import MAX_NEW, Tally, held_out_examples  # noqa: E402
from k3ref.data.tasks import check, prompt_text  # noqa: E402

END_OF_MSG = "<|end_of_msg|>"


async def generate(client: httpx.AsyncClient, model: str, ids: list[int], max_tokens: int) -> str:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "skip_special_tokens": False}
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    choice = r.json()["choices"][0]
    text = choice["text"]
    # The reference decodes its stop token too; a server leaves the EOS id's text out.
    if choice["finish_reason"] == "stop" and not text.endswith(END_OF_MSG):
        text += END_OF_MSG
    return text


async def run(a) -> tuple[dict, list]:
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    kinds = set(a.kinds.split(",")) if a.kinds else None
    examples = [(ex, th) for ex, th in held_out_examples(a.per_kind) if kinds is None or ex.kind in kinds]
    tally, samples = Tally(), []
    sem = asyncio.Semaphore(a.concurrency)
    async with httpx.AsyncClient(base_url=a.base_url, timeout=a.timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(ex, thinking):
            ids = tok.encode(prompt_text(ex), add_special_tokens=False).ids
            async with sem:
                text = await generate(client, model, ids, MAX_NEW[ex.kind])
            return ex, thinking, text

        for ex, thinking, text in await asyncio.gather(*(one(ex, th) for ex, th in examples)):
            metrics = check(ex, text)
            tally.add(ex.kind, thinking, metrics)
            if len(samples) < 24 and not all(metrics.values()):
                samples.append({"kind": ex.kind, "ok": metrics, "generated": text[:400]})
    return tally.table(), samples


def compare(table: dict, reference: dict, tolerance: float) -> list[str]:
    """Lines of `kind metric: ours vs reference`; those beyond `tolerance` are marked."""
    lines = []
    for kind, scores in sorted(table.items()):
        for metric, ours in sorted(scores.items()):
            theirs = reference.get(kind, {}).get(metric)
            if metric == "n" or theirs is None:
                continue
            mark = "  DIFFERS" if abs(ours - theirs) > tolerance else ""
            lines.append(f"{kind:12s} {metric:32s} {ours:.4f} vs {theirs:.4f}{mark}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default=str(ROOT / "models" / "k3-mini"), help="model directory (its tokenizer)")
    ap.add_argument("--per-kind", type=int, default=30)
    ap.add_argument("--kinds", default=None, help="comma-separated task kinds (default: all)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--compare", default=None, help="a k3ref.evaluate --out file to compare with")
    ap.add_argument("--tolerance", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    table, samples = asyncio.run(run(a))
    print(json.dumps(table, indent=1))
    print(f"{sum(s['n'] for s in table.values())} examples in {time.time() - t0:.1f} s", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps({"table": table, "samples": samples}, indent=1) + "\n")
    if a.compare:
        saved = json.loads(Path(a.compare).read_text())
        reference = saved.get("table", saved)  # k3ref.evaluate --out, or a bare table
        lines = compare(table, reference, a.tolerance)
        print("\n".join(lines))
        if any(line.endswith("DIFFERS") for line in lines):
            sys.exit(1)


if __name__ == "__main__":
    main()
