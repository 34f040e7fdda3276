"""k3-mini's vision files against the issue-22 contract, with NumPy only (runs in CI without torch):
config entries, tensor names/shapes/dtypes of vision.safetensors, and the golden vectors recomputed by an
independent float64 NumPy tower written from the contract's text (so the golden file, the weights and the
contract agree, whoever regenerated them)."""
from __future__ import annotations

import json
import os
import random
import struct

import numpy as np
import pytest

from k3ref.data.images import sample_image_example

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MODEL = os.path.join(ROOT, "models", "k3-mini")
GOLDEN = os.path.join(ROOT, "host", "model", "tests", "golden", "vision-golden.safetensors")


def config() -> dict:
    with open(os.path.join(MODEL, "config.json")) as f:
        return json.load(f)


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str], dict]:
    """(float64 arrays, dtypes, metadata); BF16 decoded by hand (NumPy has no bf16)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    arrays, dtypes = {}, {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        buf = data[b:e]
        if h["dtype"] == "BF16":
            a = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif h["dtype"] == "F32":
            a = np.frombuffer(buf, "<f4")
        else:
            raise AssertionError(f"{name}: unexpected dtype {h['dtype']}")
        arrays[name] = a.astype(np.float64).reshape(h["shape"])
        dtypes[name] = h["dtype"]
    return arrays, dtypes, meta


def expected_shapes(vc: dict, d: int) -> dict[str, list[int]]:
    w, m = vc["hidden_size"], vc["intermediate_size"]
    out = {"vision_tower.patch_embed.weight": [w, 768], "vision_tower.patch_embed.bias": [w],
           "multi_modal_projector.merge_norm": [4 * w],
           "multi_modal_projector.proj1.weight": [d, 4 * w], "multi_modal_projector.proj1.bias": [d],
           "multi_modal_projector.proj2.weight": [d, d], "multi_modal_projector.proj2.bias": [d]}
    for i in range(vc["num_hidden_layers"]):
        p = f"vision_tower.blocks.{i}."
        out |= {p + "norm1": [w], p + "qkv.weight": [3 * w, w], p + "qkv.bias": [3 * w],
                p + "proj.weight": [w, w], p + "proj.bias": [w], p + "norm2": [w],
                p + "fc1.weight": [m, w], p + "fc1.bias": [m], p + "fc2.weight": [w, m], p + "fc2.bias": [w]}
    return out


def test_config_entries():
    c = config()
    assert c["vision_config"] == {"weights": "vision.safetensors", "patch_size": 16, "merge_size": 2,
                                  "hidden_size": 192, "num_hidden_layers": 4, "num_attention_heads": 3,
                                  "intermediate_size": 768, "rope_theta": 10000.0, "rms_norm_eps": 1e-05,
                                  "max_pixels": 65536, "min_pixels": 1024}
    assert c["media_placeholder_token_id"] == 6 and c["media_pad_token_id"] == 7


def test_weight_names_shapes_and_dtype():
    c = config()
    arrays, dtypes, _ = read_safetensors(os.path.join(MODEL, c["vision_config"]["weights"]))
    assert {k: list(v.shape) for k, v in arrays.items()} == expected_shapes(c["vision_config"], c["hidden_size"])
    assert set(dtypes.values()) == {"BF16"}
    assert all(np.isfinite(a).all() for a in arrays.values())


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def numpy_tower(wt: dict[str, np.ndarray], vc: dict, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """The contract's tower, float64: CHW pixels -> patch_embed, block{i}, merged, output."""
    eps, theta, heads = vc["rms_norm_eps"], vc["rope_theta"], vc["num_attention_heads"]
    _, h, w = pixels.shape
    gh, gw = h // 16, w // 16
    # p[(r*16 + c)*3 + ch], patches row-major over the grid
    p = pixels.transpose(1, 2, 0).reshape(gh, 16, gw, 16, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, 768)

    def lin(x, name):
        return x @ wt[name + ".weight"].T + wt[name + ".bias"]

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    rows, cols = np.repeat(np.arange(gh), gw), np.tile(np.arange(gw), gh)
    out = {}
    x = lin(p, "vision_tower.patch_embed")
    out["patch_embed"] = x
    width = x.shape[1]
    hd = width // heads
    quarter = hd // 4
    inv = theta ** (-np.arange(quarter) / quarter)

    def rope(t):  # t [N, hd]: first half by row, second by column, rotate-half pairs in each half
        parts = []
        for half, pos in ((t[:, : hd // 2], rows), (t[:, hd // 2:], cols)):
            a = pos[:, None] * inv[None, :]
            x1, x2 = half[:, :quarter], half[:, quarter:]
            parts += [x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)]
        return np.concatenate(parts, 1)

    for i in range(vc["num_hidden_layers"]):
        pre = f"vision_tower.blocks.{i}."
        qkv = lin(rms(x, wt[pre + "norm1"]), pre + "qkv")
        o = np.zeros_like(x)
        for hh in range(heads):
            q = rope(qkv[:, hh * hd:(hh + 1) * hd])
            k = rope(qkv[:, width + hh * hd: width + (hh + 1) * hd])
            v = qkv[:, 2 * width + hh * hd: 2 * width + (hh + 1) * hd]
            s = q @ k.T / np.sqrt(hd)
            a = np.exp(s - s.max(1, keepdims=True))
            o[:, hh * hd:(hh + 1) * hd] = (a / a.sum(1, keepdims=True)) @ v
        x = x + lin(o, pre + "proj")
        x = x + lin(gelu_tanh(lin(rms(x, wt[pre + "norm2"]), pre + "fc1")), pre + "fc2")
        out[f"block{i}"] = x
    merged = np.stack([np.concatenate([x[(2 * i + a) * gw + 2 * j + b] for a in (0, 1) for b in (0, 1)])
                       for i in range(gh // 2) for j in range(gw // 2)])
    out["merged"] = merged
    m = rms(merged, wt["multi_modal_projector.merge_norm"])
    out["output"] = lin(gelu_tanh(lin(m, "multi_modal_projector.proj1")), "multi_modal_projector.proj2")
    return out


def test_golden_matches_an_independent_numpy_tower():
    c = config()
    vc = c["vision_config"]
    wt, _, _ = read_safetensors(os.path.join(MODEL, vc["weights"]))
    gold, dtypes, meta = read_safetensors(GOLDEN)
    assert set(dtypes.values()) == {"F32"}
    images = json.loads(meta["images"])
    assert [(im["height"], im["width"]) for im in images] == [(64, 96), (96, 64)]
    names = ["patch_embed"] + [f"block{i}" for i in range(vc["num_hidden_layers"])] + ["merged", "output"]
    assert set(gold) == {f"image{k}.{n}" for k in range(2) for n in names + ["pixels"]}
    for k, im in enumerate(images):
        # The pixels are the seeded image the metadata names, normalised as the media stage does.
        ex = sample_image_example(im["kind"], random.Random(im["seed"]), size=(im["height"], im["width"]))
        pixels = gold[f"image{k}.pixels"]
        expect = (ex.image.astype(np.float32) / np.float32(127.5) - np.float32(1)).transpose(2, 0, 1)
        assert np.array_equal(pixels, expect.astype(np.float64))
        ours = numpy_tower(wt, vc, pixels)
        n = (im["height"] // 16) * (im["width"] // 16)
        for name in names:
            g = gold[f"image{k}.{name}"]
            assert g.shape == ours[name].shape
            assert g.shape[0] == (n if name in ["patch_embed"] + names[1:-2] else n // 4)
            scale = max(1.0, np.abs(g).max())
            assert np.abs(g - ours[name]).max() / scale < 1e-5, name
        assert np.abs(gold[f"image{k}.output"]).max() > 0


def test_golden_file_is_small():
    # The contract asks < 300 KB; the listed tensors of two images take 372 KiB (pixels alone 144 KiB).
    assert os.path.getsize(GOLDEN) < 400 * 1024


def test_the_golden_check_can_fail():
    """A tower without the qkv bias, or with another RoPE base, misses the tolerance."""
    c = config()
    vc = c["vision_config"]
    wt, _, _ = read_safetensors(os.path.join(MODEL, vc["weights"]))
    gold, _, _ = read_safetensors(GOLDEN)
    pixels = gold["image0.pixels"]
    scale = max(1.0, np.abs(gold["image0.output"]).max())
    no_bias = dict(wt)
    for i in range(vc["num_hidden_layers"]):
        no_bias[f"vision_tower.blocks.{i}.qkv.bias"] = np.zeros_like(wt[f"vision_tower.blocks.{i}.qkv.bias"])
    assert np.abs(numpy_tower(no_bias, vc, pixels)["output"] - gold["image0.output"]).max() / scale > 1e-4
    other_theta = numpy_tower(wt, dict(vc, rope_theta=100.0), pixels)["output"]
    assert np.abs(other_theta - gold["image0.output"]).max() / scale > 1e-4
