"""The MLA checks of device_check.py (kernels/mla*.cu): the absorbed decode attend (f32, bf16 mma.sync
and the wgmma pair), its bf16 kv_b products and the fused bf16 prefill, each against the float64
expanded form. Split from device_check.py, which runs them (same order, same names: `--checks
check_mla_bf16` still selects one)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from common import cdiv, mla_prefill_plan, rand, rel_err, run_mla_prefill
from k3ref.norm import rms_norm as ref_rms_norm

if TYPE_CHECKING:
    from device import Device, Results


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
        # mla_attend_tf32_f32 (mode = precision | prefetch tiles << 2) + mla_merge_f32 + mla_out_proj_f32.
        # precise = 3xTF32 (~f32, what the backend uses); fast = 1xTF32 (TF32 rounds to 11 significant
        # bits: ~1e-3 expected, 1e-2 allowed); mixed = 3xTF32 scores, 1xTF32 P V.
        # "per-item chunk" passes chunk 0: each item splits its own length (what ops.rs does, so
        # decode launches stay equal from step to step for CUDA graphs).
        for label, splits, tol, mode in (("precise", 3, 1e-4, 1 | 4 << 2), ("fast", 2, 1e-2, 0 | 4 << 2),
                                         ("precise pf0", 1, 1e-4, 1), ("mixed", 3, 1e-3, 3 | 4 << 2),
                                         ("precise per-item chunk", 4, 1e-4, 1 | 4 << 2)):
            chunk = 0 if "per-item" in label else cdiv(max(lens), splits)
            part = torch.empty(n, heads, splits, kv_lora + 2, device=d.tdev)
            d.launch("mla_attend_tf32_f32", (cdiv(heads, 16), n, splits), 256, d.view(qt), d.view(A),
                     d.view(i64(page_start)), d.view(i32(pt_base)), d.view(i32(lens)), d.view(part), n, heads, kv_lora,
                     rope, pt, splits, chunk, (nope + rope) ** -0.5, mode)
            lat = torch.empty(n, heads, kv_lora, device=d.tdev)
            d.launch("mla_merge_f32", (n, heads, cdiv(kv_lora, 128)), 128, d.view(part), d.view(lat), n, heads,
                     kv_lora, splits)
            o = torch.empty(n, heads * v_dim, device=d.tdev)
            d.launch("mla_out_proj_f32", (heads, cdiv(v_dim, 16), cdiv(n, 64)), 256, d.view(lat), d.view(kvb),
                     d.view(o), n, heads, nope, v_dim, kv_lora)
            d.sync()
            r.check(f"mla decode tf32 {label} (H={heads}, Lkv={kv_lora}, splits={splits})", rel_err(o, ref), tol)


def check_mla_bf16_products(d: Device, r: Results, gen):
    """The decode W_UK / W_UV products on bf16 kv_b (mla_absorb_q_bf16, mla_out_proj_bf16; ops.rs
    mla_decode's path for a bf16 kv_b) against float64, f32 accuracy (x in three bf16 pieces, as in
    gemv_bf16_tc_f32): K3 per-head dims, k3-mini's, and an odd shape (two 128-row nope passes,
    kv_lora not a multiple of the 32-column chunk or the 128-column block, v_dim not a multiple of
    32); N across the two n8 tiles of a pass, and past 64 (two out_proj reduction passes). Outputs
    start as NaN: every element must be written."""
    dev = lambda t: t.contiguous().to(d.tdev)  # noqa: E731
    u16 = lambda t: d.view(t).view(np.uint16)  # noqa: E731
    for heads, nope, rope, v_dim, kv_lora, ns in ((3, 128, 64, 128, 512, (1, 3, 17, 64)),
                                                  (2, 64, 32, 64, 128, (1, 3, 17, 64)),
                                                  (2, 256, 32, 40, 200, (1, 17, 70))):
        w = rand(heads * (nope + v_dim), kv_lora, scale=kv_lora ** -0.5, gen=gen).float().to(torch.bfloat16)
        wb, wd = dev(w.view(torch.int16)), w.double().view(heads, nope + v_dim, kv_lora)
        row = kv_lora + rope
        for n in ns:
            q, lat = rand(n, heads, nope + rope, gen=gen), rand(n, heads, kv_lora, gen=gen)
            qt = dev(torch.full((n, heads, row), float("nan")))
            o = dev(torch.full((n, heads * v_dim), float("nan")))
            d.launch("mla_absorb_q_bf16", (cdiv(kv_lora, 128), heads), 128, d.view(dev(q.float())), u16(wb),
                     d.view(qt), n, heads, nope, rope, v_dim, kv_lora)
            d.launch("mla_out_proj_bf16", (cdiv(v_dim, 32), heads), 128, d.view(dev(lat.float())), u16(wb),
                     d.view(o), n, heads, nope, v_dim, kv_lora)
            d.sync()
            ref_qt = torch.cat([torch.einsum("nhp,hpl->nhl", q[..., :nope], wd[:, :nope]), q[..., nope:]], -1)
            ref_o = torch.einsum("nhl,hvl->nhv", lat, wd[:, nope:]).reshape(n, heads * v_dim)
            shape = f"H={heads} nope={nope} v={v_dim} Lkv={kv_lora} N={n}"
            r.check(f"mla_absorb_q_bf16 {shape}", rel_err(qt, ref_qt), 1e-5)
            r.check(f"mla_out_proj_bf16 {shape}", rel_err(o, ref_o), 1e-5)


# kernels/mla_attend_bf16.cu: 48 heads per 256-thread block, dynamic shared memory (geometry.rs
# MLA_BF16_SHARED: Q, two K tiles, score partials, P).
MLA_BF16_HEADS, MLA_BF16_SHARED = 48, 165568
# kernels/mla_attend_pair_wgmma.cu (wgmma, sm_90a): 48 heads per 384-thread block (geometry.rs MLA_WG_SHARED:
# Q^T, two 64-position bf16 tiles, P^T, scores, + 1 KB to align the base).
MLA_WG_HEADS, MLA_WG_THREADS, MLA_WG_SHARED = 48, 384, 223168
# mla_attend_pair_wgmma_f32 (same file): clusters of 2 blocks, grid x rounded up to pairs (geometry.rs
# mla_attend_pair_wgmma, MLA_WGMMA_SHARED: + 4 mbarriers).
MLA_WGMMA_SHARED = 223200


def mla_latent_reference(qt, rows, scale, kv_lora):
    """Latent attention of one item, float64: softmax(rows . q~_h * scale) @ rows[:, :kv_lora] -> [H, kv_lora]."""
    a = torch.softmax(qt.double() @ rows.double().T * scale, -1)
    return a @ rows.double()[:, :kv_lora]


def check_mla_bf16(d: Device, r: Results, gen):
    """mla_attend_bf16_f32 and mla_attend_pair_wgmma_f32 (wgmma, 64-position tiles, on
    2-block clusters, each block loading half of every tile; heads 4 / 6 leave the second block of the
    pair without heads), each + mla_merge_f32 (the
    latent o~, before W_UV), against (a) the float64 latent attention: bf16 rounding of q~, the rows and
    P allows 1e-2 (max-normalised; ~2.5e-3 seen), and (b) emulators._emu_mla_attend_bf16 run on the host
    at the kernel's tile (the same bf16 roundings): 2e-3, what f32 accumulation order, __expf and the
    rare bf16 rounding flips of P leave. In --dry-run the kernel *is* that emulator, so (b) only checks
    the plumbing there. Cases: several items of different lengths (not multiples of the tile, one of 1,
    one split with 1 position in its last tile), small pages (4 and 16 tokens: tiles cross pages), head
    counts that are not a multiple of 48 (the second head group partial; 4 and 6: one group mostly
    zero), rows only 4-byte aligned, K3 row width, long items with several splits (ops.rs per-item
    chunk 0) so the wg kernel's two-tile ring wraps (8 tiles in one split), and an item shorter than
    its split count (an empty split: o~ 0, m -inf, l 0). The wg kernels' final_rows path runs on every
    per-item case (check_mla_final_rows)."""
    from emulators import _emu_mla_attend_bf16
    cases = (  # heads, kv_lora, rope, page_tokens, lens, splits, chunk, aligned
        (6, 128, 32, 4, [37, 70, 1], 2, 0, False),
        (52, 512, 64, 16, [50, 17, 33], 1, 0, True),
        (4, 512, 64, 16, [700, 95], 5, 0, True),
        (96, 512, 64, 64, [300], 3, 128, True),
        (52, 512, 64, 16, [1000, 130], 2, 0, True),
        (96, 512, 64, 16, [200, 3], 4, 0, True),
    )
    kernels = (("bf16", "mla_attend_bf16_f32", 32, MLA_BF16_HEADS, 256, MLA_BF16_SHARED),
               ("pair", "mla_attend_pair_wgmma_f32", 64, 2 * MLA_WG_HEADS, MLA_WG_THREADS, MLA_WGMMA_SHARED))
    for heads, kv_lora, rope, pt, lens, splits, chunk, aligned in cases:
        row, n = kv_lora + rope, len(lens)
        npages = [cdiv(L, pt) for L in lens]
        perm = torch.randperm(sum(npages), generator=gen).tolist()
        layer_off = 2 * row + (0 if aligned else 1)
        page_floats = pt * row + 3 * row
        arena = torch.zeros(sum(npages) * page_floats, dtype=torch.float64)
        page_start, pt_base, rows_all, k = [], [], [], 0
        for i, L in enumerate(lens):
            pt_base.append(len(page_start))
            page_start += [perm[k + p] * page_floats + layer_off for p in range(npages[i])]
            k += npages[i]
            rows_all.append(rand(L, row, gen=gen).float())
            for j in range(L):
                o = page_start[pt_base[i] + j // pt] + (j % pt) * row
                arena[o:o + row] = rows_all[i][j].double()
        qt = (rand(n, heads, row, gen=gen) * 0.3).float()
        scale = 192 ** -0.5
        dev = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
        ps = torch.tensor(page_start, dtype=torch.int64)
        base, lens_t = torch.tensor(pt_base, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        A = dev(arena)
        ref = torch.stack([mla_latent_reference(qt[i], rows_all[i], scale, kv_lora) for i in range(n)])
        tag = f"H={heads}, Lkv={kv_lora}, pages of {pt}, lens={lens}, splits={splits}, chunk={chunk}" + \
            ("" if aligned else ", 4-byte rows")
        for label, kname, tile, hpb, threads, smem in kernels:
            emu_part = np.zeros((n, heads, splits, kv_lora + 2), dtype=np.float32)
            _emu_mla_attend_bf16(qt.numpy(), arena.float().numpy(), ps.numpy(), base.numpy(), lens_t.numpy(),
                                 emu_part, n, heads, kv_lora, rope, pt, splits, chunk, np.float32(scale), tile=tile)
            P = torch.from_numpy(emu_part).double()
            w = torch.exp(P[..., kv_lora] - P[..., kv_lora].amax(-1, keepdim=True))
            emu = (w[..., None] * P[..., :kv_lora]).sum(2) / (w * P[..., kv_lora + 1]).sum(-1)[..., None]
            part = torch.full((n, heads, splits, kv_lora + 2), float("nan"), device=d.tdev)
            gx = cdiv(heads, hpb) * (2 if kname == "mla_attend_pair_wgmma_f32" else 1)  # pair: pairs of 48
            ins = (d.view(dev(qt)), d.view(A), d.view(ps.to(d.tdev)), d.view(base.to(d.tdev)),
                   d.view(lens_t.to(d.tdev)))
            fin = (0,) if label != "bf16" else ()  # the wg kernels' final_rows flag

            def attend(out, sp, fin=fin):
                d.launch(kname, (gx, n, sp), threads, *ins, d.view(out), n, heads, kv_lora, rope, pt, sp, chunk,
                         scale, *fin, shared_mem=smem)
            attend(part, splits)
            lat = torch.full((n, heads, kv_lora), float("nan"), device=d.tdev)
            d.launch("mla_merge_f32", (n, heads, cdiv(kv_lora, 128)), 128, d.view(part), d.view(lat), n, heads,
                     kv_lora, splits)
            d.sync()
            r.check(f"mla attend {label} vs float64 ({tag})", rel_err(lat, ref), 1e-2)
            r.check(f"mla attend {label} vs bf16 emulation ({tag})", rel_err(lat, emu), 2e-3)
            if min(lens) < splits:  # some split is empty: the exact partials the merge expects
                ph = part.cpu()
                ch = [chunk if chunk > 0 else cdiv(L, splits) for L in lens]
                empty = [(i, s) for i, L in enumerate(lens) for s in range(splits) if s * ch[i] >= L]
                ok = all(bool((ph[i, :, s, :kv_lora] == 0).all()) and bool((ph[i, :, s, kv_lora] == float("-inf")).all())
                         and bool((ph[i, :, s, kv_lora + 1] == 0).all()) for i, s in empty)
                r.exact(f"mla attend {label} empty splits write (0, -inf, 0) ({tag})", ok and bool(empty),
                        f"{len(empty)} empty")
            if fin and chunk == 0:
                check_mla_final_rows(d, r, tag, label, attend, part, lat, ref, n, heads, kv_lora)


def check_mla_final_rows(d: Device, r: Results, tag, label, attend, part, lat, ref, n, heads, kv_lora):
    """The wg kernels' final_rows = 1 (ops.rs when one split fills the GPU): the latent straight from
    the attend must be mla_merge_f32's answer for 1 split bitwise on the GPU (the same o~ * (1 / l)),
    and with more than one split the kernel writes nothing (its contract). In --dry-run the merge
    emulator divides in float64, hence 1e-6 there."""
    p1 = torch.full((n, heads, 1, kv_lora + 2), float("nan"), device=d.tdev)
    attend(p1, 1)
    d.launch("mla_merge_f32", (n, heads, cdiv(kv_lora, 128)), 128, d.view(p1), d.view(lat), n, heads, kv_lora, 1)
    rows = torch.full((n, heads, kv_lora), float("nan"), device=d.tdev)
    attend(rows, 1, fin=(1,))
    untouched = torch.full((n, heads, kv_lora), float("nan"), device=d.tdev)
    attend(untouched, 2, fin=(1,))
    d.sync()
    r.check(f"mla attend {label} final rows vs float64 ({tag})", rel_err(rows, ref), 1e-2)
    if d.dry:
        r.check(f"mla attend {label} final rows vs 1 split + merge ({tag})", rel_err(rows, lat), 1e-6)
    else:
        r.exact(f"mla attend {label} final rows == 1 split + merge, bitwise ({tag})", bool(torch.equal(rows, lat)),
                f"max |diff| {float((rows - lat).abs().max()):.3g}")
    r.exact(f"mla attend {label} final rows with 2 splits writes nothing ({tag})",
            bool(torch.isnan(untouched).all()), "written")


def mla_prefill_reference(q, rows, kv_b, heads, nope, rope, v_dim, kv_lora, start):
    """Expanded causal MLA, float64: queries q [T, H*(nope+rope)] at positions start.. over the latent
    rows [start + T, kv_lora + rope]. Returns o [T, H*v_dim]."""
    t, length, qk = q.shape[0], rows.shape[0], nope + rope
    c, kr = rows[:, :kv_lora], rows[:, kv_lora:]
    w = kv_b.view(heads, nope + v_dim, kv_lora)
    hidden = torch.arange(length)[None, :] > (start + torch.arange(t))[:, None]
    out = []
    for h in range(heads):
        k = torch.cat([c @ w[h, :nope].t(), kr], -1)
        s = (q[:, h * qk:(h + 1) * qk] @ k.t()) * qk ** -0.5
        out.append(torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ (c @ w[h, nope:].t()))
    return torch.stack(out, 1).reshape(t, heads * v_dim)


def check_mla_prefill(d: Device, r: Results, gen):
    """Expanded MLA prefill (kernels/mla_prefill.cu + the cuBLAS calls of mla_prefill.rs, launched by
    common.run_mla_prefill as the backend does) vs the float64 expanded form: new rows appended by
    mla_append_rows_f32 after a cached prefix (start > 0), T not a multiple of the query chunk,
    head groups with a smaller last one, the sequence's rows at row0 > 0 of q / o (mla_seqs_split
    writes into a shared o), the default plan, and one row of > 8192 keys (the softmax's
    two-read path)."""
    cases = (  # heads, nope, rope, v_dim, kv_lora, start, T, plan (head_group, q_chunk) or None
        (6, 64, 32, 64, 128, 0, 45, (4, 16)),
        (6, 64, 32, 64, 128, 37, 29, (6, 8)),
        (4, 128, 64, 128, 512, 50, 70, None),
        (2, 32, 16, 32, 64, 8300, 70, (1, 32)))
    for heads, nope, rope, v_dim, kv_lora, start, t, plan in cases:
        row, pt, eps, row0, qk = kv_lora + rope, 16, 1e-5, 3, nope + rope
        length = start + t
        npages = cdiv(length, pt)
        perm = torch.randperm(npages, generator=gen)
        layer_off = 2 * row + 1  # 4-byte aligned rows only, as in check_mla
        page_floats = pt * row + 3 * row
        page_start = perm.to(torch.int64) * page_floats + layer_off
        rows = rand(length, row, gen=gen)
        kv_a = rand(t, row, gen=gen)
        norm_w = rand(kv_lora, gen=gen)
        rows[start:] = torch.cat([ref_rms_norm(kv_a[:, :kv_lora], norm_w, eps), kv_a[:, kv_lora:]], -1)
        j = torch.arange(length)
        offs = page_start[j // pt] + (j % pt) * row
        arena = torch.zeros(npages * page_floats, dtype=torch.float64)
        arena[(offs[:start, None] + torch.arange(row)[None, :]).reshape(-1)] = rows[:start].reshape(-1)
        kv_b = rand(heads * (nope + v_dim), kv_lora, scale=kv_lora ** -0.5, gen=gen)
        q = rand(t, heads * qk, gen=gen)
        dev = lambda x: x.float().contiguous().to(d.tdev)  # noqa: E731
        A = dev(arena)
        d.launch("mla_append_rows_f32", t, 128, d.view(dev(kv_a)), d.view(dev(norm_w)), d.view(A),
                 d.view(offs[start:].contiguous().to(d.tdev)), t, kv_lora, rope, eps)
        qf = dev(torch.cat([rand(row0, heads * qk, gen=gen), q]))
        ref = mla_prefill_reference(q, rows, kv_b, heads, nope, rope, v_dim, kv_lora, start)
        for flash in (False, True):
            if flash and ((qk % 16) or v_dim % 8):
                continue
            o = torch.zeros(row0 + t, heads * v_dim, device=d.tdev)
            go, used = run_mla_prefill(d, A, page_start.to(d.tdev), qf, dev(kv_b), o, row0, t, start, heads, nope,
                                       rope, v_dim, kv_lora, pt, plan, flash)
            go()
            d.sync()
            kind = "flash bf16" if flash else "expanded"
            tag = f"mla_prefill {kind} (H={heads}, Lkv={kv_lora}, start={start}, T={t}, group,chunk={used})"
            # bf16 mode: Q, K, V and P rounded to bf16 (8 bits), sums in f32.
            r.check(tag, rel_err(o[row0:], ref), 1e-2 if flash else 2e-5)
            r.exact(f"{tag}: rows outside the sequence untouched", bool((o[:row0] == 0).all()))
        if start == 0:  # the vectorised reference against check_mla's per-query one
            i = t - 1
            one = mla_reference(q[i], rows[:start + i + 1], kv_b, heads, nope, rope, v_dim, kv_lora)
            r.check(f"mla_prefill_reference vs mla_reference (T={t})", rel_err(ref[i], one), 1e-12)
    # The backend's plan at K3 shapes (mla_prefill.rs plan_fits_the_budget_at_k3_shapes).
    k3 = lambda t, n: mla_prefill_plan(96, 128, 64, 128, 512, t, n)  # noqa: E731
    r.exact("mla_prefill plan (K3 shapes)", (k3(2048, 2048), k3(8192, 8192)[0], k3(4096, 1 << 20)) ==
            ((96, 512), 48, (1, 16)))
