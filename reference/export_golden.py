"""Golden vectors for the Rust backends (docs/model-format.md §Golden vectors).

    python3 reference/export_golden.py --model models/k3-mini --out tests/golden

Per-layer partial sums, logits and greedy continuations of fixed prompts, computed in float32 from the
exported weights (bf16 upcast, MXFP4 dequantised), plus op-level unit vectors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k3ref import mxfp4  # noqa: E402
from k3ref.export import load_exported  # noqa: E402
from k3ref.kda import kda_chunked, kda_gate, kda_recurrent, l2norm  # noqa: E402
from k3ref.moe import route  # noqa: E402
from k3ref.situ import situ_glu  # noqa: E402

PROMPTS = [
    '<|open|>message role="user"<|sep|>What is 47 + 85?<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
    '<|open|>message role="user"<|sep|>Hello! My name is Ada and I live in Oslo. What city do I live in?'
    '<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>',
    '<|open|>message role="system" type="thinking-effort"<|sep|>Thinking effort: low<|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="user"<|sep|>Write one short sentence about the sea, then compute '
    '123 * 4 and explain each digit of the multiplication step by step.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
]
GREEDY_TOKENS = 16


def encode_prompts(model_dir: str, vocab: int) -> list[list[int]]:
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(tok_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
        return [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    g = torch.Generator().manual_seed(7)  # no tokenizer yet: fixed random ids of similar lengths
    return [torch.randint(8, vocab, (n,), generator=g).tolist() for n in (18, 30, 75)]


@torch.no_grad()
def model_vectors(model, prompts) -> dict[str, torch.Tensor]:
    out = {}
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids])
        layers: list[torch.Tensor] = []
        logits = model(x, collect=layers)
        out[f"p{i}.input_ids"] = torch.tensor(ids, dtype=torch.int64)
        for l, p in enumerate(layers):
            out[f"p{i}.layer{l}.p"] = p[0].float().contiguous()
        out[f"p{i}.logits"] = logits[0].float().contiguous()
        out[f"p{i}.greedy"] = torch.tensor(model.generate_greedy(ids, GREEDY_TOKENS), dtype=torch.int64)
    return out


@torch.no_grad()
def op_vectors(model) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    h, k = cfg.kda_num_heads, cfg.kda_head_dim
    scale = k ** -0.5
    # KDA core: normalised q, k; log-decay g; beta; optional initial state; in-pass states at emit points
    for name, t, with_state, emit in [("kda_rec", 6, True, [3]), ("kda_rec_nostate", 4, False, []),
                                       ("kda_chunk", 150, True, [64, 100, 150]),
                                       ("kda_chunk_nostate", 70, False, [1, 64])]:
        q, kk = l2norm(r(1, t, h, k)), l2norm(r(1, t, h, k))
        v = r(1, t, h, k)
        gate = kda_gate(r(1, t, h, k), r(h) * 0.5 + 1.0, r(h * k), cfg.gate_lower_bound)
        beta = torch.sigmoid(r(1, t, h))
        s0 = r(1, h, k, k) * 0.3 if with_state else None
        fn = kda_recurrent if name.startswith("kda_rec") else kda_chunked
        o, s, em = fn(q.double(), kk.double(), v.double(), gate.double(), beta.double(), scale,
                      None if s0 is None else s0.double(), emit_at=emit)
        out.update({f"{name}.q": q[0], f"{name}.k": kk[0], f"{name}.v": v[0], f"{name}.g": gate[0],
                    f"{name}.beta": beta[0], f"{name}.o": o[0].float(), f"{name}.s": s[0].float()})
        if s0 is not None:
            out[f"{name}.s0"] = s0[0]
        for n in emit:
            out[f"{name}.emit{n}"] = em[n][0].float()
    # MLA naive vs absorbed over a latent past, with layer 3's weights (also stored here)
    mla_layer = next(l for l in range(cfg.num_hidden_layers) if cfg.is_mla(l))
    mla = model.model.layers[mla_layer].self_attn
    for n_, p_ in mla.named_parameters():
        out[f"mla.w.{n_}"] = p_.float().contiguous()
    x, past = r(1, 7, cfg.hidden_size), r(1, 5, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    y_n, rows = mla(x, past, absorbed=False)
    y_a, _ = mla(x, past, absorbed=True)
    out.update({"mla.x": x[0], "mla.past": past[0], "mla.rows": rows[0], "mla.y_naive": y_n[0],
                "mla.y_absorbed": y_a[0]})
    # AttnRes
    from k3ref.attnres import attn_res
    p, bank = r(4, cfg.hidden_size), [r(4, cfg.hidden_size) for _ in range(3)]
    nw, pw = r(cfg.hidden_size), r(1, cfg.hidden_size)
    out.update({"attnres.p": p, "attnres.bank": torch.stack(bank), "attnres.norm_w": nw, "attnres.proj_w": pw,
                "attnres.out": attn_res(p, bank, nw, pw, cfg.rms_norm_eps)})
    # router top-k (distinct scores)
    x = r(6, cfg.hidden_size)
    gw, bias = r(cfg.num_experts, cfg.hidden_size) * 0.1, r(cfg.num_experts) * 0.05
    idx, w, _ = route(x, gw, bias, cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
    out.update({"router.x": x, "router.gate_w": gw, "router.bias": bias, "router.idx": idx.to(torch.int64),
                "router.w": w})
    # SiTU-GLU
    gt, up = r(64) * 6, r(64) * 40
    out.update({"situ.gate": gt, "situ.up": up,
                "situ.out": situ_glu(gt, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)})
    # MXFP4 decode of a real expert matrix
    moe_layer = next(l for l in range(cfg.num_hidden_layers) if not cfg.is_dense(l))
    w1 = model.model.layers[moe_layer].block_sparse_moe.experts_w1[0]
    packed, sc = mxfp4.quantize(w1)
    out.update({"mxfp4.packed": packed, "mxfp4.scale": sc, "mxfp4.dequant": mxfp4.dequantize(packed, sc)})
    return {kk_: v_.contiguous() for kk_, v_ in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/k3-mini")
    ap.add_argument("--out", default="tests/golden")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = load_exported(a.model)
    prompts = encode_prompts(a.model, model.cfg.vocab_size)
    os.makedirs(a.out, exist_ok=True)
    mv = model_vectors(model, prompts)
    save_file(mv, os.path.join(a.out, "model.safetensors"),
              metadata={"prompts": str(len(prompts)), "layers": str(model.cfg.num_hidden_layers),
                        "greedy_tokens": str(GREEDY_TOKENS)})
    ov = op_vectors(model)
    save_file(ov, os.path.join(a.out, "ops.safetensors"), metadata={"keys": " ".join(sorted(ov))})
    with open(os.path.join(a.out, "golden.json"), "w") as f:
        json.dump({"prompts": PROMPTS, "input_ids": prompts, "greedy_tokens": GREEDY_TOKENS,
                   "note": "float32 reference from the exported weights; see reference/export_golden.py"}, f, indent=1)
        f.write("\n")
    print("wrote", a.out, {k: tuple(v.shape) for k, v in list(ov.items())[:3]}, "...")


if __name__ == "__main__":
    main()
