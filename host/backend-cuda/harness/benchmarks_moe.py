"""Benchmarks of the routed-expert kernels (kernels/moe_*.cu) at K3 shapes, run by benchmarks.bench: the
single-token and few-token decode pairs against their weight floors, their harness-only probes, and the
many-assignment (prefill) paths against cuBLAS."""
from __future__ import annotations

from typing import TYPE_CHECKING

import os

import numpy as np
import torch

from common import COPY_TBPS, cdiv, log, rel_err
from common import run_few_tokens, run_few_tokens_e4m3, few_token_scratch_e4m3, few_token_stage_bytes_e4m3
from common import FEW_TOKEN_STAGES
from common import (FEW_TOKEN_BLOCK_BYTES, FEW_TOKEN_DOWN_ROWS, FEW_TOKEN_UP_ROWS, few_token_grid, few_token_ntiles,
                    few_token_scratch, few_token_shared)
from common import single_token_plan, single_token_scratch, run_single_token
from common import (MX_WG_DOWN_ROWS, MX_WG_SHARED, MX_WG_TOK, MX_WG_UP_ROWS, mx_tile_bound,
                    mx_wg_scratch, run_mx_wg)

if TYPE_CHECKING:
    from device import Device


def bench_moe(d: Device, record, quick: bool):
    """Routed MoE decode: T tokens, top-16 of E experts, K3 expert sizes."""
    dev = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    E, k, lt, ie = 128, 16, 3584, 3072
    w1p = torch.randint(0, 256, (E, ie, lt // 2), dtype=torch.uint8, device="cuda")
    w3p = torch.randint(0, 256, (E, ie, lt // 2), dtype=torch.uint8, device="cuda")
    w2p = torch.randint(0, 256, (E, lt, ie // 2), dtype=torch.uint8, device="cuda")
    w1s, w3s = (torch.randint(118, 124, (E, ie, lt // 32), dtype=torch.uint8, device="cuda") for _ in range(2))
    w2s = torch.randint(118, 124, (E, lt, ie // 32), dtype=torch.uint8, device="cuda")
    for T in ([1, 16] if quick else [1, 4, 16, 64]):
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
        up_args = (V["z"], V["w1p"], V["w1s"], V["w3p"], V["w3s"], V["off"], V["srt"], V["act"], k, lt, ie, 4.0, 25.0,
                   1, E)
        down_args = (V["act"], V["w2p"], V["w2s"], V["off"], V["srt"], V["y"], lt, ie, E)
        # The few_tokens pair (the default from 2 tokens; at T = 1 the fallback for experts too wide for the
        # single-token pair, which bench_moe_single_token times); floor = weight bytes / 4.25 TB/s. bf16
        # activations (planes 1: bfloat16 mode, the default) and hi / lo (planes 2: float32 mode).
        for planes in (1, 2):
            scratch = few_token_scratch(d, T, k, lt, ie, planes)  # split z / intermediate (views made outside graphs)

            def go(scratch=scratch, planes=planes):
                d.launch("moe_sort_assignments", 1, 1024, V["idx"], T * k, E, V["off"], V["srt"])
                run_few_tokens(d, min(E, T * k), up_args, down_args, T, lt, ie, scratch=scratch, planes=planes)
                d.launch("moe_combine_f32", cdiv(T * lt, 256), 256, V["y"], V["wts"], V["res"], T, k, lt)
            go()
            d.sync()
            ms, how = d.time_graph(go)
            nt = few_token_ntiles(T, planes)
            mode = "bf16" if planes == 1 else "hi/lo"
            record(f"moe_routed tc T={T} top{k} {mode} (sort+up+down+combine)", ms, wbytes / (COPY_TBPS * 1e12) * 1e3,
                   experts_touched=touched, stage=f"{8 * nt // planes} tokens (few_tokens)",
                   default=T > 1 and planes == 1, timing=how)
            if T == 1:
                continue
            # The kernels alone (inputs left by the last run), each against its own weight bytes (ring depths:
            # K3_BENCH_ONLY=moe_few_tokens_diag with K3_MX_DIAG="-DMXF_STAGES=4").
            gx, (_, zx, actx), shared = min(E, T * k), scratch, few_token_shared(nt)
            up_b, down_b = touched * 2 * ie * (lt // 2 + lt // 32), touched * lt * (ie // 2 + ie // 32)
            for name, fn, b in (
                    ("split z", lambda: d.launch("mxfp4_experts_few_tokens_split_f32", (T, cdiv(lt, 128)), 32, V["z"], zx,
                                                 T, lt, planes), None),
                    ("up", lambda: d.launch("mxfp4_experts_few_tokens_up_f32", few_token_grid(gx, ie, FEW_TOKEN_UP_ROWS), 256,
                                            zx, *up_args[1:7], actx, *up_args[8:], nt, planes, shared_mem=shared), up_b),
                    ("down", lambda: d.launch("mxfp4_experts_few_tokens_down_f32", few_token_grid(gx, lt, FEW_TOKEN_DOWN_ROWS),
                                              256, actx, *down_args[1:], nt, planes, shared_mem=shared), down_b)):
                ms, how = d.time_graph(fn)
                record(f"moe_routed few_tokens {name} alone T={T} ({mode})", ms, b and b / (COPY_TBPS * 1e12) * 1e3,
                       timing=how)
        # The MXFP8 pair (mxfp8 mode): z and the intermediate quantized to E4M3 + block scales, FP8 tensor cores.
        scratch8 = few_token_scratch_e4m3(d, T, k, lt, ie)

        def go8():
            d.launch("moe_sort_assignments", 1, 1024, V["idx"], T * k, E, V["off"], V["srt"])
            run_few_tokens_e4m3(d, min(E, T * k), up_args, down_args, T, k, lt, ie, scratch=scratch8)
            d.launch("moe_combine_f32", cdiv(T * lt, 256), 256, V["y"], V["wts"], V["res"], T, k, lt)
        go8()
        d.sync()
        ms, how = d.time_graph(go8)
        record(f"moe_routed tc T={T} top{k} mxfp8 (sort+quantize+up+quantize+down+combine)", ms,
               wbytes / (COPY_TBPS * 1e12) * 1e3, experts_touched=touched, timing=how)
        gx, nt = min(E, T * k), few_token_ntiles(T, 1)
        shared8 = FEW_TOKEN_STAGES * few_token_stage_bytes_e4m3(nt)
        _, zq, zf, act8, aq, af = scratch8
        up_b, down_b = touched * 2 * ie * (lt // 2 + lt // 32), touched * lt * (ie // 2 + ie // 32)
        for name, fn, b in (
                ("up", lambda: d.launch("mxfp4_experts_few_tokens_up_e4m3", few_token_grid(gx, ie, FEW_TOKEN_UP_ROWS), 256,
                                        zq, zf, *up_args[1:7], act8, *up_args[8:], nt, shared_mem=shared8), up_b),
                ("down", lambda: d.launch("mxfp4_experts_few_tokens_down_e4m3", few_token_grid(gx, lt, FEW_TOKEN_DOWN_ROWS),
                                          256, aq, af, *down_args[1:], nt, shared_mem=shared8), down_b)):
            ms, how = d.time_graph(fn)
            record(f"moe_routed few_tokens {name} alone T={T} (mxfp8)", ms, b / (COPY_TBPS * 1e12) * 1e3, timing=how)


# Harness-only compile-time probes of the few_tokens expert kernels (kernels/moe_few_tokens.cu MXF_DIAG; the base
# twice, to show the drift within the call); K3_MX_DIAG replaces the list (define sets separated by
# ";"), `K3_BENCH_ONLY=moe_few_tokens_diag`.
FEW_TOKEN_DIAG_VARIANTS = ((), ("-DMXF_DIAG=1",), ("-DMXF_DIAG=2",), ("-DMXF_DIAG=3",), ("-DMXF_DIAG=4",), ("-DMXF_DIAG=8",),
                        ("-DMXF_DIAG=7",), ())


def bench_moe_few_tokens_diag(d: Device, record):
    """The few-token up and down kernels alone at T = 4 / 16 / 64 (K3 expert sizes, top-16 of 128, bf16
    activations: the bfloat16 mode) under each probe, against their weight bytes: what the decode, the
    mma and the weight copies each cost. Variants without MXF_DIAG must equal the base's outputs
    bitwise. `-DMXF_STAGES=S` is not a define: it sizes the ring (shared memory for S stages)."""
    E, k, lt, ie = 128, 16, 3584, 3072
    gen = torch.Generator(device="cuda").manual_seed(7)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device="cuda", generator=gen)  # noqa: E731
    sc = lambda *s: torch.randint(118, 124, s, dtype=torch.uint8, device="cuda", generator=gen)  # noqa: E731
    w = {"w1p": u8(E, ie, lt // 2), "w3p": u8(E, ie, lt // 2), "w2p": u8(E, lt, ie // 2),
         "w1s": sc(E, ie, lt // 32), "w3s": sc(E, ie, lt // 32), "w2s": sc(E, lt, ie // 32)}
    extra = [tuple(x.split()) for x in os.environ.get("K3_MX_DIAG", "").split(";") if x.strip()]
    variants = ((), *extra) if extra else FEW_TOKEN_DIAG_VARIANTS
    for T in (4, 16, 64):
        idx = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)]).int()
        touched = int(idx.unique().numel())
        z = torch.randn(T, lt, device="cuda", generator=gen)
        offsets = torch.empty(E + 1, dtype=torch.int32, device="cuda")
        srt = torch.empty(T * k, dtype=torch.int32, device="cuda")
        y = torch.empty(T * k, lt, device="cuda")
        keep, zx, actx = few_token_scratch(d, T, k, lt, ie, 1)
        V = {name: d.view(x) for name, x in (("idx", idx.reshape(-1)), ("off", offsets), ("srt", srt), ("z", z),
                                              ("y", y), *w.items())}
        d.launch("moe_sort_assignments", 1, 1024, V["idx"], T * k, E, V["off"], V["srt"])
        d.launch("mxfp4_experts_few_tokens_split_f32", (T, cdiv(lt, 128)), 32, V["z"], zx, T, lt, 1)
        nt, gx = few_token_ntiles(T, 1), min(E, T * k)
        up_b, down_b = touched * 2 * ie * (lt // 2 + lt // 32), touched * lt * (ie // 2 + ie // 32)
        ref = None
        for variant in variants:
            # -DMXF_STAGES=S probes another ring depth: shared memory for S stages, and a grid of
            # one block per SM where two no longer fit.
            stages = next((int(x.split("=")[1]) for x in variant if x.startswith("-DMXF_STAGES=")), None)
            defs = tuple(x for x in variant if not x.startswith("-DMXF_STAGES="))
            shared = few_token_shared(nt, stages)
            per_sm = 2 if shared <= FEW_TOKEN_BLOCK_BYTES else 1

            def up(defs=defs, shared=shared, per_sm=per_sm):
                d.launch("mxfp4_experts_few_tokens_up_f32", few_token_grid(gx, ie, FEW_TOKEN_UP_ROWS, per_sm), 256,
                         zx, V["w1p"], V["w1s"], V["w3p"], V["w3s"], V["off"], V["srt"], actx, k, lt, ie, 4.0, 25.0, 1, E,
                         nt, 1, shared_mem=shared, defines=defs)

            def down(defs=defs, shared=shared, per_sm=per_sm):
                d.launch("mxfp4_experts_few_tokens_down_f32", few_token_grid(gx, lt, FEW_TOKEN_DOWN_ROWS, per_sm), 256,
                         actx, V["w2p"], V["w2s"], V["off"], V["srt"], V["y"], lt, ie, E, nt, 1, shared_mem=shared,
                         defines=defs)
            try:
                same = ""
                if not any("MXF_DIAG" in x for x in defs):
                    keep[1].zero_()
                    y.fill_(float("nan"))
                    up()
                    down()
                    d.sync()
                    out = (keep[1].clone(), y.clone())
                    ref = out if ref is None else ref
                    same = bool(torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]))
                tag = " ".join(variant) or "base"
                for name, fn, b in (("up", up, up_b), ("down", down, down_b)):
                    ms, how = d.time_graph(fn)
                    record(f"moe_few_tokens_diag [{tag}] {name} T={T}", ms, b / (COPY_TBPS * 1e12) * 1e3, timing=how,
                           bitwise_equal_base=same)
            except Exception as e:  # noqa: BLE001
                log(f"bench moe_few_tokens_diag {defs} T={T} raised {type(e).__name__}: {str(e)[:200]}")


def bench_moe_prefill(d: Device, record, quick: bool):
    """Routed MoE of many-assignment steps (prefill chunks) at K3 shapes, top-16 of 128, random
    routing: the wgmma GEMMs (moe/wgmma.rs, hi / lo and bf16 activations) against the cuBLAS fallback (moe_gemm.rs:
    offsets read back, gather, experts expanded to bf16 in
    groups of 32, one cuBLAS GEMM per expert and projection, GLU, combine). Floor: the larger of
    the hi / lo products' FLOPs at this run's cuBLAS bf16 rate (an 8192^3 GEMM) and the weight +
    z + out bytes at 4.25 TB/s."""
    E, k, lt, ie = 128, 16, 3584, 3072
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device="cuda")  # noqa: E731
    sc = lambda *s: torch.randint(118, 124, s, dtype=torch.uint8, device="cuda")  # noqa: E731
    wt = (u8(E, ie, lt // 2), sc(E, ie, lt // 32), u8(E, ie, lt // 2), sc(E, ie, lt // 32), u8(E, lt, ie // 2),
          sc(E, lt, ie // 32))
    w = tuple(d.view(x) for x in wt)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = d.time_ms(lambda a=a: torch.mm(a, a), reps=10)
    rate = 2 * 8192 ** 3 / (ms * 1e-3)
    record("bf16 GEMM 8192^3 (torch, cuBLAS): the rate of the moe prefill floors", ms, tflops=round(rate / 1e12))
    del a
    for T in ([2048] if quick else [512, 2048]):
        n = T * k
        idx = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :k].int().contiguous()
        wts = torch.rand(T, k, device="cuda")
        z = torch.randn(T, lt, device="cuda")
        offsets = torch.empty(E + 1, dtype=torch.int32, device="cuda")
        srt = torch.empty(n, dtype=torch.int32, device="cuda")
        out_g, out_c = torch.empty(T, lt, device="cuda"), torch.empty(T, lt, device="cuda")
        V = {name: d.view(x) for name, x in (("idx", idx.reshape(-1)), ("off", offsets), ("srt", srt), ("z", z),
                                              ("wts", wts), ("out_g", out_g), ("out_c", out_c))}
        touched = int(idx.unique().numel())
        flops = 2 * n * 3 * ie * lt  # one pass of bf16 columns (hi / lo: twice this)
        wbytes = touched * (2 * ie * (lt // 2 + lt // 32) + lt * (ie // 2 + ie // 32))

        def sort():
            d.launch("moe_sort_assignments", 1, 1024, V["idx"], n, E, V["off"], V["srt"])

        # The wgmma GEMMs (moe/wgmma.rs) as the backend runs them: hi / lo
        # activations (float32 mode; its output is compared with the cuBLAS path below) and bf16
        # (bfloat16 mode, the default). Floor: the MMA work or the bytes, whichever is larger.
        ms_w = None
        for planes in (2, 1):
            try:
                scratch = mx_wg_scratch(d, T, k, lt, ie, planes)
                pf = planes * flops
                floor = max(pf / rate * 1e3, (wbytes + 2 * T * lt * 4) / (COPY_TBPS * 1e12) * 1e3)

                def wgr(parts=("split", "up", "down", "combine"), scratch=scratch, planes=planes):
                    run_mx_wg(d, V["z"], w, V["idx"], V["wts"], V["off"], V["srt"], V["out_g"], scratch, T, k, lt, ie,
                              E, planes, parts=parts)

                sort()
                ms, how = d.time_graph(lambda wgr=wgr: (sort(), wgr()), reps=5, inner=2)
                record(f"moe_routed wg planes={planes} T={T} top{k} (sort+split+up+down+combine)", ms, floor,
                       timing=how, tflops=round(flops / ms / 1e9), mma_tflops=round(pf / ms / 1e9))
                for name, parts, share in (("up", ("up",), 2 / 3), ("down", ("down",), 1 / 3)):
                    ms_p, how = d.time_graph(lambda parts=parts, wgr=wgr: wgr(parts), reps=5, inner=2)
                    record(f"moe_routed wg planes={planes} {name} alone T={T}", ms_p, share * pf / rate * 1e3,
                           timing=how, tflops=round(share * flops / ms_p / 1e9))
                if planes == 2:
                    ms_w = ms
                    wgr()  # out_g: the hi / lo result, for the cuBLAS comparison
                del scratch
            except Exception as e:  # noqa: BLE001
                log(f"bench moe wg planes={planes} T={T} raised {type(e).__name__}: {str(e)[:200]}")
        floor = max(2 * flops / rate * 1e3, (wbytes + 2 * T * lt * 4) / (COPY_TBPS * 1e12) * 1e3)
        try:
            ms_c = bench_moe_cublas_path(d, V, w, T, k, lt, ie, E)
            extra = {} if ms_w is None else dict(wg_speedup=round(ms_c / ms_w, 2),
                                                 wg_vs_gemm_rel=float(rel_err(out_g, out_c)))
            record(f"moe_routed cuBLAS GEMM path T={T} top{k} (sort+readback+gather+expand+GEMMs+glu+combine)",
                   ms_c, floor, **extra)
        except Exception as e:  # noqa: BLE001
            log(f"bench moe cuBLAS path T={T} raised {type(e).__name__}: {str(e)[:200]}")


# kernels/moe_wgmma.cu MXW_DIAG probes: what each part of the wgmma GEMMs costs (timing only).
MOE_WG_DIAG_VARIANTS = (("base", ()), ("no decode", ("-DMXW_DIAG=1",)), ("no mma", ("-DMXW_DIAG=2",)),
                        ("no token copies", ("-DMXW_DIAG=4",)), ("no weight copies", ("-DMXW_DIAG=8",)),
                        ("no copies", ("-DMXW_DIAG=12",)), ("copies and loop only", ("-DMXW_DIAG=3",)),
                        ("skeleton", ("-DMXW_DIAG=15",)), ("no epilogue", ("-DMXW_DIAG=16",)),
                        ("no situ", ("-DMXW_DIAG=32",)), ("k3_tanh situ", ("-DMXW_DIAG=64",)))


def bench_moe_wg_diag(d: Device, record):
    """The wgmma up and down GEMMs alone at T = 2048 (K3 shapes, top-16 of 128, random routing),
    bf16 activations (planes 1, the default) and hi / lo, under each MXW_DIAG probe: which part
    of the kernel holds it below the tensor rate. K3_MOE_WG_DIAG ("base;spread"): only the
    variants named; K3_MOE_WG_PLANES ("1"): only those planes."""
    pick = [x.strip() for x in os.environ.get("K3_MOE_WG_DIAG", "").split(";") if x.strip()]
    variants = [v for v in MOE_WG_DIAG_VARIANTS if not pick or v[0] in pick]
    planes_list = [int(x) for x in os.environ.get("K3_MOE_WG_PLANES", "1,2").split(",")]
    E, k, lt, ie, T = 128, 16, 3584, 3072, 2048
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device="cuda")  # noqa: E731
    sc = lambda *s: torch.randint(118, 124, s, dtype=torch.uint8, device="cuda")  # noqa: E731
    wt = (u8(E, ie, lt // 2), sc(E, ie, lt // 32), u8(E, ie, lt // 2), sc(E, ie, lt // 32), u8(E, lt, ie // 2),
          sc(E, lt, ie // 32))
    w = tuple(d.view(x) for x in wt)
    n = T * k
    idx = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :k].int().contiguous()
    offsets = torch.empty(E + 1, dtype=torch.int32, device="cuda")
    srt = torch.empty(n, dtype=torch.int32, device="cuda")
    d.launch("moe_sort_assignments", 1, 1024, d.view(idx.reshape(-1)), n, E, d.view(offsets), d.view(srt))
    flops = 2 * n * 3 * ie * lt
    for planes in planes_list:
        _, zx, actx, y = scratch = mx_wg_scratch(d, T, k, lt, ie, planes)
        tiles = mx_tile_bound(n, E, MX_WG_TOK)
        for tag, defs in variants:
            try:
                def up(defs=defs):
                    d.launch("mxfp4_experts_wgmma_up_f32", (cdiv(ie, MX_WG_UP_ROWS), tiles), 256, zx, *w[:4],
                             d.view(offsets), actx, n, lt, ie, 4.0, 25.0, 1, E, planes, shared_mem=MX_WG_SHARED,
                             defines=defs)

                def down(defs=defs):
                    d.launch("mxfp4_experts_wgmma_down_f32", (cdiv(lt, MX_WG_DOWN_ROWS), tiles), 256, actx, *w[4:],
                             d.view(offsets), d.view(srt), y, n, lt, ie, E, planes, shared_mem=MX_WG_SHARED,
                             defines=defs)

                for name, fn, share in (("up", up, 2 / 3), ("down", down, 1 / 3)):
                    ms, how = d.time_graph(fn, reps=5, inner=2)
                    record(f"moe_wg_diag [{tag}] planes={planes} {name} T={T}", ms, timing=how,
                           mma_tflops=round(planes * share * flops / ms / 1e9))
            except Exception as e:  # noqa: BLE001
                log(f"bench moe_wg_diag [{tag}] planes={planes} raised {type(e).__name__}: {str(e)[:200]}")
        del scratch


def bench_moe_cublas_path(d: Device, V, w, T, k, lt, ie, E):
    """moe_gemm.rs's launches and cuBLAS calls (cublasGemmEx bf16 x bf16 -> f32, as gemm_bf16) on
    V's z / idx / wts, result in V["out_c"]; returns ms per call (eager: the path syncs anyway)."""
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:
        from cupy.cuda import cublas
    n = T * k
    xs = torch.empty(2 * n, lt, dtype=torch.int16, device="cuda")
    inv = torch.empty(n, dtype=torch.int32, device="cuda")
    group = min(E, (2 << 30) // (2 * (2 * ie * lt + lt * ie)))
    w13 = torch.empty(group, 2 * ie, lt, dtype=torch.int16, device="cuda")
    w2b = torch.empty(group, lt, ie, dtype=torch.int16, device="cuda")
    h = torch.empty(2 * n, 2 * ie, device="cuda")
    act = torch.empty(2 * n, ie, dtype=torch.int16, device="cuda")
    y = torch.empty(2 * n, lt, device="cuda")
    u16 = lambda x: d.view(x).view(np.uint16)  # noqa: E731
    Vx = {"xs": u16(xs), "inv": d.view(inv), "w13": u16(w13), "w2b": u16(w2b), "h": d.view(h), "act": u16(act),
          "y": d.view(y)}
    handle = d.cp.cuda.device.get_cublas_handle()
    one, zero = np.array([1.0], np.float32), np.array([0.0], np.float32)

    def gemm(wb, w_off, x, x_off, c, c_off, nn, rows, kk):  # c[rows, nn] = x[rows, kk] . w[nn, kk]^T
        cublas.gemmEx(handle, 1, 0, nn, rows, kk, one.ctypes.data, wb.data_ptr() + 2 * w_off, 14, kk,
                      x.data_ptr() + 2 * x_off, 14, kk, zero.ctypes.data, c.data_ptr() + 4 * c_off, 0, nn, 68, -1)

    def expand(pk, scl, lst, count, rows, cols, out, stride, row0):
        x = max(1, min(cdiv(rows * cols // 32, 256), cdiv(2 * 132 * 8, count)))
        d.launch("mxfp4_to_bf16_experts", (x, count), 256, pk, scl, lst, count, rows, cols, out, stride, row0)

    def path():
        d.launch("moe_sort_assignments", 1, 1024, V["idx"], n, E, V["off"], V["srt"])
        off = d.cp.asnumpy(V["off"]).tolist()  # the path's one sync
        touched = [e for e in range(E) if off[e + 1] > off[e]]
        d.launch("moe_gather_split_bf16", n, 256, V["z"], V["srt"], V["off"], E, k, lt, Vx["xs"], Vx["inv"])
        for g0 in range(0, len(touched), group):
            chunk = touched[g0:g0 + group]
            lst = d.cp.asarray(np.array(chunk, np.int32))
            expand(w[0], w[1], lst, len(chunk), ie, lt, Vx["w13"], 2 * ie * lt, 0)
            expand(w[2], w[3], lst, len(chunk), ie, lt, Vx["w13"], 2 * ie * lt, ie)
            expand(w[4], w[5], lst, len(chunk), lt, ie, Vx["w2b"], lt * ie, 0)
            for gi, ex in enumerate(chunk):
                gemm(w13, gi * 2 * ie * lt, xs, 2 * off[ex] * lt, h, 2 * off[ex] * 2 * ie, 2 * ie,
                     2 * (off[ex + 1] - off[ex]), lt)
            p0, p1 = off[chunk[0]], off[chunk[-1] + 1]
            d.launch("moe_glu_split_bf16", (p1 - p0, cdiv(ie, 256)), 256, Vx["h"], V["off"], E, p0, p1, ie, 4.0,
                     25.0, 1, Vx["act"])
            for gi, ex in enumerate(chunk):
                gemm(w2b, gi * lt * ie, act, 2 * off[ex] * ie, y, 2 * off[ex] * lt, lt, 2 * (off[ex + 1] - off[ex]),
                     ie)
        d.launch("moe_combine_split_f32", T, 256, Vx["y"], Vx["inv"], V["off"], E, V["wts"], V["out_c"], k, lt)

    return d.time_ms(path, reps=5, warmup=1)


def bench_moe_single_token(d: Device, record):
    """Routed MoE at T = 1 (top-16 of 128, K3 expert sizes): the single-token pair (ops.rs default for
    1-token steps: up + down + combine, no sort) against the few-token pair (sort + split + up + down +
    combine: the fallback for experts too wide for the single-token pair) in the same run on the same buffers,
    with the two results compared (both carry ~16 bits of the activations); then each single-token
    kernel alone against its own weight bytes. Floor = weight bytes read / 4.25 TB/s."""
    E, k, lt, ie, T = 128, 16, 3584, 3072, 1
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device="cuda")  # noqa: E731
    sc = lambda *s: torch.randint(118, 124, s, dtype=torch.uint8, device="cuda")  # noqa: E731
    w1p, w3p, w2p = u8(E, ie, lt // 2), u8(E, ie, lt // 2), u8(E, lt, ie // 2)
    w1s, w3s, w2s = sc(E, ie, lt // 32), sc(E, ie, lt // 32), sc(E, lt, ie // 32)
    idx = torch.randperm(E, device="cuda")[:k].int()
    wts = torch.rand(T, k, device="cuda")
    z = torch.randn(T, lt, device="cuda")
    offsets = torch.empty(E + 1, dtype=torch.int32, device="cuda")
    srt = torch.empty(T * k, dtype=torch.int32, device="cuda")
    act = torch.empty(T * k, ie, device="cuda")
    y = torch.zeros(T * k, lt, device="cuda")
    res = torch.empty(T, lt, device="cuda")
    V = {n: d.view(x) for n, x in (("idx", idx), ("off", offsets), ("srt", srt), ("z", z), ("w1p", w1p), ("w1s", w1s),
                                    ("w3p", w3p), ("w3s", w3s), ("w2p", w2p), ("w2s", w2s), ("act", act), ("y", y),
                                    ("wts", wts), ("res", res))}
    up_b, down_b = k * 2 * ie * (lt // 2 + lt // 32), k * lt * (ie // 2 + ie // 32)
    floor = lambda b: b / (COPY_TBPS * 1e12) * 1e3  # noqa: E731
    g_up = (V["z"], V["w1p"], V["w1s"], V["w3p"], V["w3s"], V["off"], V["srt"], V["act"], k, lt, ie, 4.0, 25.0, 1, E)
    g_down = (V["act"], V["w2p"], V["w2s"], V["off"], V["srt"], V["y"], lt, ie, E)
    try:
        scratch = few_token_scratch(d, T, k, lt, ie)

        def few_tokens():
            d.launch("moe_sort_assignments", 1, 1024, V["idx"], T * k, E, V["off"], V["srt"])
            run_few_tokens(d, min(E, T * k), g_up, g_down, T, lt, ie, scratch=scratch)
            d.launch("moe_combine_f32", cdiv(T * lt, 256), 256, V["y"], V["wts"], V["res"], T, k, lt)
        few_tokens()
        d.sync()
        ref = res.clone()
        few_ms, _ = d.time_graph(few_tokens)
        w6 = tuple(V[n] for n in ("w1p", "w1s", "w3p", "w3s", "w2p", "w2s"))
        bench_moe_single_token_kernels(d, record, V, w6, ref, few_ms, floor(up_b), floor(down_b), E, k, lt, ie, T)
    except Exception as e:  # noqa: BLE001  a failure here must not cost the benchmarks after it
        log(f"bench moe single-token raised {type(e).__name__}: {str(e)[:200]}")
    del w1p, w3p, w2p, w1s, w3s, w2s


def bench_moe_single_token_kernels(d: Device, record, V, w6, ref_few, few_ms, up_floor, down_floor, E, k, lt, ie, T):
    """The single-token pair (cp.async rings, the combine folded into the down kernel) on
    bench_moe_single_token's buffers, compared with the few-token pair's result and time at the same step
    (both hi + lo bf16: they differ by summation order only); then each
    kernel alone. "down alone" zeroes the 2 KB of counters first (the up kernel does it in the
    pair), so it includes one small memset."""
    na = T * k
    (gup, pup), (gdn, pdn) = single_token_plan(na, ie, lt, False), single_token_plan(na, lt, ie, True)
    ngu, nyp, nsy = single_token_scratch(T, k, lt, ie)
    gu, yp = torch.empty(ngu, device="cuda"), torch.empty(nyp, device="cuda")
    sync = torch.empty(nsy, dtype=torch.int32, device="cuda")
    res = torch.empty(T, lt, device="cuda")
    W = {n: d.view(x) for n, x in (("gu", gu), ("yp", yp), ("sync", sync), ("res", res))}
    for tag in ("single-token",):

        def s3(what=("up", "down")):
            run_single_token(d, V["z"], w6, V["idx"], W["gu"], W["yp"], W["sync"], V["wts"], W["res"], T, k, lt,
                             ie, E, what=what)
        try:
            s3()
            d.sync()
            rel = rel_err(res, ref_few)
            ms, how = d.time_graph(s3)
            record(f"moe_routed {tag} T={T} top{k} (up+down, combine folded)", ms, up_floor + down_floor,
                   few_us=f"{few_ms * 1e3:.1f}", speedup_vs_few=f"{few_ms / ms:.2f}x", rel_vs_few=f"{rel:.1e}",
                   timing=how, grid=f"{gup}/{gdn}", parts=f"{pup}/{pdn}")
            ms, how = d.time_graph(lambda: s3(("up",)))
            record(f"moe {tag} up kernel alone T={T} top{k}", ms, up_floor, timing=how)
            ms, how = d.time_graph(lambda: (sync.zero_(), s3(("down",))))
            record(f"moe {tag} down kernel alone (+ counter memset) T={T} top{k}", ms, down_floor, timing=how)
        except Exception as e:  # noqa: BLE001  a failure here must not cost the benchmarks after it
            log(f"bench moe {tag} raised {type(e).__name__}: {str(e)[:200]}")
