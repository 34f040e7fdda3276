"""Block Attention Residuals (docs/k3-model.md §5)."""
import torch
import torch.nn as nn

from .norm import compute_dtype


def attn_res(p: torch.Tensor, bank: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
             eps: float) -> torch.Tensor:
    """Softmax over sources [bank..., p] of w·RMSNorm(V_i) (static pseudo-query w = norm_w*proj_w); returns
    the weighted sum of the RAW sources."""
    dt = compute_dtype(p)
    V = torch.stack([b.to(dt) for b in bank] + [p.to(dt)], dim=-2)  # [..., n+1, d]
    inv = torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_w.to(dt) * proj_w.to(dt).reshape(-1)
    s = (V * inv * w).sum(-1)
    a = torch.softmax(s, dim=-1)
    return (a.unsqueeze(-1) * V).sum(-2).to(p.dtype)


class RMSNormW(nn.Module):
    """Holds just `weight` so state-dict names match K3's (`*.norm.weight`, `input_layernorm.weight`, ...)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class AttnResParams(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = RMSNormW(d)
        self.proj = nn.Linear(d, 1, bias=False)
        nn.init.zeros_(self.proj.weight)  # uniform mixing at init, as in the paper

    def forward(self, p, bank, eps):
        return attn_res(p, bank, self.norm.weight, self.proj.weight, eps)
