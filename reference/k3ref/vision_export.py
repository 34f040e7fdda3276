"""Write k3-mini's vision weights, its config entries and the golden vectors (issue 22 contract):

    PYTHONPATH=reference python3 -m k3ref.vision_export --model models/k3-mini --from $OUT/vision.safetensors
    PYTHONPATH=reference python3 -m k3ref.vision_export --model models/k3-mini --random-init 0   # untrained

- `<model>/vision.safetensors`: every tensor bf16, names `vision_tower.*` / `multi_modal_projector.*`
  (VisionTower's state dict; Linear weights [out, in]).
- `<model>/config.json` gains `vision_config`, `media_placeholder_token_id` (6) and `media_pad_token_id` (7);
  every other key is kept as it is.
- `host/model/tests/golden/vision-golden.safetensors`: for two seeded images (64x96 and 96x64 from
  data/images.py), computed in float64 from the weights as rounded to bf16 and stored f32:
  `image{k}.pixels` [3, H, W] (the media stage's CHW input), `image{k}.patch_embed` [N, W],
  `image{k}.block{i}` [N, W], `image{k}.merged` [N/4, 4W] (before merge_norm), `image{k}.output` [N/4, D].

Re-running with the trained weights (`--from`) regenerates all three from those weights.
"""
from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .data.images import sample_image_example
from .vision import VisionConfig, VisionTower, chw_pixels, normalise, patches_from_hwc, patchify_chw

PLACEHOLDER_ID = 6
MEDIA_PAD_ID = 7
# (kind, seed, (height, width)) of the golden images.
GOLDEN_IMAGES = [("count", 22, (64, 96)), ("position", 23, (96, 64))]
DEFAULT_GOLDEN = "host/model/tests/golden/vision-golden.safetensors"


def vision_config_of(model_dir: str) -> VisionConfig:
    """The model's VisionConfig: its config.json `vision_config` if present, else the default sizes."""
    with open(os.path.join(model_dir, "config.json")) as f:
        d = json.load(f)
    if "vision_config" in d:
        return VisionConfig.from_json(d["vision_config"], d["hidden_size"])
    return VisionConfig(hidden_size=d["hidden_size"])


def to_tensors(tower: VisionTower) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().to(torch.bfloat16).contiguous() for n, t in tower.state_dict().items()}


def save_vision(tower: VisionTower, path: str) -> None:
    save_file(to_tensors(tower), path, metadata={"format": "pt"})


def load_vision(path: str, cfg: VisionConfig, dtype=torch.float32) -> VisionTower:
    """The tower with the stored (bf16) weights upcast: exactly the numbers a serving backend sees."""
    tower = VisionTower(cfg)
    tensors = load_file(path)
    missing = set(tower.state_dict()) ^ set(tensors)
    if missing:
        raise ValueError(f"{path}: tensor names differ from the tower's: {sorted(missing)[:6]}")
    tower.load_state_dict({k: v.float() for k, v in tensors.items()})
    return tower.to(dtype).eval()


def bf16_rounded(tower: VisionTower, dtype=torch.float64) -> VisionTower:
    """A copy of the tower with every weight rounded to bf16 (as stored), in `dtype`."""
    out = VisionTower(tower.cfg)
    out.load_state_dict({k: v.detach().cpu().to(torch.bfloat16).float() for k, v in tower.state_dict().items()})
    return out.to(dtype).eval()


