#!/usr/bin/env python3
"""Probe: k3-slice's dense decode products (bf16 weights, M = 1 / 16 / 64 rows) through cuBLAS (torch.mm)
against the byte floor, fused against separate, and a Triton skinny GEMM autotuned per shape, to see how
far cuBLAS's choice is from what the weights' bytes allow. Weights rotate through enough copies that L2
holds none of them between calls. Writes one line per measurement.

    python3 scripts/dense_decode_probe.py [--triton] [--blas cublas,cublaslt] [--tbps 2.99] [--out f32]

--blas times every shape through each of torch's BLAS back ends in turn (cuBLASLt picks its kernels
by its own heuristic: if it beats cuBLAS on a part, the host's products could go through it);
--tbps sets the floors' HBM rate (default the H200's 4.25; scripts/hbm_rate.py measures another GPU's);
--out f32 writes f32 results as the host's products do (bf16 x bf16 -> f32; torch's `out_dtype`).
"""
import argparse
import sys

import torch

COPY_TBPS = 4.25
# (rows n, cols k, calls per k3-slice decode step)
SHAPES = [
    (12288, 7168, 40), (7168, 12288, 15), (33792, 7168, 2), (7168, 33792, 1), (3584, 7168, 7), (7168, 3584, 7),
    (1536, 7168, 2), (18432, 1536, 2), (163840, 7168, 1),
]


def timed(fn, reps=30):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best * 1e3  # µs


def copies(n, k, count=None):
    """Enough bf16 copies of an [n, k] weight (2 to 8) that rotating through them spans ~400 MB: no L2 reuse."""
    count = count or min(max(2, int(400e6 // (n * k * 2)) + 1), 8)
    return [(torch.randn(n, k, device="cuda") * 0.05).to(torch.bfloat16) for _ in range(count)]


def triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def skinny(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               SPLIT: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        kper = K // SPLIT
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(pid_k * kper, (pid_k + 1) * kper, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=rn[None, :] < N, other=0.0)
            acc += tl.dot(x, w)
        ptr = y_ptr + rm[:, None] * N + rn[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            tl.store(ptr, acc, mask=mask)
        else:
            tl.atomic_add(ptr, acc, mask=mask)

    return skinny


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton", action="store_true")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--blas", default="cublas", help="torch BLAS back ends to time, comma-separated")
    ap.add_argument("--tbps", type=float, default=COPY_TBPS, help="HBM rate of the floors, TB/s")
    ap.add_argument("--out", default="bf16", choices=("bf16", "f32"), help="the products' result type")
    a = ap.parse_args()
    kw = {"out_dtype": torch.float32} if a.out == "f32" else {}
    try:
        torch.mm(torch.ones(2, 2, device="cuda", dtype=torch.bfloat16), torch.ones(2, 2, device="cuda", dtype=torch.bfloat16),
                 **kw)
    except TypeError as e:
        sys.exit(f"--out {a.out}: this torch ({torch.__version__}) cannot: {e}")
    rows = [int(v) for v in a.rows.split(",")]
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    libs = a.blas.split(",")
    total = {(lib, m): [0.0, 0.0] for lib in libs for m in rows}
    for n, k, calls in SHAPES:
        ws = copies(n, k)  # made once per shape, timed through every back end
        floor = n * k * 2 / (a.tbps * 1e12) * 1e6
        for lib in libs:
            torch.backends.cuda.preferred_blas_library(lib)
            for m in rows:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                i = [0]

                def mm():
                    torch.mm(x, ws[i[0] % len(ws)].t(), **kw)
                    i[0] += 1

                t = timed(mm)
                total[lib, m][0] += t * calls
                total[lib, m][1] += floor * calls
                print(f"{lib} {n}x{k} M={m}: {t:.1f} us, floor {floor:.1f} us ({floor / t * 100:.0f} %), "
                      f"x{calls} per step", flush=True)
        del ws
    for (lib, m), (t, f) in total.items():
        print(f"{lib} per step M={m}: {t / 1e3:.3f} ms, floor {f / 1e3:.3f} ms ({f / t * 100:.0f} %)", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    # Four 12288 x 7168 products of one input (KDA q, k, v, g): separate, on four streams, fused.
    for m in rows:
        ws4 = [copies(12288, 7168, 2) for _ in range(4)]
        wf = [torch.cat([w[j] for w in ws4]) for j in range(2)]
        x = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
        i = [0]
        streams = [torch.cuda.Stream() for _ in range(4)]

        def sep():
            for w in ws4:
                torch.mm(x, w[i[0] % 2].t())
            i[0] += 1

        def par():
            cur = torch.cuda.current_stream()
            for s, w in zip(streams, ws4):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    torch.mm(x, w[i[0] % 2].t())
            for s in streams:
                cur.wait_stream(s)
            i[0] += 1

        def fused():
            torch.mm(x, wf[i[0] % 2].t())
            i[0] += 1

        floor = 4 * 12288 * 7168 * 2 / (a.tbps * 1e12) * 1e6
        for name, fn in (("separate", sep), ("four streams", par), ("fused", fused)):
            t = timed(fn, reps=10)
            print(f"qkvg M={m} {name}: {t:.1f} us, floor {floor:.1f} us ({floor / t * 100:.0f} %)", flush=True)
    if not a.triton:
        return
    import triton

    skinny = triton_kernel()
    for n, k, _ in SHAPES[:5]:
        ws = copies(n, k)
        floor = n * k * 2 / (a.tbps * 1e12) * 1e6
        m = 64
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = torch.zeros(m, n, device="cuda")
        best = None
        for bn in (64, 128):
            for bk in (128, 256):
                for split in (1, 2, 4):
                    for stages in (4,):
                        for warps in (4,):
                            if k % (split * bk):
                                continue
                            i = [0]

                            def run(bn=bn, bk=bk, split=split, stages=stages, warps=warps):
                                if split > 1:
                                    y.zero_()
                                skinny[(triton.cdiv(n, bn), split)](x, ws[i[0] % len(ws)], y, m, n, k, BM=64, BN=bn,
                                                                     BK=bk, SPLIT=split, num_stages=stages,
                                                                     num_warps=warps)
                                i[0] += 1
                            try:
                                t = timed(run, reps=10)
                            except Exception as e:  # out of shared memory and the like
                                print(f"  triton {n}x{k} bn={bn} bk={bk} split={split} s={stages} w={warps}: {e!s:.80}",
                                      file=sys.stderr)
                                continue
                            if best is None or t < best[0]:
                                best = (t, bn, bk, split, stages, warps)
        t, bn, bk, split, stages, warps = best
        print(f"triton {n}x{k} M={m}: best {t:.1f} us ({floor / t * 100:.0f} % of floor) at BN={bn} BK={bk} "
              f"split={split} stages={stages} warps={warps}", flush=True)


if __name__ == "__main__":
    main()
