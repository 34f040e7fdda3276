"""The routed-expert checks of device_check.py (kernels/mxfp4*.cu, moe*.cu): every MXFP4 expert path
(gemv, the few-token pair, the single-token pair, wgmma, the cuBLAS GEMM path) against the float64 reference
of k3ref, plus their determinism. Split from device_check.py, which runs them (same order, same
names: `--checks check_moe_wg` still selects one)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from common import (MX_WG_SWAP_LBO_SBO, cdiv, log, single_token_plan, single_token_scratch,
                    mx_wg_scratch, rand, rel_err, run_single_token, run_few_tokens, run_mx_wg,
                    run_few_tokens_e4m3)
from k3ref import mxfp4 as rmx
from k3ref.mxfp8 import round_trip as mxfp8_round
from k3ref.moe import route as ref_route
from k3ref.situ import situ_glu as ref_situ_glu

if TYPE_CHECKING:
    from device import Device, Results


def mx_experts(e, rows, cols, gen):
    ps, ss, deq = [], [], []
    for _ in range(e):
        w = rand(rows, cols, scale=cols ** -0.5, gen=gen)
        p, s = rmx.quantize(w)
        ps.append(p)
        ss.append(s)
        deq.append(rmx.dequantize(p, s, torch.float64))
    return torch.stack(ps), torch.stack(ss), torch.stack(deq)


def ref_routed(z, idx, wts, w1, w3, w2, act_round=None):
    """float64 routed experts: row t = sum over slots j of wts[t, j] * w2 SiTU-GLU(w1 z_t, w3 z_t) of
    expert idx[t, j] (beta 4, linear beta 25); slots with an id outside the experts are skipped.
    `act_round` (k3ref's MXFP8 round trip for the MXFP8 pair) rounds z and the intermediate first."""
    ref = torch.zeros(z.shape[0], w2.shape[1], dtype=torch.float64)
    rnd = act_round or (lambda x: x)  # noqa: E731
    z = rnd(z)
    for ex in range(w1.shape[0]):
        for j in range(idx.shape[1]):
            rows = (idx[:, j] == ex).nonzero().flatten()
            if len(rows):
                h = rnd(ref_situ_glu(z[rows] @ w1[ex].T, z[rows] @ w3[ex].T, 4.0, 25.0))
                ref[rows] += wts[rows, j:j + 1] * (h @ w2[ex].T)
    return ref


def random_routing(t: int, e: int, k: int, gen):
    """A random top-k routing of t tokens over e experts (the router's reference: identity gate,
    small bias): (idx [t, k], wts [t, k] float64)."""
    idx, wts, _ = ref_route(rand(t, e, gen=gen), torch.eye(e, dtype=torch.float64), rand(e, scale=0.1, gen=gen), k,
                            True, 1.0)
    return idx, wts


def sort_assignments(d: Device, ids, na: int, e: int):
    """moe_sort_assignments on `ids` ([na] expert ids, a device tensor): (offsets [e + 1], sorted_
    [na]) as device tensors."""
    offsets = torch.empty(e + 1, dtype=torch.int32, device=d.tdev)
    sorted_ = torch.empty(na, dtype=torch.int32, device=d.tdev)
    d.launch("moe_sort_assignments", 1, 1024, d.view(ids), na, e, d.view(offsets), d.view(sorted_))
    return offsets, sorted_


def expert_weights(e: int, lt: int, ie: int, gen):
    """W1, W3 (ie x lt) and W2 (lt x ie) of e MXFP4 experts, as (packed, scales, float64) each."""
    return mx_experts(e, ie, lt, gen), mx_experts(e, ie, lt, gen), mx_experts(e, lt, ie, gen)


def routed_case(t: int, e: int, k: int, lt: int, ie: int, gen, made=None):
    """One routed-expert case: expert_weights, float64 activations z [t, lt], and a routing: `made`
    ids with random weights, or random_routing's top-k of e."""
    w1, w3, w2 = expert_weights(e, lt, ie, gen)
    z = rand(t, lt, gen=gen)
    if made is not None:
        idx, wts = made, torch.rand(t, k, generator=gen, dtype=torch.float64)
    else:
        idx, wts = random_routing(t, e, k, gen)
    return w1, w3, w2, z, idx, wts


def check_moe(d: Device, r: Results, gen):
    t, e, k, lt, ie = 5, 16, 4, 128, 64
    (w1p, w1s, w1), (w3p, w3s, w3), (w2p, w2s, w2) = expert_weights(e, lt, ie, gen)
    z = rand(t, lt, gen=gen)
    logits, bias = rand(t, e, gen=gen), rand(e, scale=0.1, gen=gen)
    idx, wts, _ = ref_route(logits, torch.eye(e, dtype=torch.float64), bias, k, True, 1.0)
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    zf = dev(z.float())
    ref = ref_routed(z, idx, wts, w1, w3, w2)
    # All t tokens, then the first alone (4 busy experts of 16: grid.x = min(E, assignments) = 4 < E,
    # blocks mapped to busy experts; the few-token pair is also ops.rs's 1-token pair for experts too wide for
    # the single-token pair), through the few-token pair; the single-token pair's checks are check_moe_single_token.
    for tn in (t, 1):
        na = tn * k
        offsets, sorted_ = sort_assignments(d, dev(idx[:tn].int().reshape(-1)), na, e)
        act = torch.empty(na, ie, device=d.tdev)
        y = torch.empty(na, lt, device=d.tdev)
        run_few_tokens(d, min(e, na),
                   (d.view(zf), d.view(dev(w1p)), d.view(dev(w1s)), d.view(dev(w3p)), d.view(dev(w3s)),
                    d.view(offsets), d.view(sorted_), d.view(act), k, lt, ie, 4.0, 25.0, 1, e),
                   (d.view(act), d.view(dev(w2p)), d.view(dev(w2s)), d.view(offsets), d.view(sorted_),
                    d.view(y), lt, ie, e), tn, lt, ie)
        res = torch.empty(tn, lt, device=d.tdev)
        wv = d.view(dev(wts[:tn].float().reshape(-1)))
        d.launch("moe_combine_f32", cdiv(tn * lt, 256), 256, d.view(y), wv, d.view(res), tn, k, lt)
        d.sync()
        # bf16 weights (exact) times hi + lo bf16 activations (~16 bits), as check_moe_tc_shapes.
        r.check(f"moe routed tc T={tn} E={e} (sort+up+down+combine)", rel_err(res, ref[:tn]), 2e-5)


def check_moe_tc_shapes(d: Device, r: Results, gen):
    """The few-token pair on shapes with an odd number of 32-value blocks per row (a super-step's tail)
    and rows that leave a partial row tile, at T = 1, at several tokens per expert (more than 16 on
    some experts at T = 17, so two passes), and with small stages (one or three tokens per pass:
    weights re-read), also on a shape of 13 x 9 blocks (partial super-steps both ways). Each with hi / lo
    activations (planes 2, float32 mode) and bf16 ones (planes 1, bfloat16 mode: 1e-2 as check_moe_wg), and
    (the backend's stage sizes) the MXFP8 pair against the float64 of MXFP8-rounded activations."""
    e, k = 6, 3
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    for lt, ie in ((160, 96), (416, 288)):
        (w1p, w1s, w1), (w3p, w3s, w3), (w2p, w2s, w2) = expert_weights(e, lt, ie, gen)
        for t, stage, planes in [(t, st, p) for p in (2, 1) for t, st in ((1, None), (9, None), (17, None), (9, 1), (9, 3))]:
            z = rand(t, lt, gen=gen)
            idx, wts = random_routing(t, e, k, gen)
            ref = ref_routed(z, idx, wts, w1, w3, w2)
            na = t * k
            offsets, sorted_ = sort_assignments(d, dev(idx.int().reshape(-1)), na, e)
            act = torch.empty(na, ie, device=d.tdev)
            y = torch.empty(na, lt, device=d.tdev)
            wargs = (d.view(dev(z.float())), d.view(dev(w1p)), d.view(dev(w1s)), d.view(dev(w3p)),
                     d.view(dev(w3s)), d.view(offsets), d.view(sorted_), d.view(act), k, lt, ie, 4.0, 25.0, 1, e)
            dargs = (d.view(act), d.view(dev(w2p)), d.view(dev(w2s)), d.view(offsets), d.view(sorted_), d.view(y),
                     lt, ie, e)
            run_few_tokens(d, min(e, na), wargs, dargs, t, lt, ie, stage, planes=planes)
            res = torch.empty(t, lt, device=d.tdev)
            d.launch("moe_combine_f32", cdiv(t * lt, 256), 256, d.view(y), d.view(dev(wts.float().reshape(-1))),
                     d.view(res), t, k, lt)
            d.sync()
            tag = (f"T={t}" + (f" stage={stage}" if stage else "") + ("" if lt == 160 else f" {lt}x{ie}")
                   + (" bf16" if planes == 1 else ""))
            # bf16 weights (exact) times hi + lo bf16 activations (~16 bits) in f32, as the
            # split-bf16 GEMM path (check_moe_gemm's 2e-5); bf16 activations within 2^-9 each.
            r.check(f"moe routed tc {tag} (sort+up+down+combine)", rel_err(res, ref), 2e-5 if planes == 2 else 1e-2)
            if planes == 1 and stage is None:  # the MXFP8 pair: partial super-steps and row tiles as well
                run_few_tokens_e4m3(d, min(e, na), wargs, dargs, t, k, lt, ie)
                d.launch("moe_combine_f32", cdiv(t * lt, 256), 256, d.view(y), d.view(dev(wts.float().reshape(-1))),
                         d.view(res), t, k, lt)
                d.sync()
                r.check(f"moe routed tc {tag.replace(' bf16', '')} MXFP8 activations against MXFP8-rounded float64",
                        rel_err(res, ref_routed(z, idx, wts, w1, w3, w2, act_round=mxfp8_round)), 2e-3)


def replay_unit_split(n: int, nw: int, parts: int, ns: int):
    """The single-token kernels' split of n units over nw warps (unit u: part u % parts of a row's ns
    steps): the units in the order the warps visit them, and each warp's step count."""
    seen, steps = [], []
    for w in range(nw):
        units = range(n * w // nw, n * (w + 1) // nw)
        seen += list(units)
        steps.append(sum((u % parts + 1) * ns // parts - (u % parts) * ns // parts for u in units))
    return seen, steps


def _single_token_cases(d: Device, gen, shapes):
    """The one-token experts' check cases (the single-token pair): for each (latent, inter) shape,
    6 experts with random MXFP4 weights, top-3 routings at T = 1 and 3 (one slot's id out of
    range at T = 3), and the float64 routed output. Yields (lt, ie, t, k, e, wv, z, idx, wts, ref,
    ids) with wv / ids on the device."""
    e, k = 6, 3
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    for lt, ie in shapes:
        (w1p, w1s, w1), (w3p, w3s, w3), (w2p, w2s, w2) = expert_weights(e, lt, ie, gen)
        wv = [d.view(dev(x)) for x in (w1p, w1s, w3p, w3s, w2p, w2s)]
        for t in (1, 3):
            z = rand(t, lt, gen=gen)
            idx, wts = random_routing(t, e, k, gen)
            idx = idx.clone()
            if t == 3:
                idx[1, 2] = -1  # skipped slot
            ref = ref_routed(z, idx, wts, w1, w3, w2)
            yield lt, ie, t, k, e, wv, z, idx, wts, ref, dev(idx.int().reshape(-1))


def check_moe_single_token(d: Device, r: Results, gen):
    """The single-token pair (mxfp4_experts_single_token_*_f32: cp.async rings, the combine
    folded into the down kernel) against float64: the unit split replayed at K3 sizes (every unit
    once, the busiest warp within 5% of the mean steps), then widths that are multiples of 128
    (256 x 384, 384 x 128, 128 x 256 as tests/device.rs), T = 1 and 3 (an out-of-range id), the
    planned grid and odd grids / part counts (1 block: several staging rounds; 7 and 3 blocks:
    warps that start mid-row, so runs of parts cut at warp bounds and several partials per row),
    every case twice, bitwise equal (fixed combine order)."""
    for na, rows, cols, down in ((16, 3072, 3584, False), (16, 3584, 3072, True)):
        grid, parts = single_token_plan(na, rows, cols, down)
        ns, groups = cols // 128, rows // (32 if down else 16)
        n, nw = na * groups * parts, 16 * grid
        seen, steps = replay_unit_split(n, nw, parts, ns)
        mean = na * groups * ns / nw
        ok = seen == list(range(n)) and max(steps) <= 1.05 * mean
        r.exact(f"moe single-token unit split {na}x{rows}x{cols} grid={grid} parts={parts}: every unit once, steps "
                f"per warp {min(steps)}..{max(steps)} (mean {mean:.1f})", ok)
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    for lt, ie, t, k, e, wv, z, idx, wts, ref, ids in _single_token_cases(d, gen, ((256, 384), (384, 128), (128, 256))):
        na = t * k
        nsu, nsd = lt // 128, ie // 128  # steps per row: the most parts
        for grid, parts in ((None, None), ((1, 1), (nsu, 1)), ((7, 7), (1, nsd)),
                            ((3, 2), (min(2, nsu), min(2, nsd)))):
            ngu, nyp, nsy = single_token_scratch(t, k, lt, ie, parts)
            gu = torch.full((ngu,), float("nan"), device=d.tdev)  # unwritten parts would show
            yp = torch.full((nyp,), float("nan"), device=d.tdev)
            sync = torch.full((nsy,), -7, dtype=torch.int32, device=d.tdev)  # the up kernel zeroes it
            outs = []
            for _ in range(2):
                res = torch.full((t, lt), float("nan"), device=d.tdev)  # every element is written
                run_single_token(d, d.view(dev(z.float())), wv, d.view(ids), d.view(gu), d.view(yp),
                                 d.view(sync), d.view(dev(wts.float().reshape(-1))), d.view(res), t, k, lt, ie,
                                 e, grid=grid, parts=parts)
                d.sync()
                outs.append(res.cpu())
            g = grid or (single_token_plan(na, ie, lt, False)[0], single_token_plan(na, lt, ie, True)[0])
            p = parts or (single_token_plan(na, ie, lt, False)[1], single_token_plan(na, lt, ie, True)[1])
            tag = f"T={t} {lt}x{ie} grid={g[0]}/{g[1]} parts={p[0]}/{p[1]}"
            # hi + lo bf16 activations (~16 bits) as the per-lane table form (check_moe_single_token's 2e-5).
            r.check(f"moe routed single-token {tag} (up+down, combine folded)", rel_err(outs[0], ref), 2e-5)
            r.exact(f"moe routed single-token {tag}: rerun bitwise equal", torch.equal(outs[0], outs[1]))


def odd_scales(pk, sc, zeros, gen):
    """Odd E8M0 scales for experts 4 and 5: every scale raised by 9 (around 129, past the decode's
    folded single factor, so lanes with and without the second bf16 factor share a stage), and with
    `zeros` ~1 % of all bytes 0 (subnormal weights); returns the scales and the weights dequantized
    again with them."""
    sc = sc.clone()
    sc[4:6] = (sc[4:6].int() + 9).clamp(max=254).to(torch.uint8)
    if zeros:
        sc[torch.rand(sc.shape, generator=gen) > 0.99] = 0
    return sc, torch.stack([rmx.dequantize(pk[i], sc[i], torch.float64) for i in range(pk.shape[0])])


def check_moe_few_tokens(d: Device, r: Results, gen):
    """The few-token pair (default from 2 tokens) against float64: random top-4 routings
    over 16 experts at T = 2, 3, 16, 64, and a made one at T = 70, top-2 over 8 experts, whose
    experts take 70, 35, 17, 9, 8 and 1 tokens (two idle): one n-tile, n-tiles of 4 tokens and a
    partial one, several 16-token passes. 384 x 256: 4-byte-aligned scale rows (K3's case; the
    odd widths are in check_moe_tc_shapes), a partial down row block, 3 / 2 super-steps. T = 16 again
    with odd_scales (z / 2^9 keeps the raised experts' gates where the others' were) and on a grid of
    3 blocks (each walks many tiles: its ring runs across tile and expert boundaries), there also with a
    ring of 6 stages (the most the kernels take; the backend gives 3). Every case with hi / lo activations (planes 2, float32 mode: 2e-5) and with bf16
    ones (planes 1, bfloat16 mode: 1e-2, as check_moe_wg), whose passes take up to 32 tokens; then the MXFP8 pair
    (mxfp8 mode) against the float64 of MXFP8-rounded z and intermediate (2e-3: the f32 intermediate may round to
    the neighbouring E4M3 value where float64's does not) and, to show the format's cost, the unrounded one."""
    lt, ie = 384, 256
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    second = torch.tensor([1] * 1 + [2] * 8 + [3] * 9 + [4] * 17 + [5] * 35)
    made = torch.stack([torch.zeros(70, dtype=torch.long), second[torch.randperm(70, generator=gen)]], 1)
    cases = ((2, 16, 4, False, None, None), (3, 16, 4, False, None, None), (16, 16, 4, False, None, None),
             (64, 16, 4, False, None, None), (70, 8, 2, False, None, None), (16, 16, 4, True, None, None),
             (64, 16, 4, False, 3, None), (64, 16, 4, False, 3, 6))
    for (t, e, k, odd, grid, stages), planes in [(c, p) for p in (2, 1) for c in cases]:
        (w1p, w1s, w1), (w3p, w3s, w3), (w2p, w2s, w2), z, idx, wts = routed_case(
            t, e, k, lt, ie, gen, made if t == 70 else None)
        if odd:
            z = z / 512
            (w1s, w1), (w3s, w3), (w2s, w2) = (odd_scales(w1p, w1s, True, gen), odd_scales(w3p, w3s, False, gen),
                                               odd_scales(w2p, w2s, True, gen))
        ref = ref_routed(z, idx, wts, w1, w3, w2)
        na = t * k
        offsets, sorted_ = sort_assignments(d, dev(idx.int().reshape(-1)), na, e)
        counts = sorted(torch.bincount(idx.reshape(-1), minlength=e).tolist(), reverse=True)
        act = torch.empty(na, ie, device=d.tdev)
        y = torch.empty(na, lt, device=d.tdev)
        wargs = (d.view(dev(z.float())), d.view(dev(w1p)), d.view(dev(w1s)), d.view(dev(w3p)), d.view(dev(w3s)),
                 d.view(offsets), d.view(sorted_), d.view(act), k, lt, ie, 4.0, 25.0, 1, e)
        dargs = (d.view(act), d.view(dev(w2p)), d.view(dev(w2s)), d.view(offsets), d.view(sorted_), d.view(y), lt,
                 ie, e)
        run_few_tokens(d, min(e, na), wargs, dargs, t, lt, ie, blocks=grid, planes=planes, stages=stages)
        res = torch.empty(t, lt, device=d.tdev)
        d.launch("moe_combine_f32", cdiv(t * lt, 256), 256, d.view(y), d.view(dev(wts.float().reshape(-1))),
                 d.view(res), t, k, lt)
        d.sync()
        tag = ((", odd scales" if odd else "") + (f", {grid} blocks" if grid else "")
               + (f", {stages} stages" if stages else "") + (", bf16" if planes == 1 else ""))
        r.check(f"moe routed tc T={t} top{k} of {e}, tokens per expert {counts[:6]}{tag} (sort+up+down+combine)",
                rel_err(res, ref), 2e-5 if planes == 2 else 1e-2)
        if planes == 1:  # the MXFP8 pair on the same case, against the reference of MXFP8-rounded activations
            run_few_tokens_e4m3(d, min(e, na), wargs, dargs, t, k, lt, ie, blocks=grid, stages=stages)
            res8 = torch.empty(t, lt, device=d.tdev)
            d.launch("moe_combine_f32", cdiv(t * lt, 256), 256, d.view(y), d.view(dev(wts.float().reshape(-1))),
                     d.view(res8), t, k, lt)
            d.sync()
            ref8 = ref_routed(z, idx, wts, w1, w3, w2, act_round=mxfp8_round)
            r.check(f"moe routed tc T={t} top{k} of {e}{tag.replace(', bf16', '')}, MXFP8 activations (sort+quantize+up+"
                    f"quantize+down+combine) against MXFP8-rounded float64", rel_err(res8, ref8), 2e-3)
            r.check("  ... and against the unrounded float64 (what the format costs)", rel_err(res8, ref), 1e-1)


def check_moe_wg(d: Device, r: Results, gen):
    """The wgmma path (mxfp4_experts_wgmma_split_f32 + mxfp4_up/down_wg_f32 + moe_combine_ids_f32, moe/wgmma.rs,
    sm_90a) against float64, with hi / lo activations (planes 2, tol 2e-5 as the few-token pair) and
    bf16 activations (planes 1, the backend's bfloat16 mode: 1e-2, bf16(x) is within 2^-9 of x).
    Cases: a made top-2 routing (experts of 1, 63,
    64, 65, 300 and 106 tokens: tiles of 128 + 128 + 44, the N = 32 / 64 / 96 / 128 variants, one
    expert idle, one slot dropped) at 640 x 320 (10 / 5 stages: both rings wrap; 5 groups of 64
    intermediate columns: the last up CTA's second group does not exist; 10 MX blocks per down row:
    the unaligned-scale path); the same with odd scales: ~1% of the W1 / W2 E8M0 bytes 0
    (subnormal weights) and every scale of the two busiest experts raised by 9 (around 129: lanes
    with and without the decode's second bf16 factor in one stage; z / 2^9 keeps their gates where
    the other experts' were, else SiTU's conditioning, not the kernel, sets the error); and
    T = 2048, random top-4 of 16 at 256 x 384 (~4 tiles of 128 per expert, partial last tiles)."""
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    second = torch.tensor([0] * 1 + [1] * 63 + [2] * 64 + [3] * 65 + [5] * 107)
    second = second[torch.randperm(300, generator=gen)]
    made = torch.stack([torch.full((300,), 4, dtype=torch.long), second], 1)
    made[int((second == 5).nonzero()[0]), 1] = -1

    for t, e, k, lt, ie, odd in ((300, 7, 2, 640, 320, False), (300, 7, 2, 640, 320, True),
                                 (2048, 16, 4, 256, 384, False)):
        (w1p, w1s, w1), (w3p, w3s, w3), (w2p, w2s, w2), z, idx, wts = routed_case(
            t, e, k, lt, ie, gen, made if t == 300 else None)
        if odd:
            z = z / 512
            (w1s, w1), (w3s, w3), (w2s, w2) = (odd_scales(w1p, w1s, True, gen), odd_scales(w3p, w3s, False, gen),
                                               odd_scales(w2p, w2s, True, gen))
        ref = ref_routed(z, idx, wts, w1, w3, w2)
        na = t * k
        ids = dev(idx.int().reshape(-1))
        offsets, sorted_ = sort_assignments(d, ids, na, e)
        w = tuple(d.view(dev(x)) for x in (w1p, w1s, w3p, w3s, w2p, w2s))
        counts = sorted(torch.bincount(idx[idx >= 0].reshape(-1), minlength=e).tolist(), reverse=True)
        for planes, tol in ((2, 2e-5), (1, 1e-2)):
            scratch = mx_wg_scratch(d, t, k, lt, ie, planes)
            scratch[0][2].fill_(float("nan"))  # y rows of dropped slots stay NaN: the combine skips them
            out = torch.full((t, lt), float("nan"), device=d.tdev)
            run_mx_wg(d, d.view(dev(z.float())), w, d.view(ids), d.view(dev(wts.float().reshape(-1))),
                      d.view(offsets), d.view(sorted_), d.view(out), scratch, t, k, lt, ie, e, planes)
            d.sync()
            err = rel_err(out, ref)
            r.check(f"moe routed wg planes={planes} T={t} top{k} of {e} {lt}x{ie}, "
                    f"tokens per expert {counts[:7]}{', odd scales' if odd else ''} (sort+split+up+down+combine)",
                    err, tol)
            if not odd:
                check_moe_wg_stages(r, scratch, z, (w1p, w1s, w3p, w3s, w2p, w2s), offsets, sorted_, t, k, lt, ie, e,
                                    planes)
            if not err <= tol and not d.dry:  # tell a misread B descriptor from other faults (log only)
                run_mx_wg(d, d.view(dev(z.float())), w, d.view(ids), d.view(dev(wts.float().reshape(-1))),
                          d.view(offsets), d.view(sorted_), d.view(out), scratch, t, k, lt, ie, e, planes,
                          mode_bits=MX_WG_SWAP_LBO_SBO)
                d.sync()
                log(f"diagnostic: moe routed wg planes={planes} T={t} with the B descriptor's LBO / SBO swapped: "
                    f"rel err {rel_err(out, ref):.2e}")


def check_moe_wg_stages(r: Results, scratch, z, wts6, offsets, sorted_, t, k, lt, ie, e, planes):
    """Each kernel of the wgmma path alone, on what the previous one left in `scratch`: the split
    (z's rows gathered into sorted order) bit for bit against emulators._wg_pack; the up kernel's intermediate against
    _emu_moe_up_wg run on the device's split z (f32 accumulation vs float64, then the same rounding
    to `planes` bf16: 2e-5 at planes = 2, whose hi / lo pair keeps ~16 bits, so a value nudged
    across a rounding boundary moves by ~1.5e-5 - the whole path's bound -, or 1e-2 at planes = 1,
    where it can round to the next bf16); the down kernel's y rows against _emu_moe_down_wg on the
    device's intermediate (1e-5).
    So a failure names its kernel. In --dry-run these compare the emulators with themselves."""
    from emulators import _emu_moe_down_wg, _emu_moe_up_wg, _wg_chunks, _wg_pack, _wg_unpack
    zx = scratch[0][0].cpu().numpy().view(np.uint16)
    actx = scratch[0][1].cpu().numpy().view(np.uint16)
    y = scratch[0][2].cpu().numpy()
    off, srt = offsets.cpu().numpy(), sorted_.cpu().numpy()
    host = [x.contiguous().cpu().numpy() for x in wts6]
    npos, na = int(off[e]), t * k
    want = np.zeros_like(zx)
    _wg_pack(z.float().numpy()[srt[:npos].astype(np.int64) // k], want, planes, na)
    ng = cdiv(lt, 64)
    tag = f"planes={planes} T={t} {lt}x{ie}"
    r.exact(f"moe wg split z bitwise ({tag})", bool(np.array_equal(_wg_chunks(zx, ng, planes, na)[:, :, :, :npos],
                                                                   _wg_chunks(want, ng, planes, na)[:, :, :, :npos])))
    act_emu = np.zeros_like(actx)
    _emu_moe_up_wg(zx, *host[:4], off, act_emu, na, lt, ie, 4.0, 25.0, 1, e, planes)
    r.check(f"moe wg up kernel vs emulation on its split z ({tag})",
            rel_err(_wg_unpack(actx, npos, ie, planes, na), _wg_unpack(act_emu, npos, ie, planes, na)),
            2e-5 if planes == 2 else 1e-2)
    y_emu = np.zeros_like(y)
    _emu_moe_down_wg(actx, *host[4:], off, srt, y_emu, na, lt, ie, e, planes)
    rows = srt[:npos].astype(np.int64)
    r.check(f"moe wg down kernel vs emulation on its intermediate ({tag})",
            rel_err(torch.from_numpy(y.reshape(-1, lt)[rows]), torch.from_numpy(y_emu.reshape(-1, lt)[rows])), 1e-5)


def check_moe_wg_repeat(d: Device, r: Results, gen):
    """Bitwise determinism of the wgmma path, per kernel. moe_sort_assignments' atomic cursor leaves
    the order within an expert arbitrary, so a token may land in any tile / column of its expert, in
    a full N = 128 tile or the partial last one (smaller N); no result may depend on that. Per case
    (hi / lo and bf16 activations), every buffer prefilled with NaN bits (a read
    of anything not written first shows): run A on the device's sort; the up kernel alone again on
    A's split z (intermediate bitwise), the down kernel alone again on A's intermediate (y rows
    bitwise); the whole path on a fresh device sort (output bitwise; the log says whether that sort's
    order differed); the whole path on a host-made sort, each expert's range reversed and rotated
    (every token in another tile / column): each assignment's intermediate row, y row, and the
    output bitwise. Cases: check_moe_wg's made top-2 routing (tiles 128 + 128 + 44, N = 32..128, a
    dropped slot) at 640 x 320, random top-4 of 16 at 256 x 384, and on the device only (the
    emulators would take minutes) K3's 3584 x 3072 with top-4 of 8 at T = 512 (56 / 48 stages: the
    rings wrap ~10 times). Weights are random bytes (no reference needed)."""
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    bits = lambda x: x.view(torch.int32) if x.dtype == torch.float32 else x  # noqa: E731
    beq = lambda a, b: bool(torch.equal(bits(a.contiguous()).cpu(), bits(b.contiguous()).cpu()))  # noqa: E731
    second = torch.tensor([0] * 1 + [1] * 63 + [2] * 64 + [3] * 65 + [5] * 107)
    second = second[torch.randperm(300, generator=gen)]
    made = torch.stack([torch.full((300,), 4, dtype=torch.long), second], 1)
    made[int((second == 5).nonzero()[0]), 1] = -1
    cases = [(300, 7, 2, 640, 320), (2048, 16, 4, 256, 384)] + ([] if d.dry else [(512, 8, 4, 3584, 3072)])
    for t, e, k, lt, ie in cases:
        idx = made if t == 300 else torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k]
        na = t * k
        mx = lambda rows, cols: (torch.randint(0, 256, (e, rows, cols // 2), generator=gen, dtype=torch.uint8),  # noqa: E731
                                 torch.randint(120, 124, (e, rows, cols // 32), generator=gen, dtype=torch.uint8))
        w = tuple(d.view(dev(x)) for x in (*mx(ie, lt), *mx(ie, lt), *mx(lt, ie)))
        z, wts = dev(rand(t, lt, gen=gen).float()), dev(torch.rand(na, generator=gen))
        ids = dev(idx.int().reshape(-1))
        offsets = dev(torch.zeros(e + 1, dtype=torch.int32))

        def device_sort():
            s_ = dev(torch.zeros(na, dtype=torch.int32))
            d.launch("moe_sort_assignments", 1, 1024, d.view(ids), na, e, d.view(offsets), d.view(s_))
            d.sync()
            return s_

        sort_a, sort_b = device_sort(), device_sort()
        off = offsets.cpu().tolist()
        npos = off[e]
        sa = sort_a.cpu()
        sp = sa.clone()
        for ex in range(e):  # reversed and rotated: the first token of a range lands in its last tile
            p0, p1 = off[ex], off[ex + 1]
            if p1 > p0:
                sp[p0:p1] = sa[p0:p1].flip(0).roll(37 % (p1 - p0))
        sort_p = dev(sp)
        resorted = "differs" if not beq(sort_b[:npos], sort_a[:npos]) else "same order"
        sizes = f"T={t} top{k} of {e} {lt}x{ie}"

        def by_assignment(actx, srt):  # each assigned id's intermediate row (chunk-major: gathered), in id order
            rows = torch.empty(na, dtype=torch.long)
            rows[srt[:npos].cpu().long()] = torch.arange(npos)
            assigned = sa[:npos].long().sort().values
            return actx.cpu().reshape(-1, na, 8).permute(1, 0, 2).reshape(na, -1)[rows[assigned]]

        for planes in (2, 1):
            tag = f"planes={planes} {sizes}"

            def fresh():
                s_ = mx_wg_scratch(d, t, k, lt, ie, planes)
                s_[0][0].fill_(-1)  # 0xFFFF: a bf16 NaN
                s_[0][1].fill_(-1)
                s_[0][2].fill_(float("nan"))
                return s_

            def go(srt, scratch, parts=("split", "up", "down", "combine")):
                out = dev(torch.full((t, lt), float("nan")))
                run_mx_wg(d, d.view(z), w, d.view(ids), d.view(wts), d.view(offsets), d.view(srt), d.view(out),
                          scratch, t, k, lt, ie, e, planes, parts=parts)
                d.sync()
                return out

            sc_a = fresh()
            out_a = go(sort_a, sc_a)
            assigned = sa[:npos].long().to(d.tdev)
            sc = fresh()
            sc[0][0].copy_(sc_a[0][0])
            go(sort_a, sc, ("up",))
            r.exact(f"moe wg determinism: up kernel alone, rerun bitwise ({tag})",
                    beq(sc[0][1], sc_a[0][1]))  # rows past npos: the NaN fill in both
            sc = fresh()
            sc[0][1].copy_(sc_a[0][1])
            go(sort_a, sc, ("down",))
            r.exact(f"moe wg determinism: down kernel alone, rerun bitwise ({tag})",
                    beq(sc[0][2][assigned], sc_a[0][2][assigned]))
            r.exact(f"moe wg determinism: whole path on a fresh device sort, bitwise ({tag})",
                    beq(go(sort_b, fresh()), out_a), f"(device sort order {resorted})")
            sc = fresh()
            out_p = go(sort_p, sc)
            r.exact(f"moe wg determinism: reordered sort, up rows by assignment bitwise ({tag})",
                    beq(by_assignment(sc[0][1], sort_p), by_assignment(sc_a[0][1], sort_a)))
            r.exact(f"moe wg determinism: reordered sort, down y rows bitwise ({tag})",
                    beq(sc[0][2][assigned], sc_a[0][2][assigned]))
            r.exact(f"moe wg determinism: reordered sort, output bitwise ({tag})", beq(out_p, out_a))


def check_moe_gemm(d: Device, r: Results, gen):
    """The tensor-core MoE path (kernels/moe_gemm.cu, host/backend-cuda/src/moe_gemm.rs) end to end,
    with the two cuBLAS bf16 GEMMs played by f32 matmuls of the same bf16 values (exact products,
    f32 sums, as cuBLAS computes them), against the float64 reference. Two expert groups, so the
    per-group GLU position ranges are exercised."""
    t, e, k, lt, ie = 6, 8, 3, 64, 32
    (w1p, w1s, w1), (w3p, w3s, w3), (w2p, w2s, w2) = expert_weights(e, lt, ie, gen)
    z = rand(t, lt, gen=gen)
    logits, bias = rand(t, e, gen=gen), rand(e, scale=0.1, gen=gen)
    idx, wts, _ = ref_route(logits, torch.eye(e, dtype=torch.float64), bias, k, True, 1.0)
    ref = ref_routed(z, idx, wts, w1, w3, w2)
    dev = lambda x: x.contiguous().to(d.tdev)  # noqa: E731
    u16 = lambda x: d.view(x).view(np.uint16)  # noqa: E731  int16 storage, u16 kernel view
    bits_f32 = lambda x: ((x.to(torch.int32) & 0xFFFF) << 16).view(torch.float32)  # noqa: E731
    n = t * k
    offsets = dev(torch.zeros(e + 1, dtype=torch.int32))
    sorted_ = dev(torch.zeros(n, dtype=torch.int32))
    d.launch("moe_sort_assignments", 1, 1024, d.view(dev(idx.int().reshape(-1))), n, e, d.view(offsets),
             d.view(sorted_))
    xs, inv = dev(torch.zeros(2 * n, lt, dtype=torch.int16)), dev(torch.zeros(n, dtype=torch.int32))
    d.launch("moe_gather_split_bf16", n, 256, d.view(dev(z.float())), d.view(sorted_), d.view(offsets), e, k, lt,
             u16(xs), d.view(inv))
    d.sync()
    off = offsets.cpu().tolist()
    touched = [x for x in range(e) if off[x + 1] > off[x]]
    h = dev(torch.zeros(2 * n, 2 * ie))
    act = dev(torch.zeros(2 * n, ie, dtype=torch.int16))
    y = dev(torch.zeros(2 * n, lt))
    group = max(1, (len(touched) + 1) // 2)
    for g0 in range(0, len(touched), group):
        chunk = touched[g0:g0 + group]
        lst = dev(torch.tensor(chunk, dtype=torch.int32))
        w13 = dev(torch.zeros(len(chunk), 2 * ie, lt, dtype=torch.int16))
        w2b = dev(torch.zeros(len(chunk), lt, ie, dtype=torch.int16))
        for (pk, sc), row0 in (((w1p, w1s), 0), ((w3p, w3s), ie)):
            d.launch("mxfp4_to_bf16_experts", (2, len(chunk)), 256, d.view(dev(pk)),
                     d.view(dev(sc)), d.view(lst), len(chunk), ie, lt, u16(w13), 2 * ie * lt, row0)
        d.launch("mxfp4_to_bf16_experts", (2, len(chunk)), 256, d.view(dev(w2p)),
                 d.view(dev(w2s)), d.view(lst), len(chunk), lt, ie, u16(w2b), lt * ie, 0)
        d.sync()
        if g0 == 0:
            r.check("mxfp4_to_bf16_experts (exact)", rel_err(bits_f32(w13[0, :ie]).cpu(), w1[chunk[0]]), 0.0)
        for gi, ex in enumerate(chunk):
            r0, r1 = 2 * off[ex], 2 * off[ex + 1]
            h[r0:r1] = bits_f32(xs[r0:r1]) @ bits_f32(w13[gi]).T
        d.launch("moe_glu_split_bf16", (off[chunk[-1] + 1] - off[chunk[0]], cdiv(ie, 256)), 256, d.view(h),
                 d.view(offsets), e, off[chunk[0]], off[chunk[-1] + 1], ie, 4.0, 25.0, 1, u16(act))
        d.sync()
        for gi, ex in enumerate(chunk):
            r0, r1 = 2 * off[ex], 2 * off[ex + 1]
            y[r0:r1] = bits_f32(act[r0:r1]) @ bits_f32(w2b[gi]).T
    out = dev(torch.zeros(t, lt))
    d.launch("moe_combine_split_f32", t, 256, d.view(y), d.view(inv), d.view(offsets), e,
             d.view(dev(wts.float().reshape(-1))), d.view(out), k, lt)
    d.sync()
    r.check("moe routed gemm path (split bf16, 2 groups)", rel_err(out, ref), 2e-5)
