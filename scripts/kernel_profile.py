#!/usr/bin/env python3
"""What one kernel spends its issue slots on, from Nsight Compute's exports of a `--set full
--import-source yes` report (scripts/device-kernel-profile.sh writes them):

- the details page (`ncu --import R --page details --csv`): duration, DRAM and issue utilisation,
  warps per scheduler, registers, and the busiest pipeline as ncu's rules name it;
- the source page (`ncu --import R --page source --csv --print-source sass`): per SASS instruction
  its execution count and stall samples, summed here by opcode and by stall reason, and grouped by
  execution count, which shows the size of each loop body (e.g. "688128 x 41": 41 instructions
  that run once per warp and stage).

    python3 scripts/kernel_profile.py --details details.csv --source sass.csv [--kernel NAME] [--top 20]
"""
import argparse
import collections
import csv
import re

DETAIL_METRICS = (
    "Duration", "DRAM Throughput", "Memory Throughput", "Issue Slots Busy", "Executed Ipc Active",
    "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "No Eligible", "Registers Per Thread",
    "Achieved Occupancy", "L2 Hit Rate",
)


def details(path, kernel=None):
    """{(id, kernel name): {metric: "value unit"}} plus the pipeline rule text, per profiled launch."""
    rows = list(csv.reader(line for line in open(path, encoding="utf-8", errors="replace") if line.startswith('"')))
    if not rows:
        return {}
    ix = {h: i for i, h in enumerate(rows[0])}
    out = collections.OrderedDict()
    for r in rows[1:]:
        if len(r) <= ix["Metric Value"]:  # rule rows are longer, metric rows end early
            continue
        name = r[ix["Kernel Name"]]
        if kernel and kernel not in name:
            continue
        d = out.setdefault((r[ix["ID"]], name), {})
        m = r[ix["Metric Name"]]
        if m in DETAIL_METRICS and m not in d:
            d[m] = f'{r[ix["Metric Value"]]} {r[ix["Metric Unit"]]}'.strip()
        for cell in r:
            if "highest-utilized pipeline" in cell and "pipeline" not in d:
                hit = re.search(r"(\w[\w ]*?) is the highest-utilized pipeline \(([\d.]+)%\)", cell)
                if hit:
                    d["pipeline"] = f"{hit.group(1)} {hit.group(2)} %"
    return out


def opcode(source):
    """The opcode of a SASS line without its predicate or modifiers: '@!P0 LOP3.LUT R1, ...' -> LOP3."""
    s = re.sub(r"^@!?U?P[T\d]+\s+", "", source.strip())
    return s.split(" ")[0].split(".")[0]


def sass_kernels(path):
    """[(kernel name, rows)] of the source page: each row a dict of the columns."""
    kernels, cur, hdr = [], None, None
    for line in open(path, encoding="utf-8", errors="replace"):
        if line.startswith('"Kernel Name"'):
            cur = (next(csv.reader([line]))[1], [])
            kernels.append(cur)
            hdr = None
        elif cur is not None and line.startswith('"'):
            cells = next(csv.reader([line]))
            if hdr is None:
                hdr = cells
            elif len(cells) >= len(hdr):
                cur[1].append(dict(zip(hdr, cells)))
    return kernels


def num(s):
    try:
        return int(s.replace(",", ""))
    except (AttributeError, ValueError):
        return 0


def summarize_sass(rows):
    """(instructions executed, opcode counter, stall counter (samples), samples, bodies) where
    bodies maps an execution count to the number of instructions executed that many times."""
    ops, stalls, bodies = collections.Counter(), collections.Counter(), collections.Counter()
    total = samples = 0
    for r in rows:
        n = num(r.get("Instructions Executed", "0"))
        total += n
        ops[opcode(r.get("Source", ""))] += n
        if n:
            bodies[n] += 1
        samples += num(r.get("Warp Stall Sampling (All Samples)", "0"))
        for k, v in r.items():
            if k.startswith("stall_") and "Not Issued" not in k:
                stalls[k[len("stall_"):]] += num(v)
    return total, ops, stalls, samples, bodies


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--details", help="ncu --page details --csv")
    ap.add_argument("--source", help="ncu --page source --csv --print-source sass")
    ap.add_argument("--kernel", help="only kernels whose name contains this")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    if a.details:
        for (i, name), d in details(a.details, a.kernel).items():
            print(f"== launch {i}: {name}")
            for k in (*DETAIL_METRICS, "pipeline"):
                if k in d:
                    print(f"   {k}: {d[k]}")
    if a.source:
        for name, rows in sass_kernels(a.source):
            if a.kernel and a.kernel not in name:
                continue
            total, ops, stalls, samples, bodies = summarize_sass(rows)
            print(f"== {name}: {total:,} instructions executed, {samples:,} stall samples")
            for op, n in ops.most_common(a.top):
                print(f"   {op:<10} {n:>14,} {100 * n / max(total, 1):5.1f} %")
            print("   stalls: " + ", ".join(f"{k} {100 * v / max(samples, 1):.1f} %"
                                           for k, v in stalls.most_common(10) if v))
            print("   loop bodies (executions x instructions): " + ", ".join(
                f"{n:,} x {k}" for n, k in sorted(bodies.items(), reverse=True)[: a.top]))


if __name__ == "__main__":
    main()
