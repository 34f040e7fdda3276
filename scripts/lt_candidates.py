#!/usr/bin/env python3
"""Probe: for each of k3-slice's dense decode products, time each of the first N algorithms
cuBLASLt's heuristic offers (the host's blas_lt.rs takes only the first), to see whether timing the
candidates once per shape would beat taking the heuristic's first choice.
The products are the host's: bf16 weights [n, k] and rows [m, k], f32 accumulate and result.
Weights rotate through copies spanning ~400 MB, so L2 holds none of them between calls.

    python3 scripts/lt_candidates.py [--rows 16,64] [--count 16] [--tbps 4.25]

Prints one line per candidate (its config: algorithm id, tile, split-K, stages) and per shape the
heuristic's first against the fastest, then both summed over one decode step's calls.
"""
import argparse
import ctypes
import glob
import os
import sys

import torch

from dense_decode_probe import COPY_TBPS, SHAPES, copies, timed

CUDA_R_16BF, CUDA_R_32F, COMPUTE_32F = 14, 0, 68
DESC_TRANSA, PREF_MAX_WORKSPACE = 3, 1
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_STAGES = 0, 1, 2, 6
WORKSPACE = 32 << 20  # lanes.rs WORKSPACE_BYTES


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_lt():
    roots = [os.path.dirname(torch.__file__)] + [p for p in sys.path if p.endswith("site-packages")]
    for root in roots:
        for pat in ("lib/libcublasLt.so*", "../nvidia/*/lib/libcublasLt.so*", "nvidia/*/lib/libcublasLt.so*"):
            found = sorted(glob.glob(os.path.join(root, pat)))
            if found:
                return ctypes.CDLL(found[0])
    return ctypes.CDLL("libcublasLt.so")


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


class Lt:
    def __init__(self):
        self.lib = load_lt()
        self.handle = ctypes.c_void_p()
        check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    def layouts(self, n, m, k):
        """blas_lt.rs make_plan's descriptors: C' [n, m] = W'^T X' column-major, W' [k, n] transposed."""
        lib = self.lib
        desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, CUDA_R_32F), "desc")
        op_t = ctypes.c_int(1)
        check(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSA, ctypes.byref(op_t), 4), "transa")
        lay = []
        for dtype, rows, cols, ld in ((CUDA_R_16BF, k, n, k), (CUDA_R_16BF, k, m, k), (CUDA_R_32F, n, m, n)):
            h = ctypes.c_void_p()
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), dtype, ctypes.c_uint64(rows),
                                                 ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
            lay.append(h)
        return desc, lay

    def candidates(self, desc, lay, count):
        lib = self.lib
        pref = ctypes.c_void_p()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "pref ws")
        res = (Heuristic * count)()
        got = ctypes.c_int(0)
        check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, lay[0], lay[1], lay[2], lay[2], pref, count,
                                                 res, ctypes.byref(got)), "heuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def config(self, algo):
        out = []
        for attr in (CFG_ID, CFG_TILE, CFG_SPLITK, CFG_STAGES):
            v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4,
                                                          ctypes.byref(written))
            out.append(v.value)
        return "id {} tile {} splitk {} stages {}".format(*out)

    def matmul(self, desc, lay, algo, w, x, c):
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(alpha), ctypes.c_void_p(w.data_ptr()), lay[0],
            ctypes.c_void_p(x.data_ptr()), lay[1], ctypes.byref(beta), ctypes.c_void_p(c.data_ptr()), lay[2],
            ctypes.c_void_p(c.data_ptr()), lay[2], ctypes.byref(algo), ctypes.c_void_p(self.ws.data_ptr()),
            ctypes.c_size_t(WORKSPACE), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "matmul")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--count", type=int, default=16, help="candidates asked of the heuristic")
    ap.add_argument("--tbps", type=float, default=COPY_TBPS, help="HBM rate of the floors, TB/s")
    a = ap.parse_args()
    lt = Lt()
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    rows = [int(v) for v in a.rows.split(",")]
    step = {m: [0.0, 0.0, 0.0] for m in rows}  # first, best, floor (µs per step)
    for n, k, calls in SHAPES:
        ws = copies(n, k)
        floor = n * k * 2 / (a.tbps * 1e12) * 1e6
        for m in rows:
            desc, lay = lt.layouts(n, m, k)
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            c = torch.empty(m, n, device="cuda", dtype=torch.float32)
            ref = (x.float() @ ws[0].float().t())
            times = []
            for rank, h in enumerate(lt.candidates(desc, lay, a.count)):
                algo = h.algo
                i = [0]

                def mm(algo=algo, ws=ws):
                    lt.matmul(desc, lay, algo, ws[i[0] % len(ws)], x, c)
                    i[0] += 1

                try:
                    i[0] = 0
                    mm()
                    torch.cuda.synchronize()
                    err = ((c - ref).abs().max() / ref.abs().max()).item()
                    t = timed(mm)
                except RuntimeError as e:
                    print(f"  {n}x{k} M={m} #{rank}: {e}", flush=True)
                    continue
                times.append((t, rank))
                print(f"  {n}x{k} M={m} #{rank} {lt.config(algo)} ws {h.workspace >> 10} KiB: {t:.1f} us "
                      f"({floor / t * 100:.0f} % of floor), rel err {err:.1e}", flush=True)
            if not times:
                continue
            first = {r: t for t, r in times}.get(0, float("nan"))  # nan: the first candidate failed
            best, rank = min(times)
            step[m][0] += first * calls
            step[m][1] += best * calls
            step[m][2] += floor * calls
            print(f"{n}x{k} M={m}: first {first:.1f} us ({floor / first * 100:.0f} %), best #{rank} {best:.1f} us "
                  f"({floor / best * 100:.0f} %), x{calls} per step", flush=True)
    for m, (first, best, floor) in step.items():
        print(f"per step M={m}: first {first / 1e3:.3f} ms, best {best / 1e3:.3f} ms, floor {floor / 1e3:.3f} ms "
              f"({floor / first * 100:.0f} / {floor / best * 100:.0f} %)", flush=True)


if __name__ == "__main__":
    main()
