"""A small native-resolution vision tower and projector for k3-mini (issue 22; not trained yet).

The shape of K3's own tower at toy width:

- **Patches.** An RGB image whose sides are multiples of 32 (the media stage resizes to that) is cut
  into 16×16 patches in row-major order; each patch's pixels, scaled to [-1, 1], are flattened
  (row, column, channel) into 768 values and projected to `width`.
- **Encoder.** `layers` pre-norm blocks (RMSNorm, multi-head self-attention over all of the image's
  patches, RMSNorm, GELU MLP). Position is 2-D RoPE: the first half of each head's dimensions
  rotates with the patch's row, the second half with its column, so the tower takes any grid
  without a position table and attention depends only on relative offsets.
- **Merger and projector.** Each 2×2 block of patches (row-major over the merged grid) is
  concatenated (4 × `width`), normalised, and mapped by a two-layer GELU MLP to the decoder's
  `hidden_size`: one image token per 32×32 pixels. Those rows replace the embeddings of the
  `<|media_pad|>` tokens the prompt holds for the image (one per image token), so a 64×96 image is
  2×3 = 6 tokens and a 192×192 one 36.

Weights are named `vision_tower.*` and `multi_modal_projector.*` (`VisionConfig` gives the sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PATCH = 16
MERGE = 2


@dataclass(frozen=True)
class VisionConfig:
    width: int = 192
    layers: int = 4
    heads: int = 3
    mlp: int = 768
    hidden_size: int = 256  # the decoder's
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def image_tokens(height: int, width: int) -> int:
    """Image tokens (decoder rows) of an image of this size."""
    if height % (PATCH * MERGE) or width % (PATCH * MERGE):
        raise ValueError(f"{height}x{width} is not a multiple of {PATCH * MERGE} on each side")
    return (height // (PATCH * MERGE)) * (width // (PATCH * MERGE))


def patchify(image: np.ndarray) -> tuple[torch.Tensor, tuple[int, int]]:
    """uint8 [H, W, 3] -> patches [N, 768] in [-1, 1] (row-major patch order) and the grid (rows, cols)."""
    h, w, c = image.shape
    image_tokens(h, w)
    if c != 3:
        raise ValueError("an RGB image is needed")
    x = torch.from_numpy(np.ascontiguousarray(image)).double() / 127.5 - 1.0
    gh, gw = h // PATCH, w // PATCH
    p = x.reshape(gh, PATCH, gw, PATCH, 3).permute(0, 2, 1, 3, 4).reshape(gh * gw, PATCH * PATCH * 3)
    return p, (gh, gw)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, theta: float) -> torch.Tensor:
    """x [N, heads, hd]: the first hd/2 dims rotate by the row, the rest by the column (each half
    in rotate-half pairs)."""
    hd = x.shape[-1]
    quarter = hd // 4
    inv = theta ** (-torch.arange(quarter, dtype=torch.float64) / quarter)

    def rot(part, pos):
        a = pos.double()[:, None] * inv[None, :]
        cos, sin = a.cos()[:, None, :].to(part.dtype), a.sin()[:, None, :].to(part.dtype)
        x1, x2 = part[..., :quarter], part[..., quarter:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    return torch.cat([rot(x[..., : hd // 2], rows), rot(x[..., hd // 2:], cols)], -1)


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.norm1 = nn.Parameter(torch.ones(w))
        self.qkv = nn.Linear(w, 3 * w)
        self.proj = nn.Linear(w, w)
        self.norm2 = nn.Parameter(torch.ones(w))
        self.fc1 = nn.Linear(w, cfg.mlp)
        self.fc2 = nn.Linear(cfg.mlp, w)

    def forward(self, x, rows, cols):
        c = self.cfg
        n = x.shape[0]
        q, k, v = self.qkv(rms_norm(x, self.norm1, c.eps)).view(n, 3, c.heads, c.head_dim).unbind(1)
        q, k = rope_2d(q, rows, cols, c.rope_theta), rope_2d(k, rows, cols, c.rope_theta)
        att = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / c.head_dim ** 0.5, -1)
        o = torch.einsum("hij,jhd->ihd", att, v).reshape(n, c.width)
        x = x + self.proj(o)
        return x + self.fc2(F.gelu(self.fc1(rms_norm(x, self.norm2, c.eps)), approximate="tanh"))


class VisionTower(nn.Module):
    """Patches of one image -> its image tokens [rows/2 · cols/2, hidden_size]."""

    def __init__(self, cfg: VisionConfig = VisionConfig()):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(PATCH * PATCH * 3, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.merge_norm = nn.Parameter(torch.ones(MERGE * MERGE * cfg.width))
        self.proj1 = nn.Linear(MERGE * MERGE * cfg.width, cfg.hidden_size)
        self.proj2 = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def encode(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        gh, gw = grid
        rows = torch.arange(gh).repeat_interleave(gw)
        cols = torch.arange(gw).repeat(gh)
        x = self.patch_embed(patches)
        for b in self.blocks:
            x = b(x, rows, cols)
        return x

    def merge(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """[gh·gw, width] -> [gh/2 · gw/2, 4·width]: each 2×2 block's patches in row-major order."""
        gh, gw = grid
        w = x.shape[-1]
        return (x.view(gh // MERGE, MERGE, gw // MERGE, MERGE, w).permute(0, 2, 1, 3, 4)
                .reshape((gh // MERGE) * (gw // MERGE), MERGE * MERGE * w))

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        m = self.merge(self.encode(patches, grid), grid)
        m = rms_norm(m, self.merge_norm, self.cfg.eps)
        return self.proj2(F.gelu(self.proj1(m), approximate="tanh"))
