"""DSpark block drafter for k3-mini (docs/k3-model.md is the target; the drafter's contract is the spec that
host/dspark implements too): a parallel stage that drafts a whole block in one pass from tapped target hidden
states, a rank-r Markov head that makes the block's tokens depend on each other left to right, and a
confidence head that predicts each drafted token's acceptance given the ones before it were accepted.

Forward of one block (anchor token `a` at absolute position P, context = feature rows of processed positions
p < P, the most recent `context_window` of them):
  c_p = RMSNorm(taps_p fcᵀ, hidden_norm)                           features, once per processed position
  x   = [embed[a]; mask_embedding × (γ-1)]                           block rows at positions P .. P+γ-1
  per layer: pre-norm attention over keys [context ; block] (RoPE at absolute positions, non-causal inside
  the block, context K/V projected from c_p without a norm), then a SiLU-gated MLP
  y   = RMSNorm(x, norm);  U = y lm_headᵀ                              base logits, row k-1 predicts P+k
  logits_k = U_k + w1[x_{k-1}] w2,  x_0 = a                          Markov head, left to right
  z_k = confidence · [y_k ; w1[x_{k-1}]] + b;  c_k = sigmoid(z_k / T_k)

The embedding and LM head are the target's (frozen, not stored with the drafter). Linear weights are
[out, in]. Everything here runs in float64 too (the unit tests use it).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attnres import RMSNormW
from .norm import compute_dtype, rms_norm


@dataclass
class DSparkConfig:
    target_taps: list[int] = field(default_factory=lambda: [2, 5, 8])
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = 7
    markov_rank: int = 64
    context_window: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vocab_size: int = 8192
    confidence_temperatures: list[float] = field(default_factory=lambda: [1.0] * 7)

    def validate(self) -> None:
        if len(self.confidence_temperatures) != self.block_size:
            raise ValueError("confidence_temperatures needs block_size entries")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotate-half RoPE)")

    def to_json(self) -> dict:
        return {"model_type": "k3_dspark"} | dataclasses.asdict(self)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "DSparkConfig":
        with open(path) as f:
            d = json.load(f)
        if d.pop("model_type", None) != "k3_dspark":
            raise ValueError(f"{path}: not a k3_dspark config")
        cfg = cls(**d)
        cfg.validate()
        return cfg


def target_taps(target, ids: torch.Tensor, layers, **forward_kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target once: (logits [B, T, V], tap rows [B, T, ntaps*d] in the taps' list order)."""
    taps = {int(l): None for l in layers}
    logits = target(ids, taps=taps, **forward_kw)
    missing = [l for l, t in taps.items() if t is None]
    if missing:
        raise ValueError(f"target has no tap for layers {missing}")
    return logits, torch.cat([taps[int(l)] for l in layers], dim=-1)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotate-half RoPE over the whole head dim. x [..., S, H, hd], pos [..., S] (absolute, integer).
    Angles are formed in float64 so long positions lose nothing before cos/sin."""
    hd = x.shape[-1]
    half = hd // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / hd)
    ang = pos.to(torch.float64).unsqueeze(-1) * inv_freq  # [..., S, half]
    dt = compute_dtype(x)
    cos, sin = ang.cos().to(dt).unsqueeze(-2), ang.sin().to(dt).unsqueeze(-2)  # broadcast over heads
    xf = x.to(dt)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        d, hh, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size
        self.input_norm = RMSNormW(d)
        self.q_proj = nn.Linear(d, hh, bias=False)
        self.k_proj = nn.Linear(d, hh, bias=False)
        self.v_proj = nn.Linear(d, hh, bias=False)
        self.o_proj = nn.Linear(hh, d, bias=False)
        self.post_norm = RMSNormW(d)
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(vocab, rank) * rank ** -0.5)
        # zero: the head starts as "no dependence on the previous token" and grows from the CE/TV gradient
        self.w2 = nn.Parameter(torch.zeros(rank, vocab))


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DSparkConfig, embed: torch.Tensor, lm_head: torch.Tensor):
        """`embed` [V, d] and `lm_head` [V, d] are the target's; kept as non-persistent buffers (frozen, not
        exported)."""
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d, r = cfg.hidden_size, cfg.markov_rank
        if embed.shape != (cfg.vocab_size, d) or lm_head.shape != (cfg.vocab_size, d):
            raise ValueError("embedding / lm_head shapes do not match the drafter config")
        self.fc = nn.Linear(len(cfg.target_taps) * d, d, bias=False)
        self.hidden_norm = RMSNormW(d)
        self.mask_embedding = nn.Parameter(torch.randn(d) * float(embed.float().std()))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNormW(d)
        self.markov = MarkovHead(cfg.vocab_size, r)
        self.confidence = nn.Linear(d + r, 1, bias=True)
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().clone(), persistent=False)
        self._init_weights()

    def _init_weights(self):
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear) and name != "confidence":
                nn.init.normal_(mod.weight, std=out_std if name.endswith(("o_proj", "down_proj")) else std)
        nn.init.zeros_(self.confidence.weight)
        nn.init.zeros_(self.confidence.bias)

    # ---- parallel stage --------------------------------------------------------------------------------
    def features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., ntaps*d] -> c [..., d]."""
        return rms_norm(self.fc(taps.to(self.fc.weight.dtype)), self.hidden_norm.weight, self.cfg.rms_norm_eps)

    def block_hidden(self, feats: torch.Tensor, feat_pos: torch.Tensor, anchor: torch.Tensor,
                     anchor_pos: torch.Tensor) -> torch.Tensor:
        """Blocks for A anchors per sequence, all sharing the sequence's context rows.

        feats [B, T, d] feature rows; feat_pos [B, T] their absolute positions (-1: no row);
        anchor [B, A] tokens; anchor_pos [B, A] positions P. An anchor sees the rows with
        P - context_window <= pos < P. Returns y [B, A, γ, d]."""
        cfg = self.cfg
        b, t, d = feats.shape
        a, g = anchor.shape[1], cfg.block_size
        h, hd, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        dev = feats.device
        # the residual stream stays in the parameters' dtype (float32 under autocast)
        x = torch.cat([self.embed[anchor].unsqueeze(2),
                       self.mask_embedding.to(self.embed.dtype).expand(b, a, g - 1, d)], dim=2).reshape(b, a * g, d)
        qpos = (anchor_pos.unsqueeze(-1) + torch.arange(g, device=dev)).reshape(b, a * g)
        fp = feat_pos.unsqueeze(1)  # [B, 1, T]
        ap = anchor_pos.unsqueeze(-1)  # [B, A, 1]
        ctx_ok = (fp >= 0) & (fp < ap) & (fp >= ap - cfg.context_window)  # [B, A, T]
        ctx_ok = ctx_ok.repeat_interleave(g, dim=1)  # [B, A*γ, T]
        blk = torch.arange(a, device=dev).repeat_interleave(g)
        blk_ok = (blk.unsqueeze(1) == blk.unsqueeze(0)).expand(b, a * g, a * g)  # same anchor: non-causal
        allowed = torch.cat([ctx_ok, blk_ok], dim=-1).unsqueeze(1)  # [B, 1, A*γ, T + A*γ]
        kpos = feat_pos.clamp_min(0)
        for layer in self.layers:
            u = rms_norm(x, layer.input_norm.weight, eps)
            q = rope(layer.q_proj(u).view(b, a * g, h, hd), qpos, cfg.rope_theta)
            kb = rope(layer.k_proj(u).view(b, a * g, h, hd), qpos, cfg.rope_theta)
            vb = layer.v_proj(u).view(b, a * g, h, hd)
            kc = rope(layer.k_proj(feats).view(b, t, h, hd), kpos, cfg.rope_theta)
            vc = layer.v_proj(feats).view(b, t, h, hd)
            k = torch.cat([kc, kb], dim=1).transpose(1, 2)  # [B, H, T + A*γ, hd]
            v = torch.cat([vc, vb], dim=1).transpose(1, 2)
            s = (q.transpose(1, 2) @ k.transpose(-1, -2)).to(compute_dtype(q)) / math.sqrt(hd)
            p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
            o = (p.to(v.dtype) @ v).transpose(1, 2).reshape(b, a * g, h * hd)
            x = x + layer.o_proj(o)
            z = rms_norm(x, layer.post_norm.weight, eps)
            x = x + layer.down_proj(F.silu(layer.gate_proj(z)) * layer.up_proj(z))
        return rms_norm(x, self.norm.weight, eps).view(b, a, g, d)

    # ---- sequential stage ------------------------------------------------------------------------------
    def base_logits(self, y: torch.Tensor) -> torch.Tensor:
        return y @ self.lm_head.to(y.dtype).t()

    def step_logits(self, base: torch.Tensor, y: torch.Tensor, prev: torch.Tensor):
        """One Markov step for any leading shape: base [..., V], y [..., d], prev [...] (x_{k-1}).
        Returns (logits [..., V], confidence logit z [...])."""
        e = self.markov.w1[prev]
        logits = base + (e @ self.markov.w2).to(base.dtype)
        z = self.confidence(torch.cat([y, e.to(y.dtype)], dim=-1)).squeeze(-1)
        return logits, z

    def calibrated(self, z: torch.Tensor) -> torch.Tensor:
        """c_k = sigmoid(z_k / T_k); z [..., γ]."""
        temps = torch.tensor(self.cfg.confidence_temperatures, dtype=z.dtype, device=z.device)
        return torch.sigmoid(z / temps)

    @torch.no_grad()
    def markov_decode(self, y: torch.Tensor, anchor: torch.Tensor, *, greedy: bool = True,
                      temperature: float = 1.0, generator: torch.Generator | None = None):
        """Draft left to right from y [..., γ, d] with x_0 = anchor [...]. Greedy takes the argmax (ties to the
        lower id); otherwise x_k ~ softmax(logits_k / temperature). Returns dict with tokens [..., γ], logits
        [..., γ, V] (the processed draft distribution is softmax(logits / temperature)), z [..., γ]."""
        base = self.base_logits(y)
        prev = anchor
        toks, logits_all, zs = [], [], []
        for k in range(self.cfg.block_size):
            logits, z = self.step_logits(base[..., k, :], y[..., k, :], prev)
            if greedy:
                prev = torch.argmax(logits, dim=-1)
            else:
                probs = torch.softmax(logits.to(compute_dtype(logits)) / temperature, dim=-1)
                flat = probs.reshape(-1, probs.shape[-1])
                prev = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
            toks.append(prev)
            logits_all.append(logits)
            zs.append(z)
        return {"tokens": torch.stack(toks, -1), "logits": torch.stack(logits_all, -2), "z": torch.stack(zs, -1)}

    @torch.no_grad()
    def draft(self, feats: torch.Tensor, feat_pos: torch.Tensor, anchor: int, position: int, **kw):
        """One block for one sequence: feats [T, d] with positions feat_pos [T]; returns markov_decode's dict
        (leading dims dropped) plus y [γ, d]."""
        dev = feats.device
        y = self.block_hidden(feats.unsqueeze(0), feat_pos.unsqueeze(0), torch.tensor([[anchor]], device=dev),
                              torch.tensor([[position]], device=dev))[0, 0]
        out = self.markov_decode(y, torch.tensor(anchor, device=dev), **kw)
        out["y"] = y
        return out


