"""Helpers shared by the harness modules (device.py, the checks, emulators.py, the benchmarks): the
log, the error and grid arithmetic, the KDA state-arena layout with its float64 reference, the KDA
prefill launch sequence and the expanded MLA prefill with its cuBLAS calls (the packing and
launches the Rust backend does). It imports none of them, so each can import it."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "reference"))
from k3ref import kda as rk  # noqa: E402

if TYPE_CHECKING:
    from device import Device


def event_times_ms(fn, reps: int) -> list[float]:
    """`reps` CUDA-event timings (ms) of one `fn()` each, each waited for before the next; the caller
    warms up first and takes the median (Device.time_ms) or the best (scripts/hbm_rate.py)."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return times


# docs/performance.md, "How to measure": device-to-device copy, bytes read + written. Every floor is (bytes read + bytes
# written) / COPY_TBPS: a read-only kernel moves only its reads, so its floor is reads / 4.25 TB/s.
COPY_TBPS = 4.25


# The few-token pair, from 2 tokens (kernels/moe_few_tokens.cu mxfp4_experts_few_tokens_*_f32; moe/mod.rs
# few_token_*): z split into `planes` bf16 rows (1: bf16, the bfloat16 mode; 2: hi / lo, float32 mode;
# mxfp4_experts_few_tokens_split_f32, grid (T, super-steps), 32 threads), up tiles of 128 rows (one
# super-step of the split intermediate actx), down tiles of 256 rows, up to 4 n-tiles of 8 columns per
# pass, a cp.async ring of as many stages as the opt-in shared memory holds (moe/mod.rs
# FEW_TOKEN_STAGES: 3), a persistent grid of at most two blocks per SM walking the tiles.
FEW_TOKEN_UP_ROWS, FEW_TOKEN_DOWN_ROWS, FEW_TOKEN_STAGES = 128, 256, 3
SMS = 132  # the H200's SM count: the backend reads it from the device
# Dynamic shared memory per block that leaves two blocks on an H200 SM: (227 KB + 1 KB) / 2 less the
# kernels' 4,320 B of static shared memory and 1 KB reserved per block.
FEW_TOKEN_BLOCK_BYTES = (232_448 + 1024) // 2 - 4_352 - 1024


def few_token_ntiles(max_tokens_per_expert: int, planes: int = 2) -> int:
    return max(1, min(cdiv(max_tokens_per_expert * planes, 8), 4))


def few_token_stage_bytes(ntiles: int) -> int:
    return 256 * 64 + 256 * 4 + ntiles * 8 * 272


def few_token_shared(ntiles: int, stages: int | None = None) -> int:
    """moe/mod.rs few_token_shared: `stages` ring slots (the backend's 3 if None; probes may set others)."""
    return (stages or FEW_TOKEN_STAGES) * few_token_stage_bytes(ntiles)


def few_token_grid(busy: int, rows: int, rows_per_block: int, per_sm: int = 2, sms: int = SMS) -> int:
    """moe/mod.rs few_token_launch: one block per tile, at most `per_sm` (two) per SM."""
    return max(1, min(busy * cdiv(rows, rows_per_block), per_sm * sms))


def few_token_row_u16(cols: int, planes: int = 2) -> int:
    return cdiv(cols, 128) * 128 * planes


def few_token_scratch(d: Device, t: int, k: int, lt: int, ie: int, planes: int = 2):
    """Split z and split intermediate buffers of the few-token pair: (tensors to keep alive, zx view, actx
    view); made outside any graph capture (views sync)."""
    zx = torch.zeros(t * few_token_row_u16(lt, planes), dtype=torch.int16, device=d.tdev)
    actx = torch.zeros(t * k * few_token_row_u16(ie, planes), dtype=torch.int16, device=d.tdev)
    return (zx, actx), d.view(zx).view(np.uint16), d.view(actx).view(np.uint16)


