"""Benchmarks of kernels/*.cu at K3 shapes (GPU only; device_check.py runs them after the checks
unless --dry-run or --no-bench): CUDA-event / CUDA-graph timings against the memory-traffic floor
and, where importable, fla's kernels. Results go to Results.bench and the log."""
from __future__ import annotations

from typing import TYPE_CHECKING

import os
import time

import numpy as np
import torch

from common import (COPY_TBPS, KDA_CHUNK_KERNELS, KDA_CHUNK_TOL, KDA_DECODE_VARIANTS, KDA_SCAN_KERNELS, cdiv,
                    kda_decode_launcher, kda_region_floats, log, rel_err, run_kda_prefill)
from common import run_mla_prefill
from common import gemv_tc_plan, run_gemv_tc
from benchmarks_moe import (bench_moe, bench_moe_few_tokens_diag, bench_moe_prefill, bench_moe_single_token,
                            bench_moe_wg_diag)

# H200 SXM peak FP32 rate on the CUDA cores (NVIDIA data sheet: 67 TFLOP/s), where cuBLAS SGEMM in
# the default math mode (no TF32) runs: the floor of the f32 expanded MLA prefill. The "sgemm f32"
# line of the mla_prefill section measures what this card reaches in the same run.
F32_TFLOPS = 67.0

if TYPE_CHECKING:
    from device import Device, Results


def mla_splits_f32(blocks, max_len, sms=132, per_sm=2):
    """geometry::mla_splits_f32: at least one wave of 2 * sms blocks (two resident per SM), then the
    fullest last wave in [want, 2 want], splits of at least 128 positions."""
    wave = per_sm * sms
    want = max(1, cdiv(wave, blocks))
    cap = max(1, min(256, cdiv(max_len, 128)))
    fill = lambda s: blocks * s / (cdiv(blocks * s, wave) * wave)  # noqa: E731
    best = min(want, cap)
    for s in range(want, min(2 * want, cap) + 1):
        if fill(s) > fill(best) + 1e-9:
            best = s
    return best


