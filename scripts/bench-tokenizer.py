#!/usr/bin/env python3
"""Encode speed of k3serve's tokenizer against HF `tokenizers` and `fastokens`, in one run.

Builds a mixed text (prose from docs/, Rust code from host/, JSON) from this repository, cuts it to
about 1k, 10k and 100k tokens, and times, on each, the median of repeated encodes by:
  - HF `tokenizers` (Python package) and `fastokens` (Python package, segment cache off),
  - HF `tokenizers` (Rust crate) and ours (k3-frontend), through the `bench_tokenizer` example,
    ours also with one thread (RAYON_NUM_THREADS=1).
Every implementation's ids are checked equal to HF's. Needs: pip install tokenizers fastokens.

Usage: scripts/bench-tokenizer.py [--model models/k3-mini] [--repeats 21]
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [1_000, 10_000, 100_000]


def mixed_text(min_chars):
    """Prose, code and JSON blocks in turn, from the repository's own files (deterministic)."""
    prose = [open(p, encoding="utf-8").read() for p in sorted(glob.glob(f"{ROOT}/docs/*.md"))]
    code = [
        open(p, encoding="utf-8").read()
        for p in sorted(glob.glob(f"{ROOT}/host/*/src/**/*.rs", recursive=True))
    ]
    configs = [
        json.load(open(p, encoding="utf-8"))
        for p in sorted(glob.glob(f"{ROOT}/models/*/config.json"))
    ]
    records = [
        {"id": i, "name": f"item-{i}", "price": round(i * 1.37, 2), "tags": ["a", "b", str(i % 7)],
         "nested": {"ok": i % 2 == 0, "note": None, "text": "naïve café ✓ 数据"}}
        for i in range(2000)
    ]
    json_text = [json.dumps(c, indent=2) for c in configs] + [
        json.dumps(records[i:i + 20]) for i in range(0, len(records), 20)
    ]
    sources = [prose, code, json_text]
    block = 3000
    out, size, turn = [], 0, 0
    while size < min_chars:
        # Blocks in turn from each kind; each kind walks its documents block by block.
        texts = sources[turn % 3]
        step = turn // 3
        doc = texts[step % len(texts)]
        offset = (step // len(texts)) * block % max(len(doc), 1)
        piece = doc[offset:offset + block]
        out.append(piece)
        size += len(piece)
        turn += 1
    return "\n".join(out)


def cut_to_tokens(hf, text, n):
    """The prefix of `text` ending at the end of its n-th token."""
    enc = hf.encode(text, add_special_tokens=False)
    assert len(enc.ids) >= n, (len(enc.ids), n)
    return text[: enc.offsets[n - 1][1]]


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def run_rust(model, repeats, files, env_extra):
    cmd = [os.path.join(os.environ.get("CARGO_TARGET_DIR", f"{ROOT}/target"),
                        "release/examples/bench_tokenizer"), model, str(repeats), *files]
    env = dict(os.environ, **env_extra)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=f"{ROOT}/models/k3-mini")
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()

    import fastokens
    import tokenizers

    tok_file = os.path.join(args.model, "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(tok_file)
    fast = fastokens.Tokenizer.from_file(tok_file)
    fast.enable_segment_cache(0)

    text = mixed_text(400_000)
    while len(hf.encode(text, add_special_tokens=False).ids) < max(SIZES):
        text += "\n" + text
    tmp = tempfile.mkdtemp(prefix="k3-tok-bench-")
    texts, files = {}, []
    for n in SIZES:
        texts[n] = cut_to_tokens(hf, text, n)
        path = os.path.join(tmp, f"mixed-{n}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(texts[n])
        files.append(path)

    rows = []
    rust = run_rust(args.model, args.repeats, files, {})
    rust1 = run_rust(args.model, args.repeats, files, {"RAYON_NUM_THREADS": "1"})
    for n, r, r1 in zip(SIZES, rust, rust1):
        t = texts[n]
        ref = hf.encode(t, add_special_tokens=False).ids
        assert fast.encode(t).ids == ref, f"fastokens ids differ at {n}"
        assert r["tokens"] == len(ref), (r["tokens"], len(ref))
        hf_py = median_ms(lambda: hf.encode(t, add_special_tokens=False).ids, args.repeats)
        fk = median_ms(lambda: fast.encode(t).ids, args.repeats)
        rows.append((n, len(ref), len(t.encode()), hf_py, r["hf_rust_ms"], fk, r["ours_ms"],
                     r1["ours_ms"], r["threads"]))

    print(f"model: {tok_file}; cores: {os.cpu_count()}; median of {args.repeats} encodes; "
          "times in ms")
    head = ("| tokens | bytes | HF py | HF rust | fastokens | ours | ours 1 thread "
            "| fastokens / ours | HF rust / ours |")
    print(head)
    print("|---" * 9 + "|")
    for n, tokens, nbytes, hf_py, hf_rs, fk, ours, ours1, threads in rows:
        print(f"| {tokens} | {nbytes} | {hf_py:.3f} | {hf_rs:.3f} | {fk:.3f} | {ours:.3f} "
              f"| {ours1:.3f} | {fk / ours:.2f}× | {hf_rs / ours:.2f}× |")
    print(f"(ours: {rows[0][8]} rayon threads)")


if __name__ == "__main__":
    sys.exit(main())
