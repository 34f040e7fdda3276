"""Golden vectors for host/dspark: an independent NumPy (float64) implementation of the DSpark
drafter's forward pass, exactly as docs/speculative-decoding.md ("DSpark drafter") states it,
over small seeded random weights.

    python3 host/dspark/tests/make_golden.py

writes host/dspark/tests/golden/:
  drafter/config.json, drafter/model.safetensors  -- a tiny drafter (f32)
  target/config.json, target/model.safetensors    -- a tiny kimi_k3 config and the shared
                                                     embedding / LM head only (bf16, as k3-mini)
  golden.safetensors                              -- cases in the layout of host/dspark/src/golden.rs
  golden-export-layout.safetensors                -- one case in the layout of the trainer's export
                                                     (reference/k3ref/dspark_train.py)
Needs only NumPy (the safetensors files are written by hand).
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
SEED = 21

D, LAYERS, HEADS, HD, INTER = 32, 2, 2, 16, 64
V, R, GAMMA, TAPS, WINDOW = 64, 8, 4, 3, 8
EPS, THETA = 1e-5, 10000.0
CONF_TEMPS = [1.0, 1.3, 0.8, 1.6]
TARGET_LAYERS = 3


# ---- safetensors by hand --------------------------------------------------------------------

def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even); the 16 high bits."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_round(x: np.ndarray) -> np.ndarray:
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def save(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """tensors: name -> (dtype, array) with dtype F32, BF16 (uint16 bits) or I64."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dt, a = tensors[name]
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


# ---- the drafter, straight from the spec ----------------------------------------------------

def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def rope(x, pos):
    """x [n, H, hd] at absolute positions pos [n]: NeoX rotate-half over the whole head."""
    half = HD // 2
    inv = THETA ** (-2.0 * np.arange(half) / HD)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def softmax(z, axis=-1):
    z = z - z.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def silu(z):
    return z / (1.0 + np.exp(-z))


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def features(W, taps):
    return rms(taps @ W["fc.weight"].T, W["hidden_norm.weight"])


def block(W, E, LM, C, cpos, anchor, P):
    x = np.stack([E[anchor]] + [W["mask_embedding"]] * (GAMMA - 1))
    bpos = P + np.arange(GAMMA)
    for i in range(LAYERS):
        w = lambda n: W[f"layers.{i}.{n}"]  # noqa: E731
        u = rms(x, w("input_norm.weight"))
        q = rope((u @ w("q_proj.weight").T).reshape(GAMMA, HEADS, HD), bpos)
        kb = rope((u @ w("k_proj.weight").T).reshape(GAMMA, HEADS, HD), bpos)
        vb = (u @ w("v_proj.weight").T).reshape(GAMMA, HEADS, HD)
        n = len(cpos)
        kc = rope((C @ w("k_proj.weight").T).reshape(n, HEADS, HD), cpos)
        vc = (C @ w("v_proj.weight").T).reshape(n, HEADS, HD)
        K, Vv = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        p = softmax(np.einsum("qhd,khd->hqk", q, K) / np.sqrt(HD))  # no mask: non-causal
        o = np.einsum("hqk,khd->qhd", p, Vv).reshape(GAMMA, HEADS * HD)
        x = x + o @ w("o_proj.weight").T
        z = rms(x, w("post_norm.weight"))
        x = x + (silu(z @ w("gate_proj.weight").T) * (z @ w("up_proj.weight").T)) @ w("down_proj.weight").T
    y = rms(x, W["norm.weight"])
    return y, y @ LM.T


def head(W, y, U, k, prev):
    """Block position k (1-based) after token prev: Markov logits and calibrated confidence."""
    m = W["markov.w1"][prev]
    logits = U[k - 1] + m @ W["markov.w2"]
    z = W["confidence.weight"][0] @ np.concatenate([y[k - 1], m]) + W["confidence.bias"][0]
    return logits, sigmoid(z / CONF_TEMPS[k - 1])


# ---- weights and cases -----------------------------------------------------------------------