def run_few_tokens(d: Device, gx, up_args, down_args, t, lt, ie, stage=None, scratch=None, blocks=None, planes=2,
                   stages=None):
    """The few-token pair's launches (split z, up, down) over gx busy experts, as moe/mod.rs moe_routed makes
    them. up_args = (z, w1p, w1s, w3p, w3s, offsets, sorted, act, top_k, lt, ie, beta, beta_lin,
    has_lin, E), down_args = (act, w2p, w2s, offsets, sorted, y, lt, ie, E): z / act stand for the
    split buffers from `scratch` (an few_token_scratch of the same planes, made here if None); `stage`
    (tokens per pass, rounded up to n-tiles of 8 columns) defaults to the backend's choice for a step of
    t tokens; `blocks` replaces the persistent grid's size (both kernels); `planes` 1 (bfloat16 mode)
    or 2 (float32 mode); `stages` the ring's depth (the backend's choice if None)."""
    nt = few_token_ntiles(stage or t, planes)
    if scratch is None:
        scratch = few_token_scratch(d, t, up_args[8], lt, ie, planes)
    _, zx, actx = scratch
    shared = few_token_shared(nt, stages)
    d.launch("mxfp4_experts_few_tokens_split_f32", (t, cdiv(lt, 128)), 32, up_args[0], zx, t, lt, planes)
    d.launch("mxfp4_experts_few_tokens_up_f32", blocks or few_token_grid(gx, ie, FEW_TOKEN_UP_ROWS), 256, zx,
             *up_args[1:7], actx, *up_args[8:], nt, planes, shared_mem=shared)
    d.launch("mxfp4_experts_few_tokens_down_f32", blocks or few_token_grid(gx, lt, FEW_TOKEN_DOWN_ROWS), 256, actx,
             *down_args[1:], nt, planes, shared_mem=shared)


# The MXFP8 pair (CudaOptions dtype mxfp8; kernels/moe_few_tokens.cu *_e4m3): z and the intermediate quantized by
# mxfp8_quantize_f32 into e4m3 rows of 128 bytes per super-step and 4 f32 block factors, staged rows of 160 bytes.
def few_token_stage_bytes_e4m3(ntiles: int) -> int:
    return 256 * 64 + 256 * 4 + ntiles * 8 * 160


def few_token_scratch_e4m3(d: Device, t: int, k: int, lt: int, ie: int):
    """Quantized z (bytes, factors), the up kernel's f32 intermediate and its quantized form: (tensors to keep
    alive, zq, zf, act, aq, af views); made outside any graph capture."""
    zq = torch.zeros(t * cdiv(lt, 128) * 128, dtype=torch.uint8, device=d.tdev)
    zf = torch.zeros(t * cdiv(lt, 128) * 4, dtype=torch.float32, device=d.tdev)
    act = torch.zeros(t * k * ie, dtype=torch.float32, device=d.tdev)
    aq = torch.zeros(t * k * cdiv(ie, 128) * 128, dtype=torch.uint8, device=d.tdev)
    af = torch.zeros(t * k * cdiv(ie, 128) * 4, dtype=torch.float32, device=d.tdev)
    keep = (zq, zf, act, aq, af)
    return keep, *(d.view(x) for x in keep)


def run_few_tokens_e4m3(d: Device, gx, up_args, down_args, t, k, lt, ie, scratch=None, blocks=None, stages=None):
    """The MXFP8 pair's launches (quantize z, up, quantize the intermediate, down) as moe/mod.rs makes them in
    mxfp8 mode; up_args / down_args as run_few_tokens' (their act stands for the scratch's)."""
    nt = few_token_ntiles(t, 1)
    if scratch is None:
        scratch = few_token_scratch_e4m3(d, t, k, lt, ie)
    _, zq, zf, act, aq, af = scratch
    shared = (stages or FEW_TOKEN_STAGES) * few_token_stage_bytes_e4m3(nt)
    d.launch("mxfp8_quantize_f32", (t, cdiv(lt, 128)), 32, up_args[0], zq, zf, t, lt)
    d.launch("mxfp4_experts_few_tokens_up_e4m3", blocks or few_token_grid(gx, ie, FEW_TOKEN_UP_ROWS), 256, zq, zf,
             *up_args[1:7], act, *up_args[8:], nt, shared_mem=shared)
    d.launch("mxfp8_quantize_f32", (t * k, cdiv(ie, 128)), 32, act, aq, af, t * k, ie)
    d.launch("mxfp4_experts_few_tokens_down_e4m3", blocks or few_token_grid(gx, lt, FEW_TOKEN_DOWN_ROWS), 256, aq, af,
             *down_args[1:], nt, shared_mem=shared)


