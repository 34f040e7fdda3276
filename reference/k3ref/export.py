"""Export a trained model to a K3-style model directory (config.json + model.safetensors, MXFP4 experts),
and load such a directory back as a float32 reference model."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from . import mxfp4
from .config import K3Config
from .model import K3ForCausalLM

F32_NAMES = ("A_log", "dt_bias", "e_score_correction_bias")
EXPERT_KEYS = ("experts_w1", "experts_w2", "experts_w3")


def to_tensors(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        leaf = name.rsplit(".", 1)[-1]
        if leaf in EXPERT_KEYS:
            prefix = name[: -len(leaf)]
            w = leaf.split("_")[1]
            for e in range(t.shape[0]):
                packed, scale = mxfp4.quantize(t[e].float())
                out[f"{prefix}experts.{e}.{w}.weight_packed"] = packed
                out[f"{prefix}experts.{e}.{w}.weight_scale"] = scale
        elif leaf in F32_NAMES:
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def save_config(model: K3ForCausalLM, out_dir: str) -> None:
    """config.json from the model's K3Config, keeping keys the config does not model (vision_config, the media
    token ids) from an existing file: re-exporting the decoder must not drop the vision tower."""
    path = os.path.join(out_dir, "config.json")
    extra = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        known = model.cfg.to_hf()
        extra = {k: v for k, v in old.items() if k not in known}
    write_json(path, model.cfg.to_hf() | extra)


def export(model: K3ForCausalLM, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    save_config(model, out_dir)
    save_file(to_tensors(model), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_exported(model_dir: str, dtype=torch.float32, weights: str | None = None) -> K3ForCausalLM:
    """bf16 weights upcast, MXFP4 experts dequantised: exactly the numbers a serving backend sees. `weights`:
    a model.safetensors elsewhere (default: the directory's own)."""
    cfg = K3Config.load(os.path.join(model_dir, "config.json"))
    tensors = load_file(weights or os.path.join(model_dir, "model.safetensors"))
    model = K3ForCausalLM(cfg)
    sd = {}
    for name in model.state_dict():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in EXPERT_KEYS:
            prefix, w = name[: -len(leaf)], leaf.split("_")[1]
            sd[name] = torch.stack([
                mxfp4.dequantize(tensors[f"{prefix}experts.{e}.{w}.weight_packed"],
                                 tensors[f"{prefix}experts.{e}.{w}.weight_scale"], torch.float32)
                for e in range(cfg.num_experts)])
        else:
            sd[name] = tensors[name].float()
    model.load_state_dict(sd)
    return model.to(dtype).eval()


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def main():
    import argparse
    import shutil

    from .config import k3_mini
    ap = argparse.ArgumentParser(description="export a training checkpoint (state dict) to a model directory")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-dir", default=None, help="copy tokenizer.json / tokenizer_config.json from here")
    a = ap.parse_args()
    model = K3ForCausalLM(k3_mini())
    model.load_state_dict(torch.load(a.checkpoint, map_location="cpu"))
    export(model, a.out)
    if a.tokenizer_dir:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(a.tokenizer_dir, f), os.path.join(a.out, f))


if __name__ == "__main__":
    main()
