#!/usr/bin/env python3
"""Op-level correctness checks and benchmarks of kernels/*.cu on a GPU (scripts/device-check.sh).

Each check builds random inputs, packs them the way the Rust backend will (arena offsets, page
tables, MXFP4 bytes), launches the kernels, and compares with the PyTorch reference in
reference/k3ref (float64 on the host). Benchmarks time the kernels with CUDA events at K3 shapes
and print the memory-traffic floor and, where importable, fla's kernels.

--dry-run runs everything without a GPU: every launch is checked against the kernel's parsed C
signature (argument count, scalar types, array dtypes) and then executed by a NumPy/PyTorch
emulator that reads the same packed arguments. That leaves only the GPU itself new on the device.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "reference"))
from k3ref import kda as rk  # noqa: E402
from k3ref import mxfp4 as rmx  # noqa: E402
from k3ref.attnres import attn_res as ref_attn_res  # noqa: E402
from k3ref.moe import route as ref_route  # noqa: E402
from k3ref.norm import rms_norm as ref_rms_norm  # noqa: E402
from k3ref.situ import situ_glu as ref_situ_glu  # noqa: E402

KERNELS = ROOT / "kernels"
COPY_TBPS = 4.25  # anchors.md: device-to-device copy, bytes read + written

# ---------------------------------------------------------------------------------------------
# Kernel sources: inline includes (as the Rust loader does) and parse the entry points' signatures.


def inline_includes(path: Path, seen: set | None = None) -> str:
    seen = set() if seen is None else seen
    out = []
    for line in path.read_text().splitlines(keepends=True):
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if inc not in seen:
                seen.add(inc)
                out.append(inline_includes(inc, seen))
            continue
        out.append(line)
    return "".join(out)


ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)', re.S)
SCALARS = {"int": np.int32, "float": np.float32, "i64": np.int64, "u32": np.uint32}
POINTEES = {"float": np.float32, "int": np.int32, "i64": np.int64, "u8": np.uint8, "u32": np.uint32,
            "unsigned short": np.uint16}


def parse_params(text: str) -> list[tuple[str, object]]:
    """[(name, dtype or ('ptr', dtype))] from a C parameter list."""
    params = []
    for p in (x.strip() for x in text.split(",")):
        p = re.sub(r"\b(const|__restrict__)\b", " ", p)
        m = re.match(r"(.*?)(\*?)\s*(\w+)$", " ".join(p.split()))
        base, star, name = m.group(1).strip(), m.group(2), m.group(3)
        if star or base.endswith("*"):
            params.append((name, ("ptr", POINTEES[base.rstrip("*").strip()])))
        else:
            params.append((name, SCALARS[base]))
    return params


def load_signatures() -> dict[str, tuple[Path, list]]:
    sigs = {}
    for f in sorted(KERNELS.glob("*.cu")):
        for m in ENTRY.finditer(f.read_text()):
            sigs[m.group(1)] = (f, parse_params(m.group(2)))
    return sigs


# ---------------------------------------------------------------------------------------------
# Device: real (cupy) or dry (numpy + emulators). Tensors live in torch; kernels see views.


class Device:
    def __init__(self, dry: bool):
        self.dry = dry
        self.sigs = load_signatures()
        self.tdev = "cpu" if dry else "cuda"
        self.modules = {}
        if not dry:
            import cupy as cp
            self.cp = cp

    def view(self, t: torch.Tensor):
        assert t.is_contiguous()
        return t.numpy() if self.dry else self.cp.from_dlpack(t)

    def kernel(self, name):
        f, _ = self.sigs[name]
        if f not in self.modules:
            t0 = time.time()
            self.modules[f] = self.cp.RawModule(code=inline_includes(f), options=("--std=c++17",))
            self.modules[f].compile()
            log(f"compiled {f.name} in {time.time() - t0:.1f}s")
        return self.modules[f].get_function(name)

    def launch(self, name, grid, block, *args):
        _, params = self.sigs[name]
        if len(args) != len(params):
            raise TypeError(f"{name}: {len(args)} arguments for {len(params)} parameters")
        conv = []
        for (pname, want), a in zip(params, args):
            if isinstance(want, tuple):
                dt = getattr(a, "dtype", None)
                if dt is None or np.dtype(dt) != np.dtype(want[1]):
                    raise TypeError(f"{name}.{pname}: array of {want[1].__name__} expected, got {dt}")
                conv.append(a)
            else:
                if not isinstance(a, (int, float, np.integer, np.floating)):
                    raise TypeError(f"{name}.{pname}: scalar expected, got {type(a)}")
                conv.append(want(a))
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        block = tuple(block) if isinstance(block, (tuple, list)) else (block,)
        if self.dry:
            EMU[name](*conv)
        else:
            self.kernel(name)(grid, block, tuple(conv))

    def sync(self):
        if not self.dry:
            torch.cuda.synchronize()

    def time_ms(self, fn, reps=20, warmup=3) -> float:
        """Median of per-launch-sequence times over `reps` CUDA-event measurements."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return float(np.median(times))

    def time_graph(self, fn, reps=20, inner=10) -> tuple[float, str]:
        """Median ms per call of `fn` replayed from a CUDA graph of `inner` calls: no Python launch
        overhead in the number (small decode kernels run in a few us, less than one cupy launch).
        Falls back to time_ms. fn must not create cupy views (dlpack syncs break the capture)."""
        def on_torch_stream():
            with self.cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    on_torch_stream()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(inner):
                    on_torch_stream()
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / inner)
            return float(np.median(times)), "graph"
        except Exception as e:  # noqa: BLE001
            log(f"graph timing failed ({type(e).__name__}: {str(e)[:160]}); eager timing")
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
            return self.time_ms(fn), "eager"


LOG: list[str] = []


