"""Router (sigmoid + selection bias, top-k) and K3's Stable LatentMoE with MXFP4 experts (docs/k3-model.md §6)."""
from __future__ import annotations

import torch
import torch.nn as nn

from . import mxfp4
from .attnres import RMSNormW
from .config import K3Config
from .norm import compute_dtype, rms_norm
from .situ import SituMLP, situ_glu


def route(x, gate_w, bias, top_k: int, renormalize: bool = True, scaling: float = 1.0):
    """Returns (idx [N, k], weights [N, k], scores [N, E]). Selection uses scores + bias; weights use scores."""
    dt = compute_dtype(x)
    s = torch.sigmoid(x.to(dt) @ gate_w.to(dt).t())
    idx = torch.topk(s + bias.to(dt), top_k, dim=-1, sorted=True).indices
    w = s.gather(-1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling, s


class Gate(nn.Module):
    def __init__(self, d: int, e: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(e, d))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        d, lt, ie, e = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.cfg = cfg
        self.gate = Gate(d, e)
        self.routed_expert_down_proj = nn.Linear(d, lt, bias=False)
        self.routed_expert_norm = RMSNormW(lt)
        self.routed_expert_up_proj = nn.Linear(lt, d, bias=False)
        # stacked expert weights; exported per expert as MXFP4 `experts.{e}.w{1,2,3}`
        self.experts_w1 = nn.Parameter(torch.randn(e, ie, lt) * lt ** -0.5)
        self.experts_w3 = nn.Parameter(torch.randn(e, ie, lt) * lt ** -0.5)
        self.experts_w2 = nn.Parameter(torch.randn(e, lt, ie) * ie ** -0.5 * 0.5)
        self.shared_experts = SituMLP(d, cfg.shared_expert_intermediate_size, cfg.activation_situ_beta,
                                      cfg.activation_situ_linear_beta)
        self.last_load = None  # tokens per expert in the last forward (training: bias balancing)

    def forward(self, x, fake_quant: bool = False, dense: bool = False):
        cfg = self.cfg
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        idx, w, _ = route(xf, self.gate.weight, self.gate.e_score_correction_bias, cfg.num_experts_per_token,
                          cfg.moe_renormalize, cfg.routed_scaling_factor)
        z = self.routed_expert_down_proj(xf)
        w1, w3, w2 = self.experts_w1, self.experts_w3, self.experts_w2
        if fake_quant:
            w1, w3, w2 = mxfp4.fake_quantize(w1), mxfp4.fake_quantize(w3), mxfp4.fake_quantize(w2)
        beta, beta_lin = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
        if dense:
            # every expert on every token, combined with a sparse weight matrix: fewest kernels for training
            comb = torch.zeros(xf.shape[0], cfg.num_experts, device=x.device, dtype=w.dtype).scatter(1, idx, w)
            hg = torch.einsum("nl,eil->eni", z, w1.to(z.dtype))
            hu = torch.einsum("nl,eil->eni", z, w3.to(z.dtype))
            # training: SiTU in the activation dtype (bf16 under autocast) halves traffic on [E, N, I] tensors
            y = torch.einsum("eni,eli->enl", situ_glu(hg, hu, beta, beta_lin, f32=False), w2.to(z.dtype))
            y_lat = torch.einsum("enl,ne->nl", y.float(), comb.float())
        else:
            dt = compute_dtype(z)
            y_lat = torch.zeros(xf.shape[0], z.shape[-1], dtype=dt, device=x.device)
            for e in torch.unique(idx).tolist():
                rows, slot = (idx == e).nonzero(as_tuple=True)
                ze = z[rows]
                he = situ_glu(ze @ w1[e].to(ze.dtype).t(), ze @ w3[e].to(ze.dtype).t(), beta, beta_lin)
                y_lat.index_add_(0, rows, (he @ w2[e].to(ze.dtype).t()).to(dt) * w[rows, slot].unsqueeze(-1).to(dt))
        if self.training:
            self.last_load = torch.bincount(idx.reshape(-1), minlength=cfg.num_experts)
        y = self.routed_expert_up_proj(rms_norm(y_lat.to(z.dtype), self.routed_expert_norm.weight, cfg.rms_norm_eps))
        return (y + self.shared_experts(xf)).reshape(shp)
