"""The vision tower's kernels (kernels/vision.cu; docs/vision.md): their emulators for --dry-run, computed
with reference/k3ref/vision.py in float64 (emulators.py adds VISION_EMU to EMU). The device check of these
kernels is the Rust device test `vision_ops_match_cpu` (host/backend-cuda/tests/device/vision.rs)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import common  # noqa: F401  (puts reference/ on sys.path)
from k3ref.vision import rope_2d


def _flat(a):
    return a.reshape(-1)


def _emu_add_bias(x, b, n, cols):
    n, cols = int(n), int(cols)
    xs = _flat(x)[:n].astype(np.float64).reshape(-1, cols) + _flat(b)[:cols].astype(np.float64)
    _flat(x)[:n] = xs.reshape(-1)


def _emu_gelu_tanh(x, n):
    n = int(n)
    v = torch.from_numpy(_flat(x)[:n].astype(np.float64))
    _flat(x)[:n] = F.gelu(v, approximate="tanh").numpy()


def _emu_vision_rope(qkv, qk, n, heads, hd, grid_w, theta):
    n, heads, hd, grid_w = int(n), int(heads), int(hd), int(grid_w)
    x = torch.from_numpy(_flat(qkv)[: n * 3 * heads * hd].astype(np.float64)).view(n, 3, heads, hd)
    idx = torch.arange(n)
    rows, cols = idx // grid_w, idx % grid_w
    q, k = (rope_2d(x[:, s], rows, cols, float(theta)) for s in (0, 1))  # [n, heads, hd]
    out = torch.stack([q, k]).permute(0, 2, 1, 3)  # [2, heads, n, hd]
    _flat(qk)[: out.numel()] = out.reshape(-1).numpy()


def _emu_vision_attention(qk, qkv, out, n, heads, hd):
    n, heads, hd = int(n), int(heads), int(hd)
    r = torch.from_numpy(_flat(qk)[: 2 * heads * n * hd].astype(np.float64)).view(2, heads, n, hd)
    v = torch.from_numpy(_flat(qkv)[: n * 3 * heads * hd].astype(np.float64)).view(n, 3, heads, hd)[:, 2]
    att = torch.softmax(torch.einsum("hid,hjd->hij", r[0], r[1]) / hd ** 0.5, -1)
    o = torch.einsum("hij,jhd->ihd", att, v).reshape(n, heads * hd)
    _flat(out)[: o.numel()] = o.reshape(-1).numpy()


def _emu_merge_patches(x, y, grid_h, grid_w, cols, merge):
    gh, gw, cols, m = int(grid_h), int(grid_w), int(cols), int(merge)
    xs = _flat(x)[: gh * gw * cols].reshape(gh // m, m, gw // m, m, cols)
    _flat(y)[: gh * gw * cols] = xs.transpose(0, 2, 1, 3, 4).reshape(-1)


VISION_EMU = {
    "add_bias_f32": _emu_add_bias,
    "gelu_tanh_f32": _emu_gelu_tanh,
    "vision_rope_f32": _emu_vision_rope,
    "vision_attention_f32": _emu_vision_attention,
    "merge_patches_f32": _emu_merge_patches,
}


def check_vision(d, r, gen):
    """Each vision kernel against reference/k3ref/vision.py on a 4x6 patch grid, 3 heads of 64."""
    from common import rand, rel_err

    gh, gw, heads, hd, m = 4, 6, 3, 64, 2
    n, width = gh * gw, heads * hd
    dev = lambda x: d.view(x.float().contiguous().to(d.tdev))  # noqa: E731
    x = rand(n, width, gen=gen).double()
    b = rand(width, gen=gen).double()
    X = x.float().to(d.tdev)
    d.launch("add_bias_f32", 8, 128, d.view(X), dev(b), n * width, width)
    d.launch("gelu_tanh_f32", 8, 128, d.view(X), n * width)
    d.sync()
    r.check("vision add_bias + gelu_tanh", rel_err(X.cpu().double(), F.gelu(x + b, approximate="tanh")), 1e-6)

    qkv = rand(n, 3 * width, gen=gen).double()
    idx = torch.arange(n)
    parts = qkv.view(n, 3, heads, hd)
    q, k = (rope_2d(parts[:, s], idx // gw, idx % gw, 10000.0) for s in (0, 1))
    att = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / hd ** 0.5, -1)
    want = torch.einsum("hij,jhd->ihd", att, parts[:, 2]).reshape(n, width)
    QK = torch.zeros(2 * heads * n * hd, device=d.tdev)
    O = torch.zeros(n * width, device=d.tdev)
    QKV = dev(qkv)
    d.launch("vision_rope_f32", 16, 128, QKV, d.view(QK), n, heads, hd, gw, 10000.0)
    d.launch("vision_attention_f32", ((n + 3) // 4, heads), 128, d.view(QK), QKV, d.view(O), n, heads, hd)
    d.sync()
    r.check("vision_rope + vision_attention", rel_err(O.cpu().double().view(n, width), want), 1e-5)

    Y = torch.zeros(n * width, device=d.tdev)
    d.launch("merge_patches_f32", 8, 128, dev(x), d.view(Y), gh, gw, width, m)
    d.sync()
    merged = x.view(gh // m, m, gw // m, m, width).permute(0, 2, 1, 3, 4).reshape(-1)
    r.exact("vision merge_patches", torch.equal(Y.cpu().double(), merged.float().double()))