def bench_mla_tf32(d: Device, record, N, L, A, ps, qt, kvb, o, base, lens, floor):
    """MLA absorbed decode (mla/mod.rs mla_absorbed) on bench()'s buffers: the full path (attend_tf32 + merge +
    out_proj) in both precisions, then probes: attend alone at prefetch distances 0/4/8 tiles, the
    load pipeline alone (mode 2: copies, no math) and the W_UV tail alone."""
    heads, nope, rope, v_dim, kv_lora, pt = 96, 128, 64, 128, 512, 64
    hg = cdiv(heads, 16)
    splits = mla_splits_f32(N * hg, L)
    chunk = cdiv(L, splits)
    part = torch.empty(N, heads, splits, kv_lora + 2, device=qt.device)
    lat = torch.empty(N, heads, kv_lora, device=qt.device)
    a2 = [d.view(qt), d.view(A), d.view(ps), d.view(base), d.view(lens), d.view(part), N, heads, kv_lora, rope, pt,
          splits, chunk, (nope + rope) ** -0.5]
    margs = [d.view(part), d.view(lat), N, heads, kv_lora, splits]
    pargs = [d.view(lat), d.view(kvb), d.view(o), N, heads, nope, v_dim, kv_lora]

    def tail():
        d.launch("mla_merge_f32", (N, heads, cdiv(kv_lora, 128)), 128, *margs)
        d.launch("mla_out_proj_f32", (heads, cdiv(v_dim, 16), cdiv(N, 64)), 256, *pargs)
    big = N * L > 16 * 8192
    variants = [("tf32 precise", 1 | 4 << 2, True), ("tf32 mixed", 3 | 4 << 2, True), ("tf32 fast", 0 | 4 << 2, True),
                ("tf32 precise pf0", 1, False), ("tf32 precise pf4", 1 | 4 << 2, False),
                ("tf32 fast pf0", 0, False), ("tf32 fast pf4", 0 | 4 << 2, False), ("tf32 fast pf8", 0 | 8 << 2, False),
                ("tf32 loads-only pf0", 2, False), ("tf32 loads-only pf4", 2 | 4 << 2, False),
                ("tf32 loads-only pf8", 2 | 8 << 2, False)]
    for label, mode, full in variants:
        def go(mode=mode, full=full):
            d.launch("mla_attend_tf32_f32", (hg, N, splits), 256, *a2, mode)
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
        record(f"mla_tail tf32 N={N} L={L} (merge + out_proj)", ms, tail_bytes / (COPY_TBPS * 1e12) * 1e3,
               splits=splits, timing=how)
    except Exception as e:  # noqa: BLE001
        log(f"bench mla_tail tf32 N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
    del part, lat


def bench_mla_proj(d: Device, r: Results, record, quick: bool):
    """MLA decode's two per-head kv_b products at K3 shapes, N items: `new` (mla_absorb_q_bf16 +
    mla_out_proj_bf16 on the stored bf16 kv_b, what mla/mod.rs mla_absorbed runs) against `old` (the f32
    kernels on the f32 copy), each kernel alone and the pair, on the same inputs and the same kv_b
    values. Floor = (kv_b bytes as read + q_nope/q_r, qt, lat and o bytes) / 4.25 TB/s. Also checks
    that new and old agree."""
    heads, nope, rope, v_dim, kv_lora = 96, 128, 64, 128, 512
    row, qk = kv_lora + rope, nope + rope
    wt = (torch.randn(heads * (nope + v_dim), kv_lora, device="cuda") * kv_lora ** -0.5).to(torch.bfloat16)
    w32 = wt.float()
    wv, w32v = d.view(wt.view(torch.int16)).view(np.uint16), d.view(w32)
    weights = heads * (nope + v_dim) * kv_lora
    for N in ([1, 64] if quick else [1, 16, 64]):
        try:
            q, lat = torch.randn(N, heads * qk, device="cuda"), torch.randn(N, heads, kv_lora, device="cuda")
            out = {k: (torch.empty(N, heads, row, device="cuda"), torch.empty(N, heads * v_dim, device="cuda"))
                   for k in ("new", "old")}
            V = {k: (d.view(a), d.view(b)) for k, (a, b) in out.items()}
            qv, latv = d.view(q), d.view(lat)
            absorb = {
                "new": lambda N=N: d.launch("mla_absorb_q_bf16", (cdiv(kv_lora, 128), heads), 128, qv, wv, V["new"][0],
                                            N, heads, nope, rope, v_dim, kv_lora),
                "old": lambda N=N: d.launch("mla_absorb_q_f32", (N, heads), 128, qv, w32v, V["old"][0], N, heads, nope,
                                            rope, v_dim, kv_lora)}
            proj = {
                "new": lambda N=N: d.launch("mla_out_proj_bf16", (cdiv(v_dim, 32), heads), 128, latv, wv, V["new"][1],
                                            N, heads, nope, v_dim, kv_lora),
                "old": lambda N=N: d.launch("mla_out_proj_f32", (heads, cdiv(v_dim, 16), cdiv(N, 64)), 256, latv, w32v,
                                            V["old"][1], N, heads, nope, v_dim, kv_lora)}
            for k in ("new", "old"):
                absorb[k]()
                proj[k]()
            d.sync()
            r.check(f"mla_proj new vs old N={N} (K3 shapes): qt", rel_err(out["new"][0], out["old"][0]), 1e-5)
            r.check(f"mla_proj new vs old N={N} (K3 shapes): o", rel_err(out["new"][1], out["old"][1]), 1e-5)
            act_a = N * heads * (qk + row) * 4  # q read, qt written
            act_p = N * heads * (kv_lora + v_dim) * 4  # lat read, o written
            floor = lambda b: b / (COPY_TBPS * 1e12) * 1e3  # noqa: E731
            ms = {}
            for k, wbytes in (("new", 2), ("old", 4)):
                wa, wp = heads * nope * kv_lora * wbytes, heads * v_dim * kv_lora * wbytes
                t_a, how = d.time_graph(absorb[k])
                t_p, _ = d.time_graph(proj[k])
                t_b, _ = d.time_graph(lambda k=k: (absorb[k](), proj[k]()))
                ms[k] = t_b
                kern = ("mla_absorb_q_bf16", "mla_out_proj_bf16") if k == "new" else ("mla_absorb_q_f32",
                                                                                      "mla_out_proj_f32")
                record(f"mla_proj {k} {kern[0]} N={N} (K3)", t_a, floor(wa + act_a), timing=how)
                record(f"mla_proj {k} {kern[1]} N={N} (K3)", t_p, floor(wp + act_p), timing=how)
                record(f"mla_proj {k} absorb+out_proj N={N} (K3, kv_b {'bf16' if k == 'new' else 'f32'})", t_b,
                       floor(weights * wbytes + act_a + act_p), timing=how)
            log(f"bench mla_proj N={N}: new {ms['new'] * 1e3:.1f} us vs old {ms['old'] * 1e3:.1f} us "
                f"({ms['old'] / ms['new']:.1f}x)")
            del q, lat, out
        except Exception as e:  # noqa: BLE001  a failure here must not cost the benchmarks after it
            log(f"bench mla_proj N={N} raised {type(e).__name__}: {str(e)[:200]}")


# kernels/mla_attend_bf16.cu: 48 heads per block, one block per SM, a double-buffered K tile
# (geometry.rs MLA_BF16_SHARED).
MLA_BF16_HEADS, MLA_BF16_SHARED = 48, 165568


def mla_splits_bf16(blocks, max_len, sms=132):
    """geometry::mla_splits_bf16: mla_splits_f32's rule with one resident block per SM."""
    return mla_splits_f32(blocks, max_len, sms=sms, per_sm=1)


def mla_splits_wg(blocks, max_len, sms=132):
    """geometry::mla_splits_wg: 1 split (final rows, no merge) when it fills the SMs as well as
    mla_splits_bf16's choice, else that choice."""
    fill = lambda s: blocks * s / (cdiv(blocks * s, sms) * sms)  # noqa: E731
    s = mla_splits_bf16(blocks, max_len, sms)
    return 1 if fill(1) + 1e-9 >= fill(s) else s


def bench_mla_bf16(d: Device, r: Results, record, N, L, A, ps, qt, base, lens):
    """The bf16 attend (ops.rs MlaDecodeMode::Bf16) + merge on bench()'s buffers, next to the precise
    tf32 attend + merge timed in the same run (tf32_us). Floors: the f32 cache rows plus the partials
    (attend: written; attend+merge: written, read back, and the latent o~ written). Also checks the
    bf16 latent against tf32's at this shape (bf16 rounding: 2e-2)."""
    heads, rope, kv_lora, pt = 96, 64, 512, 64
    row, scale = kv_lora + rope, 192 ** -0.5
    hg, hg16 = cdiv(heads, MLA_BF16_HEADS), cdiv(heads, 16)
    sb, s2 = mla_splits_bf16(N * hg, L), mla_splits_f32(N * hg16, L)
    kv_bytes = N * L * row * 4

    def part_bytes(splits):
        return N * heads * splits * (kv_lora + 2) * 4
    pb, p2 = (torch.empty(N, heads, s, kv_lora + 2, device=qt.device) for s in (sb, s2))
    lb, l2 = (torch.empty(N, heads, kv_lora, device=qt.device) for _ in range(2))
    common_args = [d.view(qt), d.view(A), d.view(ps), d.view(base), d.view(lens)]
    big = N * L > 16 * 8192

    def attend_bf16():
        d.launch("mla_attend_bf16_f32", (hg, N, sb), 256, *common_args, d.view(pb), N, heads, kv_lora, rope, pt, sb,
                 0, scale, shared_mem=MLA_BF16_SHARED)

    def merge_bf16():
        d.launch("mla_merge_f32", (N, heads, cdiv(kv_lora, 128)), 128, d.view(pb), d.view(lb), N, heads, kv_lora, sb)

    def bf16_full():
        attend_bf16()
        merge_bf16()

    def tf32_full():
        d.launch("mla_attend_tf32_f32", (hg16, N, s2), 256, *common_args, d.view(p2), N, heads, kv_lora, rope, pt, s2,
                 0, scale, 1 | 4 << 2)
        d.launch("mla_merge_f32", (N, heads, cdiv(kv_lora, 128)), 128, d.view(p2), d.view(l2), N, heads, kv_lora, s2)

    def timed(fn):
        return d.time_graph(fn, reps=5, inner=3) if big else d.time_graph(fn)
    tf32_ms, _ = timed(tf32_full)
    ms, how = timed(attend_bf16)
    record(f"mla_attend bf16 N={N} L={L} (attend only, f32 rows)", ms, (kv_bytes + part_bytes(sb)) / (COPY_TBPS * 1e12)
           * 1e3, splits=sb, timing=how)
    ms, how = timed(bf16_full)
    floor = (kv_bytes + 2 * part_bytes(sb) + N * heads * kv_lora * 4) / (COPY_TBPS * 1e12) * 1e3
    record(f"mla_attend+merge bf16 N={N} L={L} (f32 rows + partials)", ms, floor, splits=sb, timing=how,
           tf32_us=round(tf32_ms * 1e3, 1), tf32_splits=s2, speedup_vs_tf32=round(tf32_ms / ms, 2))
    ms, how = timed(merge_bf16)
    record(f"mla_merge N={N} L={L} (bf16 partials read + latent written)", ms,
           (part_bytes(sb) + N * heads * kv_lora * 4) / (COPY_TBPS * 1e12) * 1e3, splits=sb, timing=how)
    bf16_full()
    tf32_full()
    d.sync()
    r.check(f"mla bf16 vs tf32 precise latent N={N} L={L} (K3 shapes, splits {sb} / {s2})", rel_err(lb, l2), 2e-2)
    pb = p2 = lb = l2 = None  # frees the buffers (the closures above hold the names)


# kernels/mla_attend_pair_wgmma.cu (wgmma, sm_90a): 48 heads per 384-thread block, one block per SM
# (geometry.rs MLA_WG_SHARED; splits: mla_splits_bf16's rule); mla_attend_pair_wgmma_f32: the same on
# 2-block clusters (grid x rounded up to pairs, MLA_WGMMA_SHARED).
MLA_WG_HEADS, MLA_WG_THREADS, MLA_WG_SHARED, MLA_WGMMA_SHARED = 48, 384, 223168, 223200


def bench_mla_wg(d: Device, r: Results, record, N, L, A, ps, qt, base, lens):
    """The wgmma attend (mla_attend_pair_wgmma_f32, the default on sm_90a) as ops.rs
    runs them - geometry::mla_splits_wg's splits, the merge only past 1 split (else final_rows) - next to
    the bf16 attend + merge (bf16_us) and, where the wg rule picks 1 split, the bf16 rule's splits +
    merge (splits_merge_us), timed in the same run; floors count what each moves (rows, partials,
    latent). Each wg latent is checked against the bf16 one (same rounding, different tiles: 2e-2)."""
    heads, rope, kv_lora, pt = 96, 64, 512, 64
    scale = 192 ** -0.5
    hg = cdiv(heads, MLA_WG_HEADS)
    sb = mla_splits_bf16(N * hg, L)
    sw = mla_splits_wg(N * hg, L)
    kv_bytes = N * L * (kv_lora + rope) * 4
    lat_bytes = N * heads * kv_lora * 4
    part_bytes = lambda s: N * heads * s * (kv_lora + 2) * 4  # noqa: E731
    pw, pb = (torch.empty(N, heads, sb, kv_lora + 2, device=qt.device) for _ in range(2))
    lw, lb = (torch.empty(N, heads, kv_lora, device=qt.device) for _ in range(2))
    common_args = [d.view(qt), d.view(A), d.view(ps), d.view(base), d.view(lens)]
    vpw, vpb, vlw, vlb = (d.view(t) for t in (pw, pb, lw, lb))  # views made outside the graph captures
    big = N * L > 16 * 8192
    variants = (("pair", "mla_attend_pair_wgmma_f32", 2 * cdiv(hg, 2), MLA_WGMMA_SHARED),)

    def attend(part, v, s, final=0):
        _, kname, gx, smem = v
        d.launch(kname, (gx, N, s), MLA_WG_THREADS, *common_args, part, N, heads, kv_lora, rope, pt, s, 0,
                 scale, final, shared_mem=smem)

    def merge(part, lat, s):
        d.launch("mla_merge_f32", (N, heads, cdiv(kv_lora, 128)), 128, part, lat, N, heads, kv_lora, s)

    def production(v):  # mla/mod.rs mla_absorbed's attend (+ merge)
        if sw == 1:
            attend(vlw, v, 1, final=1)
        else:
            attend(vpw, v, sw)
            merge(vpw, vlw, sw)

    def bf16_full():
        d.launch("mla_attend_bf16_f32", (cdiv(heads, MLA_BF16_HEADS), N, sb), 256, *common_args, vpb, N,
                 heads, kv_lora, rope, pt, sb, 0, scale, shared_mem=MLA_BF16_SHARED)
        merge(vpb, vlb, sb)

    def timed(fn):
        return d.time_graph(fn, reps=5, inner=3) if big else d.time_graph(fn)
    for v in variants:
        attend(vpw, v, sw)  # compile and opt in outside the graph captures
    bf16_ms, _ = timed(bf16_full)
    floor_a = (kv_bytes + part_bytes(sw)) / (COPY_TBPS * 1e12) * 1e3
    floor_m = (kv_bytes + (0 if sw == 1 else 2 * part_bytes(sw)) + lat_bytes) / (COPY_TBPS * 1e12) * 1e3
    bf16_full()
    for v in variants:
        tag = v[0]
        ms, how = timed(lambda v=v: attend(vpw, v, sw))
        record(f"mla_attend {tag} N={N} L={L} (attend only, f32 rows)", ms, floor_a, splits=sw, timing=how)
        extra = {}
        if sw != sb:  # the bf16 rule's splits + the merge, as before final_rows
            ms_old, _ = timed(lambda v=v: (attend(vpw, v, sb), merge(vpw, vlw, sb)))
            extra = dict(splits_merge_us=round(ms_old * 1e3, 1), splits_merge_splits=sb)
        ms, how = timed(lambda v=v: production(v))
        record(f"mla_attend+merge {tag} N={N} L={L} (f32 rows + partials)", ms, floor_m, splits=sw, timing=how,
               final_rows=sw == 1, bf16_us=round(bf16_ms * 1e3, 1), speedup_vs_bf16=round(bf16_ms / ms, 2),
               rows_only_floor_us=round(kv_bytes / (COPY_TBPS * 1e12) * 1e6, 1),
               pct_of_rows_floor=round(100 * kv_bytes / (COPY_TBPS * 1e12) * 1e3 / ms, 1), **extra)
        production(v)
        d.sync()
        r.check(f"mla {tag} vs bf16 latent N={N} L={L} (K3 shapes, splits {sw})", rel_err(lw, lb), 2e-2)
    del pw, pb, lb
    try:  # after the pair production run: lw holds its latent, ms its time
        bench_mla_sdpa(d, r, record, N, L, A, ps, qt, lw, ms, pt, kv_lora, scale)
    except Exception as e:  # noqa: BLE001
        log(f"bench mla sdpa N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
    del lw


def bench_mla_sdpa(d: Device, r: Results, record, N, L, A, ps, qt, lat, ours_ms, pt, kv_lora, scale):
    """torch SDPA on the same decode attention, the public implementation that runs on the device
    (FlashInfer's wheel, 101 MB, is over the device tool's 64 MiB carry): the 96 heads as 96 query
    rows over one K/V head (MQA as MHA, nothing broadcast), q~ and the rows as ours get them, the
    cached rows gathered from the pages into a contiguous [N, L, row] tensor outside the timing (the
    contiguous layout is free for SDPA). In bf16 (half the bytes of our f32 rows) and f32, under the
    default choice and each backend that accepts the shapes (qk dim 576, v dim 512); each output is
    checked against our latent (2e-2), each time recorded with ours from the same run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    row = qt.shape[-1]
    pages = cdiv(L, pt)
    rows = A.view(-1, pt * row)[ps // (pt * row)].view(N, pages * pt, row)[:, :L]
    ref = lat.view(N, 1, -1, kv_lora)
    backends = (("default", None), ("math", SDPBackend.MATH), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        k = rows.to(dt).unsqueeze(1).contiguous()  # [N, 1, L, row]
        v = k[..., :kv_lora]  # a view: the values are the rows' first kv_lora columns, as in ours
        q = qt.to(dt).unsqueeze(1).contiguous()  # [N, 1, 96, row]: heads as query rows
        out = torch.empty(N, 1, q.shape[2], kv_lora, device=q.device, dtype=dt)
        floor = (k.numel() * k.element_size() + q.numel() * q.element_size()) / (COPY_TBPS * 1e12) * 1e3
        for name, be in backends:
            def go(be=be):
                if be is None:
                    out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale))
                else:
                    with sdpa_kernel(be):
                        out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale))
            try:
                go()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                log(f"bench mla sdpa {tag} {name} N={N} L={L}: not run ({type(e).__name__}: {str(e)[:120]})")
                continue
            err = rel_err(out.float(), ref)
            ms, how = d.time_graph(go, reps=5, inner=3)
            record(f"mla sdpa {tag} {name} N={N} L={L} (heads as query rows, contiguous rows)", ms, floor,
                   timing=how, ours_us=round(ours_ms * 1e3, 1), ours_speedup=round(ms / ours_ms, 2),
                   rel_err_vs_ours=float(f"{float(err):.3g}"))
            r.check(f"mla sdpa {tag} {name} vs our latent N={N} L={L}", err, 2e-2)


# Harness-only compile-time variants of mla_attend_pair_wgmma_f32 (kernels/mla_attend_pair_wgmma.cu MLW_DIAG, MLW_NB; the
# base twice, to show the drift within the call), to find what bounds the kernel; K3_MLA_DIAG replaces
# the list (`K3_BENCH_ONLY=mla_diag`).
MLA_DIAG_VARIANTS = ((), ("-DMLW_DIAG=1",), ("-DMLW_DIAG=14",), ("-DMLW_DIAG=78",), ("-DMLW_DIAG=126",), ())


def mla_decode_case(N, L, heads, row, pt):
    """N items of L cached f32 rows each on shuffled pages of pt positions: (arena, page starts, qt,
    page-table bases, lengths), as the MLA decode benchmarks launch them."""
    pages = cdiv(L, pt)
    A = torch.randn(N * pages * pt * row, device="cuda")
    ps = torch.randperm(N * pages, device="cuda").to(torch.int64) * pt * row
    qt = torch.randn(N, heads, row, device="cuda")
    base = torch.arange(N, dtype=torch.int32, device="cuda") * pages
    lens = torch.full((N,), L, dtype=torch.int32, device="cuda")
    return A, ps, qt, base, lens


def bench_mla_diag(d: Device, record):
    """Attend-only times of the pair kernel's variants at L = 32k (N = 16, 64): DIAG 1 = producer
    alone, 2 = consumers + stores alone, 3 = neither's main work (these compute garbage on purpose);
    variants without MLW_DIAG are compared with the base variant's partials (bitwise, rel_err)."""
    heads, rope, kv_lora, pt = 96, 64, 512, 64
    row = kv_lora + rope
    # K3_MLA_DIAG replaces the list (after the base variant): define sets separated by ";".
    extra = [tuple(x.split()) for x in os.environ.get("K3_MLA_DIAG", "").split(";") if x.strip()]
    variants = ((), *extra) if extra else MLA_DIAG_VARIANTS
    for N, L in ((16, 32768), (64, 32768)):
        A, ps, qt, base, lens = mla_decode_case(N, L, heads, row, pt)
        hg = cdiv(heads, MLA_WG_HEADS)
        sw = mla_splits_bf16(N * hg, L)
        part = torch.empty(N, heads, sw, kv_lora + 2, device="cuda")
        args = [d.view(t) for t in (qt, A, ps, base, lens, part)]
        rows_floor = N * L * row * 4 / (COPY_TBPS * 1e12) * 1e3
        ref = None  # the first (base) variant's partials: the others without MLW_DIAG must equal them bitwise
        for defs in variants:
            def go(defs=defs):
                d.launch("mla_attend_pair_wgmma_f32", (2 * cdiv(hg, 2), N, sw), MLA_WG_THREADS, *args, N, heads, kv_lora,
                         rope, pt, sw, 0, 192 ** -0.5, 0, shared_mem=MLA_WGMMA_SHARED, defines=defs)
            try:
                part.fill_(float("nan"))
                go()
                d.sync()
                same, err = "", ""
                if not any("MLW_DIAG" in x for x in defs):
                    if ref is None:
                        ref = part.clone()
                    same = bool(torch.equal(part, ref))
                    err = float(rel_err(part, ref))
                ms, how = d.time_graph(go, reps=5, inner=3)
                record(f"mla_diag pair [{' '.join(defs) or 'base'}] N={N} L={L} (attend only)", ms, rows_floor,
                       splits=sw, timing=how, bitwise_equal_base=same, rel_err_vs_base=err)
            except Exception as e:  # noqa: BLE001
                log(f"bench mla_diag {defs} N={N} raised {type(e).__name__}: {str(e)[:200]}")
        del A, part


def bench_mla_steady(d: Device, record, rounds=6):
    """The MLA decode at N = 64, L = 32k as ops.rs runs it (1 split, final rows), in `rounds` rounds
    interleaved with a 1 GiB read (torch.sum) and an SM copy (torch.mul, read + write), so each
    round's share is against the bandwidth this GPU gave in that same round: the kernel's time
    drifts by a few percent over a call (clocks under sustained HBM load), and a share against the
    fixed COPY_TBPS mixes that drift in. (dst.copy_ in a graph runs on a copy engine at ~2.7 TB/s:
    no reference for SM kernels.)"""
    heads, rope, kv_lora, pt, N, L = 96, 64, 512, 64, 64, 32768
    row = kv_lora + rope
    A, ps, qt, base, lens = mla_decode_case(N, L, heads, row, pt)
    lat = torch.empty(N, heads, kv_lora, device="cuda")
    hg = cdiv(heads, MLA_WG_HEADS)
    sw = mla_splits_wg(N * hg, L)
    args = [d.view(t) for t in (qt, A, ps, base, lens, lat)]
    src = torch.empty(1 << 28, device="cuda")
    dst, one = torch.empty_like(src), torch.empty((), device="cuda")

    def attend():
        d.launch("mla_attend_pair_wgmma_f32", (2 * cdiv(hg, 2), N, sw), MLA_WG_THREADS, *args, N, heads, kv_lora, rope, pt,
                 sw, 0, 192 ** -0.5, int(sw == 1), shared_mem=MLA_WGMMA_SHARED)
    attend()
    rows_bytes = N * L * row * 4 + lat.numel() * 4
    shares = []
    for i in range(rounds):
        read_ms, _ = d.time_graph(lambda: torch.sum(src, dim=0, out=one), reps=5, inner=3)
        copy_ms, _ = d.time_graph(lambda: torch.mul(src, 1.0, out=dst), reps=5, inner=3)
        ms, how = d.time_graph(attend, reps=5, inner=3)
        read_tbps, copy_tbps = src.numel() * 4 / read_ms / 1e9, 2 * src.numel() * 4 / copy_ms / 1e9
        shares.append(rows_bytes / (copy_tbps * 1e12) * 1e3 / ms)
        record(f"mla_steady round {i} pair N={N} L={L} (splits {sw}, final rows)", ms,
               rows_bytes / (COPY_TBPS * 1e12) * 1e3, timing=how, read_tbps=round(read_tbps, 3),
               copy_tbps=round(copy_tbps, 3), pct_of_same_round_copy=round(100 * shares[-1], 1),
               pct_of_same_round_read=round(100 * rows_bytes / (read_tbps * 1e12) * 1e3 / ms, 1))
    shares.sort()
    log(f"bench mla_steady N={N} L={L}: share of the same-round copy rate, median {100 * shares[len(shares) // 2]:.1f} %"
        f" (min {100 * shares[0]:.1f}, max {100 * shares[-1]:.1f}) over {rounds} rounds")


def bench(d: Device, r: Results, quick: bool, only=None):
    """Every benchmark, or the sections named in `only` (kda_decode, kda_prefill, mla, mla_proj,
    mla_prefill, attn_res, moe, moe_prefill, gemv, sampling; mla includes mla_proj and the torch SDPA comparison).
    The probes run only when named: mla_diag, mla_steady, moe_few_tokens_diag, moe_wg_diag."""
    def want(section):
        return not only or section in only

    H, hk, conv, lb = 96, 96 * 128, 4, -5.0
    reg = kda_region_floats(hk, conv, H)
    fla = None
    try:  # only the KDA sections compare with fla (importing it compiles for ~90 s)
        if want("kda_decode") or want("kda_prefill"):
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
    for N in ([] if not want("kda_decode") else [1, 64] if quick else [1, 16, 64, 256]):
        A = torch.randn(N * reg, device="cuda") * 0.01
        offs = torch.randperm(N, device="cuda").to(torch.int64) * reg
        ck = torch.full((N,), -1, dtype=torch.int64, device="cuda")
        x = [dev(N, hk) for _ in range(4)] + [dev(N, H)]
        cw = [dev(hk, conv) * 0.5 for _ in range(3)]
        o = torch.empty(N, hk, device="cuda")
        args = [d.view(t) for t in x + cw] + [d.view(dev(H)), d.view(dev(hk)), d.view(A), d.view(offs), d.view(ck),
                                              d.view(o), N, H, conv, lb]
        # Every decode kernel on the same buffers ("kda_decode N=.." is the default).
        runs = {}
        for variant in KDA_DECODE_VARIANTS:
            runs[variant] = d.time_graph(kda_decode_launcher(d, variant, H, N, args))
        floor = N * H * 128 * 128 * 4 * 2 / (COPY_TBPS * 1e12) * 1e3
        extra = {}
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
        default = KDA_DECODE_VARIANTS[0]
        for variant, (ms, how) in runs.items():
            ratio = {} if variant == default else {f"vs_{default}": round(runs[default][0] / ms, 3)}
            if "fla_ms" in extra:
                ratio["vs_fla"] = round(extra["fla_ms"] / ms, 3)
            record(f"kda_decode N={N}" if variant == default else f"kda_decode {variant} N={N}", ms, floor,
                   timing=how, **ratio, **extra)
        del A

    # KDA prefill, one sequence of T tokens.
    for T in ([] if not want("kda_prefill") else [8192] if quick else [1024, 8192]):
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
            # conv + prep alone (scan modes: the record pass, i.e. conv + prep + chunk algebra)
            prep_ms = d.time_ms(go.prep_only, reps=5, warmup=1)
            tag, err = "", {}
            if chunk != "f32":  # vs the f32 kernel at the K3 shape (96 heads, long T), same start state
                tag = f"[{chunk}]"
                err = {"o_err_vs_f32": rel_err(outs[chunk][0], outs["f32"][0]),
                       "S_err_vs_f32": rel_err(outs[chunk][1], outs["f32"][1])}
            if "fla_ms" in extra:
                err["vs_fla"] = round(extra["fla_ms"] / ms, 3)
            # Floor: the DRAM bytes of the record pass (raw q, k, v, f in, records out) + the scan's
            # record reads and o write: about 4 + 4.3 + 4.3 + 1 tensors of T*H*128 f32.
            floor = (4 + 4.3 + 4.3 + 1) * T * hk * 4 / (COPY_TBPS * 1e12) * 1e3 if chunk in KDA_SCAN_KERNELS else None
            record(f"kda_prefill{tag} T={T} (conv+prep+chunk)", ms, floor, Mtok_s=T / ms / 1e3, chunk_ms=chunk_ms,
                   prep_ms=prep_ms, **err, **extra)
        for chunk in [c for c in KDA_CHUNK_KERNELS if c != "f32"]:
            (o1, a1), (o2, a2) = outs["f32"], outs[chunk]
            tol = KDA_CHUNK_TOL[chunk]
            r.check(f"kda_prefill[{chunk}] T={T} H={H} vs kda_chunk_fwd_f32: o", rel_err(o2, o1), tol)
            r.check(f"kda_prefill[{chunk}] T={T} H={H} vs kda_chunk_fwd_f32: state", rel_err(a2, a1), tol)
        del A, A0, xs, outs

    # MLA decode: N queries, L cached positions each, K3 heads and row. The CUDA-core attend (old)
    # and the tensor-core one (3xTF32 "precise" and 1xTF32 "fast"), each + combine.
    heads, nope, rope, v_dim, kv_lora, pt = 96, 128, 64, 128, 512, 64
    row = kv_lora + rope
    mla_shapes = [] if not want("mla") else [(16, 8192), (1, 32768), (64, 32768)] if quick else \
        [(1, 8192), (16, 8192), (64, 4096), (1, 32768), (16, 32768), (64, 32768)]
    if want("mla") and os.environ.get("K3_MLA_SHAPES"):  # e.g. "64x32768,16x32768": repeat a figure cheaply
        mla_shapes = [tuple(int(v) for v in x.split("x")) for x in os.environ["K3_MLA_SHAPES"].split(",")]
    for N, L in mla_shapes:
        pages = cdiv(L, pt)
        A = torch.randn(N * pages * pt * row, device="cuda")
        ps = (torch.randperm(N * pages, device="cuda").to(torch.int64) * pt * row)
        qt = dev(N, heads, row)
        kvb = dev(heads * (nope + v_dim), kv_lora) * kv_lora ** -0.5
        o = torch.empty(N, heads * v_dim, device="cuda")
        base = torch.arange(N, dtype=torch.int32, device="cuda") * pages
        lens = torch.full((N,), L, dtype=torch.int32, device="cuda")
        floor = N * L * row * 4 / (COPY_TBPS * 1e12) * 1e3
        try:  # a failure here must not cost the benchmarks after it
            bench_mla_tf32(d, record, N, L, A, ps, qt, kvb, o, base, lens, floor)
        except Exception as e:  # noqa: BLE001
            log(f"bench mla tf32 N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
        try:
            bench_mla_bf16(d, r, record, N, L, A, ps, qt, base, lens)
        except Exception as e:  # noqa: BLE001
            log(f"bench mla bf16 N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
        try:
            bench_mla_wg(d, r, record, N, L, A, ps, qt, base, lens)
        except Exception as e:  # noqa: BLE001
            log(f"bench mla wg N={N} L={L} raised {type(e).__name__}: {str(e)[:200]}")
        del A
    if want("mla") or want("mla_proj"):
        bench_mla_proj(d, r, record, quick)

    if want("mla_prefill"):
        bench_mla_prefill(d, r, record)
    if only and "mla_diag" in only:  # probes, only when named
        bench_mla_diag(d, record)
    if only and "mla_steady" in only:
        bench_mla_steady(d, record)
    if only and "moe_few_tokens_diag" in only:  # probes, only when named
        bench_moe_few_tokens_diag(d, record)
    if want("attn_res"):
        bench_attn_res(d, record)
    if want("moe"):
        bench_moe_single_token(d, record)
        bench_moe(d, record, quick)
    if want("moe") or want("moe_prefill"):
        bench_moe_prefill(d, record, quick)
    if only and "moe_wg_diag" in only:  # probes, only when named
        bench_moe_wg_diag(d, record)
    if want("sampling"):
        bench_topk(d, record)
    if want("gemv"):
        bench_gemv(d, record, quick)


def bench_mla_prefill(d: Device, r: Results, record):
    """MLA prefill of one sequence, T new tokens from position 0, K3 shapes, rows already in the pages
    (the append is the same kernel on both paths): the expanded form (mla_prefill.rs, what mla_seqs
    runs for >= 64 new tokens) against the absorbed one (mla/mod.rs mla_absorbed tf32: absorb_q + attend_tf32
    precise + merge + out_proj over T items of causal lengths 1..T). Floor: the expanded form's FLOPs
    (K/V expansion + causal QK and PV) at F32_TFLOPS. Also checks the two outputs agree. ~10 s."""
    heads, nope, rope, v_dim, kv_lora, pt = 96, 128, 64, 128, 512, 64
    row, qk, hg16 = kv_lora + rope, nope + rope, cdiv(heads, 16)
    n = 8192
    a, b, c = (torch.randn(n, n, device="cuda") for _ in range(3))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ms = d.time_ms(lambda: torch.matmul(a, b, out=c), reps=5, warmup=1)
        record(f"sgemm f32 {n}^3 (torch, no TF32)", ms, 2 * n ** 3 / (F32_TFLOPS * 1e12) * 1e3,
               tflops=2 * n ** 3 / ms / 1e9)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for T in (2048, 8192):
        try:
            pages = cdiv(T, pt)
            A = torch.randn(pages * pt * row, device="cuda")
            ps = torch.randperm(pages, device="cuda").to(torch.int64) * (pt * row)
            q = torch.randn(T, heads * qk, device="cuda")
            kvb = torch.randn(heads * (nope + v_dim), kv_lora, device="cuda") * kv_lora ** -0.5
            o_e, o_a = (torch.empty(T, heads * v_dim, device="cuda") for _ in range(2))
            go_e, (hg, qc) = run_mla_prefill(d, A, ps, q, kvb, o_e, 0, T, 0, heads, nope, rope, v_dim, kv_lora, pt)
            splits = mla_splits_f32(T * hg16, T)
            chunk = cdiv(T, splits)
            bufs = dict(q=q, kvb=kvb, A=A, ps=ps, o=o_a, qt=torch.empty(T, heads, row, device="cuda"),
                        part=torch.empty(T, heads, splits, kv_lora + 2, device="cuda"),
                        lat=torch.empty(T, heads, kv_lora, device="cuda"),
                        base=torch.zeros(T, dtype=torch.int32, device="cuda"),  # one page table for all items
                        lens=torch.arange(1, T + 1, dtype=torch.int32, device="cuda"))
            v = {k: d.view(x) for k, x in bufs.items()}

            def go_a(T=T, v=v, splits=splits, chunk=chunk):
                d.launch("mla_absorb_q_f32", (T, heads), 128, v["q"], v["kvb"], v["qt"], T, heads, nope, rope,
                         v_dim, kv_lora)
                d.launch("mla_attend_tf32_f32", (hg16, T, splits), 256, v["qt"], v["A"], v["ps"], v["base"],
                         v["lens"], v["part"], T, heads, kv_lora, rope, pt, splits, chunk, qk ** -0.5, 1 | 4 << 2)
                d.launch("mla_merge_f32", (T, heads, cdiv(kv_lora, 128)), 128, v["part"], v["lat"], T, heads, kv_lora,
                         splits)
                d.launch("mla_out_proj_f32", (heads, cdiv(v_dim, 16), cdiv(T, 64)), 256, v["lat"], v["kvb"], v["o"],
                         T, heads, nope, v_dim, kv_lora)
            go_e()
            go_a()
            d.sync()
            r.check(f"mla_prefill expanded vs absorbed T={T} (K3 shapes)", rel_err(o_e, o_a), 1e-4)
            flops = 2 * T * kv_lora * heads * (nope + v_dim) + heads * (qk + v_dim) * T * (T + 1)
            floor = flops / (F32_TFLOPS * 1e12) * 1e3
            o_f = torch.empty(T, heads * v_dim, device="cuda")
            go_f, _ = run_mla_prefill(d, A, ps, q, kvb, o_f, 0, T, 0, heads, nope, rope, v_dim, kv_lora, pt,
                                      flash=True)
            go_f()
            d.sync()
            r.check(f"mla_prefill flash bf16 vs expanded T={T} (K3 shapes)", rel_err(o_f, o_e), 1e-2)
            ms_f = d.time_ms(go_f, reps=5, warmup=1)
            ms_e = d.time_ms(go_e, reps=5, warmup=1)
            record(f"mla_prefill flash bf16 T={T} start=0 (gather+expand+fused QK/softmax/PV)", ms_f, floor,
                   head_group=hg, tflops=flops / ms_f / 1e9, speedup_vs_expanded_f32=ms_e / ms_f)
            ms_a = d.time_ms(go_a, reps=3 if T > 4096 else 5, warmup=1)
            record(f"mla_prefill expanded T={T} start=0 (gather+expand+QK+softmax+PV)", ms_e, floor, head_group=hg,
                   q_chunk=qc, tflops=flops / ms_e / 1e9, speedup_vs_absorbed=ms_a / ms_e)
            record(f"mla_prefill absorbed T={T} start=0 (absorb_q+attend_tf32+merge+out_proj)", ms_a, floor,
                   splits=splits, tflops=flops / ms_a / 1e9)
            del A, q, kvb, o_e, o_a, bufs, v, go_e
        except Exception as e:  # noqa: BLE001  a failure here must not cost the benchmarks after it
            log(f"bench mla_prefill T={T} raised {type(e).__name__}: {str(e)[:200]}")


TOPK_SEGMENT = 4096  # ops.rs TOPK_SEGMENT


def bench_topk(d: Device, record):
    """Sampling candidates (what a greedy / top-k decode step hands the host): topk_rows_f32 plus
    copying its k pairs back, against copying the whole logits rows back (what the engine did
    before), both to pageable host memory and both timed end to end on the host (they sync).
    Floor of the kernel: reading the rows once / 4.25 TB/s."""
    vocab = 163840
    for rows in (1, 16, 64):
        lg = torch.randn(rows, vocab, device="cuda") * 3
        for k in (1, 50):
            segs = cdiv(vocab, TOPK_SEGMENT)
            seg_ids = torch.empty(rows * segs * k, dtype=torch.int32, device="cuda")
            seg_vals = torch.empty(rows * segs * k, device="cuda")
            seg_count = torch.empty(rows * segs, dtype=torch.int32, device="cuda")
            ids = torch.empty(rows * k, dtype=torch.int32, device="cuda")
            vals = torch.empty(rows * k, device="cuda")
            count = torch.empty(rows, dtype=torch.int32, device="cuda")
            no_mask = torch.empty(1, dtype=torch.uint32, device="cuda")  # not read with 0 mask words

            def run(rows=rows, k=k, segs=segs, seg_ids=seg_ids, seg_vals=seg_vals, seg_count=seg_count, ids=ids,
                    vals=vals, count=count, lg=lg, no_mask=no_mask):
                d.launch("topk_segments_f32", (segs, rows), 512, d.view(lg), d.view(seg_ids), d.view(seg_vals),
                         d.view(seg_count), rows, vocab, k, TOPK_SEGMENT, d.view(no_mask), 0)
                d.launch("topk_merge_f32", rows, 1024, d.view(lg), d.view(seg_ids), d.view(seg_vals),
                         d.view(seg_count), d.view(ids), d.view(vals), d.view(count), rows, vocab, k, segs)
            ms, how = d.time_graph(run)

            def wall(fn, reps=20):
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                return (time.perf_counter() - t0) / reps * 1e3
            sel = wall(lambda: (run(), ids.cpu(), vals.cpu(), count.cpu()))
            full = wall(lambda: lg.cpu())
            record(f"topk_rows k={k} rows={rows} vocab={vocab} (segments + merge)", ms, rows * vocab * 4 / (COPY_TBPS * 1e12) * 1e3,
                   timing=how)
            log(f"bench sampling rows={rows} k={k}: select + copy {sel * 1e3:.0f} us vs whole rows to host "
                f"{full * 1e3:.0f} us ({full / sel:.1f}x)")
            # Constrained decoding: every row masked (a JSON-like mask, 1 token in 8 allowed),
            # table uploaded from pageable host memory each step as the backend does.
            words = cdiv(vocab, 32)
            host_table = np.concatenate([np.arange(rows, dtype=np.uint32),
                                         np.full(rows * words, 0x01010101, dtype=np.uint32)])

            def run_masked(rows=rows, k=k, segs=segs, seg_ids=seg_ids, seg_vals=seg_vals, seg_count=seg_count,
                           ids=ids, vals=vals, count=count, lg=lg, host_table=host_table, words=words):
                dt = torch.from_numpy(host_table).to("cuda", non_blocking=False)
                d.launch("topk_segments_f32", (segs, rows), 512, d.view(lg), d.view(seg_ids), d.view(seg_vals),
                         d.view(seg_count), rows, vocab, k, TOPK_SEGMENT, d.view(dt), words)
                d.launch("topk_merge_f32", rows, 1024, d.view(lg), d.view(seg_ids), d.view(seg_vals),
                         d.view(seg_count), d.view(ids), d.view(vals), d.view(count), rows, vocab, k, segs)
            sel_masked = wall(lambda: (run_masked(), ids.cpu(), vals.cpu(), count.cpu()))
            log(f"bench sampling rows={rows} k={k}: masked select + upload + copy {sel_masked * 1e3:.0f} us vs "
                f"unmasked {sel * 1e3:.0f} us ({sel_masked / sel:.2f}x)")


def bench_attn_res(d: Device, record):
    """AttnRes (9 sources; a cluster of 8 blocks per row) and RMSNorm (512 threads per row) at d = 7168:
    prefill rows and the decode sizes, where few rows must still spread over many SMs."""
    dev = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    dm = 7168
    w = dev(dm) * 0.01
    for T in (4096, 1, 16, 64):
        srcs = [dev(T, dm) for _ in range(9)]
        out = torch.empty(T, dm, device="cuda")
        bits = torch.empty(T, dm, dtype=torch.int16, device="cuda")
        views, vw, vo = [d.view(s) for s in srcs], d.view(w), d.view(out)  # no views inside a captured fn
        vb = d.view(bits).view(np.uint16)
        ms, how = d.time_graph(lambda: d.launch("attn_res_f32", T * 8, 128, *views[:8], 8, views[8], vw, 0, vw, vw, 0,
                                                vo, T, dm, 1e-5, vb, 0))
        record(f"attn_res T={T} n=9", ms, (9 * T * dm * 4 + T * dm * 4) / (COPY_TBPS * 1e12) * 1e3, timing=how)
        # As Backend::attn_res_norm: the first source added into the last (read and written), RMSNorm after.
        va = d.view(srcs[0])
        # With the bf16 copy of the output (bfloat16 mode, a sublayer's input for cuBLAS).
        ms, how = d.time_graph(lambda: d.launch("attn_res_f32", T * 8, 128, *views[:8], 8, views[8], va, 1, vw, vw, 1,
                                                vo, T, dm, 1e-5, vb, 1))
        record(f"attn_res_norm T={T} n=9", ms, (11 * T * dm * 4 + T * dm * 6) / (COPY_TBPS * 1e12) * 1e3,
               timing=how)
        ms, how = d.time_graph(lambda: d.launch("rms_norm_f32", T, 512, views[0], vw, vo, T, dm, 1e-5, vb, 1))
        record(f"rms_norm T={T}", ms, (T * dm * 4 + T * dm * 6 + dm * 4) / (COPY_TBPS * 1e12) * 1e3, timing=how)



# K3's dense decode matmuls (n x k of the bf16 weight): k3-slice K3_PROFILE shapes.
GEMV_SHAPES = [(12288, 7168), (7168, 12288), (33792, 7168), (6144, 7168), (3584, 7168), (7168, 6144),
               (7168, 3584), (1536, 7168), (18432, 1536), (576, 7168), (128, 7168), (96, 7168), (12288, 128)]


def bench_gemv(d: Device, record, quick: bool):
    """Dense bf16-weight decode products, y [M, n] = x [M, k] w^T, per shape and M: `new` / `new
    bf16` (gemv_bf16_tc_f32, its last blocks summing the splits, x in three pieces / rounded once;
    dense/mod.rs matmul_linear takes it for M <= 16 up to CudaOptions::gemv_max_weight_elems = 2^22
    weights) and `cublas` / `cublas bf16` (split rows + torch bf16 matmul of the [2M, k] hi/lo rows
    + sum of halves in float32 mode, of the [M, k] rounded rows in bf16 mode: the path above that).
    Floor = weight bytes / 4.25 TB/s; `new` also reports its error against float64 (rel) and
    whether matmul_linear picks it (`taken`). Probes: K3_GEMV_DIAG (compile-time define sets) and
    K3_GEMV_SLICES (other K-slice lengths). Buffers are rebound per shape (the loop frees them)."""
    shapes = GEMV_SHAPES[:4] + GEMV_SHAPES[7:8] if quick else GEMV_SHAPES
    # Probes of the bf16 form: K3_GEMV_DIAG lists define sets (";"-separated), e.g. "-DGEMV_TC_UNROLL=4"
    # (more columns per step, so more loads in flight), and K3_GEMV_SLICES other K-slice lengths than
    # gemv_tc_plan's (","-separated columns).
    probes = [tuple(v.split()) for v in os.environ.get("K3_GEMV_DIAG", "").split(";") if v.strip()]
    slices = [int(v) for v in os.environ.get("K3_GEMV_SLICES", "").split(",") if v.strip()]
    for n, k in shapes:
        wt = (torch.randn(n, k, device="cuda") * 0.1).to(torch.bfloat16)
        wb = wt.view(torch.int16)
        floor = n * k * 2 / 4.25e12 * 1e3
        wv = d.view(wb).view(np.uint16)
        for M in ([1, 16] if quick else [1, 16, 64]):
            if M > 16:
                log(f"bench gemv {n}x{k} M={M}: new kernel takes M <= 16 (matmul_linear uses cuBLAS)")
            x = torch.randn(M, k, device="cuda")
            y = torch.empty(M, n, device="cuda")
            splits, kslice = gemv_tc_plan(n, k)
            part = torch.empty(max([splits] + [cdiv(k, ks) for ks in slices]) * M * n, device="cuda")
            xs = torch.empty(2 * M, k, dtype=torch.int16, device="cuda")
            c = torch.empty(2 * M, n, device="cuda")
            cb = torch.empty(2 * M, n, dtype=torch.bfloat16, device="cuda")
            V = {name: d.view(t) for name, t in (("x", x), ("y", y), ("part", part), ("xs", xs), ("c", c))}
            xsv = V["xs"].view(np.uint16)

            def new(M=M):
                run_gemv_tc(d, V["x"], wv, V["y"], M, n, k, V["part"], (splits, kslice))

            def new_bf16(M=M, defs=()):
                run_gemv_tc(d, V["x"], wv, V["y"], M, n, k, V["part"], (splits, kslice), pieces=1, defines=defs)

            def cublas(M=M):
                d.launch("bf16_split_rows_f32", cdiv(M * k, 256), 256, V["x"], xsv, M * k, 2)
                # cuBLAS writes f32 in matmul_linear; torch's bf16 matmul writes bf16 (a proxy: the
                # weight stream dominates, the output is 2M x n).
                torch.matmul(xs.view(torch.bfloat16), wt.T, out=cb)
                d.launch("sum_row_halves_f32", cdiv(M * n, 256), 256, V["c"], V["y"], M * n)

            def cublas_bf16(M=M):  # bfloat16 mode: x rounded once, M rows
                d.launch("bf16_split_rows_f32", cdiv(M * k, 256), 256, V["x"], xsv, M * k, 1)
                torch.matmul(xs[:M].view(torch.bfloat16), wt.T, out=cb[:M])
            def sliced(M=M, ks=64):
                run_gemv_tc(d, V["x"], wv, V["y"], M, n, k, V["part"], (cdiv(k, ks), ks), pieces=1)
            runs = ([("new", new), ("new bf16", new_bf16)]
                    + [(f"new bf16 [{' '.join(p)}]", lambda M=M, p=p: new_bf16(M, p)) for p in probes]
                    + [(f"new bf16 [kslice {ks}]", lambda M=M, ks=ks: sliced(M, ks)) for ks in slices
                       if ks != kslice and ks < k]
                    if M <= 16 else []) + [("cublas", cublas), ("cublas bf16", cublas_bf16)]
            extra = {}
            if M <= 16:
                new()
                torch.cuda.synchronize()
                extra = {"rel": f"{rel_err(y, x.double() @ wt.double().T):.1e}"}
            for label, fn in runs:
                try:
                    ms, how = d.time_graph(fn)
                    kw = {"splits": splits, "kslice": kslice, "taken": n * k <= 1 << 22, **extra} \
                        if label == "new" else {}
                    record(f"gemv {label} {n}x{k} M={M}", ms, floor, timing=how, **kw)
                except Exception as e:  # noqa: BLE001
                    log(f"bench gemv {label} {n}x{k} M={M} raised {type(e).__name__}: {str(e)[:200]}")
