#!/usr/bin/env python3
"""Op-level correctness checks and benchmarks of kernels/*.cu on a GPU (scripts/device-check.sh).

Each check builds random inputs, packs them the way the Rust backend will (arena offsets, page
tables, MXFP4 bytes), launches the kernels, and compares with the PyTorch reference in
reference/k3ref (float64 on the host). Benchmarks time the kernels with CUDA events at K3 shapes
and print the memory-traffic floor and, where importable, fla's kernels.

--dry-run runs everything without a GPU: every launch is checked against the kernel's parsed C
signature (argument count, scalar types, array dtypes) and then executed by a NumPy/PyTorch
emulator that reads the same packed arguments. That leaves only the GPU itself new on the device.

The device (NVRTC compiles, checked launches, timing, the dry run) lives in device.py, the
emulators in emulators.py, the benchmarks in benchmarks.py (the routed experts' in
benchmarks_moe.py), the routed-expert checks in checks_moe.py, the MLA checks in checks_mla.py, the
ReplaySSM checks (and their two kernels' emulators) in checks_kda_replay.py, and what they share
(log, arena layout, KDA reference and prefill launches) in common.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Sibling modules (plain imports: run as a script, this folder is already sys.path[0]). common
# puts reference/ on sys.path for k3ref.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks import bench  # noqa: E402
from common import (KDA_CHUNK_TOL, KDA_DECODE_VARIANTS, KDA_PREP, KDA_SCAN_KERNELS, LOG, cdiv,  # noqa: E402
                    kda_decode_launcher, kda_reference, kda_region_floats, log, pack_kda_region, rel_err, run_kda_prefill, unpack_kda_region)
from common import gemv_tc_plan, gemv_tickets, run_gemv_tc  # noqa: E402
from checks_moe import (check_moe, check_moe_gemm,  # noqa: E402
                        check_moe_single_token, check_moe_few_tokens, check_moe_tc_shapes, check_moe_wg, check_moe_wg_repeat)
from common import rand  # noqa: E402
from checks_kda_replay import check_kda_verify  # noqa: E402
from checks_mla import check_mla, check_mla_bf16, check_mla_bf16_products, check_mla_prefill  # noqa: E402
from checks_vision import check_vision  # noqa: E402
from device import Device, Results  # noqa: E402
from emulators import EMU, bf16_bits  # noqa: E402
from k3ref.attnres import attn_res as ref_attn_res  # noqa: E402
from k3ref.moe import route as ref_route  # noqa: E402
from k3ref.norm import rms_norm as ref_rms_norm  # noqa: E402
from k3ref.situ import situ_glu as ref_situ_glu  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Checks (small shapes, every code path: tails, multiple sequences, scattered slots).


def check_pointwise(d: Device, r: Results, gen):
    T = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
    rows, eps = 37, 1e-5
    # 300 columns: the float4 path on the backend's 512 threads; 301: the scalar path.
    for (cols, block), bf16 in [(c, b) for c in ((300, 512), (301, 256)) for b in (0, 1)]:
        x, w = rand(rows, cols, gen=gen), rand(cols, gen=gen)
        y = torch.empty(rows, cols, device=d.tdev)
        bits = torch.zeros(rows, cols, dtype=torch.int16, device=d.tdev)
        d.launch("rms_norm_f32", rows, block, d.view(T(x)), d.view(T(w)), d.view(y), rows, cols, eps,
                 d.view(bits).view(np.uint16), bf16)
        d.sync()
        r.check(f"rms_norm cols={cols}{' +bf16' if bf16 else ''}", rel_err(y, ref_rms_norm(x, w, eps)), 1e-5)
        # The bf16 rows a cuBLAS product takes: bit for bit the rounding of the f32 output.
        want = bf16_bits(y.cpu().numpy()) if bf16 else np.zeros((rows, cols), np.uint16)
        r.exact(f"rms_norm cols={cols} bf16 rows{'' if bf16 else ' untouched'}",
                bool((bits.cpu().numpy().view(np.uint16) == want).all()))
    cols = 300

    heads, hd = 3, 128
    o, g, wn = rand(5, heads * hd, gen=gen), rand(5, heads * hd, gen=gen), rand(hd, gen=gen)
    y = torch.empty(5, heads * hd, device=d.tdev)
    bits = torch.zeros(5, heads * hd, dtype=torch.int16, device=d.tdev)
    d.launch("gated_head_norm_f32", cdiv(5 * heads, 4), 128, d.view(T(o)), d.view(T(g)), d.view(T(wn)), d.view(y),
             5, heads, hd, eps, d.view(bits).view(np.uint16), 1)
    d.sync()
    r.exact("gated_head_norm bf16 rows", bool((bits.cpu().numpy().view(np.uint16) == bf16_bits(y.cpu().numpy())).all()))
    ref = (ref_rms_norm(o.view(5, heads, hd), wn, eps) * torch.sigmoid(g.view(5, heads, hd))).view(5, -1)
    r.check("gated_head_norm", rel_err(y, ref), 1e-5)

    n = 10007
    ga, up = rand(n, scale=6, gen=gen), rand(n, scale=40, gen=gen)
    for has_lin in (1, 0):
        y = torch.empty(n, device=d.tdev)
        bits = torch.zeros(n, dtype=torch.int16, device=d.tdev)
        d.launch("situ_glu_f32", cdiv(n, 256), 256, d.view(T(ga)), d.view(T(up)), d.view(y), n, 4.0, 25.0, has_lin,
                 d.view(bits).view(np.uint16), 1)
        d.sync()
        r.check(f"situ_glu(lin={has_lin})", rel_err(y, ref_situ_glu(ga, up, 4.0, 25.0 if has_lin else None)), 1e-5)
        r.exact(f"situ_glu(lin={has_lin}) bf16 rows",
                bool((bits.cpu().numpy().view(np.uint16) == bf16_bits(y.cpu().numpy())).all()))

    # Elementwise, over a sweep that crosses common.cuh k3_tanh's 0.125 switch (|g| / 4 and
    # |u| / 25 from 1e-7 up to saturation): the branch-free tanh must hold each value, not just
    # the norm, near the float64 SiTU.
    mag = torch.logspace(-6, 3, 4001, dtype=torch.float64)
    ga = torch.cat([mag, -mag]).float()
    up = torch.cat([mag.flip(0), mag]).float()
    for has_lin in (1, 0):
        y = torch.empty(ga.numel(), device=d.tdev)
        d.launch("situ_glu_f32", cdiv(ga.numel(), 256), 256, d.view(T(ga)), d.view(T(up)), d.view(y), ga.numel(),
                 4.0, 25.0, has_lin, d.view(y).view(np.uint16), 0)
        d.sync()
        ref = ref_situ_glu(ga.double(), up.double(), 4.0, 25.0 if has_lin else None)
        big = ref.abs() > 1e-30
        worst = ((y.cpu().double() - ref).abs()[big] / ref.abs()[big]).max().item()
        r.check(f"situ_glu(lin={has_lin}) sweep 1e-6..1e3, max elementwise rel err", worst, 1e-5)

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
    """attn_res_f32 (geometry.rs attn_res: a cluster of 8 blocks of 128 threads per row, block q on
    columns [q s, (q + 1) s), s = d / 8 rounded up to 4): 1000 columns (float4 path, a short last
    block), 1001 (the scalar path), K3's 7168 at one row, and 40 (blocks past the row's end); each
    plain, and as Backend::attn_res_norm (the last source += add first, RMSNorm after)."""
    eps = 1e-5
    cases = ((1, 1000, 7), (2, 1000, 7), (9, 1000, 7), (9, 1001, 7), (9, 7168, 1), (3, 40, 5))
    for (n, dm, rows), fused in [(c, f) for c in cases for f in (False, True)]:
        srcs = [rand(rows, dm, scale=1 + i, gen=gen) for i in range(n)]
        add, norm = rand(rows, dm, gen=gen), rand(dm, scale=0.5, gen=gen) + 1
        w = rand(dm, scale=0.05, gen=gen)
        T = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
        bank = [d.view(T(s)) for s in srcs[:-1]]
        last = T(srcs[-1])
        vw = d.view(T(w))
        ptrs = bank + [vw] * (8 - len(bank))  # unused slots: any valid pointer, never read
        out = torch.empty(rows, dm, device=d.tdev)
        bits = torch.zeros(rows, dm, dtype=torch.int16, device=d.tdev)
        va, vn = (d.view(T(add)), d.view(T(norm))) if fused else (vw, vw)
        # The norm's output also as bf16 rows (bfloat16 mode), the plain mix's not.
        d.launch("attn_res_f32", rows * 8, 128, *ptrs, n - 1, d.view(last), va, int(fused), vw, vn, int(fused),
                 d.view(out), rows, dm, eps, d.view(bits).view(np.uint16), int(fused))
        d.sync()
        want = bf16_bits(out.cpu().numpy()) if fused else np.zeros((rows, dm), np.uint16)
        r.exact(f"attn_res{'_norm' if fused else ''}(n={n}, d={dm}, rows={rows}) bf16 rows",
                bool((bits.cpu().numpy().view(np.uint16) == want).all()))
        tag = f"attn_res{'_norm' if fused else ''}(n={n}, d={dm}, rows={rows})"
        p = srcs[-1].double() + (add.double() if fused else 0)
        ref = ref_attn_res(p, srcs[:-1], w, torch.ones(1, dm, dtype=torch.float64), eps)
        if fused:
            ref = ref_rms_norm(ref, norm.double(), eps)
            r.check(f"{tag} last += add", rel_err(last, p), 1e-6)
        r.check(tag, rel_err(out, ref), 1e-5)


def check_router_sampling(d: Device, r: Results, gen):
    """router_topk_f32 (one warp per token, 4 per 128-thread block: geometry.rs router) against
    ref_route: 5 tokens (a partial block) of 96 experts (lanes owning 2 or 3), K3's 128 / top-16 over
    9 tokens with renormalisation off, the 1024 / top-64 limit, and ties (logits rounded to a few
    values: equal scores go to the lower expert)."""
    for t, e, k, renorm, ties in ((5, 96, 8, 1, False), (9, 128, 16, 0, False), (3, 1024, 64, 1, False),
                                  (6, 128, 16, 1, True)):
        logits, bias = rand(t, e, scale=2, gen=gen), rand(e, scale=0.3, gen=gen)
        if ties:
            logits, bias = (logits * 2).round() / 2, torch.zeros(e, dtype=torch.float64)
        idx = torch.empty(t, k, dtype=torch.int32, device=d.tdev)
        w = torch.empty(t, k, device=d.tdev)
        d.launch("router_topk_f32", cdiv(t, 4), 128, d.view(logits.float().contiguous().to(d.tdev)),
                 d.view(bias.float().contiguous().to(d.tdev)), d.view(idx), d.view(w), t, e, k, renorm, 2.5)
        d.sync()
        ridx, rw, sc = ref_route(logits, torch.eye(e, dtype=torch.float64), bias, k, bool(renorm), 2.5)
        if ties:  # torch.topk does not promise which of equal scores comes first; the kernel takes the lower id
            ridx = torch.sort(sc + bias, dim=-1, descending=True, stable=True).indices[:, :k]
            rw = sc.gather(-1, ridx)
            rw = rw / (rw.sum(-1, keepdim=True) + 1e-20) * 2.5
        tag = f"T={t} E={e} top{k}" + ("" if renorm else " no renorm") + (" ties" if ties else "")
        r.exact(f"router idx {tag}", bool((idx.cpu().long() == ridx).all()))
        r.check(f"router weights {tag}", rel_err(w, rw), 1e-5)

    check_topk_rows(d, r, gen)


def ref_top_k_row(row, k):
    """The k largest finite entries as (id, value), largest first, ties to the lower id; -0 ranks
    below +0 (k3_model::top_k_of_row). Plain Python sorting, independent of the emulator."""
    import struct

    def key(v):
        b = struct.unpack("<I", struct.pack("<f", v))[0]
        return (0xFFFFFFFF - b) if b & 0x80000000 else (b | 0x80000000)
    fin = [(i, float(v)) for i, v in enumerate(row.tolist()) if math.isfinite(v)]
    fin.sort(key=lambda iv: (-key(iv[1]), iv[0]))
    return fin[:k]


def check_topk_rows(d: Device, r: Results, gen):
    """Candidate selection for sampling: exact ids, values and counts against the definition, on
    rows with heavy ties (quantised logits), -0 / +0, NaN / +-inf, fewer finite entries than k."""
    # 70001 / 163840: rows over 18 / 40 segments (equal logits across segment borders); 300: one
    # segment with fewer finite entries than k.
    for vocab, ks in ((70001, (1, 5, 64)), (163840, (1, 50, 1024)), (300, (1, 7, 1024))):
        rows = 4
        lg = (rand(rows, vocab, scale=3, gen=gen) * 4).round() / 4  # ties everywhere
        lg = lg.float()
        lg[0, 12345 % vocab] = 50.0
        lg[1, :] = 0.0
        lg[1, ::3] = -0.0
        lg[1, 7] = float("nan")
        lg[2, ::2] = float("nan")
        lg[2, 1::4] = float("-inf")
        lg[2, 3::8] = float("inf")
        lg[3, :] = float("nan")
        lg[3, 5:vocab:max(1, vocab // 40)] = torch.arange(len(range(5, vocab, max(1, vocab // 40)))).float()
        lgd = lg.contiguous().to(d.tdev)
        for k in ks:
            ids, vals, count = run_topk(d, lgd, rows, vocab, k)
            ids_h, vals_h, count_h = ids.cpu().view(rows, k), vals.cpu().view(rows, k), count.cpu()
            ok, detail = True, ""
            for row in range(rows):
                want = ref_top_k_row(lg[row], k)
                n = int(count_h[row])
                got = [(int(ids_h[row, i]), float(vals_h[row, i])) for i in range(n)]
                same = n == len(want) and all(
                    gi == wi and struct_bits(gv) == struct_bits(wv) for (gi, gv), (wi, wv) in zip(got, want))
                if not same:
                    ok, detail = False, f"row {row}: {got[:4]}... vs {want[:4]}... ({n} vs {len(want)})"
                    break
            r.exact(f"topk_rows vocab={vocab} k={k}", ok, detail)


TOPK_SEGMENT = 4096  # ops.rs TOPK_SEGMENT


def run_topk(d: Device, lgd, rows, vocab, k, seg_len=TOPK_SEGMENT):
    """ops.rs top_k_rows: per-segment picks, then the merge. Returns device (ids, vals, count)."""
    segs = cdiv(vocab, seg_len)
    seg_ids = torch.empty(rows * segs * k, dtype=torch.int32, device=d.tdev)
    seg_vals = torch.empty(rows * segs * k, device=d.tdev)
    seg_count = torch.empty(rows * segs, dtype=torch.int32, device=d.tdev)
    ids = torch.empty(rows * k, dtype=torch.int32, device=d.tdev)
    vals = torch.empty(rows * k, device=d.tdev)
    count = torch.empty(rows, dtype=torch.int32, device=d.tdev)
    no_mask = torch.empty(1, dtype=torch.uint32, device=d.tdev)  # not read with 0 mask words
    d.launch("topk_segments_f32", (segs, rows), 512, d.view(lgd), d.view(seg_ids), d.view(seg_vals),
             d.view(seg_count), rows, vocab, k, seg_len, d.view(no_mask), 0)
    d.launch("topk_merge_f32", rows, 1024, d.view(lgd), d.view(seg_ids), d.view(seg_vals), d.view(seg_count),
             d.view(ids), d.view(vals), d.view(count), rows, vocab, k, segs)
    d.sync()
    return ids, vals, count


def struct_bits(v):
    import struct
    return struct.unpack("<I", struct.pack("<f", v))[0]


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
    refs = [kda_reference(inp["xq"][i], inp["xk"][i], inp["xv"][i], inp["f"][i], inp["b"][i], inp["convw"],
                          inp["a_log"], inp["dt_bias"], inp["windows"][i], inp["S0"][i], heads, lb) for i in range(n)]
    F32 = lambda xs: torch.cat([x for x in xs]).float().contiguous().to(d.tdev)  # noqa: E731
    outs = {}
    for variant in KDA_DECODE_VARIANTS:  # all from the same arena
        A = arena.float().to(d.tdev)
        o = torch.empty(n, hk, device=d.tdev)
        args = [d.view(F32(inp["xq"])), d.view(F32(inp["xk"])), d.view(F32(inp["xv"])), d.view(F32(inp["f"])),
                d.view(F32(inp["b"]))] + [d.view(w.float().contiguous().to(d.tdev)) for w in inp["convw"]] + [
            d.view(inp["a_log"].float().to(d.tdev)), d.view(inp["dt_bias"].float().to(d.tdev)), d.view(A),
            d.view(torch.tensor(offs, dtype=torch.int64).to(d.tdev)),
            d.view(torch.tensor(ck, dtype=torch.int64).to(d.tdev)), d.view(o), n, heads, conv, lb]
        kda_decode_launcher(d, variant, heads, n, args)()
        d.sync()
        A, o = A.cpu(), o.cpu()
        outs[variant] = (A, o)
        A = A.double()
        eo, es, ew = 0.0, 0.0, 0.0
        for i in range(n):
            ro, rS, rw, _ = refs[i]
            gw, gS = unpack_kda_region(A, offs[i], hk, conv, heads)
            eo = max(eo, rel_err(o[i:i + 1], ro))
            es = max(es, rel_err(gS, rS))
            ew = max(ew, max(rel_err(a, b) for a, b in zip(gw, rw)))
            if ck[i] >= 0:
                cw, cS = unpack_kda_region(A, ck[i], hk, conv, heads)
                es = max(es, rel_err(cS, rS))
                ew = max(ew, max(rel_err(a, b) for a, b in zip(cw, rw)))
        tag = "kda_decode" if variant == KDA_DECODE_VARIANTS[0] else f"kda_decode {variant}"
        r.check(f"{tag} o", eo, 2e-5)
        r.check(f"{tag} state (+checkpoint)", es, 2e-5)
        r.check(f"{tag} windows (+checkpoint)", ew, 1e-6)


def check_kda_prefill(d: Device, r: Results, gen, chunk="f32", prep=KDA_PREP, conv=4, seg=None, cases=None):
    heads, lb = 2, -5.0
    hk, reg = heads * 128, kda_region_floats(heads * 128, conv, heads)
    tag = "kda_prefill" if chunk == "f32" else f"kda_prefill[{chunk}]"
    if prep != KDA_PREP or conv != 4:
        tag += f"[prep={prep},conv={conv}]"
    if seg:
        tag += f"[seg={seg}]"
    extra = {"seg": seg} if seg else {}
    tol = KDA_CHUNK_TOL[chunk]
    cases = cases or ((45, [1, 16, 30, 45]), (16, []), (3, [2])) + (((2, [1]),) if conv == 4 else ())
    for t, emit in cases:
        inp = kda_inputs(t, heads, conv, gen)
        arena = torch.zeros((len(emit) + 1) * reg, dtype=torch.float64)
        off = len(emit) * reg  # the working slot is the last; checkpoint j goes to slot j
        pack_kda_region(arena, off, inp["windows"][0], inp["S0"][0])
        ck_off = [j * reg for j in range(len(emit))]
        A = arena.float().to(d.tdev)
        o, go = run_kda_prefill(d, t, heads, conv, lb, A, off, emit, ck_off, inp["xq"][0], inp["xk"][0], inp["xv"][0],
                                inp["f"][0], inp["b"][0], inp["convw"], inp["a_log"], inp["dt_bias"], chunk, prep,
                                **extra)
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


def check_kda_prefill_scan(d: Device, r: Results, gen):
    """The two-pass path (record pass + scan with the state in mma registers; 3xTF32: the f32
    tolerances hold), each record-pass variant: tails, checkpoints, chained 16-token segments, conv
    widths; and the one-pass f32 path at conv > 4 (where ops.rs always takes it)."""
    check_kda_prefill(d, r, gen, prep="split", conv=6)
    for scan in KDA_SCAN_KERNELS:
        check_kda_prefill(d, r, gen, chunk=scan)
        check_kda_prefill(d, r, gen, chunk=scan, seg=16)
        for conv in (2, 3):
            check_kda_prefill(d, r, gen, chunk=scan, conv=conv)
        # Several 8-chunk record blocks: conv history from the inputs at a block start, checkpoints
        # inside a block and on a block boundary, a 12-token tail.
        check_kda_prefill(d, r, gen, chunk=scan, cases=((300, [100, 128, 131, 300]),))


def check_kda_prefill_conv(d: Device, r: Results, gen):
    """The one-pass f32 kernels (conv + SiLU, prep, chunk) at other conv widths."""
    for conv in (3, 2):  # (conv 1 has no window; the checks below would compare empty tensors)
        check_kda_prefill(d, r, gen, conv=conv)


def check_bf16_matmul(d: Device, r: Results, gen):
    """Dense matmul with bf16 weights (kernels/bf16.cu around the cuBLAS bf16 GEMM of
    dense/mod.rs matmul_linear; the GEMM played by an f32 matmul of the same bf16 values)."""
    m, k, n = 5, 96, 40
    x = rand(m, k, gen=gen)
    w = rand(n, k, scale=0.1, gen=gen).float().to(torch.bfloat16).double()  # bf16 checkpoint values
    dev = lambda t: t.contiguous().to(d.tdev)  # noqa: E731
    u16 = lambda t: d.view(t).view(np.uint16)  # noqa: E731
    bits_f32 = lambda t: ((t.to(torch.int32) & 0xFFFF) << 16).view(torch.float32)  # noqa: E731
    wb = dev(w.float().to(torch.bfloat16).view(torch.int16))
    wf = dev(torch.zeros(n, k))
    d.launch("bf16_to_f32", cdiv(n * k, 256), 256, u16(wb), d.view(wf), n * k)
    xs = dev(torch.zeros(2 * m, k, dtype=torch.int16))
    d.launch("bf16_split_rows_f32", cdiv(m * k, 256), 256, d.view(dev(x.float())), u16(xs), m * k, 2)
    d.sync()
    r.check("bf16_to_f32 (exact)", rel_err(wf, w), 0.0)
    c = dev(bits_f32(xs) @ bits_f32(wb).T)
    y = dev(torch.zeros(m, n))
    d.launch("sum_row_halves_f32", cdiv(m * n, 256), 256, d.view(c), d.view(y), m * n)
    d.sync()
    r.check("matmul with bf16 weights (split activations)", rel_err(y, x @ w.T), 2e-5)


def check_gemv_tc(d: Device, r: Results, gen):
    """The tensor-core decode product (gemv_bf16_tc_f32; its last blocks sum the split-K partials)
    against float64, f32 accuracy: N below / not a multiple of the 128-row block, K not a multiple of
    the 64-column step (and a short last K slice), one split and several, M across both n8 tiles of
    x rows; x in three pieces (float32 mode) and rounded once (bfloat16 mode, against float64 of the
    rounded x). y starts as NaN at every launch, and the launches share one ticket buffer: a ticket
    not put back to 0 leaves the next split product's rows unsummed."""
    dev = lambda t: t.contiguous().to(d.tdev)  # noqa: E731
    u16 = lambda t: d.view(t).view(np.uint16)  # noqa: E731
    for n, k, plan in ((77, 520, None), (300, 1544, None), (130, 200, (1, 256)),
                       (260, 1032, (5, 256))):
        w = rand(n, k, scale=0.1, gen=gen).float().to(torch.bfloat16)
        wb = dev(w.view(torch.int16))
        part = dev(torch.zeros(16 * 16 * n))
        for m in (1, 3, 8, 16):
            x = rand(m, k, gen=gen)
            splits = (plan or gemv_tc_plan(n, k))[0]
            for pieces in (3, 1):
                y = dev(torch.full((m, n), float("nan")))
                run_gemv_tc(d, d.view(dev(x.float())), u16(wb), d.view(y), m, n, k, d.view(part), plan, pieces)
                d.sync()
                # pieces 1 (bfloat16 mode): against float64 of x rounded to bf16 as the kernel rounds it.
                xr = x if pieces == 3 else x.float().to(torch.bfloat16).double()
                r.check(f"gemv_bf16_tc_f32 M={m} {n}x{k} splits={splits} pieces={pieces}", rel_err(y, xr @ w.double().T),
                        1e-5)
    tickets = gemv_tickets(d, 1)
    r.exact("gemv_bf16_tc_f32 tickets back to 0", not bool(np.asarray(tickets.get() if hasattr(tickets, "get")
                                                                     else tickets).any()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: check signatures, run emulators")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checks", default="", help="comma list of check functions to run (default all)")
    ap.add_argument("--only", default=os.environ.get("K3_BENCH_ONLY", ""),
                    help="comma list of benchmark sections (kda_decode,kda_prefill,mla,mla_proj,mla_prefill,attn_res,moe,gemv); "
                         "default all")
    args = ap.parse_args()
    d = Device(args.dry_run)
    r = Results()
    missing = sorted(set(d.sigs) - set(EMU))
    r.exact("every kernel has an emulator", not missing, " ".join(missing))
    gen = torch.Generator().manual_seed(args.seed)
    if not args.dry_run:
        log(f"device: {torch.cuda.get_device_name()} torch {torch.__version__} cupy {d.cp.__version__}")
    t0 = time.time()
    for fn in (check_pointwise, check_attnres, check_router_sampling, check_kda_decode, check_kda_verify, check_kda_prefill,
               check_vision, check_kda_prefill_scan, check_mla, check_mla_bf16, check_mla_bf16_products, check_mla_prefill,
               check_moe, check_moe_tc_shapes, check_moe_single_token, check_moe_few_tokens, check_moe_gemm,
               check_moe_wg, check_moe_wg_repeat, check_bf16_matmul, check_gemv_tc, check_kda_prefill_conv):
        try:
            if not args.checks or fn.__name__ in args.checks.split(","):
                fn(d, r, gen)
        except Exception as e:  # noqa: BLE001  a crash in one check must not hide the others
            r.exact(fn.__name__, False, f"raised {type(e).__name__}: {e}")
    log(f"checks: {len(r.checks)} run, {r.failed} failed, {time.time() - t0:.1f}s")
    if not args.dry_run and not args.no_bench:
        try:
            bench(d, r, args.quick, [x for x in args.only.split(",") if x])
        except Exception as e:  # noqa: BLE001
            log(f"bench raised {type(e).__name__}: {e}")
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "device_check.json").write_text(json.dumps({"checks": r.checks, "bench": r.bench,
                                                               "failed": r.failed, "dry_run": args.dry_run}, indent=1))
    Path(args.out, "device_check.log").write_text("\n".join(LOG) + "\n")
    sys.exit(1 if r.failed else 0)


if __name__ == "__main__":
    main()
