"""A small native-resolution vision tower and projector for k3-mini (issue 22).

The shape of K3's own tower at toy width (the contract the Rust side implements: the module names below
are the tensor names of `models/k3-mini/vision.safetensors`):

- **Patches.** An RGB image whose sides are multiples of 32 (the media stage resizes to that) is cut
  into 16×16 patches in row-major order; each patch's pixels, scaled to [-1, 1] (x/127.5 - 1), are
  flattened (row, column, channel) into 768 values and projected to `width` (`vision_tower.patch_embed`).
- **Encoder.** `layers` pre-norm blocks (`vision_tower.blocks.{i}`: RMSNorm, multi-head self-attention
  over all of the image's patches, non-causal, RMSNorm, GELU-tanh MLP). Position is 2-D RoPE: the first
  half of each head's dimensions rotates with the patch's row, the second half with its column
  (rotate-half pairs), so the tower takes any grid without a position table and attention depends only on
  relative offsets.
- **Merger and projector** (`multi_modal_projector`). Each 2×2 block of patches (row-major inside the
  block; blocks row-major over the merged grid) is concatenated (4 × `width`), normalised (`merge_norm`),
  and mapped by a two-layer GELU-tanh MLP (`proj1`, `proj2`) to the decoder's `hidden_size`: one image
  token per 32×32 pixels. Those rows replace the embeddings of the `<|media_pad|>` tokens the prompt holds
  for the image (one per image token), so a 64×96 image is 2×3 = 6 tokens and a 192×192 one 36.

`VisionTower.forward` takes one image (any float dtype: float64 for golden vectors); `forward_batch`
takes several images of different sizes, padded, with a key mask (training, evaluation).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PATCH = 16
MERGE = 2
PATCH_DIM = PATCH * PATCH * 3


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

    def to_json(self, weights: str = "vision.safetensors", max_pixels: int = 65536, min_pixels: int = 1024) -> dict:
        """`vision_config` of the model's config.json (`hidden_size` there is the tower's width)."""
        return {"weights": weights, "patch_size": PATCH, "merge_size": MERGE, "hidden_size": self.width,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "intermediate_size": self.mlp, "rope_theta": self.rope_theta, "rms_norm_eps": self.eps,
                "max_pixels": max_pixels, "min_pixels": min_pixels}

    @classmethod
    def from_json(cls, d: dict, decoder_hidden: int) -> "VisionConfig":
        if d.get("patch_size", PATCH) != PATCH or d.get("merge_size", MERGE) != MERGE:
            raise ValueError("only 16-px patches with a 2x2 merge are implemented")
        return cls(width=d["hidden_size"], layers=d["num_hidden_layers"], heads=d["num_attention_heads"],
                   mlp=d["intermediate_size"], hidden_size=decoder_hidden, rope_theta=d["rope_theta"],
                   eps=d["rms_norm_eps"])


def image_tokens(height: int, width: int) -> int:
    """Image tokens (decoder rows) of an image of this size."""
    if height % (PATCH * MERGE) or width % (PATCH * MERGE) or height <= 0 or width <= 0:
        raise ValueError(f"{height}x{width} is not a multiple of {PATCH * MERGE} on each side")
    return (height // (PATCH * MERGE)) * (width // (PATCH * MERGE))


def normalise(image: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [H, W, 3] in [-1, 1], as the media stage does."""
    return image.astype(np.float32) / np.float32(127.5) - np.float32(1.0)


def chw_pixels(image: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] -> the media stage's CHW float32 (`pixels[(c*H + y)*W + x]`)."""
    return np.ascontiguousarray(normalise(image).transpose(2, 0, 1))


def patches_from_hwc(x: np.ndarray | torch.Tensor):
    """Normalised [H, W, 3] (NumPy or torch, any float dtype) -> [N, 768] in row-major patch order, each
    patch (row-in-patch, col-in-patch, channel), and the grid (rows, cols)."""
    h, w, c = x.shape
    image_tokens(h, w)
    if c != 3:
        raise ValueError("an RGB image is needed")
    gh, gw = h // PATCH, w // PATCH
    r = x.reshape(gh, PATCH, gw, PATCH, 3)
    r = r.transpose(1, 2) if isinstance(r, torch.Tensor) else r.transpose(0, 2, 1, 3, 4)
    return r.reshape(gh * gw, PATCH_DIM), (gh, gw)


def patchify(image: np.ndarray) -> tuple[torch.Tensor, tuple[int, int]]:
    """uint8 [H, W, 3] -> float64 patches [N, 768] in [-1, 1] and the grid (rows, cols)."""
    x = torch.from_numpy(np.ascontiguousarray(image)).double() / 127.5 - 1.0
    p, grid = patches_from_hwc(x)
    return p.contiguous(), grid