def mx_tile_bound(n_assign: int, experts: int, tok: int) -> int:
    """moe_sorted.rs tile_bound: grid.y of the wgmma GEMMs."""
    return cdiv(n_assign, tok) + min(experts, n_assign)


def _expert_scratch(d: Device, t: int, k: int, lt: int, zx_row: int, actx_row: int):
    """Split z ([t, zx_row] u16), split intermediate ([t k, actx_row] u16) and y ([t k, lt] f32):
    (tensors to keep alive, zx, actx, y views); made outside any graph capture (views sync)."""
    zx = torch.zeros(t * zx_row, dtype=torch.int16, device=d.tdev)
    actx = torch.zeros(t * k * actx_row, dtype=torch.int16, device=d.tdev)
    y = torch.zeros(t * k, lt, device=d.tdev)
    return (zx, actx, y), d.view(zx).view(np.uint16), d.view(actx).view(np.uint16), d.view(y)


# The wgmma expert GEMMs (kernels/moe_wgmma.cu, sm_90a; moe/wgmma.rs):
# tiles of up to 128 sorted assignments of one expert, 256-thread blocks of 128 intermediate rows
# (up) / 256 latent rows (down), grid.y an upper bound on the tiles, one block per SM; activations
# chunk-major ([64-column groups][8 planes chunks][rows][8] bf16; planes 2 = hi / lo, 1 = bf16),
# one row per sorted position: the split gathers z's rows into sorted order.
MX_WG_TOK, MX_WG_UP_ROWS, MX_WG_DOWN_ROWS, MX_WG_SHARED = 128, 128, 256, 209920
MX_WG_SWAP_LBO_SBO = 16  # mode bit of the GEMMs: the B descriptor's LBO / SBO swapped (a diagnostic)


def mx_wg_row_u16(cols: int, planes: int) -> int:
    return cdiv(cols, 64) * 64 * planes


def mx_wg_scratch(d: Device, t: int, k: int, lt: int, ie: int, planes: int = 2):
    """The wgmma path's work buffers (_expert_scratch): zx and actx both t k rows."""
    return _expert_scratch(d, t, k, lt, k * mx_wg_row_u16(lt, planes), mx_wg_row_u16(ie, planes))


def run_mx_wg(d: Device, z, w, idx, wts, offsets, sorted_, out, scratch, t, k, lt, ie, e, planes=2,
              situ=(4.0, 25.0, 1), parts=("split", "up", "down", "combine"), mode_bits=0):
    """moe/wgmma.rs after the sort: split z, up, down, combine (views; w = (w1p, w1s, w3p, w3s, w2p,
    w2s); scratch from mx_wg_scratch).
    mode_bits: further bits of the GEMMs' mode (MX_WG_SWAP_LBO_SBO)."""
    _, zx, actx, y = scratch
    n = t * k
    tiles = mx_tile_bound(n, e, MX_WG_TOK)
    if "split" in parts:
        d.launch("mxfp4_experts_wgmma_split_f32", (cdiv(n, 8), cdiv(lt, 64)), 64, z, sorted_, offsets, zx, n, lt, k, e,
                 planes)
    if "up" in parts:
        d.launch("mxfp4_experts_wgmma_up_f32", (cdiv(ie, MX_WG_UP_ROWS), tiles), 256, zx, *w[:4], offsets, actx, n, lt,
                 ie, *situ, e, planes | mode_bits, shared_mem=MX_WG_SHARED)
    if "down" in parts:
        d.launch("mxfp4_experts_wgmma_down_f32", (cdiv(lt, MX_WG_DOWN_ROWS), tiles), 256, actx, *w[4:], offsets, sorted_, y,
                 n, lt, ie, e, planes | mode_bits, shared_mem=MX_WG_SHARED)
    if "combine" in parts:
        d.launch("moe_combine_ids_f32", min(cdiv(t * lt, 256), 132 * 32), 256, y, idx, wts, out, t, k, lt, e)