def position_weights(block_size: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/γ), k = 1..γ."""
    return torch.exp(-torch.arange(block_size, dtype=dtype, device=device) / block_size)


def dspark_loss(drafter: DSparkDrafter, y: torch.Tensor, prev: torch.Tensor, teacher_logits: torch.Tensor,
                row_k: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Training loss over N valid block rows (spec: 0.1 CE(target argmax) + 0.9 TV + 1.0 BCE(c, 1 - TV), each
    row weighted by exp(-(k-1)/γ), normalised by the weights' sum).

    y [N, d] drafter rows; prev [N] the Markov input x_{k-1} (the sequence's token); teacher_logits [N, V] the
    target's logits at the row's position; row_k [N] the row's k-1 (0..γ-1)."""
    base = drafter.base_logits(y)
    dt = compute_dtype(base)
    logits, z = drafter.step_logits(base.to(dt), y, prev)  # the Markov sum in float32 even under autocast
    logp_d = torch.log_softmax(logits.to(dt), dim=-1)
    p_t = torch.softmax(teacher_logits.to(dt), dim=-1)
    ce = -logp_d.gather(-1, p_t.argmax(-1, keepdim=True)).squeeze(-1)
    tv = 0.5 * (logp_d.exp() - p_t).abs().sum(-1)
    label = (1.0 - tv).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(z.to(dt), label, reduction="none")
    w = position_weights(drafter.cfg.block_size, dt, y.device)[row_k]
    wsum = w.sum().clamp_min(1e-12)
    parts = {"ce": (w * ce).sum() / wsum, "tv": (w * tv).sum() / wsum, "bce": (w * bce).sum() / wsum,
             "agree": (logits.argmax(-1) == p_t.argmax(-1)).detach(), "row_k": row_k}
    total = 0.1 * parts["ce"] + 0.9 * parts["tv"] + 1.0 * parts["bce"]
    return total, parts


# ---- files -------------------------------------------------------------------------------------------------
def shared_weights(target) -> tuple[torch.Tensor, torch.Tensor]:
    return target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()


def save_drafter(drafter: DSparkDrafter, out_dir: str) -> None:
    import os

    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    drafter.cfg.save(os.path.join(out_dir, "config.json"))
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_drafter(model_dir: str, target) -> DSparkDrafter:
    """Float32 drafter from a directory written by save_drafter, sharing `target`'s embedding and LM head."""
    import os

    from safetensors.torch import load_file
    cfg = DSparkConfig.load(os.path.join(model_dir, "config.json"))
    embed, head = shared_weights(target)
    drafter = DSparkDrafter(cfg, embed.float().cpu(), head.float().cpu())
    drafter.load_state_dict(load_file(os.path.join(model_dir, "model.safetensors")))
    return drafter.eval()
