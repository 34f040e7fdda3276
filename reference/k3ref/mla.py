"""Gated NoPE MLA: naive (expanded) and absorbed (latent-only) forms (docs/k3-model.md §4)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attnres import RMSNormW
from .config import K3Config
from .norm import rms_norm


class MLA(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.h, self.p, self.r, self.vd = h, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.lq, self.lkv, self.eps = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rms_norm_eps
        self.scale = (self.p + self.r) ** -0.5
        self.q_a_proj = nn.Linear(d, self.lq, bias=False)
        self.q_a_layernorm = RMSNormW(self.lq)
        self.q_b_proj = nn.Linear(self.lq, h * (self.p + self.r), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.lkv + self.r, bias=False)
        self.kv_a_layernorm = RMSNormW(self.lkv)
        self.kv_b_proj = nn.Linear(self.lkv, h * (self.p + self.vd), bias=False)
        self.g_proj = nn.Linear(d, h * self.vd, bias=False)
        self.o_proj = nn.Linear(h * self.vd, d, bias=False)

    def latents(self, x):
        """Cache rows [c̄_kv (Lkv) ; k_r (R)] for the new tokens."""
        a = self.kv_a_proj_with_mqa(x)
        c = rms_norm(a[..., : self.lkv], self.kv_a_layernorm.weight, self.eps)
        return torch.cat([c, a[..., self.lkv:]], dim=-1)

    def queries(self, x):
        b, t, _ = x.shape
        cq = rms_norm(self.q_a_proj(x), self.q_a_layernorm.weight, self.eps)
        q = self.q_b_proj(cq).view(b, t, self.h, self.p + self.r)
        return q[..., : self.p], q[..., self.p:]

    def _finish(self, x, o):
        b, t = x.shape[:2]
        o = o * torch.sigmoid(self.g_proj(x)).view(b, t, self.h, self.vd)
        return self.o_proj(o.reshape(b, t, self.h * self.vd))

    def forward(self, x, past: torch.Tensor | None = None, absorbed: bool = False):
        """x [B, T, d] (normed); past [B, Tp, Lkv+R] latent rows. Returns (y, latent rows of all Tp+T tokens)."""
        lat = self.latents(x)
        rows = lat if past is None else torch.cat([past.to(lat.dtype), lat], dim=1)
        o = self._attend_absorbed(x, rows) if absorbed else self._attend_naive(x, rows)
        return self._finish(x, o), rows

    def _attend_naive(self, x, rows):
        b, t, _ = x.shape
        ta = rows.shape[1]
        q_nope, q_r = self.queries(x)
        kv = self.kv_b_proj(rows[..., : self.lkv]).view(b, ta, self.h, self.p + self.vd)
        k_nope, v = kv[..., : self.p], kv[..., self.p:]
        k_r = rows[..., self.lkv:].unsqueeze(2).expand(b, ta, self.h, self.r)
        q = torch.cat([q_nope, q_r], -1).transpose(1, 2)  # [B, H, T, P+R]
        k = torch.cat([k_nope, k_r], -1).transpose(1, 2)
        vv = v.transpose(1, 2)
        if t == ta and x.is_cuda and x.dtype != torch.float64:
            # training path: fused causal attention; pad v to the qk width for kernels that need equal dims
            pad = (self.p + self.r) - self.vd
            o = F.scaled_dot_product_attention(q, k, F.pad(vv, (0, pad)) if pad > 0 else vv, is_causal=True,
                                               scale=self.scale)[..., : self.vd]
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale
            s = s.float() if s.dtype != torch.float64 else s
            pos_q = torch.arange(ta - t, ta, device=x.device)
            mask = torch.arange(ta, device=x.device)[None, :] > pos_q[:, None]
            s = s.masked_fill(mask, float("-inf"))
            o = torch.softmax(s, -1).to(vv.dtype) @ vv
        return o.transpose(1, 2)  # [B, T, H, Vd]

    def absorbed_weights(self):
        w = self.kv_b_proj.weight.view(self.h, self.p + self.vd, self.lkv)
        return w[:, : self.p], w[:, self.p:]  # W_UK [H, P, Lkv], W_UV [H, Vd, Lkv]

    def _attend_absorbed(self, x, rows):
        b, t, _ = x.shape
        ta = rows.shape[1]
        q_nope, q_r = self.queries(x)
        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.einsum("bthp,hpl->bthl", q_nope, w_uk)
        qt = torch.cat([q_lat, q_r], -1)  # [B, T, H, Lkv+R]
        s = torch.einsum("bthc,bjc->bhtj", qt, rows) * self.scale
        s = s.float() if s.dtype != torch.float64 else s
        pos_q = torch.arange(ta - t, ta, device=x.device)
        mask = torch.arange(ta, device=x.device)[None, :] > pos_q[:, None]
        a = torch.softmax(s.masked_fill(mask, float("-inf")), -1).to(rows.dtype)
        o_lat = torch.einsum("bhtj,bjl->bthl", a, rows[..., : self.lkv])
        return torch.einsum("bthl,hvl->bthv", o_lat, w_uv)