@torch.no_grad()
def random_init(tower: VisionTower, seed: int, out_rms: float = 0.04) -> VisionTower:
    """A seeded initialisation with sane activations: matrices ~ N(0, 1/in) (residual outputs half that),
    small random biases, norm weights near 1 (so a reimplementation that drops a bias or a norm weight is
    caught by the golden vectors), and proj2 rescaled so image rows have `out_rms` per element, about
    the RMS of k3-mini's token embeddings (0.039)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in tower.named_parameters():
        if p.ndim == 2:
            std = p.shape[1] ** -0.5 * (0.5 if name.endswith(("proj.weight", "fc2.weight")) else 1.0)
            p.copy_(torch.randn(p.shape, generator=g) * std)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        else:  # RMSNorm weights
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    ex = sample_image_example("color", random.Random(seed), size=(96, 96))
    p, grid = patches_from_hwc(torch.from_numpy(normalise(ex.image)))
    out = tower.float()(p, grid)
    s = out_rms / float(out.pow(2).mean().sqrt())
    proj2 = tower.multi_modal_projector.proj2
    proj2.weight.mul_(s)
    proj2.bias.mul_(s)
    return tower


def golden_images() -> list[np.ndarray]:
    return [sample_image_example(kind, random.Random(seed), size=size).image for kind, seed, size in GOLDEN_IMAGES]


@torch.no_grad()
def golden_vectors(tower: VisionTower) -> dict[str, torch.Tensor]:
    """The contract's golden tensors, float64 through the bf16-rounded weights, stored f32."""
    t64 = bf16_rounded(tower)
    out: dict[str, torch.Tensor] = {}
    for k, image in enumerate(golden_images()):
        pixels = torch.from_numpy(chw_pixels(image))  # f32, exactly what the media stage hands over
        p, grid = patchify_chw(pixels.double())
        collect: list[torch.Tensor] = []
        x = t64.encode(p, grid, collect)
        merged = t64.merge(x, grid)
        tokens = t64.multi_modal_projector(merged, t64.cfg.eps)
        out[f"image{k}.pixels"] = pixels
        out[f"image{k}.patch_embed"] = collect[0]
        for i, b in enumerate(collect[1:]):
            out[f"image{k}.block{i}"] = b
        out[f"image{k}.merged"] = merged
        out[f"image{k}.output"] = tokens
    return {k: v.float().contiguous() for k, v in out.items()}


def save_golden(tower: VisionTower, path: str) -> dict[str, torch.Tensor]:
    gold = golden_vectors(tower)
    meta = {"format": "pt", "images": json.dumps([{"kind": k, "seed": s, "height": h, "width": w}
                                                  for k, s, (h, w) in GOLDEN_IMAGES])}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(gold, path, metadata=meta)
    return gold


def update_config(model_dir: str, cfg: VisionConfig) -> dict:
    """Add the vision entries to config.json, keeping every other key (and the key order) as it is."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        d = json.load(f)
    if d["hidden_size"] != cfg.hidden_size:
        raise ValueError(f"the projector maps to {cfg.hidden_size}, the decoder is {d['hidden_size']} wide")
    d["vision_config"] = cfg.to_json()
    d["media_placeholder_token_id"] = PLACEHOLDER_ID
    d["media_pad_token_id"] = MEDIA_PAD_ID
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
    return d


def export_all(tower: VisionTower, model_dir: str | None, weights_path: str, golden_path: str | None) -> None:
    """vision.safetensors at `weights_path`, the config entries (when `model_dir`), the golden file."""
    save_vision(tower, weights_path)
    if model_dir:
        update_config(model_dir, tower.cfg)
    if golden_path:
        save_golden(tower, golden_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/k3-mini")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="src", help="a vision.safetensors (e.g. a training run's) to export")
    src.add_argument("--random-init", type=int, metavar="SEED", help="an untrained, seeded tower")
    ap.add_argument("--golden", default=DEFAULT_GOLDEN)
    a = ap.parse_args()
    cfg = vision_config_of(a.model)
    if a.src:
        tower = load_vision(a.src, cfg)
    else:
        tower = random_init(VisionTower(cfg), a.random_init)
    export_all(tower, a.model, os.path.join(a.model, "vision.safetensors"), a.golden)
    gold = load_file(a.golden)
    print(f"wrote {a.model}/vision.safetensors ({sum(p.numel() for p in tower.parameters()) / 1e6:.2f}M params), "
          f"{a.model}/config.json, {a.golden} ({os.path.getsize(a.golden) / 1024:.0f} KiB; "
          f"image0.output rms {float(gold['image0.output'].pow(2).mean().sqrt()):.4f})")


if __name__ == "__main__":
    main()
