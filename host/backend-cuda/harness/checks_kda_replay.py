"""ReplaySSM for KDA (kernels/kda_decode.cu: kda_verify_lines_f32, kda_commit_lines_f32; the Rust side is
host/backend-cuda/src/kda/replay.rs): the check device_check.py runs, and the two kernels' emulators for
--dry-run (emulators.py adds KDA_REPLAY_EMU to EMU).

Record layout (floats from the record's start, T tokens): per head h and token t at (h*T + t) * 385: k-hat [128],
v [128], exp(g) [128], beta; then the pre-conv q, k, v rows [3, T, H*128]."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from common import kda_reference, kda_region_floats, pack_kda_region, rand, rel_err, unpack_kda_region
from k3ref import kda as rk

if TYPE_CHECKING:
    from device import Device, Results

REC_HEAD = 3 * 128 + 1


def record_floats(t, heads):
    return t * heads * REC_HEAD + 3 * t * heads * 128


def _t(a):
    return torch.from_numpy(a)


def _emu_kda_verify(q_in, k_in, v_in, f_in, b_in, cq, ck, cv, a_log, dt_bias, arena, state_off, ckpt_off, rec_off,
                    seq_row, seq_tokens, o_out, n_seqs, heads, conv, lb):
    heads, conv = int(heads), int(conv)
    hk, A = heads * 128, _t(arena)
    convw = [_t(c).view(hk, conv).double() for c in (cq, ck, cv)]
    for n in range(int(n_seqs)):
        r0, t = int(seq_row[n]), int(seq_tokens[n])
        rows = lambda x, w: _t(x).reshape(-1)[r0 * w:(r0 + t) * w].view(t, w).double()  # noqa: E731
        xq, xk, xv, f = (rows(x, hk) for x in (q_in, k_in, v_in, f_in))
        b = rows(b_in, heads)
        w, S = unpack_kda_region(A, int(state_off[n]), hk, conv, heads)
        win = [x.double().clone() for x in w]
        ro, rS, rw, _ = kda_reference(xq, xk, xv, f, b, convw, _t(a_log).double(), _t(dt_bias).double(), win,
                                      S.double().clone(), heads, float(lb))
        o_out.reshape(-1)[r0 * hk:(r0 + t) * hk] = ro.float().numpy().reshape(-1)
        if rec_off[n] < 0:  # a plain decode: state, windows and checkpoint after its tokens
            for dst in [int(state_off[n])] + ([int(ckpt_off[n])] if ckpt_off[n] >= 0 else []):
                pack_kda_region(A, dst, [x.float() for x in rw], rS.float())
            continue
        ys = [F.silu(rk.short_conv(x[None], cw[:, None, :], wi.t()[None])[0][0]) for x, cw, wi in
              zip((xq, xk, xv), convw, win)]
        k = rk.l2norm(ys[1].view(1, t, heads, 128))[0]
        g = rk.kda_gate(f.view(1, t, heads, 128), _t(a_log).double(), _t(dt_bias).double(), float(lb))[0]
        head = torch.cat([k, ys[2].view(t, heads, 128), torch.exp(g), torch.sigmoid(b)[..., None]], -1)
        flat = torch.cat([head.transpose(0, 1).reshape(-1), torch.stack([xq, xk, xv]).reshape(-1)]).float()
        A[int(rec_off[n]):int(rec_off[n]) + flat.numel()] = flat


def _emu_kda_commit(arena, state_off, rec_off, rec_tokens, accepted, n_commits, heads, conv):
    heads, conv = int(heads), int(conv)
    hk, A = heads * 128, _t(arena)
    for n in range(int(n_commits)):
        t, acc, base = int(rec_tokens[n]), int(accepted[n]), int(rec_off[n])
        if not 1 <= acc <= t:
            continue
        w, S = unpack_kda_region(A, int(state_off[n]), hk, conv, heads)
        head = A[base:base + heads * t * REC_HEAD].view(heads, t, REC_HEAD).double().transpose(0, 1)[None, :acc]
        pre = A[base + heads * t * REC_HEAD:base + record_floats(t, heads)].view(3, t, hk).double()
        k, v, alpha, beta = head[..., :128], head[..., 128:256], head[..., 256:384], head[..., 384]
        _, S1, _ = rk.kda_recurrent(torch.zeros_like(k), k, v, torch.log(alpha), beta, 1.0,
                                    initial_state=S.double()[None])
        wins = [torch.cat([w[i].double(), pre[i, :acc].t()], 1)[:, acc:] for i in range(3)]
        pack_kda_region(A, int(state_off[n]), [x.float() for x in wins], S1[0].float())


KDA_REPLAY_EMU = {
    "kda_verify_lines_f32": _emu_kda_verify,  # grid (4H, N) of 128-thread clusters, as decode
    "kda_commit_lines_f32": _emu_kda_commit,  # grid (4H, N) of independent 128-thread blocks
}


def check_kda_verify(d: Device, r: Results, gen):
    """One verify launch over a verifying sequence (T tokens, rows 1..T, its state only 4-byte aligned) and a plain
    decode (row 0, with a checkpoint); then one commit launch of accepted 3, T and 0 of the verified block into
    three copies of its state. Against kda_reference (float64) of the same tokens."""
    heads, conv, lb, t = 3, 4, -5.0, 5
    hk, reg = heads * 128, kda_region_floats(heads * 128, conv, heads)
    convw = [rand(hk, conv, scale=0.5, gen=gen) for _ in range(3)]
    a_log, dt_bias = rand(heads, scale=0.5, gen=gen), rand(hk, scale=0.5, gen=gen)
    xs = [[rand(n, hk, gen=gen) for _ in range(4)] + [rand(n, heads, gen=gen)] for n in (t, 1)]
    win = [[rand(hk, conv - 1, gen=gen) for _ in range(3)] for _ in range(2)]
    S0 = [rand(heads, 128, 128, scale=0.1, gen=gen) for _ in range(2)]
    # Slots: verify state, decode state, decode checkpoint, three commit copies, then the record.
    at = [11 + i * (reg + 8) for i in range(6)]
    rec = at[5] + reg + 5
    arena = torch.zeros(rec + record_floats(t, heads) + 16, dtype=torch.float64)
    pack_kda_region(arena, at[0], win[0], S0[0])
    pack_kda_region(arena, at[1], win[1], S0[1])
    ref_v = kda_reference(*xs[0][:5], convw, a_log, dt_bias, win[0], S0[0], heads, lb, emit_at=(3,))
    ref_d = kda_reference(*xs[1][:5], convw, a_log, dt_bias, win[1], S0[1], heads, lb)
    dev = lambda x: d.view(x.float().contiguous().to(d.tdev))  # noqa: E731
    i64 = lambda v: d.view(torch.tensor(v, dtype=torch.int64).to(d.tdev))  # noqa: E731
    i32 = lambda v: d.view(torch.tensor(v, dtype=torch.int32).to(d.tdev))  # noqa: E731
    A = arena.float().to(d.tdev)
    before = A.cpu().clone()
    o = torch.full((t + 1, hk), float("nan"), device=d.tdev)
    stacked = [dev(torch.cat([xs[1][i], xs[0][i]])) for i in range(5)]  # row 0: the decode, rows 1..t: the verify
    d.launch("kda_verify_lines_f32", (4 * heads, 2), 128, *stacked, *[dev(c) for c in convw], dev(a_log),
             dev(dt_bias), d.view(A), i64([at[0], at[1]]), i64([-1, at[2]]), i64([rec, -1]), i32([1, 0]), i32([t, 1]),
             d.view(o), 2, heads, conv, lb)
    d.sync()
    got = A.cpu()
    r.check("kda_verify o (verify of 5)", rel_err(o.cpu()[1:], ref_v[0]), 2e-5)
    r.check("kda_verify o (decode in the same launch)", rel_err(o.cpu()[:1], ref_d[0]), 2e-5)
    same = torch.equal(got[at[0]:at[0] + reg], before[at[0]:at[0] + reg])
    r.exact("kda_verify leaves the verified state and windows unchanged", same)
    es, ew = 0.0, 0.0
    for slot in (at[1], at[2]):
        gw, gS = unpack_kda_region(got.double(), slot, hk, conv, heads)
        es = max(es, rel_err(gS, ref_d[1]))
        ew = max(ew, max(rel_err(a, b) for a, b in zip(gw, ref_d[2])))
    r.check("kda_verify decode state (+checkpoint)", es, 2e-5)
    r.check("kda_verify decode windows (+checkpoint)", ew, 1e-6)

    for slot in at[3:6]:
        A[slot:slot + reg] = A[at[0]:at[0] + reg]
    d.launch("kda_commit_lines_f32", (4 * heads, 3), 128, d.view(A), i64(at[3:6]), i64([rec] * 3), i32([t] * 3),
             i32([3, t, 0]), 3, heads, conv)
    d.sync()
    got = A.cpu().double()
    want = {at[3]: ref_v[3][3], at[4]: (ref_v[1], ref_v[2])}
    for slot, (wS, ww) in want.items():
        gw, gS = unpack_kda_region(got, slot, hk, conv, heads)
        n = 3 if slot == at[3] else t
        r.check(f"kda_commit state ({n} of {t})", rel_err(gS, wS), 2e-5)
        r.check(f"kda_commit windows ({n} of {t})", max(rel_err(a, b) for a, b in zip(gw, ww)), 1e-6)
    r.exact("kda_commit of 0 leaves the state", torch.equal(A.cpu()[at[5]:at[5] + reg], before[at[0]:at[0] + reg]))
