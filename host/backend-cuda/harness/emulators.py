"""NumPy/PyTorch emulators of kernels/*.cu for `device_check.py --dry-run` (no GPU).

Each takes the kernel's exact argument list (NumPy views in place of device pointers, already
type-checked against the parsed C signature by Device.launch) and writes its outputs in place,
computed with reference/k3ref in float64. EMU maps every kernel name to its emulator; a kernel
without one fails the "every kernel has an emulator" check.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from common import kda_reference, pack_kda_region, unpack_kda_region  # first: puts reference/ on sys.path
from checks_kda_replay import KDA_REPLAY_EMU
from checks_vision import VISION_EMU
from k3ref import kda as rk
from k3ref import mxfp4 as rmx
from k3ref import mxfp8 as rmx8
from k3ref.attnres import attn_res as ref_attn_res
from k3ref.moe import route as ref_route
from k3ref.norm import rms_norm as ref_rms_norm
from k3ref.situ import situ_glu as ref_situ_glu

# Same argument lists as the kernels, NumPy arrays in place.


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


_REC_PERM = []


def _rec_perm():
    """Record float p (kernels/kda_prefill_scan.cu header layout) -> index into the concatenation
    [W (16x128), Qp (16x128), Kd (16x128), U (16x128), Aqk (16x16), e (128)], all row-major."""
    if not _REC_PERM:
        perm = np.zeros(8576, np.int64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for s in range(16):  # W, Qp: {M[g][k], M[g][k+1], M[g+8][k], M[g+8][k+1]}, k = 8s + 2t
                k = 8 * s + 2 * t
                for r, (i, j) in enumerate(((g, k), (g, k + 1), (g + 8, k), (g + 8, k + 1))):
                    p = (s * 32 + lane) * 4 + r
                    perm[p], perm[2048 + p] = i * 128 + j, 2048 + i * 128 + j
            for s2 in range(2):
                j = 8 * s2 + 2 * t
                for pp in range(8):  # Kd: {Kd[j][d], Kd[j+1][d], Kd[j][d+8], Kd[j+1][d+8]}, d = 16p + g
                    dd = 16 * pp + g
                    for r, (tok, key) in enumerate(((j, dd), (j + 1, dd), (j, dd + 8), (j + 1, dd + 8))):
                        perm[4096 + ((s2 * 8 + pp) * 32 + lane) * 4 + r] = 4096 + tok * 128 + key
                # Aqk: {A[g][j], A[g][j+1], A[g+8][j], A[g+8][j+1]}
                for r, (i, jj) in enumerate(((g, j), (g, j + 1), (g + 8, j), (g + 8, j + 1))):
                    perm[8192 + (s2 * 32 + lane) * 4 + r] = 8192 + i * 16 + jj
            for mc in range(8):
                for nt in range(2):  # U: {U[i][c], U[i+1][c], U[i][c+8], U[i+1][c+8]}, i = 8nt + 2t, c = 16mc + g
                    i, c = 8 * nt + 2 * t, 16 * mc + g
                    for r, (tok, col) in enumerate(((i, c), (i + 1, c), (i, c + 8), (i + 1, c + 8))):
                        perm[6144 + ((mc * 2 + nt) * 32 + lane) * 4 + r] = 6144 + tok * 128 + col
        for d in range(128):  # e[8n + 2t + r] at t*32 + 2n + r
            perm[8448 + ((d >> 1) & 3) * 32 + 2 * (d >> 3) + (d & 1)] = 8448 + d
        assert sorted(perm.tolist()) == list(range(8576))
        _REC_PERM.append(perm)
    return _REC_PERM[0]


def _emu_kda_chunk_rec(qi, ki, vi, fi, bi, cq, ck, cv, a_log, dt_bias, rec, arena, off, ck_n, ck_off, n_ck, t0, t1,
                       heads, conv, lb):
    """Records of chunks [t0, t1) (float64 math), windows after t1 and window checkpoints in (t0, t1]."""
    t0, t1, heads, conv = int(t0), int(t1), int(heads), int(conv)
    if conv > 4:
        return
    hk, A = heads * 128, _t(arena)
    rows = lambda x, c: _t(x).view(-1, c).double()  # noqa: E731
    win, _ = unpack_kda_region(A, int(off), hk, conv, heads)
    ys = []
    for i, (x, c) in enumerate(zip((qi, ki, vi), (cq, ck, cv))):
        X, wc = rows(x, hk), _t(c).view(hk, conv).double()
        w0 = win[i].double().t() if t0 == 0 else X[t0 - (conv - 1):t0]  # [C-1, hk], oldest first
        y, nw = rk.short_conv(X[None, t0:t1], wc[:, None, :], w0[None])
        ys.append(F.silu(y[0]))
        wlen = hk * (conv - 1)
        A[int(off) + i * wlen:int(off) + (i + 1) * wlen] = nw[0].t().reshape(-1).float()
        for j in range(int(n_ck)):
            n = int(ck_n[j])
            if t0 < n <= t1:
                _, wn = rk.short_conv(X[None, t0:n], wc[:, None, :], w0[None])
                A[int(ck_off[j]) + i * wlen:int(ck_off[j]) + (i + 1) * wlen] = wn[0].t().reshape(-1).float()
    n = t1 - t0
    nc = (n + 15) // 16
    pad = lambda x: F.pad(x, (0, 0) * (x.dim() - 1) + (0, nc * 16 - n)).view(nc, 16, *x.shape[1:])  # noqa: E731
    q = pad(rk.l2norm(ys[0].view(n, heads, 128)) * 128 ** -0.5)  # [nc, 16, H, K]
    k = pad(rk.l2norm(ys[1].view(n, heads, 128)))
    v = pad(ys[2].view(n, heads, 128))
    g = pad(rk.kda_gate(rows(fi, hk)[t0:t1].view(n, heads, 128), _t(a_log).double(), _t(dt_bias).double(), float(lb)))
    beta = pad(torch.sigmoid(rows(bi, heads)[t0:t1]))  # [nc, 16, H]
    G = g.cumsum(1)
    kp, kn, qp = k * G.exp(), k * (-G).exp(), q * G.exp()
    kd = k * (G[:, -1:] - G).exp()
    tri = lambda x, d: torch.tril(x, d)  # noqa: E731
    L = tri(torch.einsum("cihd,cjhd->chij", kp, kn), -1) * beta.permute(0, 2, 1)[..., None]
    Aqk = tri(torch.einsum("cihd,cjhd->chij", qp, kn), 0)
    eye = torch.eye(16, dtype=torch.float64)
    bd = torch.diag_embed(beta.permute(0, 2, 1))  # [nc, H, 16, 16]
    Tm = torch.linalg.solve_triangular(eye + L, bd, upper=False)
    W = Tm @ kp.permute(0, 2, 1, 3)
    U = Tm @ v.permute(0, 2, 1, 3)
    src = torch.cat([W.reshape(nc, heads, -1), qp.permute(0, 2, 1, 3).reshape(nc, heads, -1),
                     kd.permute(0, 2, 1, 3).reshape(nc, heads, -1), U.reshape(nc, heads, -1),
                     Aqk.reshape(nc, heads, -1), G[:, -1].exp()], -1)  # [nc, H, 8576]
    R = _t(rec).view(-1)
    R[:nc * heads * 8576] = src[..., torch.from_numpy(_rec_perm())].reshape(-1).float()


def _emu_kda_chunk_scan(rec, arena, off, ck_n, ck_off, n_ck, o_out, f_in, a_log, dt_bias, lb, t0, t1, heads, conv):
    """The state scan over the records of [t0, t1): X = U - W S, O = Qp S + Aqk X, S <- e S + Kd^T X
    (float64); checkpoints from the chunk-start state with G recomputed from f."""
    t0, t1, heads, conv = int(t0), int(t1), int(heads), int(conv)
    hk, A = heads * 128, _t(arena)
    nc = (t1 - t0 + 15) // 16
    src = torch.empty(nc, heads, 8576, dtype=torch.float64)
    src[..., torch.from_numpy(_rec_perm())] = _t(rec).view(-1)[:nc * heads * 8576].view(nc, heads, 8576).double()
    W, Qp, Kd, U = (src[..., i * 2048:(i + 1) * 2048].reshape(nc, heads, 16, 128) for i in range(4))
    Aqk, e = src[..., 8192:8448].reshape(nc, heads, 16, 16), src[..., 8448:]
    _, S = unpack_kda_region(A, int(off), hk, conv, heads)
    S = S.double().clone()
    wf = 3 * hk * (conv - 1)
    O = _t(o_out).view(-1, hk)
    F_ = _t(f_in).view(-1, heads, 128).double()
    for c in range(nc):
        c0 = t0 + 16 * c
        cl = min(16, t1 - c0)
        X = U[c] - W[c] @ S
        O[c0:c0 + cl] = (Qp[c] @ S + Aqk[c] @ X).permute(1, 0, 2).reshape(16, hk)[:cl].float()
        for j in range(int(n_ck)):
            m = int(ck_n[j]) - c0
            if 1 <= m <= cl:
                G = rk.kda_gate(F_[c0:c0 + cl], _t(a_log).double(), _t(dt_bias).double(), float(lb)).cumsum(0)
                gm, gc = G[m - 1], G[cl - 1]  # [H, K]
                Sm = gm.exp()[..., None] * S + ((Kd[c][:, :m] * (gm - gc).exp()[:, None]).transpose(-1, -2)
                                                @ X[:, :m])
                A[int(ck_off[j]) + wf:int(ck_off[j]) + wf + Sm.numel()] = Sm.reshape(-1).float()
        S = e[c][..., None] * S + Kd[c].transpose(-1, -2) @ X
    A[int(off) + wf:int(off) + wf + S.numel()] = S.reshape(-1).float()


def _emu_mla_attend(qt, arena, page_start, pt_base, lens, part, items, heads, kv_lora, rope, page_tokens, splits,
                    chunk, scale):
    row = int(kv_lora) + int(rope)
    A, P = _t(arena), _t(part).view(int(items), int(heads), int(splits), int(kv_lora) + 2)
    for n in range(int(items)):
        L = int(lens[n])
        rows = torch.stack([A[int(page_start[int(pt_base[n]) + j // int(page_tokens)]) + (j % int(page_tokens)) * row:][:row]
                            for j in range(L)]).double()
        ch = int(chunk) if int(chunk) > 0 else -(-L // int(splits))  # chunk <= 0: per item (mla.cu)
        for s in range(int(splits)):
            j0, j1 = s * ch, min(L, (s + 1) * ch)
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


def _bf16(x):
    """float64 -> f32 -> bf16 (round to nearest even) -> float64, as the kernels round."""
    return x.float().to(torch.bfloat16).double()


def _emu_mla_attend_bf16(qt, arena, page_start, pt_base, lens, part, items, heads, kv_lora, rope, page_tokens,
                         splits, chunk, scale, tile=32):
    """kernels/mla_attend_bf16.cu's rounding, tile by tile: bf16(q~ * scale) (f32 product) and bf16 rows,
    exact scores, online softmax over tiles of 32 positions from each split's start, P = bf16(exp(s - m))
    in both P V and the row sum l."""
    row, lkv, H = int(kv_lora) + int(rope), int(kv_lora), int(heads)
    A, P = _t(arena), _t(part).view(int(items), H, int(splits), lkv + 2)
    Q = _t(qt).view(int(items), H, row)
    for n in range(int(items)):
        L = int(lens[n])
        rows = _bf16(torch.stack([A[int(page_start[int(pt_base[n]) + j // int(page_tokens)])
                                    + (j % int(page_tokens)) * row:][:row] for j in range(L)]).double())
        q = _bf16((Q[n] * np.float32(scale)).double())  # [H, row]
        ch = int(chunk) if int(chunk) > 0 else -(-L // int(splits))
        for s in range(int(splits)):
            j0, j1 = s * ch, min(L, (s + 1) * ch)
            m = torch.full((H,), float("-inf"), dtype=torch.float64)
            l = torch.zeros(H, dtype=torch.float64)
            acc = torch.zeros(H, lkv, dtype=torch.float64)
            for p0 in range(j0, j1, tile):
                kt = rows[p0:min(j1, p0 + tile)]
                sc = q @ kt.T  # [H, tile]
                mn = torch.maximum(m, sc.max(1).values)
                corr = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(m - mn))
                p = _bf16(torch.exp(sc - mn[:, None]))
                l = l * corr + p.sum(1)
                acc = acc * corr[:, None] + p @ kt[:, :lkv]
                m = mn
            P[n, :, s, :lkv] = acc.float()
            P[n, :, s, lkv] = m.float()
            P[n, :, s, lkv + 1] = l.float()


def _emu_mla_attend_wg(qt, arena, page_start, pt_base, lens, part, items, heads, kv_lora, rope, page_tokens,
                       splits, chunk, scale, final_rows):
    """kernels/mla_attend_pair_wgmma.cu (both kernels): the bf16 attend's rounding on 64-position tiles; with
    final_rows (one split only) the latent o~ * (1 / l) [items, H, kv_lora] in `part` instead."""
    args = (qt, arena, page_start, pt_base, lens)
    geo = (items, heads, kv_lora, rope, page_tokens, splits, chunk, scale)
    if not int(final_rows):
        return _emu_mla_attend_bf16(*args, part, *geo, tile=64)
    if int(splits) != 1:
        return None  # the kernel's contract: nothing written
    tmp = np.zeros(int(items) * int(heads) * (int(kv_lora) + 2), np.float32)
    _emu_mla_attend_bf16(*args, tmp, *geo, tile=64)
    P = _t(tmp).view(int(items), int(heads), int(kv_lora) + 2)
    l = P[..., int(kv_lora) + 1:]
    inv = torch.where(l > 0, 1.0 / l, torch.zeros_like(l))  # f32, as the kernel: o~ * (1 / l)
    _t(part).view(-1)[:int(items) * int(heads) * int(kv_lora)] = (P[..., :int(kv_lora)] * inv).reshape(-1)


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


def _emu_mla_prefill_gather(arena, page_start, lat, k, length, heads, kv_lora, rope, qk, page_tokens):
    length, heads, kv_lora, rope, qk, pt = (int(x) for x in (length, heads, kv_lora, rope, qk, page_tokens))
    row, nope = kv_lora + rope, qk - rope
    j = np.arange(length)
    offs = page_start[j // pt].astype(np.int64) + (j % pt) * row
    rows = arena[offs[:, None] + np.arange(row)[None, :]]  # [length, row]
    lat[:length * kv_lora] = rows[:, :kv_lora].reshape(-1)
    k[:heads * length * qk].reshape(heads, length, qk)[:, :, nope:] = rows[None, :, kv_lora:]


def _emu_mla_prefill_softmax(s, rows, tq, lk, q0):
    rows, tq, lk, q0 = int(rows), int(tq), int(lk), int(q0)
    S = _t(s)[:rows * lk].view(rows, lk)
    lim = torch.clamp(q0 + torch.arange(rows) % tq + 1, max=lk)
    hidden = torch.arange(lk)[None, :] >= lim[:, None]
    S[:] = torch.softmax(S.double().masked_fill(hidden, float("-inf")), -1).masked_fill(hidden, 0.0).float()


def _emu_mla_prefill_flash(q, k, v, o, t, length, start, heads, h0, row0, qk, vd, scale):
    """Causal attention of one head group: Q rounded to bf16 as the kernel stages it, K and V bf16
    bits (the kernel's inputs), P in float64 here (the kernel rounds it to bf16)."""
    t, length, start, heads, h0, row0, qk, vd = (int(x) for x in (t, length, start, heads, h0, row0, qk, vd))
    bf = lambda x: torch.from_numpy(bf16_value(split_bf16(np.ascontiguousarray(x, dtype=np.float32))[0]))  # noqa: E731
    hg = k.size // (length * qk)
    K = torch.from_numpy(bf16_value(k.reshape(-1)[:hg * length * qk])).view(hg, length, qk).double()
    V = torch.from_numpy(bf16_value(v.reshape(-1)[:hg * length * vd])).view(hg, length, vd).double()
    Q = bf(q.reshape(-1, heads * qk)[row0:row0 + t]).view(t, heads, qk)[:, h0:h0 + hg].permute(1, 0, 2).double()
    hg = Q.shape[0]
    S = torch.einsum("htc,hkc->htk", Q, K[:hg]) * float(scale)
    hidden = torch.arange(length)[None, :] > (start + torch.arange(t))[:, None]
    P = torch.softmax(S.masked_fill(hidden[None], float("-inf")), -1)
    O = torch.einsum("htk,hkc->thc", P, V[:hg]).float()
    _t(o).view(-1, heads, vd)[row0:row0 + t, h0:h0 + hg] = O


def _single_token_parts(cols, parts):
    """Column ranges of the single-token kernels' parts: steps of 128 columns, part p = steps
    [p ns / parts, (p + 1) ns / parts)."""
    ns = -(-(cols // 32) // 4)
    return [(128 * (p * ns // parts), min(cols, 128 * ((p + 1) * ns // parts))) for p in range(parts)]


def _split_f64(x):
    """hi + lo bf16 of f32 values (what the single-token kernels multiply), as float64."""
    hi, lo = split_bf16(np.asarray(x, dtype=np.float32))
    return torch.from_numpy(bf16_value(hi).astype(np.float64) + bf16_value(lo).astype(np.float64))


def _emu_moe_up_parts(z, w1p, w1s, w3p, w3s, idx, gu, top_k, lt, ie, e, n, parts):
    """Per-part up sums of the single-token pair: gu[a, p, m] = part p's columns of W{1,3}_e . (hi + lo of z_t), valid ids only."""
    lt, ie, e, n, parts = int(lt), int(ie), int(e), int(n), int(parts)
    out = _t(gu)[:n * parts * 2 * ie].view(n, parts, 2, ie)
    for a in range(n):
        ex = int(idx[a])
        if not 0 <= ex < e:
            continue
        x = _split_f64(z.reshape(-1, lt)[a // int(top_k)])
        for m, (wp, ws) in enumerate(((w1p, w1s), (w3p, w3s))):
            w = _mx_expert(wp, ws, e, ie, lt, ex)
            for p, (c0, c1) in enumerate(_single_token_parts(lt, parts)):
                out[a, p, m] = (w[:, c0:c1] @ x[c0:c1]).float()


def _emu_moe_down_parts(gu, w2p, w2s, idx, yp, lt, ie, beta, beta_lin, has_lin, e, n, parts_up, parts):
    """Per-part down sums of the single-token pair: act = SiTU-GLU(sum of gu's parts), yp[a, p] = part p of W2_e . (hi + lo of act)."""
    lt, ie, e, n, parts_up, parts = int(lt), int(ie), int(e), int(n), int(parts_up), int(parts)
    g = _t(gu)[:n * parts_up * 2 * ie].view(n, parts_up, 2, ie)
    out = _t(yp)[:n * parts * lt].view(n, parts, lt)
    for a in range(n):
        ex = int(idx[a])
        if not 0 <= ex < e:
            continue
        s = g[a].sum(0)  # f32, part order
        act = ref_situ_glu(s[0].double(), s[1].double(), float(beta), float(beta_lin) if has_lin else None)
        x = _split_f64(act.float().numpy())
        w2 = _mx_expert(w2p, w2s, e, lt, ie, ex)
        for p, (c0, c1) in enumerate(_single_token_parts(ie, parts)):
            out[a, p] = (w2[:, c0:c1] @ x[c0:c1]).float()


def _emu_combine_parts(yp, idx, w, out, t, k, lt, e, parts):
    t, k, lt, e, parts = int(t), int(k), int(lt), int(e), int(parts)
    y = _t(yp)[:t * k * parts * lt].view(t, k, parts, lt).double().sum(2)
    ok = torch.from_numpy((idx[:t * k] >= 0) & (idx[:t * k] < e)).view(t, k)
    wv = torch.where(ok, _t(w)[:t * k].view(t, k).double(), 0.0)  # skipped slots: yp rows never written
    y = torch.where(ok[..., None], y, 0.0)
    out.reshape(-1)[:t * lt] = torch.einsum("tk,tkl->tl", wv, y).float().numpy().reshape(-1)


def _emu_moe_up_single_token(z, w1p, w1s, w3p, w3s, idx, gu, sync, n_sync, top_k, lt, ie, e, n, parts):
    """mxfp4_experts_single_token_up_f32: the per-part gu, and the down kernel's counters / masks zeroed."""
    sync.reshape(-1)[:int(n_sync)] = 0
    _emu_moe_up_parts(z, w1p, w1s, w3p, w3s, idx, gu, top_k, lt, ie, e, n, parts)


def _emu_moe_down_single_token(gu, w2p, w2s, idx, w, yp, sync, out, top_k, lt, ie, beta, beta_lin, has_lin, e, n,
                            parts_up, parts):
    """mxfp4_experts_single_token_down_f32: out[t] = sum over valid slots j of w * W2_e (hi + lo of act); the run
    partials in yp and the counters are the kernel's business (only out is read back)."""
    t, k, lt = int(n) // int(top_k), int(top_k), int(lt)
    y = np.zeros(int(n) * lt, dtype=np.float32)
    _emu_moe_down_parts(gu, w2p, w2s, idx, y, lt, ie, beta, beta_lin, has_lin, e, n, parts_up, 1)
    _emu_combine_parts(y, idx, w, out, t, k, lt, e, 1)


def _emu_sort(idx, n, e, offsets, sorted_):
    ids = idx[:int(n)]
    valid = (ids >= 0) & (ids < int(e))  # out-of-range ids are dropped (sorted_ past them untouched)
    order = np.argsort(np.where(valid, ids, int(e)), kind="stable")[:int(valid.sum())]
    sorted_[:len(order)] = order.astype(np.int32)
    offsets[:] = np.concatenate([[0], np.cumsum(np.bincount(ids[valid], minlength=int(e)))]).astype(np.int32)


def _topk_select(vals, ids, k):
    """k3_model::top_k_of_row over (value, id) candidates: the k largest finite values, largest first,
    ties to the lower id (-0 below +0, as Rust's total_cmp)."""
    fin = np.isfinite(vals)
    vals, ids = vals[fin], ids[fin]
    b = vals.view(np.uint32).astype(np.int64)
    key = np.where(b & 0x80000000, 0xFFFFFFFF - b, b | 0x80000000)
    order = np.lexsort((ids, -key))[:k]
    return ids[order], vals[order]


def _emu_topk_segments(lg, seg_ids, seg_vals, seg_count, rows, vocab, k, seg_len, mask_table, mask_words):
    rows, vocab, k, seg_len, mask_words = int(rows), int(vocab), int(k), int(seg_len), int(mask_words)
    segs = len(seg_count) // rows
    x = lg.reshape(rows, vocab).copy()
    for r in range(rows):
        m = int(np.int32(np.uint32(mask_table[r]))) if mask_words > 0 else -1
        if m >= 0:  # forbidden tokens key as masked logits
            words = np.asarray(mask_table[rows + m * mask_words: rows + (m + 1) * mask_words], dtype=np.uint32)
            bits = (words[np.arange(vocab) >> 5] >> (np.arange(vocab) & 31).astype(np.uint32)) & 1
            x[r, bits == 0] = np.nan
    for r in range(rows):
        for s in range(segs):
            lo, hi = s * seg_len, min(vocab, (s + 1) * seg_len)
            ids, vals = _topk_select(x[r, lo:hi].copy(), np.arange(lo, max(lo, hi)), k)
            at = (r * segs + s) * k
            seg_ids[at:at + k] = -1
            seg_vals[at:at + k] = 0.0
            seg_ids[at:at + len(ids)] = ids
            seg_vals[at:at + len(ids)] = vals
            seg_count[r * segs + s] = len(ids)


def _emu_topk_merge(lg, seg_ids, seg_vals, seg_count, ids, vals, count, rows, vocab, k, segments):
    rows, k, segments = int(rows), int(k), int(segments)
    for r in range(rows):
        pick_ids, pick_vals = [], []
        for s in range(segments):
            at, n = (r * segments + s) * k, int(seg_count[r * segments + s])
            pick_ids.append(seg_ids[at:at + n])
            pick_vals.append(seg_vals[at:at + n])
        got_ids, got_vals = _topk_select(np.concatenate(pick_vals).astype(np.float32),
                                         np.concatenate(pick_ids).astype(np.int64), k)
        ids[r * k:(r + 1) * k] = -1
        vals[r * k:(r + 1) * k] = 0.0
        ids[r * k:r * k + len(got_ids)] = got_ids
        vals[r * k:r * k + len(got_ids)] = got_vals
        count[r] = len(got_ids)


def _emu_router(logits, bias, idx, w, t, e, k, renorm, scaling):
    """kernels/router.cu: the top-k of sigmoid(logits) + bias, equal scores to the lower expert."""
    _, _, sc = ref_route(_t(logits).view(int(t), int(e)).double(), torch.eye(int(e), dtype=torch.float64),
                         _t(bias).double(), int(k), bool(renorm), float(scaling))
    ri = torch.sort(sc + _t(bias).double(), dim=-1, descending=True, stable=True).indices[:, :int(k)]
    rw = sc.gather(-1, ri)
    if renorm:
        rw = rw / (rw.sum(-1, keepdim=True) + 1e-20)
    idx[:] = ri.int().numpy().reshape(idx.shape)
    w[:] = (rw * float(scaling)).float().numpy().reshape(w.shape)


def _emu_rms_norm(x, w, y, rows, cols, eps, y_bf16, has_bf16):
    """kernels/norm.cu rms_norm_f32; with has_bf16 the output's bf16 bits into y_bf16 too."""
    n = int(rows) * int(cols)
    y.reshape(-1)[:n] = ref_rms_norm(_t(x).view(int(rows), int(cols)).double(), _t(w).double(),
                                     float(eps)).float().numpy().reshape(-1)
    if has_bf16:
        y_bf16.reshape(-1)[:n] = bf16_bits(y.reshape(-1)[:n])


def _emu_situ_glu(g, u, out, n, b, bl, hl, out_bf16, has_bf16):
    """kernels/situ.cu situ_glu_f32; with has_bf16 the output's bf16 bits into out_bf16 too."""
    out[:] = ref_situ_glu(_t(g).double(), _t(u).double(), float(b), float(bl) if hl else None).float().numpy()
    if has_bf16:
        out_bf16.reshape(-1)[:int(n)] = bf16_bits(out.reshape(-1)[:int(n)])


def _emu_gated_head_norm(o, g, w, y, rows, heads, hd, eps, y_bf16, has_bf16):
    """kernels/norm.cu gated_head_norm_f32; with has_bf16 the output's bf16 bits into y_bf16 too."""
    y[:] = (ref_rms_norm(_t(o).view(-1, int(hd)).double(), _t(w).double(), float(eps))
            * torch.sigmoid(_t(g).view(-1, int(hd)).double())).float().numpy().reshape(y.shape)
    if has_bf16:
        n = int(rows) * int(heads) * int(hd)
        y_bf16.reshape(-1)[:n] = bf16_bits(y.reshape(-1)[:n])


def _emu_attn_res(*a):
    bank, nb, last, add, has_add, w, norm, has_norm, out, rows, dm, eps, out_bf16, has_bf16 = (
        a[:8], int(a[8]), a[9], a[10], int(a[11]), a[12], a[13], int(a[14]), a[15], int(a[16]), int(a[17]),
        float(a[18]), a[19], int(a[20]))
    L = _t(last).view(rows, dm)
    if has_add:
        L += _t(add).view(rows, dm)
    S = [_t(s).view(rows, dm).double() for s in bank[:nb]]
    h = ref_attn_res(L.double(), S, _t(w).double(), torch.ones(1, dm, dtype=torch.float64), eps)
    if has_norm:
        h = ref_rms_norm(h, _t(norm).double(), eps)
    out[:] = h.float().numpy().reshape(out.shape)
    if has_bf16:
        out_bf16.reshape(-1)[:rows * dm] = bf16_bits(out.reshape(-1)[:rows * dm])


def bf16_bits(x):
    """f32 -> bf16 bits, round to nearest even (kernels/moe_gemm.cu f32_to_bf16_bits; no NaNs here)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def split_bf16(x):
    hi = bf16_bits(x)
    return hi, bf16_bits(np.asarray(x, dtype=np.float32) - bf16_value(hi))


def _few_tokens_perm():
    """kernels/moe_few_tokens.cu mx_pos: column c of a 128-column super-step -> its index in the row."""
    c = np.arange(128)
    i = c & 7
    return 16 * (2 * ((c >> 3) & 3) + (((i >> 1) & 1) ^ 1)) + 4 * (c >> 5) + np.where(i & 1, 0, 2) + (i >> 2)


def _few_tokens_pack(x, out, planes=2):
    """f32 rows [n, cols] -> few-token split layout [n][ceil(cols / 128)][planes][128] bf16 bits
    (planes 1: bf16(x); 2: hi, lo)."""
    n, cols = x.shape
    nss = -(-cols // 128)
    xp = np.zeros((n, nss * 128), np.float32)
    xp[:, :cols] = x
    hi, lo = split_bf16(xp.reshape(-1))
    o = out.reshape(-1)[:n * nss * 128 * planes].reshape(n, nss, planes, 128)
    perm = _few_tokens_perm()
    o[:, :, 0, perm] = hi.reshape(n, nss, 128)
    if planes == 2:
        o[:, :, 1, perm] = lo.reshape(n, nss, 128)


def _few_tokens_unpack(xs, n, cols, planes=2):
    """few-token split layout -> float64 rows (the sum of the planes) [n, cols]: what the kernels multiply."""
    nss = -(-cols // 128)
    o = xs.reshape(-1)[:n * nss * 128 * planes].reshape(n, nss, planes, 128)[:, :, :, _few_tokens_perm()]
    v = sum(bf16_value(o[:, :, p]).astype(np.float64) for p in range(planes))
    return torch.from_numpy(v.reshape(n, nss * 128)[:, :cols])


def _e4m3_perm():
    """kernels/moe_few_tokens.cu mxfp8_quantize_f32: column c of a 128-column super-step -> its byte in the row."""
    c = np.arange(128)
    i = c & 7
    return 32 * (c >> 5) + 8 * ((c & 31) >> 3) + 4 * (i & 1) + (i >> 1)


def _emu_mxfp8_quantize(x, xq, xf, rows, cols):
    rows, cols = int(rows), int(cols)
    nss = -(-cols // 128)
    xp = np.zeros((rows, nss * 128), np.float32)
    xp[:, :cols] = x.reshape(-1)[:rows * cols].reshape(rows, cols)
    q, e = rmx8.quantize(torch.from_numpy(xp))  # zero padding blocks take e = -127, as in the kernel
    o = xq.reshape(-1)[:rows * nss * 128].reshape(rows, nss, 128)
    o[:, :, _e4m3_perm()] = q.view(torch.uint8).reshape(rows, nss, 128).numpy()
    xf.reshape(-1)[:rows * nss * 4] = torch.exp2((e + 6).double()).float().reshape(-1).numpy()


def _e4m3_unpack(xq, xf, n, cols):
    """mxfp8_quantize_f32's rows -> float64 [n, cols]: what the MXFP8 pair multiplies."""
    nss = -(-cols // 128)
    q = torch.from_numpy(np.ascontiguousarray(xq.reshape(-1)[:n * nss * 128].reshape(n, nss, 128)[:, :, _e4m3_perm()]))
    v = q.view(torch.float8_e4m3fn).double().reshape(n, nss * 4, 32)
    f = torch.from_numpy(np.asarray(xf.reshape(-1)[:n * nss * 4], np.float32)).double().reshape(n, nss * 4, 1) / 64
    return (v * f).reshape(n, nss * 128)[:, :cols]


def _emu_moe_up_e4m3(zq, zf, w1p, w1s, w3p, w3s, offsets, sorted_, act, top_k, lt, ie, beta, beta_lin, has_lin, e, nt):
    lt, ie, k, e = int(lt), int(ie), int(top_k), len(offsets) - 1
    z = _e4m3_unpack(zq, zf, zf.size // (-(-lt // 128) * 4), lt)
    out = act.reshape(-1, ie)
    for ex in range(e):
        a = sorted_[offsets[ex]:offsets[ex + 1]].astype(np.int64)
        if len(a):
            x = z[torch.from_numpy(a // k)]
            w1, w3 = _mx_expert(w1p, w1s, e, ie, lt, ex), _mx_expert(w3p, w3s, e, ie, lt, ex)
            out[a] = ref_situ_glu(x @ w1.T, x @ w3.T, float(beta), float(beta_lin) if has_lin else None).float().numpy()


def _emu_moe_down_e4m3(aq, af, w2p, w2s, offsets, sorted_, y, lt, ie, e, nt):
    lt, ie, e = int(lt), int(ie), len(offsets) - 1
    act = _e4m3_unpack(aq, af, af.size // (-(-ie // 128) * 4), ie)
    out = y.reshape(-1, lt)
    for ex in range(e):
        a = sorted_[offsets[ex]:offsets[ex + 1]].astype(np.int64)
        if len(a):
            out[a] = (act[torch.from_numpy(a)] @ _mx_expert(w2p, w2s, e, lt, ie, ex).T).float().numpy()


def _emu_moe_up_few_tokens(zx, w1p, w1s, w3p, w3s, offsets, sorted_, actx, top_k, lt, ie, beta, beta_lin, has_lin, e, nt,
                           planes):
    lt, ie, k, e, planes = int(lt), int(ie), int(top_k), len(offsets) - 1, int(planes)
    na = actx.size // (-(-ie // 128) * 128 * planes)
    z = _few_tokens_unpack(zx, zx.size // (-(-lt // 128) * 128 * planes), lt, planes)
    act = np.zeros((na, ie), np.float32)
    for ex in range(e):
        a = sorted_[offsets[ex]:offsets[ex + 1]].astype(np.int64)
        if len(a):
            w1 = _mx_expert(w1p, w1s, e, ie, lt, ex)
            w3 = _mx_expert(w3p, w3s, e, ie, lt, ex)
            x = z[torch.from_numpy(a // k)]
            act[a] = ref_situ_glu(x @ w1.T, x @ w3.T, float(beta), float(beta_lin) if has_lin else None).float().numpy()
    rows = np.unique(sorted_[offsets[0]:offsets[-1]]).astype(np.int64)  # rows of other assignments untouched
    packed = np.zeros((na, -(-ie // 128) * 128 * planes), np.uint16)
    _few_tokens_pack(act, packed, planes)
    actx.reshape(na, -1)[rows] = packed[rows]


def _emu_moe_down_few_tokens(actx, w2p, w2s, offsets, sorted_, y, lt, ie, e, nt, planes):
    lt, ie, e, planes = int(lt), int(ie), len(offsets) - 1, int(planes)
    na = actx.size // (-(-ie // 128) * 128 * planes)
    act = _few_tokens_unpack(actx, na, ie, planes)
    for ex in range(e):
        a = sorted_[offsets[ex]:offsets[ex + 1]].astype(np.int64)
        if len(a):
            w2 = _mx_expert(w2p, w2s, e, lt, ie, ex)
            _t(y).view(-1, lt)[torch.from_numpy(a)] = (act[torch.from_numpy(a)] @ w2.T).float()


def _mx_expert(wp, ws, e, rows, cols, ex):
    """Expert ex of e packed MXFP4 matrices [rows, cols], dequantised to float64."""
    return rmx.dequantize(_t(wp).view(e, rows, cols // 2)[ex], _t(ws).view(e, rows, cols // 32)[ex], torch.float64)


def _in_order(sorted_, p0, p1):
    """Positions p0..p1-1 of one expert as the sort left them."""
    return np.arange(p0, p1)


def _sorted_up(z, w1p, w1s, w3p, w3s, offsets, sorted_, k, lt, ie, beta, beta_lin, has_lin, e, order):
    """The sort-based up kernels: act row p = SiTU-GLU of the token of sorted position p through
    its expert, each expert's positions taken in `order(sorted_, p0, p1)`."""
    act = np.zeros((int(offsets[e]), ie), np.float32)
    for ex in range(e):
        p0, p1 = int(offsets[ex]), int(offsets[ex + 1])
        if p1 > p0:
            w1, w3 = _mx_expert(w1p, w1s, e, ie, lt, ex), _mx_expert(w3p, w3s, e, ie, lt, ex)
            rows = order(sorted_, p0, p1)
            x = z[torch.from_numpy(sorted_[rows].astype(np.int64) // k)]
            act[rows] = ref_situ_glu(x @ w1.T, x @ w3.T, float(beta),
                                     float(beta_lin) if has_lin else None).float().numpy()
    return act


def _sorted_down(act, w2p, w2s, offsets, sorted_, y, lt, ie, e, order):
    """The sort-based down kernels: y[sorted[p]] = W2_e act[p] (rows of dropped slots untouched)."""
    for ex in range(e):
        p0, p1 = int(offsets[ex]), int(offsets[ex + 1])
        if p1 > p0:
            w2 = _mx_expert(w2p, w2s, e, lt, ie, ex)
            rows = order(sorted_, p0, p1)
            _t(y).view(-1, lt)[torch.from_numpy(sorted_[rows].astype(np.int64))] = (act[rows] @ w2.T).float()


def _emu_moe_up_grouped(zx, w1p, w1s, w3p, w3s, offsets, sorted_, actx, top_k, lt, ie, beta, beta_lin, has_lin, e):
    """mxfp4_up_grouped_f32: as the few-token up kernel, but actx row p = sorted position p."""
    lt, ie, k, e = int(lt), int(ie), int(top_k), int(e)
    z = _few_tokens_unpack(zx, zx.size // (-(-lt // 128) * 256), lt)
    act = _sorted_up(z, w1p, w1s, w3p, w3s, offsets, sorted_, k, lt, ie, beta, beta_lin, has_lin, e, _in_order)
    _few_tokens_pack(act, actx)  # rows [0, npos); rows past them untouched


def _emu_moe_down_grouped(actx, w2p, w2s, offsets, sorted_, y, lt, ie, e):
    """mxfp4_down_grouped_f32: y[sorted[p]] = W2_e act[p] (rows of dropped slots untouched)."""
    lt, ie, e = int(lt), int(ie), int(e)
    _sorted_down(_few_tokens_unpack(actx, int(offsets[e]), ie), w2p, w2s, offsets, sorted_, y, lt, ie, e, _in_order)


def _wg_perm():
    """kernels/moe_wgmma.cu mxw_pos: column c of a 64-column group -> its position in the group."""
    c = np.arange(64)
    return 16 * ((c >> 2) & 3) + 8 * ((c >> 1) & 1) + 2 * (c >> 4) + (c & 1)


def _wg_chunks(buf, ng, planes, rows=None):
    """A chunk-major buffer (kernels/moe_wgmma.cu) as [ng groups, planes, 8 chunks, R rows, 8] (a
    view); R defaults to what the buffer holds."""
    per_row = ng * planes * 64
    rows = buf.size // per_row if rows is None else int(rows)
    return buf.reshape(-1)[:rows * per_row].reshape(ng, int(planes), 8, rows, 8)


def _wg_pack(x, out, planes, rows=None):
    """f32 rows [n, cols] -> rows 0..n-1 of the chunk-major layout (R rows): hi / lo bf16 bits
    (planes 2) or bf16 rounded once (planes 1), columns past cols zero; other rows untouched."""
    n, cols = x.shape
    ng, planes = -(-cols // 64), int(planes)
    xp = np.zeros((n, ng * 64), np.float32)
    xp[:, :cols] = x
    if planes == 2:
        vals = split_bf16(xp.reshape(-1))
    else:
        vals = (bf16_bits(xp.reshape(-1)),)
    o = _wg_chunks(out, ng, planes, rows)
    perm = _wg_perm()
    for p, v in enumerate(vals):
        by_pos = np.empty((n, ng, 64), np.uint16)
        by_pos[:, :, perm] = v.reshape(n, ng, 64)
        o[:, p, :, :n, :] = by_pos.reshape(n, ng, 8, 8).transpose(1, 2, 0, 3)


def _wg_unpack(xs, n, cols, planes, rows=None):
    """Rows 0..n-1 of the chunk-major layout -> float64 rows [n, cols], the planes summed (what the
    kernels multiply)."""
    ng, planes = -(-cols // 64), int(planes)
    o = _wg_chunks(xs, ng, planes, rows)[:, :, :, :n, :]
    by_pos = o.transpose(3, 0, 1, 2, 4).reshape(n, ng, planes, 64)[:, :, :, _wg_perm()]
    v = bf16_value(by_pos).astype(np.float64).sum(axis=2)
    return torch.from_numpy(v.reshape(n, ng * 64)[:, :cols])


def _emu_wg_split(z, sorted_, offsets, xs, rows, cols, top_k, e, planes):
    """mxfp4_experts_wgmma_split_f32: row r < offsets[e] of xs = z's row sorted[r] / top_k."""
    npos, cols = int(offsets[int(e)]), int(cols)
    x = z.reshape(-1, cols)[sorted_[:npos].astype(np.int64) // int(top_k)]
    _wg_pack(x, xs, planes, rows)


def _wg_canonical(sorted_, p0, p1):
    """Positions p0..p1-1 of one expert ordered by assignment id. The kernels' results do not depend
    on where the sort (atomic cursor: any order within an expert) puts a token - each output is one
    accumulator lane, summed in a fixed k order whatever its tile, column or the tile's N - so the
    emulators compute in this canonical order: a BLAS's row blocking cannot make them depend on it
    either (check_moe_wg_repeat compares runs on differently ordered sorts bit for bit)."""
    return p0 + np.argsort(sorted_[p0:p1], kind="stable")


def _emu_moe_up_wg(zx, w1p, w1s, w3p, w3s, offsets, actx, rows, lt, ie, beta, beta_lin, has_lin, e, mode):
    """mxfp4_experts_wgmma_up_f32: actx row p = SiTU-GLU of zx row p through its expert, chunk-major with
    mode & 3 planes (rows past the assignments untouched; the diagnostic mode bits change nothing
    here). The kernel sees no assignment ids, so each expert's rows are taken in the order of their
    bits (_wg_canonical's reason: no result may depend on where the sort put a row)."""
    lt, ie, rows, e, planes = int(lt), int(ie), int(rows), int(e), int(mode) & 3
    ng = -(-lt // 64)
    raw = _wg_chunks(zx, ng, planes, rows).transpose(3, 0, 1, 2, 4).reshape(rows, -1)
    by_bits = lambda _s, p0, p1: p0 + np.lexsort(raw[p0:p1].T[::-1])  # noqa: E731
    z = _wg_unpack(zx, rows, lt, planes, rows)
    act = _sorted_up(z, w1p, w1s, w3p, w3s, offsets, np.arange(rows), 1, lt, ie, beta, beta_lin, has_lin, e,
                     by_bits)
    _wg_pack(act, actx, planes, rows)


def _emu_moe_down_wg(actx, w2p, w2s, offsets, sorted_, y, rows, lt, ie, e, mode):
    """mxfp4_experts_wgmma_down_f32: y[sorted[p]] = W2_e act[p] (rows of dropped slots untouched)."""
    lt, ie, e = int(lt), int(ie), int(e)
    act = _wg_unpack(actx, int(offsets[e]), ie, int(mode) & 3, rows)
    _sorted_down(act, w2p, w2s, offsets, sorted_, y, lt, ie, e, _wg_canonical)


def _emu_combine_ids(y, idx, w, out, t, k, lt, e):
    """moe_combine_ids_f32: moe_combine_f32 over the slots with an expert id in [0, e) only."""
    t, k, lt = int(t), int(k), int(lt)
    ids = idx.reshape(-1)[:t * k]
    ok = torch.from_numpy((ids >= 0) & (ids < int(e))).view(t, k, 1)
    Y = torch.where(ok, _t(y).reshape(-1)[:t * k * lt].view(t, k, lt), torch.zeros((), dtype=torch.float32))
    out.reshape(-1)[:t * lt] = torch.einsum("tk,tkl->tl", _t(w).reshape(-1)[:t * k].view(t, k), Y).numpy().reshape(-1)


def _emu_gemv_tc(x, w, out, y, tickets, m, n, k, kslice, npieces):
    """kernels/bf16.cu gemv_bf16_tc_f32: x in `npieces` (3 or 1) bf16 pieces (each the rounded residual of
    the ones before), exact products summed in f64 per K slice; out [ceil(K / kslice), M, N] partials
    (y itself for one slice), then with several slices their sum in slice order, in f32, into y (what
    the last block of each row block does; the tickets end at 0)."""
    m, n, k, ks = int(m), int(n), int(k), int(kslice)
    xv = x.reshape(-1)[:m * k].astype(np.float32)
    pieces = []
    for _ in range(int(npieces)):
        b = bf16_bits(xv)
        pieces.append(bf16_value(b).astype(np.float64))
        xv = (xv - bf16_value(b)).astype(np.float32)
    xs = sum(pieces).reshape(m, k)
    wv = bf16_value(w.reshape(-1)[:n * k]).astype(np.float64).reshape(n, k)
    for s, k0 in enumerate(range(0, k, ks)):
        part = xs[:, k0:k0 + ks] @ wv[:, k0:k0 + ks].T
        out.reshape(-1)[s * m * n:(s + 1) * m * n] = part.astype(np.float32).reshape(-1)
    splits = len(range(0, k, ks))
    if splits > 1:
        acc = np.zeros(m * n, dtype=np.float32)
        for j in range(splits):
            acc += out.reshape(-1)[j * m * n:(j + 1) * m * n]
        y.reshape(-1)[:m * n] = acc
    assert not tickets.any(), "tickets are 0 between launches"


def _split3(x):
    """f32 x as the sum of its three bf16 pieces (bf16.cu / mla.cu split3), in float64."""
    xv, acc = np.asarray(x, dtype=np.float32), 0.0
    for _ in range(3):
        b = bf16_bits(xv)
        acc = acc + bf16_value(b).astype(np.float64)
        xv = (xv - bf16_value(b)).astype(np.float32)
    return acc


def _emu_mla_absorb_bf16(q, kv_b, qt, items, heads, nope, rope, v_dim, kv_lora):
    """kernels/mla.cu mla_absorb_q_bf16: q_nope in three bf16 pieces times bf16 W_UK, exact products
    summed in f64; q_r copied."""
    n, h, nope, rope, lkv = int(items), int(heads), int(nope), int(rope), int(kv_lora)
    Q = q.reshape(-1)[:n * h * (nope + rope)].reshape(n, h, nope + rope)
    W = bf16_value(kv_b.reshape(-1)[:h * (nope + int(v_dim)) * lkv]).astype(np.float64).reshape(h, -1, lkv)
    out = qt.reshape(-1)[:n * h * (lkv + rope)].reshape(n, h, lkv + rope)
    out[..., :lkv] = np.einsum("nhp,hpl->nhl", _split3(Q[..., :nope]), W[:, :nope]).astype(np.float32)
    out[..., lkv:] = Q[..., nope:]


def _emu_mla_out_proj_bf16(lat, kv_b, o, items, heads, nope, v_dim, kv_lora):
    """kernels/mla.cu mla_out_proj_bf16: lat in three bf16 pieces times bf16 W_UV, f64 sums."""
    n, h, nope, vd, lkv = int(items), int(heads), int(nope), int(v_dim), int(kv_lora)
    L = _split3(lat.reshape(-1)[:n * h * lkv]).reshape(n, h, lkv)
    W = bf16_value(kv_b.reshape(-1)[:h * (nope + vd) * lkv]).astype(np.float64).reshape(h, -1, lkv)
    o.reshape(-1)[:n * h * vd] = np.einsum("nhl,hvl->nhv", L, W[:, nope:]).astype(np.float32).reshape(-1)


def _stack_rows(offsets, p):
    """Stacked hi / lo rows of sorted position p (kernels/moe_gemm.cu)."""
    e = int(np.searchsorted(offsets, p, side="right")) - 1
    cnt = int(offsets[e + 1] - offsets[e])
    return int(offsets[e]) + p, int(offsets[e]) + p + cnt


def _emu_gather_split(z, sorted_, offsets, experts, top_k, lt, xs, inv):
    lt = int(lt)
    X, Z = xs.reshape(-1, lt), z.reshape(-1, lt)
    for p, a in enumerate(sorted_):
        h, lo = _stack_rows(offsets, p)
        X[h], X[lo] = split_bf16(Z[int(a) // int(top_k)])
        inv[int(a)] = p


def _emu_to_bf16(packed, scales, lst, count, rows, cols, out, stride, row0):
    rows, cols = int(rows), int(cols)
    for i in range(int(count)):
        e = int(lst[i])
        w = rmx.dequantize(_t(packed).view(-1, rows, cols // 2)[e], _t(scales).view(-1, rows, cols // 32)[e])
        base = i * int(stride) + int(row0) * cols
        out.reshape(-1)[base:base + rows * cols] = bf16_bits(w.float().numpy()).reshape(-1)


def _emu_glu_split(h, offsets, experts, p0, p1, ie, beta, beta_lin, has_lin, act):
    ie = int(ie)
    H, A = h.reshape(-1, 2 * ie), act.reshape(-1, ie)
    for p in range(int(p0), int(p1)):
        hr, lr = _stack_rows(offsets, p)
        g = _t(H[hr, :ie].astype(np.float32) + H[lr, :ie]).double()
        u = _t(H[hr, ie:].astype(np.float32) + H[lr, ie:]).double()
        A[hr], A[lr] = split_bf16(ref_situ_glu(g, u, float(beta), float(beta_lin) if has_lin else None).float().numpy())


def _emu_combine_split(y, inv, offsets, experts, w, out, top_k, lt):
    k, lt = int(top_k), int(lt)
    Y, O, W = y.reshape(-1, lt), out.reshape(-1, lt), w.reshape(-1, k)
    for t in range(O.shape[0]):
        acc = np.zeros(lt, dtype=np.float64)
        for j in range(k):
            hr, lr = _stack_rows(offsets, int(inv[t * k + j]))
            acc += float(W[t, j]) * (Y[hr].astype(np.float64) + Y[lr])
        O[t] = acc


EMU = {
    "rms_norm_f32": _emu_rms_norm,
    "gated_head_norm_f32": _emu_gated_head_norm,
    "situ_glu_packed_f32": lambda gu, out, rows, ie, b, bl, hl: out.__setitem__(slice(None), ref_situ_glu(
        _t(gu).view(int(rows), 2, int(ie))[:, 0].double(), _t(gu).view(int(rows), 2, int(ie))[:, 1].double(), float(b),
        float(bl) if hl else None).float().numpy().reshape(out.shape)),
    "situ_glu_f32": _emu_situ_glu,
    "add_assign_f32": lambda p, a, n: p.__setitem__(slice(None), p + a),
    "sigmoid_mul_f32": lambda o, g, n: o.__setitem__(slice(None), o * torch.sigmoid(_t(g)).numpy()),
    "embed_rows_f32": lambda tab, ids, out, t, dm, v: out.__setitem__(slice(None), _t(tab).view(int(v), int(dm))[
        torch.from_numpy(ids.astype(np.int64))].numpy()),
    "embed_rows_bf16": lambda tab, ids, out, t, dm, v: out.__setitem__(slice(None), _t(tab.view(np.int16)).view(
        torch.bfloat16).view(int(v), int(dm))[torch.from_numpy(ids.astype(np.int64))].float().numpy()),
    "attn_res_f32": _emu_attn_res,
    "router_topk_f32": _emu_router,
    "topk_segments_f32": _emu_topk_segments,
    "topk_merge_f32": _emu_topk_merge,
    "kda_decode_lines_f32": _emu_kda_decode,  # grid (4H, N) of 128-thread clusters
    "kda_conv_silu_f32": _emu_kda_conv,
    "kda_prep_f32": _emu_kda_prep,
    "kda_chunk_fwd_f32": _emu_kda_chunk,
    "kda_prefill_record_f32": _emu_kda_chunk_rec,  # 8 chunks per block (float64 here)
    "kda_prefill_scan_f32": _emu_kda_chunk_scan,  # 128-thread blocks (key-split)
    "mla_append_rows_f32": lambda kv_a, nw, arena, dst, t, lkv, rope, eps: [arena.__setitem__(
        slice(int(dst[i]), int(dst[i]) + int(lkv) + int(rope)), np.concatenate([ref_rms_norm(
            _t(kv_a).view(int(t), -1)[i, :int(lkv)].double(), _t(nw).double(), float(eps)).float().numpy(),
            kv_a.reshape(int(t), -1)[i, int(lkv):]])) for i in range(int(t))],
    "mla_absorb_q_f32": lambda q, kvb, qt, items, heads, nope, rope, vd, lkv: qt.__setitem__(slice(None), torch.cat([
        torch.einsum("nhp,hpl->nhl", _t(q).view(int(items), int(heads), -1)[..., :int(nope)].double(),
                     _t(kvb).view(int(heads), int(nope) + int(vd), int(lkv))[:, :int(nope)].double()),
        _t(q).view(int(items), int(heads), -1)[..., int(nope):].double()], -1).float().numpy().reshape(qt.shape)),
    "mla_attend_tf32_f32": lambda *a: _emu_mla_attend(*a[:-1]),  # mode: rounding / prefetch / probe only
    "mla_attend_bf16_f32": _emu_mla_attend_bf16,
    "mla_attend_pair_wgmma_f32": _emu_mla_attend_wg,  # block pairs: the same partials
    "mla_merge_f32": _emu_mla_merge,  # grid (items, heads, kv_lora / 128)
    "mla_out_proj_f32": _emu_mla_out_proj,
    "mla_absorb_q_bf16": _emu_mla_absorb_bf16,
    "mla_out_proj_bf16": _emu_mla_out_proj_bf16,
    "mla_prefill_gather_f32": _emu_mla_prefill_gather,
    "mla_prefill_softmax_f32": _emu_mla_prefill_softmax,
    "mla_prefill_flash_bf16": _emu_mla_prefill_flash,
    "moe_sort_assignments": _emu_sort,
    "bf16_split_rows_f32": lambda x, xs, n, planes: [xs.reshape(-1).__setitem__(slice(k * int(n), (k + 1) * int(n)), h)
                                                     for k, h in enumerate(split_bf16(x.reshape(-1)[:int(n)])[:int(planes)])],
    "sum_row_halves_f32": lambda c, y, n: y.reshape(-1).__setitem__(
        slice(0, int(n)), c.reshape(-1)[:int(n)] + c.reshape(-1)[int(n):2 * int(n)]),
    "gemv_bf16_tc_f32": _emu_gemv_tc,
    "bf16_to_f32": lambda b, out, n: out.reshape(-1).__setitem__(slice(0, int(n)), bf16_value(b.reshape(-1)[:int(n)])),
    "moe_gather_split_bf16": _emu_gather_split,
    "mxfp4_to_bf16_experts": _emu_to_bf16,
    "moe_glu_split_bf16": _emu_glu_split,
    "moe_combine_split_f32": _emu_combine_split,
    "mxfp4_experts_single_token_up_f32": _emu_moe_up_single_token,  # the per-part sums, counters zeroed
    "mxfp4_experts_single_token_down_f32": _emu_moe_down_single_token,  # down + the folded combine
    "mxfp4_experts_few_tokens_split_f32": lambda x, xs, rows, cols, planes: _few_tokens_pack(
        x.reshape(-1)[:int(rows) * int(cols)].reshape(int(rows), int(cols)), xs, int(planes)),
    "mxfp4_experts_few_tokens_up_f32": _emu_moe_up_few_tokens,  # planes in, act split out (the few-token layout end to end)
    "mxfp4_experts_few_tokens_down_f32": _emu_moe_down_few_tokens,
    "mxfp8_quantize_f32": _emu_mxfp8_quantize,
    "mxfp4_experts_few_tokens_up_e4m3": _emu_moe_up_e4m3,
    "mxfp4_experts_few_tokens_down_e4m3": _emu_moe_down_e4m3,
    "moe_combine_ids_f32": _emu_combine_ids,
    "mxfp4_experts_wgmma_split_f32": _emu_wg_split,  # gathered into sorted order, chunk-major
    "mxfp4_experts_wgmma_up_f32": _emu_moe_up_wg,  # wgmma layout in and out, `planes` bf16 pieces per value
    "mxfp4_experts_wgmma_down_f32": _emu_moe_down_wg,
    "moe_combine_f32": lambda y, w, out, t, k, lt: out.__setitem__(slice(None), torch.einsum(
        "tk,tkl->tl", _t(w).view(int(t), int(k)), _t(y).view(int(t), int(k), int(lt))).numpy().reshape(out.shape)),
}
EMU.update(KDA_REPLAY_EMU)  # kernels/kda_decode.cu's ReplaySSM verify and commit (checks_kda_replay.py)
EMU.update(VISION_EMU)  # kernels/vision.cu (checks_vision.py)