# The single-token pair (kernels/moe_single_token.cu; moe/single_token.rs single_token_plan):
# one 512-thread block per SM, a cp.async ring per warp, two 16-row sets per step (up: W1 and W3
# of a tile; down: two tiles, so 32-row groups whose consecutive parts on a warp merge into one
# run) and the combine folded into the down kernel. Widths: multiples of 128.
SINGLE_TOKEN_SHARED = 65536 + 17 * 4 * 2176


def single_token_plan(n_assign: int, rows: int, cols: int, down: bool, sms: int = 132) -> tuple[int, int]:
    """(blocks, parts) as moe/single_token.rs single_token_plan: one block of 16 warps per SM (fewer: >= 8
    steps per warp), parts (<= 8, <= steps per row) minimising the busiest warp's units times their
    cost (up: 2 per step + 1, down: 4 per step + 1: its runs merge)."""
    steps, groups = cols // 128, rows // (32 if down else 16)
    grid = max(1, min(sms, cdiv(n_assign * groups * steps, 16 * 8)))
    per = 4 if down else 2
    costs = [(cdiv(n_assign * groups * p, 16 * grid) * (per * cdiv(steps, p) + 1), p)
             for p in range(1, min(steps, 8) + 1)]
    return grid, min(costs)[1]


def single_token_scratch(t: int, k: int, lt: int, ie: int, parts=None) -> tuple[int, int, int]:
    """Floats of gu and yp, ints of the down kernel's counters and part masks (sync)."""
    na = t * k
    pup, pdn = parts or (single_token_plan(na, ie, lt, False)[1], single_token_plan(na, lt, ie, True)[1])
    return na * pup * 2 * ie, na * pdn * lt, (t + na) * (lt // 32)


def run_single_token(d: Device, z, w, idx, gu, yp, sync, wts, out, t, k, lt, ie, e, situ=(4.0, 25.0, 1),
                     grid=None, parts=None, what=("up", "down")):
    """moe/single_token.rs moe_experts_single_token's launches (views; w = (w1p, w1s, w3p, w3s, w2p, w2s)).
    `grid` / `parts` = (up, down) overrides (any values are valid: the checks move unit bounds).
    The up kernel zeroes `sync`; "down" alone needs it zeroed by the caller."""
    na = t * k
    (gup, pup), (gdn, pdn) = single_token_plan(na, ie, lt, False), single_token_plan(na, lt, ie, True)
    gup, gdn = grid or (gup, gdn)
    pup, pdn = parts or (pup, pdn)
    if "up" in what:
        d.launch("mxfp4_experts_single_token_up_f32", gup, 512, z, *w[:4], idx, gu, sync, (t + na) * (lt // 32), k, lt, ie,
                 e, na, pup, shared_mem=SINGLE_TOKEN_SHARED)
    if "down" in what:
        d.launch("mxfp4_experts_single_token_down_f32", gdn, 512, gu, *w[4:], idx, wts, yp, sync, out, k, lt, ie, *situ, e,
                 na, pup, pdn, shared_mem=SINGLE_TOKEN_SHARED)


# Dense bf16-weight decode products (kernels/bf16.cu gemv_bf16_tc_f32; dense/mod.rs gemv_tc_plan):
# 128 weight rows per 128-thread block, K slices a multiple of 64 columns and >= 128 long, as many
# splits as fit the row blocks into one wave of 4 blocks per SM.
GEMV_TC_ROWS = 128
GEMV_TC_MIN_SLICE = 128  # dense/mod.rs


def gemv_tc_plan(n: int, k: int, sms: int = 132) -> tuple[int, int]:
    want = max(1, min((max(1, sms) * 4) // cdiv(n, GEMV_TC_ROWS), max(1, cdiv(k, GEMV_TC_MIN_SLICE))))
    kslice = cdiv(cdiv(k, want), 64) * 64
    return cdiv(k, kslice), kslice


_GEMV_TICKETS = {}


def gemv_tickets(d: Device, row_blocks: int):
    """gemv_bf16_tc_f32's tickets (device.rs gemv_tickets): zeros, put back to 0 by every launch,
    so one buffer per device serves every call."""
    t = _GEMV_TICKETS.get(id(d))
    if t is None or t.numel() < row_blocks:
        t = torch.zeros(max(row_blocks, 132 * 4), dtype=torch.int32, device=d.tdev)
        _GEMV_TICKETS[id(d)] = t
    return d.view(t)


def run_gemv_tc(d: Device, x, wbits, y, m: int, n: int, k: int, part, plan=None, pieces=3, defines=()):
    """dense/mod.rs matmul_linear's decode path: one launch, whose last block per row block sums the
    K-split partials when there is more than one. x [m, k] f32, wbits [n, k] bf16 bits (u16 view),
    y [m, n], part: a view of >= splits * m * n floats (the caller keeps it alive until the launch
    finishes); `pieces` 3 (x in three bf16 pieces: float32 mode) or 1 (x rounded once: bfloat16
    mode); `defines`: a harness probe's compile-time overrides (bench_gemv)."""
    splits, kslice = plan or gemv_tc_plan(n, k)
    blocks = cdiv(n, GEMV_TC_ROWS)
    d.launch("gemv_bf16_tc_f32", (blocks, splits), 128, x, wbits, y if splits == 1 else part, y,
             gemv_tickets(d, blocks), m, n, k, kslice, pieces, defines=defines)


LOG: list[str] = []


def log(msg: str):
    print(msg, flush=True)
    LOG.append(msg)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


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


# Decode kernels (same arguments): variant -> (name, grid for (heads, seqs), block). One left
# (ops.rs KDA_DECODE_KERNEL: a cluster of 4 column-slice blocks per head); the first is the default.
KDA_DECODE_KERNELS = {"lines": ("kda_decode_lines_f32", lambda h, n: (4 * h, n), 128)}
KDA_DECODE_VARIANTS = list(KDA_DECODE_KERNELS)


def kda_decode_launcher(d: Device, variant, heads, n, args):
    """A closure that runs decode `variant` with the kernels' argument list `args`."""
    name, grid, block = KDA_DECODE_KERNELS[variant]
    return lambda: d.launch(name, grid(heads, n), block, *args)


# Chunk kernels of the prefill (same arguments): name -> grid for `heads`. "f32" is the one-pass path
# (kernels/kda_chunk.cu; kda/mod.rs: every conv > 4).
KDA_CHUNK_KERNELS = {"f32": ("kda_chunk_fwd_f32", lambda h: (h, 4))}
# The two-pass path (kernels/kda_prefill_scan.cu, kda/mod.rs for conv <= 4): the
# record pass (conv + prep + chunk algebra, grid (ceil(chunks / KDA_REC_NCH), heads), 128 threads) then
# the key-split scan, grid (4, heads), 128 threads (kda/mod.rs kda_rec_launch / KDA_REC_KERNEL /
# kda_scan_launch).
KDA_SCAN_KERNELS = {"two-pass": ("kda_prefill_record_f32", "kda_prefill_scan_f32")}
KDA_SCAN_THREADS = {"kda_prefill_scan_f32": 128}
KDA_REC_NCH = 8  # kda/mod.rs KDA_REC_NCH; kernels/kda_prefill_scan.cu KDA_REC_NCH
KDA_CHUNK_KERNELS.update({k: (v[1], lambda h: (4, h)) for k, v in KDA_SCAN_KERNELS.items()})
# Tolerance of each against the float64 reference (and against the f32 kernel at K3 shapes): the
# scans' 3xTF32 keeps f32 accuracy.
KDA_CHUNK_TOL = {"f32": 1e-4, "two-pass": 1e-4}
KDA_REC_FLOATS = 8576  # one (chunk, head) record; kda/mod.rs KDA_REC_FLOATS
KDA_SCAN_SEG = 8192  # tokens per rec + scan segment; kda/mod.rs KDA_SCAN_SEG


# Conv + prep of the one-pass f32 prefill: kda_conv_silu_f32 + kda_prep_f32 (the only form).
KDA_PREP = "split"


def run_kda_prefill(d: Device, t, heads, conv, lb, A, off, ck_n, ck_off, xq, xk, xv, f, b, convw, a_log, dt_bias,
                    chunk="f32", prep=KDA_PREP, seg=KDA_SCAN_SEG):
    """Launch the prefill kernels; returns (o, launch closure) with device tensors as given. The closure
    has .chunk_only (the chunk / scan kernel alone, inputs from a previous go()) and .prep_only (the
    conv + prep part alone: conv_silu + prep, or the record pass)."""
    if chunk in KDA_SCAN_KERNELS and conv <= 4:
        return _run_kda_scan(d, t, heads, conv, lb, A, off, ck_n, ck_off, xq, xk, xv, f, b, convw, a_log, dt_bias,
                             KDA_SCAN_KERNELS[chunk], seg)
    chunk_name, chunk_grid = KDA_CHUNK_KERNELS[chunk]
    assert prep == "split", prep
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
        fg.copy_(f0)  # the prep kernel writes g over f
        d.launch("kda_conv_silu_f32", cdiv(3 * hk, 256), 256, *v, d.view(qo), d.view(ko), d.view(vo), d.view(A), off,
                 d.view(cn), d.view(co), len(ck_n), t, hk, conv)
        d.launch("kda_prep_f32", cdiv(t * heads, 4), 128, d.view(qo), d.view(ko), d.view(fg), bv, d.view(beta), al, dtb,
                 t, heads, lb)
        chunk_only()

    def chunk_only():  # the chunk kernel alone (inputs from a previous go())
        d.launch(chunk_name, chunk_grid(heads), 128, d.view(qo), d.view(ko), d.view(vo), d.view(fg), d.view(beta),
                 d.view(A), off, d.view(cn), d.view(co), len(ck_n), d.view(o), t, heads, conv)

    def prep_only():
        fg.copy_(f0)
        d.launch("kda_conv_silu_f32", cdiv(3 * hk, 256), 256, *v, d.view(qo), d.view(ko), d.view(vo), d.view(A), off,
                 d.view(cn), d.view(co), len(ck_n), t, hk, conv)
        d.launch("kda_prep_f32", cdiv(t * heads, 4), 128, d.view(qo), d.view(ko), d.view(fg), bv, d.view(beta), al, dtb,
                 t, heads, lb)
    go.chunk_only, go.prep_only = chunk_only, prep_only
    return o, go


def _run_kda_scan(d: Device, t, heads, conv, lb, A, off, ck_n, ck_off, xq, xk, xv, f, b, convw, a_log, dt_bias, kernels,
                  seg):
    """ops.rs kda_prefill's default path: per segment of `seg` tokens, the record pass then the scan
    (`kernels` = their names)."""
    rec_fn, scan = kernels
    dev = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
    o = torch.empty(t, heads * 128, device=d.tdev)
    rec = torch.empty(cdiv(min(t, seg), 16) * heads * KDA_REC_FLOATS, device=d.tdev)
    cn = torch.tensor(ck_n or [0], dtype=torch.int32).to(d.tdev)
    co = torch.tensor(ck_off or [0], dtype=torch.int64).to(d.tdev)
    ins = [d.view(dev(x)) for x in (xq, xk, xv, f, b)] + [d.view(dev(w)) for w in convw]
    al, dtb = d.view(dev(a_log)), d.view(dev(dt_bias))
    segs = [(t0, min(t, t0 + seg)) for t0 in range(0, t, seg)]

    def rec_pass(t0, t1):
        d.launch(rec_fn, (cdiv(t1 - t0, 16 * KDA_REC_NCH), heads), 128, *ins, al, dtb, d.view(rec),
                 d.view(A), off, d.view(cn), d.view(co), len(ck_n), t0, t1, heads, conv, lb)

    def scan_pass(t0, t1):
        d.launch(scan, (4, heads), KDA_SCAN_THREADS[scan], d.view(rec), d.view(A), off, d.view(cn), d.view(co), len(ck_n), d.view(o),
                 ins[3], al, dtb, lb, t0, t1, heads, conv)

    def go():
        for t0, t1 in segs:
            rec_pass(t0, t1)
            scan_pass(t0, t1)
    # Alone (inputs from a previous go(); the last segment's records): per-kernel timings.
    go.prep_only = lambda: [rec_pass(*s) for s in segs[-1:]]
    go.chunk_only = lambda: [scan_pass(*s) for s in segs[-1:]]
    return o, go


# ---------------------------------------------------------------------------------------------
# Expanded MLA prefill (host/backend-cuda/src/mla_prefill.rs): its plan, its cuBLAS calls and its
# launch sequence, so the device check and the benchmark run exactly what the backend runs.

MLA_PREFILL_Q_CHUNK, MLA_PREFILL_MIN_Q_CHUNK = 512, 16
MLA_PREFILL_SCRATCH_BYTES = 2 << 30


def mla_prefill_plan(heads, nope, rope, v_dim, kv_lora, t, length, budget=MLA_PREFILL_SCRATCH_BYTES):
    """mla_prefill::plan: (head_group, q_chunk) within `budget` bytes of scratch."""
    heads, length = max(heads, 1), max(length, 1)
    avail = max(0, budget // 4 - length * kv_lora)
    kv = nope + rope + v_dim
    q_chunk = min(max(t, 1), MLA_PREFILL_Q_CHUNK)
    if avail < length * (kv + q_chunk):
        q_chunk = min(max(max(0, avail // length - kv), min(MLA_PREFILL_MIN_Q_CHUNK, q_chunk)), q_chunk)
    fit = min(max(avail // (length * (kv + q_chunk)), 1), heads)
    return cdiv(heads, cdiv(heads, fit)), q_chunk


_CUBLAS: dict = {}


def _cupy_cublas():
    """CuPy's cuBLAS bindings (the module moved between CuPy versions), or None."""
    if "mod" not in _CUBLAS:
        mod = None
        for name in ("cupy_backends.cuda.libs.cublas", "cupy.cuda.cublas"):
            try:
                mod = __import__(name, fromlist=["sgemmStridedBatched"])
                break
            except ImportError:
                continue
        _CUBLAS["mod"] = mod
        log(f"sgemm_sb: {'cuBLAS through ' + mod.__name__ if mod else 'torch.bmm (no CuPy cuBLAS)'}")
    return _CUBLAS["mod"]


def sgemm_sb(d: Device, ta, tb, m, n, k, alpha, a, b, c, lda, ldb, ldc, sa, sb, sc, batch):
    """cublasSgemmStridedBatched (column-major, beta = 0) as mla_prefill.rs calls it: for each batch
    i, C_i = alpha op(A_i) op(B_i) with X_i at X's float offset + i * stride. a, b, c: (flat float32
    tensor, float offset). The extents are checked as Sgemm::check does. Dry run: float64 on the
    host; on the GPU: cuBLAS through CuPy (torch.bmm over the same strided views if unavailable)."""
    (A, ao), (B, bo), (C, co) = a, b, c
    ar, ac = (k, m) if ta else (m, k)
    br, bc = (n, k) if tb else (k, n)
    for what, t, off, rows, cols, ld, st in (("A", A, ao, ar, ac, lda, sa), ("B", B, bo, br, bc, ldb, sb),
                                             ("C", C, co, m, n, ldc, sc)):
        end = off + (cols - 1) * ld + rows + (batch - 1) * st
        if ld < max(rows, 1) or end > t.numel():
            raise ValueError(f"sgemm {what}: {rows}x{cols} ld {ld} stride {st} x{batch} at {off} in {t.numel()}")
    cb = None if d.dry or int(d.cp.__version__.split(".")[0]) < 9 else _cupy_cublas()  # < 9: alpha by value
    if cb is not None:
        h = d.cp.cuda.device.get_cublas_handle()
        al, be = np.array([alpha], np.float32), np.array([0.0], np.float32)
        ptr = lambda t, off: t.data_ptr() + 4 * off  # noqa: E731
        cb.sgemmStridedBatched(h, int(ta), int(tb), m, n, k, al.ctypes.data, ptr(A, ao), lda, sa, ptr(B, bo), ldb, sb,
                               be.ctypes.data, ptr(C, co), ldc, sc, batch)
        return
    dt = torch.float64 if d.dry else torch.float32

    def view(t, off, rows, cols, ld, st):  # column-major rows x cols per batch
        return t.as_strided((batch, rows, cols), (st, 1, ld), t.storage_offset() + off)
    opa, opb = view(A, ao, ar, ac, lda, sa).to(dt), view(B, bo, br, bc, ldb, sb).to(dt)
    opa, opb = opa.transpose(1, 2) if ta else opa, opb.transpose(1, 2) if tb else opb
    view(C, co, m, n, ldc, sc).copy_((alpha * torch.bmm(opa, opb)).float())


def run_mla_prefill(d: Device, A, page_start, q, kvb, o, row0, t, start, heads, nope, rope, v_dim, kv_lora, pt,
                    plan=None, flash=False):
    """The expanded prefill of one sequence (mla_prefill.rs mla_prefill_expanded): rows row0..row0+t of
    q [*, H*(nope+rope)] -> the same rows of o [*, H*v_dim], keys 0..start+t read from the pages of
    arena A (page_start: int64 float offsets, layer offset included). Allocates the scratch; returns
    go() (every launch and GEMM) and the plan (head_group, q_chunk). flash: the bf16 mode's attention,
    mla_prefill_flash_bf16, in place of the QK / softmax / PV chunks."""
    qk, length = nope + rope, start + t
    hg, qc = plan or mla_prefill_plan(heads, nope, rope, v_dim, kv_lora, t, length)
    new = lambda n: torch.empty(n, device=d.tdev)  # noqa: E731  fully written before read, as in Rust
    lat, kb, vb, sb = new(length * kv_lora), new(hg * length * qk), new(hg * length * v_dim), new(hg * qc * length)
    va, vps, vlat, vkb, vsb = d.view(A), d.view(page_start), d.view(lat), d.view(kb), d.view(sb)
    u16 = lambda n: torch.empty(n, dtype=torch.int16, device=d.tdev)  # noqa: E731  bf16 bits
    k16, v16 = (u16(hg * length * qk), u16(hg * length * v_dim)) if flash else (None, None)
    hw = (nope + v_dim) * kv_lora

    def go():
        d.launch("mla_prefill_gather_f32", length, 128, va, vps, vlat, vkb, length, hg, kv_lora, rope, qk, pt)
        for h0 in range(0, heads, hg):
            hn = min(hg, heads - h0)
            # K_nope,h into K's first nope columns (ldc = qk); V_h; lat shared (stride 0).
            sgemm_sb(d, 1, 0, nope, length, kv_lora, 1.0, (kvb, h0 * hw), (lat, 0), (kb, 0), kv_lora, kv_lora, qk,
                     hw, 0, length * qk, hn)
            sgemm_sb(d, 1, 0, v_dim, length, kv_lora, 1.0, (kvb, h0 * hw + nope * kv_lora), (lat, 0), (vb, 0), kv_lora,
                     kv_lora, v_dim, hw, 0, length * v_dim, hn)
            if flash:
                for src, dst, n in ((kb, k16, hn * length * qk), (vb, v16, hn * length * v_dim)):
                    d.launch("bf16_split_rows_f32", cdiv(n, 256), 256, d.view(src), d.view(dst).view(np.uint16), n, 1)
                d.launch("mla_prefill_flash_bf16", (cdiv(t, 64), hn), 128, d.view(q), d.view(k16).view(np.uint16),
                         d.view(v16).view(np.uint16),
                         d.view(o), t, length, start, heads, h0, row0, qk, v_dim, qk ** -0.5)
                continue
            for i0 in range(0, t, qc):
                tq = min(qc, t - i0)
                lk = start + i0 + tq
                sgemm_sb(d, 1, 0, lk, tq, qk, qk ** -0.5, (kb, 0), (q, (row0 + i0) * heads * qk + h0 * qk), (sb, 0),
                         qk, heads * qk, lk, length * qk, qk, tq * lk, hn)
                d.launch("mla_prefill_softmax_f32", hn * tq, 256, vsb, hn * tq, tq, lk, start + i0)
                sgemm_sb(d, 0, 0, v_dim, tq, lk, 1.0, (vb, 0), (sb, 0), (o, (row0 + i0) * heads * v_dim + h0 * v_dim),
                         v_dim, lk, heads * v_dim, length * v_dim, tq * lk, v_dim, hn)
    return go, (hg, qc)


def rand(*shape, scale=1.0, gen=None):
    return torch.randn(*shape, dtype=torch.float64, generator=gen) * scale