def patchify_chw(pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """The media stage's CHW pixels [3, H, W] -> patches [N, 768] (the Rust side's input path)."""
    p, grid = patches_from_hwc(pixels.permute(1, 2, 0))
    return p.contiguous(), grid


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., N, heads, hd], rows/cols [..., N]: the first hd/2 dims rotate by the row, the rest by the
    column (each half in rotate-half pairs). Angles in float64, then cast to x's dtype."""
    hd = x.shape[-1]
    quarter = hd // 4
    inv = theta ** (-torch.arange(quarter, dtype=torch.float64, device=x.device) / quarter)

    def rot(part, pos):
        a = pos.double()[..., None] * inv
        cos, sin = a.cos()[..., None, :].to(part.dtype), a.sin()[..., None, :].to(part.dtype)
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

    def forward(self, x, rows, cols, key_ok: torch.Tensor | None = None):
        """x [B, N, W]; rows/cols [B, N]; key_ok [B, N] (False for padding) or None."""
        c = self.cfg
        b, n, _ = x.shape
        q, k, v = self.qkv(rms_norm(x, self.norm1, c.eps)).view(b, n, 3, c.heads, c.head_dim).unbind(2)
        q, k = rope_2d(q, rows, cols, c.rope_theta), rope_2d(k, rows, cols, c.rope_theta)
        mask = None if key_ok is None else key_ok[:, None, None, :]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, c.width))
        return x + self.fc2(F.gelu(self.fc1(rms_norm(x, self.norm2, c.eps)), approximate="tanh"))


class VisionEncoder(nn.Module):
    """`vision_tower.*`: patch embedding and the blocks."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embed = nn.Linear(PATCH_DIM, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))


class Projector(nn.Module):
    """`multi_modal_projector.*`: the 2×2 merge's norm and the two-layer MLP into the decoder's width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merge_norm = nn.Parameter(torch.ones(MERGE * MERGE * cfg.width))
        self.proj1 = nn.Linear(MERGE * MERGE * cfg.width, cfg.hidden_size)
        self.proj2 = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, merged: torch.Tensor, eps: float) -> torch.Tensor:
        return self.proj2(F.gelu(self.proj1(rms_norm(merged, self.merge_norm, eps)), approximate="tanh"))


def grid_positions(grid: tuple[int, int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    gh, gw = grid
    return (torch.arange(gh, device=device).repeat_interleave(gw), torch.arange(gw, device=device).repeat(gh))


def merge_order(grid: tuple[int, int]) -> torch.Tensor:
    """[gh/2 · gw/2, 4] patch indices: merged token (i, j) takes patches (2i+a, 2j+b), (a, b) row-major."""
    gh, gw = grid
    i = torch.arange(gh // MERGE)[:, None, None, None]
    j = torch.arange(gw // MERGE)[None, :, None, None]
    a = torch.arange(MERGE)[None, None, :, None]
    b = torch.arange(MERGE)[None, None, None, :]
    return ((MERGE * i + a) * gw + MERGE * j + b).reshape(-1, MERGE * MERGE)


class VisionTower(nn.Module):
    """Patches of an image -> its image tokens [rows/2 · cols/2, hidden_size]."""

    def __init__(self, cfg: VisionConfig = VisionConfig()):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionEncoder(cfg)
        self.multi_modal_projector = Projector(cfg)

    def encode(self, patches: torch.Tensor, grid: tuple[int, int], collect: list | None = None) -> torch.Tensor:
        """[N, 768] -> [N, width]; `collect` receives the patch embedding and every block's output."""
        rows, cols = grid_positions(grid, patches.device)
        x = self.vision_tower.patch_embed(patches)[None]
        if collect is not None:
            collect.append(x[0])
        for b in self.vision_tower.blocks:
            x = b(x, rows[None], cols[None])
            if collect is not None:
                collect.append(x[0])
        return x[0]

    def merge(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """[gh·gw, width] -> [gh/2 · gw/2, 4·width]: each 2×2 block's patches in row-major order."""
        return x[merge_order(grid).to(x.device)].reshape(-1, MERGE * MERGE * x.shape[-1])

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        return self.multi_modal_projector(self.merge(self.encode(patches, grid), grid), self.cfg.eps)

    def forward_batch(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Several images: patches [B, Nmax, 768] (each image's rows first, then padding) -> the image
        tokens of each, [n_i, hidden_size]. Padding never reaches a valid row (masked keys; the merge
        gathers valid patches only)."""
        b, nmax, _ = patches.shape
        dev = patches.device
        counts = [gh * gw for gh, gw in grids]
        key_ok = torch.arange(nmax, device=dev)[None, :] < torch.tensor(counts, device=dev)[:, None]
        rows = torch.zeros(b, nmax, dtype=torch.long)
        cols = torch.zeros(b, nmax, dtype=torch.long)
        mmax = max(c // (MERGE * MERGE) for c in counts)
        order = torch.zeros(b, mmax, MERGE * MERGE, dtype=torch.long)
        for i, g in enumerate(grids):
            r, c = grid_positions(g)
            rows[i, : counts[i]], cols[i, : counts[i]] = r, c
            mo = merge_order(g)
            order[i, : mo.shape[0]] = mo
        rows, cols, order = rows.to(dev), cols.to(dev), order.to(dev)
        x = self.vision_tower.patch_embed(patches)
        for blk in self.vision_tower.blocks:
            x = blk(x, rows, cols, key_ok)
        w = x.shape[-1]
        merged = torch.gather(x, 1, order.reshape(b, -1, 1).expand(-1, -1, w)).reshape(b, mmax, MERGE * MERGE * w)
        out = self.multi_modal_projector(merged, self.cfg.eps)
        return [out[i, : counts[i] // (MERGE * MERGE)] for i in range(b)]
