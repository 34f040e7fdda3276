#!/usr/bin/env python3
"""Where a decode step's GPU time goes, per kernel, from an Nsight Compute CSV of `k3serve bench`
(scripts/device-step-profile.sh writes it: one metric, gpu__time_duration.sum, every kernel of the
run, CUDA graph nodes included). ncu runs kernels one at a time, so the figures are each kernel's
own time with nothing overlapped, and their sum leaves out the gaps between kernels.

A step ends with the device top-k's merge kernel (kernels/sampling.cu topk_merge_f32). The bench
runs, per batch size, a prefill and then `--decode-tokens` steps of equal kernel count; each run
of two or more equal-length steps is one batch size, and its last step is reported.

    python3 scripts/step_profile.py times.csv [--top 25]
"""
import argparse
import collections
import csv
import re

STEP_END = "topk_merge_f32"


def kernels(path):
    """(kernel name, µs, DRAM bytes or None) per kernel, in launch order; bytes when the CSV has
    dram__bytes_read.sum / dram__bytes_write.sum rows (device-step-profile.sh with K3_STEP_BYTES=1)."""
    lines = [line for line in open(path, encoding="utf-8", errors="replace") if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        raise SystemExit(f"{path}: no kernel rows (did ncu finish?)")
    ix = {n: i for i, n in enumerate(rows[0])}
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
    byte_scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    order, got = [], {}
    for r in rows[1:]:
        key = r[ix["ID"]] if "ID" in ix else len(order)
        if key not in got:
            got[key] = [r[ix["Kernel Name"]], None, None]
            order.append(key)
        metric, unit = r[ix["Metric Name"]], r[ix["Metric Unit"]]
        value = float(r[ix["Metric Value"]].replace(",", ""))
        if metric == "gpu__time_duration.sum":
            got[key][1] = value * scale[unit]
        elif metric.startswith("dram__bytes_"):
            got[key][2] = (got[key][2] or 0.0) + value * byte_scale.get(unit, 1)
    for key in order:
        name, us, b = got[key]
        if us is not None:
            yield name, us, b


def short(name):
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"[<(].*", "", name)
    if name.startswith("nvjet") or "cutlass" in name or "cublas" in name:
        return "cuBLAS " + name.split("::")[-1][:28]
    return name


def steps(ks):
    cur = []
    for k in ks:
        cur.append(k)
        if short(k[0]) == STEP_END:
            yield cur
            cur = []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--each", type=float, default=0.0, help="also list every kernel of at least this many µs")
    a = ap.parse_args()
    segs = list(steps(kernels(a.csv)))
    runs, i = [], 0
    while i < len(segs):
        j = i
        while j + 1 < len(segs) and len(segs[j + 1]) == len(segs[i]):
            j += 1
        if j > i:
            runs.append(segs[j])
        i = j + 1
    for n, seg in enumerate(runs):
        total = sum(us for _, us, _ in seg)
        agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for name, us, b in seg:
            agg[short(name)][0] += 1
            agg[short(name)][1] += us
            agg[short(name)][2] += b or 0.0
        print(f"== decode run {n + 1}: {len(seg)} kernels, {total / 1e3:.2f} ms of kernel time per step")
        for name, (count, us, b) in sorted(agg.items(), key=lambda kv: -kv[1][1])[: a.top]:
            rate = f"  {b / us / 1e6:5.2f} TB/s" if b else ""
            print(f"  {us:9.1f} us  {100 * us / total:5.1f} %  {count:4d} x{rate}  {name}")
        if a.each:
            for name, us, b in seg:
                if us >= a.each:
                    rate = f"{b / 1e6:9.1f} MB {b / us / 1e6:5.2f} TB/s" if b else ""
                    print(f"    {us:8.1f} us {rate}  {short(name)}")


if __name__ == "__main__":
    main()
