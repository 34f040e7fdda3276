"""Kimi Delta Attention: gate, short conv, token-recurrent and chunked (WY/UT) forms (docs/k3-model.md §3).

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g (log decay, <= 0) [B, T, H, K]; beta [B, T, H];
state S [B, H, K, V] (S[k][v]). `emit_at` lists token counts n (1..T) after which the state is also returned:
the in-pass checkpoints of the serving engine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import compute_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """Safe gate: g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)) in (lb, 0); f is [..., H, K]."""
    h, k = f.shape[-2], f.shape[-1]
    dt = compute_dtype(f)
    a = torch.exp(a_log.to(dt)).view(h, 1)
    return lower_bound * torch.sigmoid(a * (f.to(dt) + dt_bias.to(dt).view(h, k)))


def short_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None):
    """Causal depthwise conv (no activation). x [B, T, C], weight [C, 1, W], window [B, W-1, C] of previous
    pre-conv inputs (zeros at sequence start). Returns (y [B, T, C], new window)."""
    b, t, c = x.shape
    w = weight.shape[-1]
    if window is None:
        window = x.new_zeros(b, w - 1, c)
    xx = torch.cat([window.to(x.dtype), x], dim=1)
    y = F.conv1d(xx.transpose(1, 2), weight.to(x.dtype), groups=c).transpose(1, 2)
    return y, xx[:, xx.shape[1] - (w - 1):].contiguous()


def kda_recurrent(q, k, v, g, beta, scale: float, initial_state=None, emit_at=()):
    """Token-by-token delta rule: S <- diag(exp g) S; u = beta (v - S^T k); S += k u^T; o = S^T (scale q)."""
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    dt = compute_dtype(q)
    S = torch.zeros(b, h, kd, vd, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt).clone()
    o = torch.empty(b, t, h, vd, dtype=dt, device=q.device)
    emitted = {}
    want = set(emit_at)
    for i in range(t):
        S = S * torch.exp(g[:, i].to(dt)).unsqueeze(-1)
        kt = k[:, i].to(dt)
        u = beta[:, i].to(dt).unsqueeze(-1) * (v[:, i].to(dt) - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        o[:, i] = torch.einsum("bhkv,bhk->bhv", S, q[:, i].to(dt) * scale)
        if i + 1 in want:
            emitted[i + 1] = S.clone()
    return o.to(q.dtype), S, emitted


def kda_chunked(q, k, v, g, beta, scale: float, initial_state=None, chunk: int = 64, emit_at=()):
    """Exact chunked (WY / UT-transform) form; decay differences are exponentiated directly (no factorisation),
    so it is the numerically honest reference. Emits states at `emit_at` from inside the pass."""
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    dt = compute_dtype(q)
    tr = lambda x: x.to(dt).transpose(1, 2)  # noqa: E731  [B, H, T, *]
    qh, kh, vh, gh = tr(q), tr(k), tr(v), tr(g)
    bh = beta.to(dt).transpose(1, 2)  # [B, H, T]
    S = torch.zeros(b, h, kd, vd, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt).clone()
    o = torch.empty(b, h, t, vd, dtype=dt, device=q.device)
    emitted = {}
    for c0 in range(0, t, chunk):
        c1 = min(c0 + chunk, t)
        c = c1 - c0
        qc, kc, vc, bc = qh[:, :, c0:c1] * scale, kh[:, :, c0:c1], vh[:, :, c0:c1], bh[:, :, c0:c1]
        G = gh[:, :, c0:c1].cumsum(2)  # [B, H, C, K]
        incl = torch.tril(torch.ones(c, c, dtype=torch.bool, device=q.device))
        strict = torch.tril(incl, -1)
        diff = G.unsqueeze(3) - G.unsqueeze(2)  # [B, H, i, j, K] = G_i - G_j
        E = torch.exp(diff.masked_fill(~incl[..., None], float("-inf")))
        L = torch.einsum("bhid,bhijd,bhjd->bhij", kc, E, kc) * bc.unsqueeze(-1) * strict
        A = torch.einsum("bhid,bhijd,bhjd->bhij", qc, E, kc) * incl
        eye = torch.eye(c, dtype=dt, device=q.device)
        Tm = torch.linalg.solve_triangular(eye + L, torch.diag_embed(bc), upper=False)
        W = Tm @ (torch.exp(G) * kc)
        U = Tm @ vc
        Vt = U - W @ S  # the delta-rule corrections
        o[:, :, c0:c1] = (qc * torch.exp(G)) @ S + A @ Vt
        for n in emit_at:
            if c0 < n <= c1:
                m = n - c0
                Gm = G[:, :, m - 1]
                Kd = torch.exp(Gm.unsqueeze(2) - G[:, :, :m]) * kc[:, :, :m]
                emitted[n] = torch.exp(Gm).unsqueeze(-1) * S + Kd.transpose(-1, -2) @ Vt[:, :, :m]
        Gl = G[:, :, -1]
        S = torch.exp(Gl).unsqueeze(-1) * S + (torch.exp(Gl.unsqueeze(2) - G) * kc).transpose(-1, -2) @ Vt
    return o.transpose(1, 2).to(q.dtype), S, emitted


def kda_chunked_fast(q, k, v, g, beta, scale: float, initial_state=None, chunk: int = 64, sub: int = 16):
    """Training form: 64-token chunks (few sequential steps, few kernel launches), with the intra-chunk decay
    factorised around the start r of each 16-token row block: exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j).
    Both factors stay inside fp32 range (|G_i - G_r| <= 5*16 with the safe gate; G_r - G_j <= 0 for earlier
    blocks), and entries above the diagonal are masked before the exponential. Exact in exact arithmetic."""
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    nsub = chunk // sub
    pad = (-t) % chunk
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (t + pad) // chunk
    rs = lambda x: x.transpose(1, 2).reshape(b, h, n, chunk, x.shape[-1])  # noqa: E731
    qc, kc, vc, gc = rs(q), rs(k), rs(v), rs(g)
    bc = beta.transpose(1, 2).reshape(b, h, n, chunk)
    G = gc.cumsum(3)  # [B, H, N, C, K]
    dev = q.device
    pos = torch.arange(chunk, device=dev)
    ref = torch.arange(nsub, device=dev) * sub  # start of each row block
    Gr = G[:, :, :, ref]  # [B, H, N, nsub, K]
    rowblk = (pos // sub)
    # exp(G_i - G_r(i)) for rows, exp(G_r - G_j) for columns j < r + sub (else masked to 0 before exp)
    e_row = torch.exp(G - Gr[:, :, :, rowblk])  # [B, H, N, C, K]
    col_ok = pos[None, :] < (ref[:, None] + sub)  # [nsub, C]
    col_exp = (Gr.unsqueeze(4) - G.unsqueeze(3)).masked_fill(~col_ok[:, :, None], float("-inf"))
    e_col = torch.exp(col_exp)  # [B, H, N, nsub, C, K]
    kp = (kc * e_row).view(b, h, n, nsub, sub, kd)
    qp = (qc * scale * e_row).view(b, h, n, nsub, sub, kd)
    km = kc.unsqueeze(3) * e_col  # [B, H, N, nsub, C, K]
    L = torch.einsum("bhnisd,bhnicd->bhnisc", kp, km).reshape(b, h, n, chunk, chunk)
    A = torch.einsum("bhnisd,bhnicd->bhnisc", qp, km).reshape(b, h, n, chunk, chunk)
    incl = pos[None, :] <= pos[:, None]
    strict = pos[None, :] < pos[:, None]
    L = L * bc.unsqueeze(-1) * strict
    A = A * incl
    eye = torch.eye(chunk, dtype=dt, device=dev)
    Tm = torch.linalg.solve_triangular(eye + L, torch.diag_embed(bc), upper=False)
    eG = torch.exp(G)
    W, U = Tm @ (kc * eG), Tm @ vc
    qg = qc * scale * eG
    Gl = G[:, :, :, -1]  # [B, H, N, K]
    kd_end = kc * torch.exp(Gl.unsqueeze(3) - G)
    decay = torch.exp(Gl).unsqueeze(-1)
    S = torch.zeros(b, h, kd, vd, dtype=dt, device=dev) if initial_state is None else initial_state.to(dt)
    outs = []
    # unbind once: one backward node per tensor instead of one select per chunk
    for Ui, Wi, qi, Ai, ki, di in zip(U.unbind(2), W.unbind(2), qg.unbind(2), A.unbind(2), kd_end.unbind(2),
                                      decay.unbind(2)):
        Vt = Ui - Wi @ S
        outs.append(qi @ S + Ai @ Vt)
        S = di * S + ki.transpose(-1, -2) @ Vt
    o = torch.stack(outs, 2).reshape(b, h, n * chunk, vd)[:, :, :t].transpose(1, 2)
    return o, S