def weights(rng):
    def mat(o, i, gain=1.0):
        return (rng.standard_normal((o, i)) * gain / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    W = {"fc.weight": mat(D, TAPS * D), "hidden_norm.weight": norm(D),
         "mask_embedding": rng.standard_normal(D).astype(np.float32)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        W[p + "input_norm.weight"] = norm(D)
        for n in ("q_proj", "k_proj", "v_proj"):
            W[p + n + ".weight"] = mat(HEADS * HD, D, 2.0)
        W[p + "o_proj.weight"] = mat(D, HEADS * HD)
        W[p + "post_norm.weight"] = norm(D)
        W[p + "gate_proj.weight"] = mat(INTER, D)
        W[p + "up_proj.weight"] = mat(INTER, D)
        W[p + "down_proj.weight"] = mat(D, INTER)
    W["norm.weight"] = norm(D)
    W["markov.w1"] = rng.standard_normal((V, R)).astype(np.float32)
    W["markov.w2"] = mat(R, V, 1.5)
    W["confidence.weight"] = mat(1, D + R, 2.0)
    W["confidence.bias"] = np.array([0.3], dtype=np.float32)
    return W


def make_case(W, E, LM, rng, positions, anchor, P, temperature):
    n = len(positions)
    taps = rng.standard_normal((n, TAPS * D)).astype(np.float32)
    W64 = {k: v.astype(np.float64) for k, v in W.items()}
    feats = features(W64, taps.astype(np.float64))
    used = max(0, n - WINDOW)  # the most recent context_window observed rows
    y, U = block(W64, E, LM, feats[used:], np.asarray(positions[used:]), anchor, P)
    tokens, glogits, gconf, prev = [], [], [], anchor
    for k in range(1, GAMMA + 1):
        logits, c = head(W64, y, U, k, prev)
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3, "near-tie in greedy argmax: pick another seed"
        prev = int(np.argmax(logits))
        tokens.append(prev)
        glogits.append(logits)
        gconf.append(c)
    forced = rng.integers(0, V, GAMMA)
    fprobs, fconf, prev = [], [], anchor
    for k in range(1, GAMMA + 1):
        logits, c = head(W64, y, U, k, prev)
        fprobs.append(softmax(logits / temperature))
        fconf.append(c)
        prev = int(forced[k - 1])
    f32 = lambda a: ("F32", np.asarray(a, dtype=np.float32))  # noqa: E731
    i64 = lambda a: ("I64", np.asarray(a, dtype=np.int64))  # noqa: E731
    case = {"anchor": i64([anchor, P]), "features": f32(feats.reshape(n, D)),
            "hidden": f32(y), "base_logits": f32(U),
            "greedy_tokens": i64(tokens), "greedy_logits": f32(glogits),
            "greedy_confidence": f32(gconf),
            "forced_tokens": i64(forced), "forced_temperature": f32([temperature]),
            "forced_probs": f32(fprobs), "forced_confidence": f32(fconf)}
    if n:
        case["taps"] = f32(taps)
        case["positions"] = i64(positions)
    return case


def export_case(W, E, LM, rng, n, anchor):
    """A prompt of n positions (all observed), the anchor at position n; top-5 logits only."""
    taps = rng.standard_normal((n, TAPS * D)).astype(np.float32)
    W64 = {k: v.astype(np.float64) for k, v in W.items()}
    feats = features(W64, taps.astype(np.float64))
    lo = max(0, n - WINDOW)
    y, U = block(W64, E, LM, feats[lo:], np.arange(lo, n), anchor, n)
    tokens, glogits, conf, prev = [], [], [], anchor
    for k in range(1, GAMMA + 1):
        logits, c = head(W64, y, U, k, prev)
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3, "near-tie in greedy argmax: pick another seed"
        prev = int(np.argmax(logits))
        tokens.append(prev)
        glogits.append(logits)
        conf.append(c)
    glogits = np.stack(glogits)
    top = lambda a: np.argsort(-a, axis=-1, kind="stable")[:, :5]  # noqa: E731
    f32 = lambda a: ("F32", np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    i64 = lambda a: ("I64", np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    bt, gt = top(U), top(glogits)
    case = {"prompt_ids": i64(rng.integers(0, V, n)), "taps": f32(taps), "features": f32(feats),
            "anchor_token": i64([anchor]), "anchor_position": i64([n]), "y": f32(y),
            "base_logits_top5_ids": i64(bt), "base_logits_top5_values": f32(np.take_along_axis(U, bt, -1)),
            "greedy_tokens": i64(tokens), "greedy_logits_top5_ids": i64(gt),
            "greedy_logits_top5_values": f32(np.take_along_axis(glogits, gt, -1)),
            "confidence": f32(conf)}
    return {f"short.{k}": v for k, v in case.items()} | {"confidence_temperatures": f32(CONF_TEMPS)}


def target_config():
    return {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForCausalLM"], "vocab_size": V,
        "hidden_size": D, "num_hidden_layers": TARGET_LAYERS, "rms_norm_eps": EPS,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "max_position_embeddings": 4096, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": 2,
        "first_k_dense_replace": 1, "intermediate_size": 64,
        "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3], "num_heads": 2,
                               "head_dim": 16, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "gate_low_rank_dim": 16},
        "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 8, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
        "num_shared_experts": 1, "shared_expert_intermediate_size": 32,
        "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "num_expert_group": 1,
        "topk_group": 1,
        "quantization_config": {"quant_method": "compressed-tensors",
                                "format": "mxfp4-pack-quantized", "group_size": 32,
                                "targets": ["routed_experts"]},
    }


def main():
    rng = np.random.default_rng(SEED)
    W = weights(rng)
    E = bf16_round(rng.standard_normal((V, D)).astype(np.float32))
    LM = bf16_round((rng.standard_normal((V, D)) * 2.0 / np.sqrt(D)).astype(np.float32))
    E64, LM64 = E.astype(np.float64), LM.astype(np.float64)

    cases = {
        # 11 observed positions with gaps (6..10 and 15 never ran); the window keeps 8.
        "ctx": make_case(W, E64, LM64, rng, list(range(0, 6)) + list(range(10, 15)), 17, 17, 0.8),
        # Nothing observed yet: the block attends to itself only.
        "none": make_case(W, E64, LM64, rng, [], 5, 2, 1.3),
        # Far positions (RoPE angles in the hundreds of radians).
        "far": make_case(W, E64, LM64, rng, list(range(1990, 1996)), 40, 2000, 1.0),
    }

    os.makedirs(os.path.join(OUT, "drafter"), exist_ok=True)
    os.makedirs(os.path.join(OUT, "target"), exist_ok=True)
    cfg = {"model_type": "k3_dspark", "target_taps": [1, 2, 3], "hidden_size": D,
           "num_layers": LAYERS, "num_heads": HEADS, "head_dim": HD, "intermediate_size": INTER,
           "block_size": GAMMA, "markov_rank": R, "context_window": WINDOW, "rms_norm_eps": EPS,
           "rope_theta": THETA, "vocab_size": V, "confidence_temperatures": CONF_TEMPS}
    with open(os.path.join(OUT, "drafter", "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save(os.path.join(OUT, "drafter", "model.safetensors"), {k: ("F32", v) for k, v in W.items()})
    with open(os.path.join(OUT, "target", "config.json"), "w") as f:
        json.dump(target_config(), f, indent=1)
    save(os.path.join(OUT, "target", "model.safetensors"),
         {"model.embed_tokens.weight": ("BF16", bf16_bits(E)), "lm_head.weight": ("BF16", bf16_bits(LM))})
    save(os.path.join(OUT, "golden.safetensors"),
         {f"{c}.{k}": v for c, t in cases.items() for k, v in t.items()})
    save(os.path.join(OUT, "golden-export-layout.safetensors"), export_case(W, E64, LM64, rng, 11, 23))
    for c, t in cases.items():
        print(c, "greedy", t["greedy_tokens"][1].tolist(), "confidence",
              np.round(t["greedy_confidence"][1], 3).tolist())


if __name__ == "__main__":
    main()