def log(msg: str):
    print(msg, flush=True)
    LOG.append(msg)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Results:
    def __init__(self):
        self.checks, self.bench, self.failed = [], [], 0

    def check(self, name: str, err: float, tol: float):
        ok = err <= tol and math.isfinite(err)
        self.failed += not ok
        self.checks.append({"name": name, "rel_err": err, "tol": tol, "ok": ok})
        log(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:.0e})")

    def exact(self, name: str, ok: bool, detail: str = ""):
        self.failed += not ok
        self.checks.append({"name": name, "ok": ok, "detail": detail})
        log(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")


def cdiv(a, b):
    return (a + b - 1) // b


# ---------------------------------------------------------------------------------------------
# Layout helpers shared by the checks (the packing the Rust backend does).


def kda_region_floats(hk, conv, heads):
    return 3 * hk * (conv - 1) + heads * 128 * 128


def pack_kda_region(arena, off, windows, S):
    """windows: 3 x [hk, W-1] (oldest first); S [H, K, V]."""
    parts = [w.reshape(-1) for w in windows] + [S.reshape(-1)]
    flat = torch.cat(parts)
    arena[off:off + flat.numel()] = flat


def unpack_kda_region(arena, off, hk, conv, heads):
    wf = hk * (conv - 1)
    w = [arena[off + i * wf: off + (i + 1) * wf].reshape(hk, conv - 1) for i in range(3)]
    S = arena[off + 3 * wf: off + 3 * wf + heads * 128 * 128].reshape(heads, 128, 128)
    return w, S


def kda_reference(xq, xk, xv, f, b, convw, a_log, dt_bias, windows, S0, heads, lb, emit_at=()):
    """Logical reference for T tokens of one sequence (float64). Returns o [T, hk], S, windows
    after T and emitted {n: (S, windows)}."""
    t, hk = xq.shape
    ys, wins_end, emitted_w = [], [], {}
    for x, w, win in zip((xq, xk, xv), convw, windows):
        y, nw = rk.short_conv(x[None], w[:, None, :], win.t()[None])
        ys.append(F.silu(y[0]))
        wins_end.append(nw[0].t())
        for n in emit_at:
            _, wn = rk.short_conv(x[None, :n], w[:, None, :], win.t()[None])
            emitted_w.setdefault(n, []).append(wn[0].t())
    q = rk.l2norm(ys[0].view(1, t, heads, 128))
    k = rk.l2norm(ys[1].view(1, t, heads, 128))
    v = ys[2].view(1, t, heads, 128)
    g = rk.kda_gate(f.view(1, t, heads, 128), a_log, dt_bias, lb)
    beta = torch.sigmoid(b.view(1, t, heads))
    o, S, em = rk.kda_recurrent(q, k, v, g, beta, 128 ** -0.5, initial_state=S0[None], emit_at=emit_at)
    return o.reshape(t, hk), S[0], wins_end, {n: (em[n][0], emitted_w[n]) for n in emit_at}


# ---------------------------------------------------------------------------------------------
# Checks (small shapes, every code path: tails, multiple sequences, scattered slots).


def rand(*shape, scale=1.0, gen=None):
    return torch.randn(*shape, dtype=torch.float64, generator=gen) * scale


def check_pointwise(d: Device, r: Results, gen):
    T = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
    rows, cols, eps = 37, 300, 1e-5
    x, w = rand(rows, cols, gen=gen), rand(cols, gen=gen)
    y = torch.empty(rows, cols, device=d.tdev)
    d.launch("rms_norm_f32", rows, 256, d.view(T(x)), d.view(T(w)), d.view(y), rows, cols, eps)
    d.sync()
    r.check("rms_norm", rel_err(y, ref_rms_norm(x, w, eps)), 1e-5)

    heads, hd = 3, 128
    o, g, wn = rand(5, heads * hd, gen=gen), rand(5, heads * hd, gen=gen), rand(hd, gen=gen)
    y = torch.empty(5, heads * hd, device=d.tdev)
    d.launch("gated_head_norm_f32", cdiv(5 * heads, 4), 128, d.view(T(o)), d.view(T(g)), d.view(T(wn)), d.view(y),
             5, heads, hd, eps)
    d.sync()
    ref = (ref_rms_norm(o.view(5, heads, hd), wn, eps) * torch.sigmoid(g.view(5, heads, hd))).view(5, -1)
    r.check("gated_head_norm", rel_err(y, ref), 1e-5)

    n = 10007
    ga, up = rand(n, scale=6, gen=gen), rand(n, scale=40, gen=gen)
    for has_lin in (1, 0):
        y = torch.empty(n, device=d.tdev)
        d.launch("situ_glu_f32", cdiv(n, 256), 256, d.view(T(ga)), d.view(T(up)), d.view(y), n, 4.0, 25.0, has_lin)
        d.sync()
        r.check(f"situ_glu(lin={has_lin})", rel_err(y, ref_situ_glu(ga, up, 4.0, 25.0 if has_lin else None)), 1e-5)

    rows_gu, inter = 7, 96
    gu = rand(rows_gu, 2 * inter, scale=6, gen=gen)
    y = torch.empty(rows_gu, inter, device=d.tdev)
    d.launch("situ_glu_packed_f32", cdiv(rows_gu * inter, 256), 256, d.view(T(gu)), d.view(y), rows_gu, inter, 4.0,
             25.0, 1)
    d.sync()
    r.check("situ_glu_packed", rel_err(y, ref_situ_glu(gu[:, :inter], gu[:, inter:], 4.0, 25.0)), 1e-5)

    p, a = T(rand(n, gen=gen)), rand(n, gen=gen)
    p0 = p.clone()
    d.launch("add_assign_f32", cdiv(n, 256), 256, d.view(p), d.view(T(a)), n)
    d.sync()
    r.check("add_assign", rel_err(p, p0.double().cpu() + a.float().double()), 1e-6)
    oo = T(rand(n, gen=gen))
    o0 = oo.clone()
    d.launch("sigmoid_mul_f32", cdiv(n, 256), 256, d.view(oo), d.view(T(a)), n)
    d.sync()
    r.check("sigmoid_mul", rel_err(oo, o0.double().cpu() * torch.sigmoid(a.float().double())), 1e-6)

    vocab, dm = 50, 64
    table = rand(vocab, dm, gen=gen)
    ids = torch.tensor([3, 0, 49, 7], dtype=torch.int32)
    out = torch.empty(4, dm, device=d.tdev)
    idv = d.view(ids.to(d.tdev)).view(np.uint32)
    d.launch("embed_rows_f32", 4, 64, d.view(T(table)), idv, d.view(out), 4, dm, vocab)
    d.sync()
    r.check("embed_rows_f32", rel_err(out, table[ids.long()]), 1e-7)
    tb = T(table).to(torch.bfloat16)
    out = torch.empty(4, dm, device=d.tdev)
    d.launch("embed_rows_bf16", 4, 64, d.view(tb.view(torch.int16)).view(np.uint16), idv, d.view(out), 4, dm, vocab)
    d.sync()
    r.check("embed_rows_bf16", rel_err(out, tb.float().cpu()[ids.long()]), 1e-7)


def check_attnres(d: Device, r: Results, gen):
    rows, dm, eps = 7, 1000, 1e-5
    for n in (1, 2, 9):
        srcs = [rand(rows, dm, scale=1 + i, gen=gen) for i in range(n)]
        w = rand(dm, scale=0.05, gen=gen)
        dev = [d.view(s.float().contiguous().to(d.tdev)) for s in srcs]
        ptrs = dev + [dev[0]] * (9 - n)  # unused slots: any valid pointer, never read
        out = torch.empty(rows, dm, device=d.tdev)
        d.launch("attn_res_f32", rows, 256, *ptrs, n, d.view(w.float().contiguous().to(d.tdev)), d.view(out), rows, dm,
                 eps)
        d.sync()
        ref = ref_attn_res(srcs[-1], srcs[:-1], w, torch.ones(1, dm, dtype=torch.float64), eps)
        r.check(f"attn_res(n={n})", rel_err(out, ref), 1e-5)


def check_router_sampling(d: Device, r: Results, gen):
    t, e, k = 5, 96, 8
    logits, bias = rand(t, e, scale=2, gen=gen), rand(e, scale=0.3, gen=gen)
    idx = torch.empty(t, k, dtype=torch.int32, device=d.tdev)
    w = torch.empty(t, k, device=d.tdev)
    d.launch("router_topk_f32", t, 128, d.view(logits.float().contiguous().to(d.tdev)),
             d.view(bias.float().contiguous().to(d.tdev)), d.view(idx), d.view(w), t, e, k, 1, 2.5)
    d.sync()
    ridx, rw, _ = ref_route(logits, torch.eye(e, dtype=torch.float64), bias, k, True, 2.5)
    r.exact("router idx", bool((idx.cpu().long() == ridx).all()))
    r.check("router weights", rel_err(w, rw), 1e-5)

    rows, vocab = 3, 70001
    lg = rand(rows, vocab, scale=3, gen=gen)
    lg[1, 12345] = 50.0
    lgd = lg.float().contiguous().to(d.tdev)
    ids = torch.empty(rows, dtype=torch.int32, device=d.tdev)
    d.launch("argmax_rows_f32", rows, 1024, d.view(lgd), d.view(ids), rows, vocab)
    d.sync()
    r.exact("argmax_rows", bool((ids.cpu().long() == lg.float().argmax(-1)).all()))
    probs = torch.empty(rows, vocab, device=d.tdev)
    d.launch("softmax_temperature_f32", rows, 1024, d.view(lgd), d.view(probs), rows, vocab, 0.7)
    d.sync()
    r.check("softmax_temperature", rel_err(probs, torch.softmax(lg / 0.7, -1)), 1e-5)


def kda_inputs(t, heads, conv, gen, seqs=1):
    hk = heads * 128
    return dict(
        xq=[rand(t, hk, gen=gen) for _ in range(seqs)], xk=[rand(t, hk, gen=gen) for _ in range(seqs)],
        xv=[rand(t, hk, gen=gen) for _ in range(seqs)], f=[rand(t, hk, gen=gen) for _ in range(seqs)],
        b=[rand(t, heads, gen=gen) for _ in range(seqs)],
        convw=[rand(hk, conv, scale=0.5, gen=gen) for _ in range(3)],
        a_log=rand(heads, scale=0.5, gen=gen), dt_bias=rand(hk, scale=0.5, gen=gen),
        windows=[[rand(hk, conv - 1, gen=gen) for _ in range(3)] for _ in range(seqs)],
        S0=[rand(heads, 128, 128, scale=0.1, gen=gen) for _ in range(seqs)])


def check_kda_decode(d: Device, r: Results, gen):
    heads, conv, lb, n = 3, 4, -5.0, 3
    hk, reg = heads * 128, kda_region_floats(heads * 128, conv, heads)
    inp = kda_inputs(1, heads, conv, gen, seqs=n)
    # Scattered slots: seq i at slot order [2, 0, 3], checkpoint of seq 1 into slot 1.
    # Slot 2 is only 4-byte aligned (the kernel's scalar path), the others 16-byte aligned (float4).
    slots = [2, 0, 3]
    at = lambda s: 8 + s * (reg + 4) + (3 if s == 2 else 0)  # noqa: E731
    arena = torch.zeros(5 * (reg + 4) + 16, dtype=torch.float64)
    offs = [at(s) for s in slots]
    for i in range(n):
        pack_kda_region(arena, offs[i], inp["windows"][i], inp["S0"][i])
    ck = [-1, at(1), -1]
    A = arena.float().to(d.tdev)
    F32 = lambda xs: torch.cat([x for x in xs]).float().contiguous().to(d.tdev)  # noqa: E731
    o = torch.empty(n, hk, device=d.tdev)
    args = [d.view(F32(inp["xq"])), d.view(F32(inp["xk"])), d.view(F32(inp["xv"])), d.view(F32(inp["f"])),
            d.view(F32(inp["b"]))] + [d.view(w.float().contiguous().to(d.tdev)) for w in inp["convw"]] + [
        d.view(inp["a_log"].float().to(d.tdev)), d.view(inp["dt_bias"].float().to(d.tdev)), d.view(A),
        d.view(torch.tensor(offs, dtype=torch.int64).to(d.tdev)), d.view(torch.tensor(ck, dtype=torch.int64).to(d.tdev)),
        d.view(o), n, heads, conv, lb]
    d.launch("kda_decode_f32", (heads, n), 512, *args)
    d.sync()
    A = A.double().cpu()
    eo, es, ew = 0.0, 0.0, 0.0
    for i in range(n):
        ro, rS, rw, _ = kda_reference(inp["xq"][i], inp["xk"][i], inp["xv"][i], inp["f"][i], inp["b"][i],
                                      inp["convw"], inp["a_log"], inp["dt_bias"], inp["windows"][i], inp["S0"][i],
                                      heads, lb)
        gw, gS = unpack_kda_region(A, offs[i], hk, conv, heads)
        eo = max(eo, rel_err(o[i:i + 1], ro))
        es = max(es, rel_err(gS, rS))
        ew = max(ew, max(rel_err(a, b) for a, b in zip(gw, rw)))
        if ck[i] >= 0:
            cw, cS = unpack_kda_region(A, ck[i], hk, conv, heads)
            es = max(es, rel_err(cS, rS))
            ew = max(ew, max(rel_err(a, b) for a, b in zip(cw, rw)))
    r.check("kda_decode o", eo, 2e-5)
    r.check("kda_decode state (+checkpoint)", es, 2e-5)
    r.check("kda_decode windows (+checkpoint)", ew, 1e-6)


# Chunk kernels of the prefill (same arguments): name -> grid for `heads`.
KDA_CHUNK_KERNELS = {"f32": ("kda_chunk_fwd_f32", lambda h: (h, 4)),
                     "tc": ("kda_chunk_tc_f32", lambda h: (4, h)),
                     "tc_fast": ("kda_chunk_tc_fast_f32", lambda h: (4, h))}
# Tolerance of each against the float64 reference: 3xTF32 keeps f32 accuracy, 1xTF32 ~7e-4.
KDA_CHUNK_TOL = {"f32": 1e-4, "tc": 1e-4, "tc_fast": 2e-3}


# Conv + prep: "fused" = kda_conv_prep_f32 (one pass, conv <= 4), "split" = the two old kernels
# (kda_conv_silu_f32 + kda_prep_f32), kept as the fallback. Must match ops.rs KDA_FUSED_PREP.
KDA_PREP = "fused"


def run_kda_prefill(d: Device, t, heads, conv, lb, A, off, ck_n, ck_off, xq, xk, xv, f, b, convw, a_log, dt_bias,
                    chunk="f32", prep=KDA_PREP):
    """Launch the prefill kernels; returns (o, launch closure) with device tensors as given."""
    chunk_name, chunk_grid = KDA_CHUNK_KERNELS[chunk]
    fused = prep == "fused" and conv <= 4
    hk = heads * 128
    dev = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
    qo, ko, vo = (torch.empty(t, hk, device=d.tdev) for _ in range(3))
    fg = dev(f).clone()
    f0 = fg.clone()
    beta = torch.empty(t, heads, device=d.tdev)
    o = torch.empty(t, hk, device=d.tdev)
    cn = torch.tensor(ck_n or [0], dtype=torch.int32).to(d.tdev)
    co = torch.tensor(ck_off or [0], dtype=torch.int64).to(d.tdev)
    v = [d.view(dev(x)) for x in (xq, xk, xv)] + [d.view(dev(w)) for w in convw]
    bv, al, dtb = d.view(dev(b)), d.view(dev(a_log)), d.view(dev(dt_bias))

    def go():
        if fused:  # g to its own buffer (fg): f is only read
            d.launch("kda_conv_prep_f32", (cdiv(t, 32), cdiv(heads, 4)), 128, *v[:3], d.view(f0), bv, *v[3:], al, dtb,
                     d.view(qo), d.view(ko), d.view(vo), d.view(fg), d.view(beta), d.view(A), off, d.view(cn),
                     d.view(co), len(ck_n), t, heads, conv, lb)
            chunk_only()
            return
        fg.copy_(f0)  # the prep kernel writes g over f
        d.launch("kda_conv_silu_f32", cdiv(3 * hk, 256), 256, *v, d.view(qo), d.view(ko), d.view(vo), d.view(A), off,
                 d.view(cn), d.view(co), len(ck_n), t, hk, conv)
        d.launch("kda_prep_f32", cdiv(t * heads, 4), 128, d.view(qo), d.view(ko), d.view(fg), bv, d.view(beta), al, dtb,
                 t, heads, lb)
        chunk_only()

    def chunk_only():  # the chunk kernel alone (inputs from a previous go())
        d.launch(chunk_name, chunk_grid(heads), 128, d.view(qo), d.view(ko), d.view(vo), d.view(fg), d.view(beta),
                 d.view(A), off, d.view(cn), d.view(co), len(ck_n), d.view(o), t, heads, conv)
    go.chunk_only = chunk_only
    return o, go


def check_kda_prefill(d: Device, r: Results, gen, chunk="f32", prep=KDA_PREP, conv=4):
    heads, lb = 2, -5.0
    hk, reg = heads * 128, kda_region_floats(heads * 128, conv, heads)
    tag = "kda_prefill" if chunk == "f32" else f"kda_prefill[{chunk}]"
    if prep != KDA_PREP or conv != 4:
        tag += f"[prep={prep},conv={conv}]"
    tol = KDA_CHUNK_TOL[chunk]
    for t, emit in ((45, [1, 16, 30, 45]), (16, []), (3, [2])) + (((2, [1]),) if conv == 4 else ()):
        inp = kda_inputs(t, heads, conv, gen)
        arena = torch.zeros((len(emit) + 1) * reg, dtype=torch.float64)
        off = len(emit) * reg  # the working slot is the last; checkpoint j goes to slot j
        pack_kda_region(arena, off, inp["windows"][0], inp["S0"][0])
        ck_off = [j * reg for j in range(len(emit))]
        A = arena.float().to(d.tdev)
        o, go = run_kda_prefill(d, t, heads, conv, lb, A, off, emit, ck_off, inp["xq"][0], inp["xk"][0], inp["xv"][0],
                                inp["f"][0], inp["b"][0], inp["convw"], inp["a_log"], inp["dt_bias"], chunk, prep)
        go()
        d.sync()
        ro, rS, rw, em = kda_reference(inp["xq"][0], inp["xk"][0], inp["xv"][0], inp["f"][0], inp["b"][0], inp["convw"],
                                       inp["a_log"], inp["dt_bias"], inp["windows"][0], inp["S0"][0], heads, lb, emit)
        A = A.double().cpu()
        gw, gS = unpack_kda_region(A, off, hk, conv, heads)
        r.check(f"{tag} T={t} o", rel_err(o, ro), tol)
        r.check(f"{tag} T={t} state", rel_err(gS, rS), tol)
        r.check(f"{tag} T={t} windows", max(rel_err(a, b) for a, b in zip(gw, rw)), 1e-6)
        for slot, n in zip(ck_off, emit):
            cw, cS = unpack_kda_region(A, slot, hk, conv, heads)
            eS, eW = em[n]
            r.check(f"{tag} T={t} checkpoint n={n}", max(rel_err(cS, eS),
                    max(rel_err(a, b) for a, b in zip(cw, eW))), tol)


def check_kda_prefill_tc(d: Device, r: Results, gen):
    """The tensor-core chunk kernels on the same cases (3xTF32: the f32 tolerances hold)."""
    check_kda_prefill(d, r, gen, chunk="tc")
    check_kda_prefill(d, r, gen, chunk="tc_fast")


def check_kda_prefill_prep(d: Device, r: Results, gen):
    """The conv + prep variant not taken by default, and the fused one at other conv widths."""
    check_kda_prefill(d, r, gen, prep="split" if KDA_PREP == "fused" else "fused")
    for conv in (3, 2):  # (conv 1 has no window; the checks below would compare empty tensors)
        check_kda_prefill(d, r, gen, prep="fused", conv=conv)


def mla_reference(q, rows, kv_b, heads, nope, rope, v_dim, kv_lora):
    """Expanded (naive) form for one query over rows [len, kv_lora + rope], float64."""
    c, kr = rows[:, :kv_lora], rows[:, kv_lora:]
    w = kv_b.view(heads, nope + v_dim, kv_lora)
    out = []
    for h in range(heads):
        k = torch.cat([c @ w[h, :nope].t(), kr], -1)
        v = c @ w[h, nope:].t()
        qh = q[h * (nope + rope):(h + 1) * (nope + rope)]
        a = torch.softmax(k @ qh * (nope + rope) ** -0.5, 0)
        out.append(a @ v)
    return torch.cat(out)


def check_mla(d: Device, r: Results, gen):
    for heads, nope, rope, v_dim, kv_lora, lens in ((6, 64, 32, 64, 128, [37, 70, 1]), (4, 128, 64, 128, 512, [50, 17])):
        row, pt, eps = kv_lora + rope, 16, 1e-5
        n = len(lens)
        npages = [cdiv(L, pt) for L in lens]
        total = sum(npages)
        perm = torch.randperm(total, generator=gen).tolist()  # pages scattered over the arena
        # This layer's rows start 3 rows into each page; one float further for the first shape, so
        # its rows are only 4-byte aligned (the tensor-core kernel's cp.async 4-byte path).
        layer_off = 3 * row + (1 if kv_lora == 128 else 0)
        page_floats = pt * row + 5 * row
        arena = torch.zeros(total * page_floats, dtype=torch.float64)
        page_start, pt_base, rows_all, k = [], [], [], 0
        for i, L in enumerate(lens):
            pt_base.append(len(page_start))
            for p in range(npages[i]):
                page_start.append(perm[k] * page_floats + layer_off)
                k += 1
            rows_all.append(rand(L, row, gen=gen))
        # Cached rows 0..L-2 are packed here; row L-1 is appended by the kernel from kv_a.
        kv_a = rand(n, row, gen=gen)
        norm_w = rand(kv_lora, gen=gen)
        dst = []
        for i, L in enumerate(lens):
            rows_all[i][L - 1] = torch.cat([ref_rms_norm(kv_a[i, :kv_lora], norm_w, eps), kv_a[i, kv_lora:]])
            for j in range(L):
                o = page_start[pt_base[i] + j // pt] + (j % pt) * row
                if j < L - 1:
                    arena[o:o + row] = rows_all[i][j]
                else:
                    dst.append(o)
        kv_b = rand(heads * (nope + v_dim), kv_lora, scale=kv_lora ** -0.5, gen=gen)
        q = rand(n, heads * (nope + rope), gen=gen)
        dev = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
        A = dev(arena)
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64).to(d.tdev)  # noqa: E731
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(d.tdev)  # noqa: E731
        d.launch("mla_append_rows_f32", n, 128, d.view(dev(kv_a)), d.view(dev(norm_w)), d.view(A), d.view(i64(dst)), n,
                 kv_lora, rope, eps)
        qt = torch.empty(n, heads, row, device=d.tdev)
        kvb = dev(kv_b)
        d.launch("mla_absorb_q_f32", (n, heads), 128, d.view(dev(q)), d.view(kvb), d.view(qt), n, heads, nope, rope,
                 v_dim, kv_lora)
        d.sync()
        Ah = A.double().cpu()
        r.check(f"mla append (Lkv={kv_lora})", max(rel_err(Ah[x:x + row], rows_all[i][lens[i] - 1])
                                                   for i, x in enumerate(dst)), 1e-5)
        ref = torch.stack([mla_reference(q[i], rows_all[i], kv_b, heads, nope, rope, v_dim, kv_lora) for i in range(n)])
        # The CUDA-core attend, and the tensor-core one in 3xTF32 (~f32) and 1xTF32 modes (TF32 rounds
        # to 11 significant bits: ~1e-3 expected here, 1e-2 allowed; the backend uses 3xTF32).
        for kern, splits, tol, extra in (("mla_attend_f32", 3, 1e-4, ()), ("mla_attend_tc_f32", 3, 1e-4, (1,)),
                                         ("mla_attend_tc_f32", 2, 1e-2, (0,))):
            chunk = cdiv(max(lens), splits)
            part = torch.empty(n, heads, splits, kv_lora + 2, device=d.tdev)
            grid, block = ((n, cdiv(heads, 4), splits), 128) if not extra else ((cdiv(heads, 16), n, splits), 256)
            d.launch(kern, grid, block, d.view(qt), d.view(A), d.view(i64(page_start)), d.view(i32(pt_base)),
                     d.view(i32(lens)), d.view(part), n, heads, kv_lora, rope, pt, splits, chunk, (nope + rope) ** -0.5,
                     *extra)
            o = torch.empty(n, heads * v_dim, device=d.tdev)
            d.launch("mla_combine_f32", (n, heads), 128, d.view(part), d.view(kvb), d.view(o), n, heads, nope, v_dim,
                     kv_lora, splits)
            d.sync()
            mode = "" if not extra else (" tc precise" if extra[0] else " tc fast")
            r.check(f"mla decode{mode} (H={heads}, Lkv={kv_lora}, splits={splits})", rel_err(o, ref), tol)
        # v2: mla_attend_tc2_f32 (mode = precision | prefetch tiles << 2) + mla_merge_f32 + mla_out_proj_f32.
        # mixed = 3xTF32 scores, 1xTF32 P V: its error is what decides whether it can be the default.
        for label, splits, tol, mode in (("precise", 3, 1e-4, 1 | 4 << 2), ("fast", 2, 1e-2, 0 | 4 << 2),
                                         ("precise pf0", 1, 1e-4, 1), ("mixed", 3, 1e-3, 3 | 4 << 2)):
            chunk = cdiv(max(lens), splits)
            part = torch.empty(n, heads, splits, kv_lora + 2, device=d.tdev)
            d.launch("mla_attend_tc2_f32", (cdiv(heads, 16), n, splits), 256, d.view(qt), d.view(A),
                     d.view(i64(page_start)), d.view(i32(pt_base)), d.view(i32(lens)), d.view(part), n, heads, kv_lora,
                     rope, pt, splits, chunk, (nope + rope) ** -0.5, mode)
            lat = torch.empty(n, heads, kv_lora, device=d.tdev)
            d.launch("mla_merge_f32", (n, heads), 128, d.view(part), d.view(lat), n, heads, kv_lora, splits)
            o = torch.empty(n, heads * v_dim, device=d.tdev)
            d.launch("mla_out_proj_f32", (heads, cdiv(v_dim, 16), cdiv(n, 64)), 256, d.view(lat), d.view(kvb),
                     d.view(o), n, heads, nope, v_dim, kv_lora)
            d.sync()
            r.check(f"mla decode v2 {label} (H={heads}, Lkv={kv_lora}, splits={splits})", rel_err(o, ref), tol)


def mx_experts(e, rows, cols, gen):
    ps, ss, deq = [], [], []
    for _ in range(e):
        w = rand(rows, cols, scale=cols ** -0.5, gen=gen)
        p, s = rmx.quantize(w)
        ps.append(p)
        ss.append(s)
        deq.append(rmx.dequantize(p, s, torch.float64))
    return torch.stack(ps), torch.stack(ss), torch.stack(deq)


def check_moe(d: Device, r: Results, gen):
    t, e, k, lt, ie = 5, 16, 4, 128, 64
    w1p, w1s, w1 = mx_experts(e, ie, lt, gen)
    w3p, w3s, w3 = mx_experts(e, ie, lt, gen)
    w2p, w2s, w2 = mx_experts(e, lt, ie, gen)
    out = torch.empty(ie, lt, device=d.tdev)
    d.launch("mxfp4_dequant_f32", cdiv(ie * lt // 2, 256), 256, d.view(w1p[3].contiguous().to(d.tdev)),
             d.view(w1s[3].contiguous().to(d.tdev)), d.view(out), ie, lt)
    d.sync()
    r.check("mxfp4_dequant", rel_err(out, w1[3]), 0.0)
    z = rand(t, lt, gen=gen)
    logits, bias = rand(t, e, gen=gen), rand(e, scale=0.1, gen=gen)
    idx, wts, _ = ref_route(logits, torch.eye(e, dtype=torch.float64), bias, k, True, 1.0)
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    zf = dev(z.float())
    ref = torch.zeros(t, lt, dtype=torch.float64)
    for tt in range(t):
        for j in range(k):
            ex = int(idx[tt, j])
            h = ref_situ_glu(w1[ex] @ z[tt], w3[ex] @ z[tt], 4.0, 25.0)
            ref[tt] += wts[tt, j] * (w2[ex] @ h)
    # All t tokens, then the first alone (4 busy experts of 16: the fast kernels' grid.x =
    # min(E, assignments) = 4 < E, blocks mapped to busy experts).
    for tn in (t, 1):
        na = tn * k
        offsets = torch.empty(e + 1, dtype=torch.int32, device=d.tdev)
        sorted_ = torch.empty(na, dtype=torch.int32, device=d.tdev)
        d.launch("moe_sort_assignments", 1, 1024, d.view(dev(idx[:tn].int().reshape(-1))), na, e, d.view(offsets),
                 d.view(sorted_))
        # The old expert kernels (8 rows per block, grid.x = E) and the word-per-lane ones (16 rows
        # per block, + the expert count E, grid.x = min(E, assignments)).
        for up, down, rpb, ex_arg in (("mxfp4_expert_up_f32", "mxfp4_expert_down_f32", 8, ()),
                                      ("mxfp4_up_fast_f32", "mxfp4_down_fast_f32", 16, (e,))):
            gx = min(e, na) if ex_arg else e
            act = torch.empty(na, ie, device=d.tdev)
            y = torch.empty(na, lt, device=d.tdev)
            d.launch(up, (gx, cdiv(ie, rpb)), 256, d.view(zf), d.view(dev(w1p)), d.view(dev(w1s)), d.view(dev(w3p)),
                     d.view(dev(w3s)), d.view(offsets), d.view(sorted_), d.view(act), k, lt, ie, 4.0, 25.0, 1,
                     *ex_arg)
            d.launch(down, (gx, cdiv(lt, rpb)), 256, d.view(act), d.view(dev(w2p)), d.view(dev(w2s)),
                     d.view(offsets), d.view(sorted_), d.view(y), lt, ie, *ex_arg)
            res = torch.empty(tn, lt, device=d.tdev)
            wv = d.view(dev(wts[:tn].float().reshape(-1)))
            d.launch("moe_combine_f32", cdiv(tn * lt, 256), 256, d.view(y), wv, d.view(res), tn, k, lt)
            d.sync()
            tag = ("" if up == "mxfp4_expert_up_f32" else " fast") + ("" if tn == t else f" T={tn}")
            r.check(f"moe routed{tag} (sort+up+down+combine)", rel_err(res, ref[:tn]), 1e-5)


# ---------------------------------------------------------------------------------------------
# Emulators for --dry-run: same argument lists as the kernels, NumPy arrays in place.

def _t(a):
    return torch.from_numpy(a)


def _emu_kda_decode(q_in, k_in, v_in, f_in, b_in, cq, ck, cv, a_log, dt_bias, arena, state_off, ckpt_off, o_out,
                    n_seqs, heads, conv, lb):
    hk = int(heads) * 128
    A = _t(arena)
    for n in range(int(n_seqs)):
        w, S = unpack_kda_region(A, int(state_off[n]), hk, int(conv), int(heads))
        row = lambda x, w: _t(x).reshape(-1)[n * w:(n + 1) * w].view(1, w).double()  # noqa: E731
        ro, rS, rw, _ = kda_reference(*(row(x, hk) for x in (q_in, k_in, v_in, f_in)), row(b_in, int(heads)),
                                      [_t(c).view(hk, int(conv)).double() for c in (cq, ck, cv)], _t(a_log).double(),
                                      _t(dt_bias).double(), [x.double() for x in w], S.double(), int(heads), float(lb))
        for dst in [int(state_off[n])] + ([int(ckpt_off[n])] if ckpt_off[n] >= 0 else []):
            pack_kda_region(A, dst, [x.float() for x in rw], rS.float())
        o_out.reshape(-1)[n * hk:(n + 1) * hk] = ro.float().numpy().reshape(-1)


_PREFILL = {}


def _emu_kda_conv(qi, ki, vi, cq, ck, cv, qo, ko, vo, arena, off, ck_n, ck_off, n_ck, t, hk, conv):
    # The whole prefill is emulated at the chunk kernel; here only stash the inputs and conv outputs.
    A = _t(arena)
    w, S = unpack_kda_region(A, int(off), int(hk), int(conv), int(hk) // 128)
    _PREFILL.update(xs=[_t(x).view(int(t), int(hk)).double().clone() for x in (qi, ki, vi)],
                    convw=[_t(c).view(int(hk), int(conv)).double() for c in (cq, ck, cv)],
                    windows=[x.double().clone() for x in w])
    for x, wc, win, out, i in zip(_PREFILL["xs"], _PREFILL["convw"], _PREFILL["windows"], (qo, ko, vo), range(3)):
        y, nw = rk.short_conv(x[None], wc[:, None, :], win.t()[None])
        out[:] = F.silu(y[0]).float().numpy()
        A[int(off) + i * int(hk) * (int(conv) - 1): int(off) + (i + 1) * int(hk) * (int(conv) - 1)] = \
            nw[0].t().reshape(-1).float()
        for j in range(int(n_ck)):
            _, wn = rk.short_conv(x[None, :int(ck_n[j])], wc[:, None, :], win.t()[None])
            base = int(ck_off[j]) + i * int(hk) * (int(conv) - 1)
            A[base: base + int(hk) * (int(conv) - 1)] = wn[0].t().reshape(-1).float()


def _emu_kda_conv_prep(qi, ki, vi, fi, bi, cq, ck, cv, a_log, dt_bias, qo, ko, vo, g, beta, arena, off, ck_n, ck_off,
                       n_ck, t, heads, conv, lb):
    # Same contract as conv then prep, with g written to its own buffer (f only read).
    if int(conv) > 4:
        return  # the kernel does nothing there; launchers take the two-kernel path
    _emu_kda_conv(qi, ki, vi, cq, ck, cv, qo, ko, vo, arena, off, ck_n, ck_off, n_ck, t, int(heads) * 128, conv)
    g[:] = fi
    _emu_kda_prep(qo, ko, g, bi, beta, a_log, dt_bias, t, heads, lb)


def _emu_kda_prep(q, k, f, b, beta, a_log, dt_bias, t, heads, lb):
    t, heads = int(t), int(heads)
    qq, kk = _t(q).view(t, heads, 128), _t(k).view(t, heads, 128)
    qq[:] = rk.l2norm(qq.double()).float() * 128 ** -0.5
    kk[:] = rk.l2norm(kk.double()).float()
    ff = _t(f).view(t, heads, 128)
    ff[:] = rk.kda_gate(ff.double(), _t(a_log).double(), _t(dt_bias).double(), float(lb)).float()
    _t(beta).view(t, heads)[:] = torch.sigmoid(_t(b).view(t, heads))


def _emu_kda_chunk(q, k, v, g, beta, arena, off, ck_n, ck_off, n_ck, o_out, t, heads, conv):
    t, heads, hk = int(t), int(heads), int(heads) * 128
    A = _t(arena)
    _, S = unpack_kda_region(A, int(off), hk, int(conv), heads)
    sh = lambda x: _t(x).view(1, t, heads, 128).double()  # noqa: E731
    emit = [int(ck_n[j]) for j in range(int(n_ck))]
    o, S1, em = rk.kda_chunked(sh(q), sh(k), sh(v), sh(g), _t(beta).view(1, t, heads).double(), 1.0,
                               initial_state=S.double()[None], chunk=16, emit_at=emit)
    o_out[:] = o.reshape(t, hk).float().numpy()
    wf = 3 * hk * (int(conv) - 1)
    A[int(off) + wf: int(off) + wf + S1.numel()] = S1.reshape(-1).float()
    for j, n in enumerate(emit):
        A[int(ck_off[j]) + wf: int(ck_off[j]) + wf + S1.numel()] = em[n].reshape(-1).float()


def _emu_mla_attend(qt, arena, page_start, pt_base, lens, part, items, heads, kv_lora, rope, page_tokens, splits,
                    chunk, scale):
    row = int(kv_lora) + int(rope)
    A, P = _t(arena), _t(part).view(int(items), int(heads), int(splits), int(kv_lora) + 2)
    for n in range(int(items)):
        L = int(lens[n])
        rows = torch.stack([A[int(page_start[int(pt_base[n]) + j // int(page_tokens)]) + (j % int(page_tokens)) * row:][:row]
                            for j in range(L)]).double()
        for s in range(int(splits)):
            j0, j1 = s * int(chunk), min(L, (s + 1) * int(chunk))
            for h in range(int(heads)):
                if j1 <= j0:
                    P[n, h, s, :] = 0.0
                    P[n, h, s, int(kv_lora)] = float("-inf")
                    continue
                sc = rows[j0:j1] @ _t(qt).view(int(items), int(heads), row)[n, h].double() * float(scale)
                m = sc.max()
                p = torch.exp(sc - m)
                P[n, h, s, :int(kv_lora)] = (p @ rows[j0:j1, :int(kv_lora)]).float()
                P[n, h, s, int(kv_lora)] = float(m)
                P[n, h, s, int(kv_lora) + 1] = float(p.sum())


def _emu_mla_combine(part, kv_b, o, items, heads, nope, v_dim, kv_lora, splits):
    P = _t(part).view(int(items), int(heads), int(splits), int(kv_lora) + 2).double()
    W = _t(kv_b).view(int(heads), int(nope) + int(v_dim), int(kv_lora)).double()
    out = _t(o).view(int(items), int(heads), int(v_dim))
    m = P[..., int(kv_lora)].amax(-1, keepdim=True)
    f = torch.exp(P[..., int(kv_lora)] - m)
    lat = (f.unsqueeze(-1) * P[..., :int(kv_lora)]).sum(2) / (f * P[..., int(kv_lora) + 1]).sum(-1, keepdim=True)
    out[:] = torch.einsum("nhl,hvl->nhv", lat, W[:, int(nope):]).float()


def _emu_mla_merge(part, lat, items, heads, kv_lora, splits):
    P = _t(part).view(int(items), int(heads), int(splits), int(kv_lora) + 2).double()
    m = P[..., int(kv_lora)].amax(-1, keepdim=True)
    f = torch.exp(P[..., int(kv_lora)] - m)
    lat[:] = ((f.unsqueeze(-1) * P[..., :int(kv_lora)]).sum(2) / (f * P[..., int(kv_lora) + 1]).sum(-1, keepdim=True)) \
        .float().numpy().reshape(lat.shape)


def _emu_mla_out_proj(lat, kv_b, o, items, heads, nope, v_dim, kv_lora):
    L = _t(lat).view(int(items), int(heads), int(kv_lora)).double()
    W = _t(kv_b).view(int(heads), int(nope) + int(v_dim), int(kv_lora)).double()
    o[:] = torch.einsum("nhl,hvl->nhv", L, W[:, int(nope):]).float().numpy().reshape(o.shape)


def _emu_moe_up(z, w1p, w1s, w3p, w3s, offsets, sorted_, act, top_k, lt, ie, beta, beta_lin, has_lin):
    lt, ie = int(lt), int(ie)
    e = len(offsets) - 1
    for ex in range(e):
        for a in sorted_[offsets[ex]:offsets[ex + 1]]:
            x = _t(z).view(-1, lt)[int(a) // int(top_k)].double()
            w1 = rmx.dequantize(_t(w1p).view(e, ie, lt // 2)[ex], _t(w1s).view(e, ie, lt // 32)[ex], torch.float64)
            w3 = rmx.dequantize(_t(w3p).view(e, ie, lt // 2)[ex], _t(w3s).view(e, ie, lt // 32)[ex], torch.float64)
            _t(act).view(-1, ie)[int(a)] = ref_situ_glu(w1 @ x, w3 @ x, float(beta),
                                                        float(beta_lin) if has_lin else None).float()


def _emu_moe_down(act, w2p, w2s, offsets, sorted_, y, lt, ie):
    lt, ie = int(lt), int(ie)
    e = len(offsets) - 1
    for ex in range(e):
        w2 = rmx.dequantize(_t(w2p).view(e, lt, ie // 2)[ex], _t(w2s).view(e, lt, ie // 32)[ex], torch.float64)
        for a in sorted_[offsets[ex]:offsets[ex + 1]]:
            _t(y).view(-1, lt)[int(a)] = (w2 @ _t(act).view(-1, ie)[int(a)].double()).float()


def _emu_sort(idx, n, e, offsets, sorted_):
    order = np.argsort(idx[:int(n)], kind="stable")
    sorted_[:] = order.astype(np.int32)
    offsets[:] = np.concatenate([[0], np.cumsum(np.bincount(idx[:int(n)], minlength=int(e)))]).astype(np.int32)


def _emu_router(logits, bias, idx, w, t, e, k, renorm, scaling):
    ri, rw, _ = ref_route(_t(logits).view(int(t), int(e)).double(), torch.eye(int(e), dtype=torch.float64),
                          _t(bias).double(), int(k), bool(renorm), float(scaling))
    idx[:] = ri.int().numpy().reshape(idx.shape)
    w[:] = rw.float().numpy().reshape(w.shape)


def _emu_attn_res(*a):
    srcs, n, w, out, rows, dm, eps = a[:9], int(a[9]), a[10], a[11], int(a[12]), int(a[13]), float(a[14])
    S = [_t(s).view(rows, dm).double() for s in srcs[:n]]
    out[:] = ref_attn_res(S[-1], S[:-1], _t(w).double(), torch.ones(1, dm, dtype=torch.float64), eps).float() \
        .numpy().reshape(out.shape)


EMU = {
    "rms_norm_f32": lambda x, w, y, rows, cols, eps: y.__setitem__(
        slice(None), ref_rms_norm(_t(x).view(int(rows), int(cols)).double(), _t(w).double(), float(eps)).float().numpy()
        .reshape(y.shape)),
    "gated_head_norm_f32": lambda o, g, w, y, rows, heads, hd, eps: y.__setitem__(slice(None), (
        ref_rms_norm(_t(o).view(-1, int(hd)).double(), _t(w).double(), float(eps))
        * torch.sigmoid(_t(g).view(-1, int(hd)).double())).float().numpy().reshape(y.shape)),
    "situ_glu_packed_f32": lambda gu, out, rows, ie, b, bl, hl: out.__setitem__(slice(None), ref_situ_glu(
        _t(gu).view(int(rows), 2, int(ie))[:, 0].double(), _t(gu).view(int(rows), 2, int(ie))[:, 1].double(), float(b),
        float(bl) if hl else None).float().numpy().reshape(out.shape)),
    "situ_glu_f32": lambda g, u, out, n, b, bl, hl: out.__setitem__(slice(None), ref_situ_glu(
        _t(g).double(), _t(u).double(), float(b), float(bl) if hl else None).float().numpy()),
    "add_assign_f32": lambda p, a, n: p.__setitem__(slice(None), p + a),
    "sigmoid_mul_f32": lambda o, g, n: o.__setitem__(slice(None), o * torch.sigmoid(_t(g)).numpy()),
    "embed_rows_f32": lambda tab, ids, out, t, dm, v: out.__setitem__(slice(None), _t(tab).view(int(v), int(dm))[
        torch.from_numpy(ids.astype(np.int64))].numpy()),
    "embed_rows_bf16": lambda tab, ids, out, t, dm, v: out.__setitem__(slice(None), _t(tab.view(np.int16)).view(
        torch.bfloat16).view(int(v), int(dm))[torch.from_numpy(ids.astype(np.int64))].float().numpy()),
    "attn_res_f32": _emu_attn_res,
    "router_topk_f32": _emu_router,
    "argmax_rows_f32": lambda lg, ids, rows, v: ids.__setitem__(slice(None), _t(lg).view(int(rows), int(v)).argmax(-1)
                                                               .int().numpy()),
    "softmax_temperature_f32": lambda lg, p, rows, v, temp: p.__setitem__(slice(None), torch.softmax(
        _t(lg).view(int(rows), int(v)).double() / float(temp), -1).float().numpy()),
    "kda_decode_f32": _emu_kda_decode,
    "kda_conv_silu_f32": _emu_kda_conv,
    "kda_prep_f32": _emu_kda_prep,
    "kda_conv_prep_f32": _emu_kda_conv_prep,
    "kda_chunk_fwd_f32": _emu_kda_chunk,
    "kda_chunk_tc_f32": _emu_kda_chunk,  # same contract; only the grid and the chunking differ
    "kda_chunk_tc_fast_f32": _emu_kda_chunk,
    "mla_append_rows_f32": lambda kv_a, nw, arena, dst, t, lkv, rope, eps: [arena.__setitem__(
        slice(int(dst[i]), int(dst[i]) + int(lkv) + int(rope)), np.concatenate([ref_rms_norm(
            _t(kv_a).view(int(t), -1)[i, :int(lkv)].double(), _t(nw).double(), float(eps)).float().numpy(),
            kv_a.reshape(int(t), -1)[i, int(lkv):]])) for i in range(int(t))],
    "mla_absorb_q_f32": lambda q, kvb, qt, items, heads, nope, rope, vd, lkv: qt.__setitem__(slice(None), torch.cat([
        torch.einsum("nhp,hpl->nhl", _t(q).view(int(items), int(heads), -1)[..., :int(nope)].double(),
                     _t(kvb).view(int(heads), int(nope) + int(vd), int(lkv))[:, :int(nope)].double()),
        _t(q).view(int(items), int(heads), -1)[..., int(nope):].double()], -1).float().numpy().reshape(qt.shape)),
    "mla_attend_f32": _emu_mla_attend,
    "mla_attend_tc_f32": lambda *a: _emu_mla_attend(*a[:-1]),  # same math; `precise` only changes rounding
    "mla_combine_f32": _emu_mla_combine,
    "mla_attend_tc2_f32": lambda *a: _emu_mla_attend(*a[:-1]),  # mode: rounding / prefetch / probe only
    "mla_merge_f32": _emu_mla_merge,
    "mla_out_proj_f32": _emu_mla_out_proj,
    "moe_sort_assignments": _emu_sort,
    "mxfp4_expert_up_f32": _emu_moe_up,
    "mxfp4_expert_down_f32": _emu_moe_down,
    "mxfp4_up_fast_f32": lambda *a: _emu_moe_up(*a[:-1]),  # + E (the grid's busy-expert mapping)
    "mxfp4_down_fast_f32": lambda *a: _emu_moe_down(*a[:-1]),
    "moe_combine_f32": lambda y, w, out, t, k, lt: out.__setitem__(slice(None), torch.einsum(
        "tk,tkl->tl", _t(w).view(int(t), int(k)), _t(y).view(int(t), int(k), int(lt))).numpy().reshape(out.shape)),
    "mxfp4_dequant_f32": lambda p, s, out, rows, cols: out.__setitem__(slice(None), rmx.dequantize(
        _t(p).view(int(rows), -1), _t(s).view(int(rows), -1)).numpy().reshape(out.shape)),
}

# ---------------------------------------------------------------------------------------------
# Benchmarks (GPU only), K3 shapes.


def mla_splits_tc(blocks, max_len, sms=132, slots=None):
    """geometry::mla_splits_tc: >= 2 blocks per SM, then the fullest last wave in [want, 2 want].
    slots = 2 * sms: geometry::mla_splits_tc2 (two resident blocks per SM, waves of 2 * sms)."""
    wave = slots or sms
    want = max(1, cdiv(2 * sms if slots is None else slots, blocks))
    cap = max(1, min(256, cdiv(max_len, 128)))
    fill = lambda s: blocks * s / (cdiv(blocks * s, wave) * wave)  # noqa: E731
    best = min(want, cap)
    for s in range(want, min(2 * want, cap) + 1):
        if fill(s) > fill(best) + 1e-9:
            best = s
    return best


def bench_mla_v2(d: Device, record, N, L, A, ps, qt, kvb, o, base, lens, floor):
    """MLA decode v2 (ops.rs MLA_DECODE_V2) on bench()'s buffers: the full path (attend_tc2 + merge +
    out_proj) in both precisions, then probes: attend alone at prefetch distances 0/4/8 tiles, the
    load pipeline alone (mode 2: copies, no math) and the W_UV tail alone."""
    heads, nope, rope, v_dim, kv_lora, pt = 96, 128, 64, 128, 512, 64
    hg = cdiv(heads, 16)
    splits = mla_splits_tc(N * hg, L, slots=2 * 132)
    chunk = cdiv(L, splits)
    part = torch.empty(N, heads, splits, kv_lora + 2, device=qt.device)
    lat = torch.empty(N, heads, kv_lora, device=qt.device)
    a2 = [d.view(qt), d.view(A), d.view(ps), d.view(base), d.view(lens), d.view(part), N, heads, kv_lora, rope, pt,
          splits, chunk, (nope + rope) ** -0.5]
    margs = [d.view(part), d.view(lat), N, heads, kv_lora, splits]
    pargs = [d.view(lat), d.view(kvb), d.view(o), N, heads, nope, v_dim, kv_lora]

    def tail():
        d.launch("mla_merge_f32", (N, heads), 128, *margs)
        d.launch("mla_out_proj_f32", (heads, cdiv(v_dim, 16), cdiv(N, 64)), 256, *pargs)
    big = N * L > 16 * 8192
    variants = [("v2 precise", 1 | 4 << 2, True), ("v2 mixed", 3 | 4 << 2, True), ("v2 fast", 0 | 4 << 2, True),
                ("v2 precise pf0", 1, False), ("v2 precise pf4", 1 | 4 << 2, False),
                ("v2 fast pf0", 0, False), ("v2 fast pf4", 0 | 4 << 2, False), ("v2 fast pf8", 0 | 8 << 2, False),
                ("v2 loads-only pf0", 2, False), ("v2 loads-only pf4", 2 | 4 << 2, False),
                ("v2 loads-only pf8", 2 | 8 << 2, False)]
    for label, mode, full in variants:
        def go(mode=mode, full=full):
            d.launch("mla_attend_tc2_f32", (hg, N, splits), 256, *a2, mode)
            if full:
                tail()
        name = f"mla_decode {label} N={N} L={L} (attend+merge+proj, f32 rows)" if full else \
            f"mla_attend {label} N={N} L={L} (attend only)"
        try:
            ms, how = d.time_graph(go, reps=5, inner=3) if big else d.time_graph(go)
            record(name, ms, floor, splits=splits, timing=how)
        except Exception as e:  # noqa: BLE001
            log(f"bench {name} raised {type(e).__name__}: {str(e)[:200]}")
    try:
        ms, how = d.time_graph(tail)
        tail_bytes = (heads * v_dim * kv_lora + N * heads * (splits * (kv_lora + 2) + 2 * kv_lora)) * 4
        record(f"mla_tail v2 N={N} L={L} (merge + out_proj)", ms, tail_bytes / (COPY_TBPS / 2 * 1e12) * 1e3,
               splits=splits, timing=how)
    except Exception as e:  # noqa: BLE001
        log(f"bench mla_tail v2 N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
    del part, lat


def bench(d: Device, r: Results, quick: bool):
    H, hk, conv, lb = 96, 96 * 128, 4, -5.0
    reg = kda_region_floats(hk, conv, H)
    fla = None
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        fla = (chunk_kda, fused_recurrent_kda)
    except Exception as e:  # noqa: BLE001
        log(f"fla not importable ({type(e).__name__}: {str(e)[:120]}); no fla comparison")

    def record(name, ms, floor_ms=None, **kw):
        entry = {"name": name, "ms": ms, **kw}
        if floor_ms is not None:
            entry["floor_ms"] = floor_ms
            entry["pct_of_floor"] = 100 * floor_ms / ms
        r.bench.append(entry)
        extra = f", floor {floor_ms * 1e3:.1f} us ({100 * floor_ms / ms:.0f}%)" if floor_ms else ""
        log(f"bench {name}: {ms * 1e3:.1f} us{extra} " + " ".join(f"{k}={v}" for k, v in kw.items()))

    dev = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    # KDA decode, N sequences in scattered slots.
    fla_graph = True
    for N in ([1, 64] if quick else [1, 16, 64, 256]):
        A = torch.randn(N * reg, device="cuda") * 0.01
        offs = torch.randperm(N, device="cuda").to(torch.int64) * reg
        ck = torch.full((N,), -1, dtype=torch.int64, device="cuda")
        x = [dev(N, hk) for _ in range(4)] + [dev(N, H)]
        cw = [dev(hk, conv) * 0.5 for _ in range(3)]
        o = torch.empty(N, hk, device="cuda")
        args = [d.view(t) for t in x + cw] + [d.view(dev(H)), d.view(dev(hk)), d.view(A), d.view(offs), d.view(ck),
                                              d.view(o), N, H, conv, lb]
        ms, how = d.time_graph(lambda: d.launch("kda_decode_f32", (H, N), 512, *args))
        floor = N * H * 128 * 128 * 4 * 2 / (COPY_TBPS * 1e12) * 1e3
        extra = {"timing": how}
        if fla:
            q, k, v = (torch.randn(N, 1, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            g = -torch.rand(N, 1, H, 128, device="cuda") * 5
            beta = torch.rand(N, 1, H, device="cuda", dtype=torch.bfloat16)
            h0 = torch.randn(N, H, 128, 128, device="cuda") * 0.01
            try:
                def fla_step():
                    with torch.inference_mode():
                        fla[1](q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
                if fla_graph:  # one failed capture is enough: time fla eagerly from then on
                    extra["fla_ms"], extra["fla_timing"] = d.time_graph(fla_step)
                    fla_graph = extra["fla_timing"] == "graph"
                else:
                    extra["fla_ms"], extra["fla_timing"] = d.time_ms(fla_step), "eager"
            except Exception as e:  # noqa: BLE001
                extra["fla_error"] = repr(e)[:200]
        record(f"kda_decode N={N}", ms, floor, **extra)
        del A

    # KDA prefill, one sequence of T tokens.
    for T in ([8192] if quick else [1024, 8192]):
        A = torch.randn(reg, device="cuda") * 0.01
        A0 = A.clone()
        xs = [dev(T, hk) for _ in range(4)] + [dev(T, H)]
        ws = [dev(hk, conv) * 0.5 for _ in range(3)], dev(H), dev(hk)
        extra = {}
        if fla:
            q, k, v = (torch.randn(1, T, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            g = -torch.rand(1, T, H, 128, device="cuda") * 5
            beta = torch.rand(1, T, H, device="cuda", dtype=torch.bfloat16)
            h0 = torch.randn(1, H, 128, 128, device="cuda") * 0.01
            try:
                with torch.inference_mode():
                    extra["fla_ms"] = d.time_ms(lambda: fla[0](q, k, v, g, beta, initial_state=h0,
                                                               output_final_state=True, use_qk_l2norm_in_kernel=True),
                                                reps=5, warmup=1)
            except Exception as e:  # noqa: BLE001
                extra["fla_error"] = repr(e)[:200]
        outs = {}
        for chunk in KDA_CHUNK_KERNELS:
            A.copy_(A0)
            o, go = run_kda_prefill(d, T, H, conv, lb, A, 0, [], [], *xs, *ws, chunk=chunk)
            go()
            d.sync()
            outs[chunk] = (o.clone(), A.clone())
            ms = d.time_ms(go, reps=5, warmup=1)
            chunk_ms = d.time_ms(go.chunk_only, reps=5, warmup=1)
            tag, err = "", {}
            if chunk != "f32":  # vs the f32 kernel at the K3 shape (96 heads, long T), same start state
                tag = f"[{chunk}]"
                err = {"o_err_vs_f32": rel_err(outs[chunk][0], outs["f32"][0]),
                       "S_err_vs_f32": rel_err(outs[chunk][1], outs["f32"][1])}
            record(f"kda_prefill{tag} T={T} (conv+prep+chunk)", ms, None, Mtok_s=T / ms / 1e3, chunk_ms=chunk_ms,
                   **err, **extra)
        for chunk in ("tc", "tc_fast"):
            (o1, a1), (o2, a2) = outs["f32"], outs[chunk]
            tol = KDA_CHUNK_TOL[chunk]
            r.check(f"kda_prefill[{chunk}] T={T} H={H} vs kda_chunk_fwd_f32: o", rel_err(o2, o1), tol)
            r.check(f"kda_prefill[{chunk}] T={T} H={H} vs kda_chunk_fwd_f32: state", rel_err(a2, a1), tol)
        # The other conv + prep path with the tc chunk kernel: timing and agreement at K3 shapes.
        other = "split" if KDA_PREP == "fused" else "fused"
        A.copy_(A0)
        o, go = run_kda_prefill(d, T, H, conv, lb, A, 0, [], [], *xs, *ws, chunk="tc", prep=other)
        go()
        d.sync()
        eo, ea = rel_err(o, outs["tc"][0]), rel_err(A, outs["tc"][1])
        ms = d.time_ms(go, reps=5, warmup=1)
        record(f"kda_prefill[tc,prep={other}] T={T} (conv+prep+chunk)", ms, None, Mtok_s=T / ms / 1e3)
        # Only the norms' summation order differs between the two: f32 rounding, not 1e-4.
        r.check(f"kda_prefill[tc] T={T} H={H} prep {KDA_PREP} vs {other}: o", eo, 1e-4)
        r.check(f"kda_prefill[tc] T={T} H={H} prep {KDA_PREP} vs {other}: state+windows", ea, 1e-4)
        del A, A0, xs, outs

    # MLA decode: N queries, L cached positions each, K3 heads and row. The CUDA-core attend (old)
    # and the tensor-core one (3xTF32 "precise" and 1xTF32 "fast"), each + combine.
    heads, nope, rope, v_dim, kv_lora, pt = 96, 128, 64, 128, 512, 64
    row = kv_lora + rope
    mla_shapes = [(16, 8192), (1, 32768), (64, 32768)] if quick else \
        [(1, 8192), (16, 8192), (64, 4096), (1, 32768), (16, 32768), (64, 32768)]
    for N, L in mla_shapes:
        pages = cdiv(L, pt)
        A = torch.randn(N * pages * pt * row, device="cuda")
        ps = (torch.randperm(N * pages, device="cuda").to(torch.int64) * pt * row)
        qt = dev(N, heads, row)
        kvb = dev(heads * (nope + v_dim), kv_lora) * kv_lora ** -0.5
        o = torch.empty(N, heads * v_dim, device="cuda")
        base = torch.arange(N, dtype=torch.int32, device="cuda") * pages
        lens = torch.full((N,), L, dtype=torch.int32, device="cuda")
        floor = N * L * row * 4 / (COPY_TBPS / 2 * 1e12) * 1e3
        hg = cdiv(heads, 16)
        variants = [("tc precise", "mla_attend_tc_f32", (1,)), ("tc fast", "mla_attend_tc_f32", (0,))]
        if N * L <= 16 * 8192:  # the old kernel takes ~50 ms at 64 x 32k
            variants.insert(0, ("cuda-core", "mla_attend_f32", ()))
        for label, kern, extra in variants:
            if extra:
                splits = mla_splits_tc(N * hg, L)
                grid, block = (hg, N, splits), 256
            else:
                splits = max(1, min(64, 264 // (N * heads // 4)))
                grid, block = (N, heads // 4, splits), 128
            chunk = cdiv(L, splits)
            part = torch.empty(N, heads, splits, kv_lora + 2, device="cuda")
            args = [d.view(qt), d.view(A), d.view(ps), d.view(base), d.view(lens), d.view(part), N, heads, kv_lora,
                    rope, pt, splits, chunk, (nope + rope) ** -0.5, *extra]
            cargs = [d.view(part), d.view(kvb), d.view(o), N, heads, nope, v_dim, kv_lora, splits]

            def go(kern=kern, grid=grid, block=block, args=args, cargs=cargs):
                d.launch(kern, grid, block, *args)
                d.launch("mla_combine_f32", (N, heads), 128, *cargs)
            try:
                ms, how = d.time_graph(go, reps=10 if N * L > 16 * 8192 else 20)
                record(f"mla_decode {label} N={N} L={L} (attend+combine, f32 rows)", ms, floor, splits=splits,
                       timing=how)
            except Exception as e:  # noqa: BLE001
                log(f"bench mla_decode {label} N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
            if label == "tc precise" and N * L <= 16 * 8192:  # where v1's time goes: attend vs combine
                try:
                    ms_a, _ = d.time_graph(lambda kern=kern, grid=grid, block=block, args=args:
                                           d.launch(kern, grid, block, *args))
                    record(f"mla_attend v1 tc precise N={N} L={L} (attend only)", ms_a, floor, splits=splits)
                    ms_c, _ = d.time_graph(lambda cargs=cargs: d.launch("mla_combine_f32", (N, heads), 128, *cargs))
                    record(f"mla_combine v1 N={N} L={L} (merge + W_UV per item)", ms_c, None, splits=splits)
                except Exception as e:  # noqa: BLE001
                    log(f"bench mla v1 parts N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
            del part
        try:  # a failure here must not cost the benchmarks after it
            bench_mla_v2(d, record, N, L, A, ps, qt, kvb, o, base, lens, floor)
        except Exception as e:  # noqa: BLE001
            log(f"bench mla v2 N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
        del A

    # AttnRes, 9 sources, d = 7168.
    T, dm = 4096, 7168
    srcs = [dev(T, dm) for _ in range(9)]
    out = torch.empty(T, dm, device="cuda")
    w = dev(dm) * 0.01
    ms = d.time_ms(lambda: d.launch("attn_res_f32", T, 256, *[d.view(s) for s in srcs], 9, d.view(w), d.view(out), T,
                                    dm, 1e-5))
    record(f"attn_res T={T} n=9", ms, (9 * T * dm * 4 + T * dm * 4) / (COPY_TBPS / 2 * 1e12) * 1e3)

    # Routed MoE decode: T tokens, top-16 of E experts, K3 expert sizes (E reduced to bound memory).
    E, k, lt, ie = 128, 16, 3584, 3072
    w1p = torch.randint(0, 256, (E, ie, lt // 2), dtype=torch.uint8, device="cuda")
    w3p = torch.randint(0, 256, (E, ie, lt // 2), dtype=torch.uint8, device="cuda")
    w2p = torch.randint(0, 256, (E, lt, ie // 2), dtype=torch.uint8, device="cuda")
    w1s, w3s = (torch.randint(118, 124, (E, ie, lt // 32), dtype=torch.uint8, device="cuda") for _ in range(2))
    w2s = torch.randint(118, 124, (E, lt, ie // 32), dtype=torch.uint8, device="cuda")
    for T in ([1, 16] if quick else [1, 16, 64]):
        idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).int()
        touched = int(idx.unique().numel())
        wts = torch.rand(T, k, device="cuda")
        z = dev(T, lt)
        offsets = torch.empty(E + 1, dtype=torch.int32, device="cuda")
        srt = torch.empty(T * k, dtype=torch.int32, device="cuda")
        act = torch.empty(T * k, ie, device="cuda")
        y = torch.empty(T * k, lt, device="cuda")
        res = torch.empty(T, lt, device="cuda")
        V = {name: d.view(x) for name, x in (("idx", idx.reshape(-1)), ("off", offsets), ("srt", srt), ("z", z),
                                              ("w1p", w1p), ("w1s", w1s), ("w3p", w3p), ("w3s", w3s), ("w2p", w2p),
                                              ("w2s", w2s), ("act", act), ("y", y), ("wts", wts), ("res", res))}
        wbytes = touched * (2 * ie * (lt // 2 + lt // 32) + lt * (ie // 2 + ie // 32))
        for label, up, down, rpb, ex_arg in (("old", "mxfp4_expert_up_f32", "mxfp4_expert_down_f32", 8, ()),
                                             ("fast", "mxfp4_up_fast_f32", "mxfp4_down_fast_f32", 16, (E,))):
            def go(up=up, down=down, rpb=rpb, ex_arg=ex_arg):
                gx = min(E, T * k) if ex_arg else E  # fast: blocks only for (at most) the busy experts
                d.launch("moe_sort_assignments", 1, 1024, V["idx"], T * k, E, V["off"], V["srt"])
                d.launch(up, (gx, cdiv(ie, rpb)), 256, V["z"], V["w1p"], V["w1s"], V["w3p"], V["w3s"], V["off"],
                         V["srt"], V["act"], k, lt, ie, 4.0, 25.0, 1, *ex_arg)
                d.launch(down, (gx, cdiv(lt, rpb)), 256, V["act"], V["w2p"], V["w2s"], V["off"], V["srt"], V["y"], lt,
                         ie, *ex_arg)
                d.launch("moe_combine_f32", cdiv(T * lt, 256), 256, V["y"], V["wts"], V["res"], T, k, lt)
            ms, how = d.time_graph(go)
            record(f"moe_routed {label} T={T} top{k} (sort+up+down+combine)", ms, wbytes / (COPY_TBPS / 2 * 1e12) * 1e3,
                   experts_touched=touched, timing=how)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: check signatures, run emulators")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    d = Device(args.dry_run)
    r = Results()
    missing = sorted(set(d.sigs) - set(EMU))
    r.exact("every kernel has an emulator", not missing, " ".join(missing))
    gen = torch.Generator().manual_seed(args.seed)
    if not args.dry_run:
        log(f"device: {torch.cuda.get_device_name()} torch {torch.__version__} cupy {d.cp.__version__}")
    t0 = time.time()
    for fn in (check_pointwise, check_attnres, check_router_sampling, check_kda_decode, check_kda_prefill,
               check_kda_prefill_tc, check_mla, check_moe, check_kda_prefill_prep):
        try:
            fn(d, r, gen)
        except Exception as e:  # noqa: BLE001  a crash in one check must not hide the others
            r.exact(fn.__name__, False, f"raised {type(e).__name__}: {e}")
    log(f"checks: {len(r.checks)} run, {r.failed} failed, {time.time() - t0:.1f}s")
    if not args.dry_run and not args.no_bench:
        try:
            bench(d, r, args.quick)
        except Exception as e:  # noqa: BLE001
            log(f"bench raised {type(e).__name__}: {e}")
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "device_check.json").write_text(json.dumps({"checks": r.checks, "bench": r.bench,
                                                               "failed": r.failed, "dry_run": args.dry_run}, indent=1))
    Path(args.out, "device_check.log").write_text("\n".join(LOG) + "\n")
    sys.exit(1 if r.failed else 0)


if __name__ == "__main__":
    main()
