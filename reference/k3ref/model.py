"""The K3 decoder (docs/k3-model.md §2) with module names matching K3's tensor names (docs/model-format.md)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attnres import AttnResParams, RMSNormW
from .config import K3Config
from .kda import kda_chunked, kda_chunked_fast, kda_gate, kda_recurrent, l2norm, short_conv
from .mla import MLA
from .moe import LatentMoE
from .norm import rms_norm
from .situ import SituMLP

try:  # fla's Triton kernels: the fast training path on the GPU (same math as kda_chunked)
    from fla.ops.kda import chunk_kda as _fla_chunk_kda
except Exception:  # pragma: no cover - CPU / no fla
    _fla_chunk_kda = None


class KDA(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        d, h, k = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        self.h, self.k, self.lb, self.eps = h, k, cfg.gate_lower_bound, cfg.rms_norm_eps
        p, w = h * k, cfg.short_conv_kernel_size
        self.q_proj = nn.Linear(d, p, bias=False)
        self.k_proj = nn.Linear(d, p, bias=False)
        self.v_proj = nn.Linear(d, p, bias=False)
        self.q_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.k_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.v_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.f_a_proj = nn.Linear(d, cfg.gate_low_rank_dim, bias=False)
        self.f_b_proj = nn.Linear(cfg.gate_low_rank_dim, p, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(h).uniform_(1, 16)))
        dt = torch.exp(torch.empty(p).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.b_proj = nn.Linear(d, h, bias=False)
        self.g_proj = nn.Linear(d, p, bias=False)
        self.o_norm = RMSNormW(k)
        self.o_proj = nn.Linear(p, d, bias=False)

    def forward(self, x, cache: dict | None = None, impl: str = "exact", emit_at=()):
        """x [B, T, d] normed. cache {'conv': (q, k, v windows), 'S': state} is read and replaced."""
        b, t, _ = x.shape
        h, k = self.h, self.k
        wins = cache["conv"] if cache else (None, None, None)
        qc, wq = short_conv(self.q_proj(x), self.q_conv1d.weight, wins[0])
        kc, wk = short_conv(self.k_proj(x), self.k_conv1d.weight, wins[1])
        vc, wv = short_conv(self.v_proj(x), self.v_conv1d.weight, wins[2])
        q = l2norm(F.silu(qc).view(b, t, h, k))
        kk = l2norm(F.silu(kc).view(b, t, h, k))
        v = F.silu(vc).view(b, t, h, k)
        beta = torch.sigmoid(self.b_proj(x))
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(b, t, h, k), self.A_log, self.dt_bias, self.lb)
        s0 = cache["S"] if cache else None
        scale = k ** -0.5
        emitted = {}
        if impl == "fla":
            f32 = torch.float32  # fla's training kernels want one dtype for q/k/v/beta
            o, s = _fla_chunk_kda(q.to(f32), kk.to(f32), v.to(f32), g.float(), beta.to(f32), scale=scale, initial_state=s0,
                                  output_final_state=cache is not None, use_qk_l2norm_in_kernel=False)
        elif impl == "fast":
            o, s = kda_chunked_fast(q, kk, v, g, beta, scale, s0)
        elif t == 1 and not emit_at:
            o, s, emitted = kda_recurrent(q, kk, v, g, beta, scale, s0)
        else:
            o, s, emitted = kda_chunked(q, kk, v, g, beta, scale, s0, emit_at=emit_at)
        if cache is not None:
            cache["conv"], cache["S"] = (wq, wk, wv), s
            cache["emitted"] = emitted
        o = rms_norm(o.to(x.dtype), self.o_norm.weight, self.eps) * torch.sigmoid(self.g_proj(x)).view(b, t, h, k)
        return self.o_proj(o.reshape(b, t, h * k))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer: int):
        super().__init__()
        d = cfg.hidden_size
        self.layer, self.cfg = layer, cfg
        self.input_layernorm = RMSNormW(d)
        self.post_attention_layernorm = RMSNormW(d)
        if layer > 0:
            self.self_attention_res = AttnResParams(d)
        self.mlp_res = AttnResParams(d)
        self.is_kda = cfg.is_kda(layer)
        self.self_attn = KDA(cfg) if self.is_kda else MLA(cfg)
        if cfg.is_dense(layer):
            self.mlp = SituMLP(d, cfg.intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        else:
            self.block_sparse_moe = LatentMoE(cfg)


class K3Inner(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, l) for l in range(cfg.num_hidden_layers))
        self.norm = RMSNormW(cfg.hidden_size)
        self.output_attn_res = AttnResParams(cfg.hidden_size)


class K3ForCausalLM(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.model = K3Inner(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self):
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear) and not name.endswith(".proj"):
                nn.init.normal_(mod.weight, std=out_std if name.endswith(("o_proj", "down_proj", "up_proj")) and
                                "shared" not in name and "mlp" not in name else std)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, std=std)
        for name, mod in self.named_modules():
            if name.endswith(("mlp.down_proj", "shared_experts.down_proj")):
                nn.init.normal_(mod.weight, std=out_std)

    def new_cache(self) -> list[dict]:
        return [{} for _ in range(self.cfg.num_hidden_layers)]

    def forward(self, ids: torch.Tensor, cache: list[dict] | None = None, *, kda_impl: str = "exact",
                moe_dense: bool = False, fake_quant: bool = False, absorbed: bool = False,
                collect: list | None = None, emit_at=(), last_only: bool = False, taps: dict | None = None,
                inputs_embeds: torch.Tensor | None = None):
        """ids [B, T]. With `cache` (from new_cache / a previous call) the call continues the sequence.
        `inputs_embeds` [B, T, d], when given, replaces the embedding lookup of `ids` (image rows spliced in:
        k3ref/vision_data.py splice_embeds); `ids` then only gives the shape.
        `collect` receives p after every layer; `emit_at` asks KDA layers for in-pass states (cache[l]['emitted']).
        `taps` {l: None, ...} is filled with the streams a DSpark drafter reads (docs of k3ref/dspark.py): for
        1 <= l < L the AttnRes-mixed input h of layer l before its input RMSNorm; for l = L the final mix."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        x = self.model.embed_tokens(ids) if inputs_embeds is None else inputs_embeds
        bank: list[torch.Tensor] = []
        p = x
        for l, layer in enumerate(self.model.layers):
            h = layer.self_attention_res(p, bank, eps) if bank else p
            if taps is not None and l in taps:
                taps[l] = h
            if l % cfg.attn_res_block_size == 0:
                bank.append(p)
                p = None
            hn = rms_norm(h, layer.input_layernorm.weight, eps)
            if layer.is_kda:
                lc = None
                if cache is not None:
                    lc = cache[l]
                a = layer.self_attn(hn, lc, impl=kda_impl, emit_at=emit_at)
            else:
                past = cache[l].get("latent") if cache is not None else None
                a, rows = layer.self_attn(hn, past, absorbed=absorbed)
                if cache is not None:
                    cache[l]["latent"] = rows
            p = a if p is None else p + a
            h = layer.mlp_res(p, bank, eps)
            hn = rms_norm(h, layer.post_attention_layernorm.weight, eps)
            f = layer.mlp(hn) if cfg.is_dense(l) else layer.block_sparse_moe(hn, fake_quant=fake_quant,
                                                                              dense=moe_dense)
            p = p + f
            if collect is not None:
                collect.append(p)
        y = self.model.output_attn_res(p, bank, eps)
        if taps is not None and cfg.num_hidden_layers in taps:
            taps[cfg.num_hidden_layers] = y
        if last_only:
            y = y[:, -1:]
        return self.lm_head(rms_norm(y, self.model.norm.weight, eps))

    @torch.no_grad()
    def generate_greedy(self, ids: list[int], max_new: int, stop_ids=(), kda_impl="exact",
                        inputs_embeds: torch.Tensor | None = None) -> list[int]:
        """Greedy decoding with the recurrent/latent caches (batch 1). `inputs_embeds` [1, len(ids), d]
        replaces the prompt's embeddings (image rows spliced in)."""
        dev = self.lm_head.weight.device
        cache = self.new_cache()
        logits = self.forward(torch.tensor([ids], device=dev), cache, kda_impl=kda_impl, last_only=True,
                              inputs_embeds=inputs_embeds)
        out = []
        for _ in range(max_new):
            nxt = int(torch.argmax(logits[0, -1].float()))
            out.append(nxt)
            if nxt in stop_ids:
                break
            logits = self.forward(torch.tensor([[nxt]], device=dev), cache, absorbed=True)
        return out
