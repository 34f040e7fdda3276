"""Helpers shared by device_check.py, emulators.py and benchmarks.py: the log, the error and
grid arithmetic, the KDA state-arena layout with its float64 reference, and the KDA prefill launch
sequence (the packing and launches the Rust backend does). A module of its own so the three can
import it without importing each other (device_check.py runs as __main__)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "reference"))
from k3ref import kda as rk  # noqa: E402

if TYPE_CHECKING:
    from device_check import Device

COPY_TBPS = 4.25  # anchors.md: device-to-device copy, bytes read + written


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
