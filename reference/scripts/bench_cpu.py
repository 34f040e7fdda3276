"""PyTorch reference on CPU, same shapes as `k3serve bench`: the comparison for docs/performance.md.

    python3 reference/scripts/bench_cpu.py --model models/k3-mini --threads 2
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3ref.export import load_exported  # noqa: E402


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/k3-mini")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = load_exported(a.model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(8, m.cfg.vocab_size, (1, a.prompt), generator=g)
    t = time.perf_counter()
    m(ids, m.new_cache(), kda_impl="fast", last_only=True)
    prefill = a.prompt / (time.perf_counter() - t)
    cache = m.new_cache()
    m(ids[:, :64], cache, last_only=True)
    t = time.perf_counter()
    tok = ids[:, -1:]
    for _ in range(a.decode):
        tok = m(tok, cache, absorbed=True).argmax(-1)
    decode = a.decode / (time.perf_counter() - t)
    print(f"torch {torch.__version__} threads={a.threads} prefill tok/s: {prefill:.0f}  decode tok/s: {decode:.1f}")


if __name__ == "__main__":
    main()
