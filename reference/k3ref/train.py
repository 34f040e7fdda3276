"""Train k3-mini on the synthetic K3-format corpus (runs on the lent H200; falls back to CPU for smoke runs).

    python3 -m k3ref.train --out runs/k3-mini --time-budget 420

Routed experts train through MXFP4 fake quantisation (straight-through), so the exported 4-bit experts lose
nothing; the router's selection bias is balanced DeepSeek-V3 style (no auxiliary loss). The data is generated on
the fly from seeds by worker processes, so the corpus is never stored.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from .config import k3_mini
from .model import _fla_chunk_kda, K3ForCausalLM


class ConversationStream(IterableDataset):
    """Yields (ids, loss mask) for seeded random conversations; each worker has its own seed stream."""

    def __init__(self, tokenizer_path: str, seed: int, max_len: int, mix: dict[str, float] | None = None):
        self.tokenizer_path, self.seed, self.max_len, self.mix = tokenizer_path, seed, max_len, mix

    def __iter__(self):
        from tokenizers import Tokenizer

        from .data.tasks import sample_training_conversation, train_segments

        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        rng = random.Random(self.seed * 1000 + wid)
        tok = Tokenizer.from_file(self.tokenizer_path)
        while True:
            ex = sample_training_conversation(rng, self.mix)
            ids, mask = [], []
            for text, train in train_segments(ex):
                piece = tok.encode(text, add_special_tokens=False).ids
                ids += piece
                mask += [train] * len(piece)
            if len(ids) <= self.max_len:
                yield ids, mask


def batches(stream, token_budget: int, pool: int = 256):
    """Group conversations of similar length into [B, T] batches of about `token_budget` padded tokens."""
    it = iter(stream)
    while True:
        items = [next(it) for _ in range(pool)]
        items.sort(key=lambda x: len(x[0]))
        i = 0
        while i < len(items):
            j = i
            while j < len(items) and (j - i + 1) * len(items[j][0]) <= token_budget:
                j += 1
            j = max(j, i + 1)
            group = items[i:j]
            t = max(len(x[0]) for x in group)
            ids = torch.zeros(len(group), t, dtype=torch.long)
            tgt_mask = torch.zeros(len(group), t, dtype=torch.bool)
            for r, (a, m) in enumerate(group):
                ids[r, : len(a)] = torch.tensor(a)
                tgt_mask[r, : len(m)] = torch.tensor(m, dtype=torch.bool)
            yield ids, tgt_mask
            i = j


def balance_router_bias(model: K3ForCausalLM, speed: float) -> torch.Tensor:
    """b_e -= speed if expert e is over the mean load, += if under. Returns the worst max/mean load ratio as a
    tensor (read only when logging: a host sync per step would stall the launch-bound trainer)."""
    worst = torch.zeros(())
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None or moe.last_load is None:
            continue
        load = moe.last_load.float()
        mean = load.mean()
        moe.gate.e_score_correction_bias -= speed * torch.sign(load - mean)
        worst = torch.maximum(worst.to(load.device), load.max() / mean.clamp_min(1))
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/k3-mini")
    ap.add_argument("--tokenizer", default="models/k3-mini/tokenizer.json")
    ap.add_argument("--time-budget", type=float, default=420.0, help="seconds of training")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--token-budget", type=int, default=32 * 1024)
    ap.add_argument("--max-len", type=int, default=3200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kda-impl", default="auto", choices=["auto", "fla", "fast"])
    ap.add_argument("--init-from", default=None, help="model directory to continue from (exported weights)")
    ap.add_argument("--profile-steps", type=int, default=0, help="profile steps 3..N and write profile.txt")
    ap.add_argument("--moe", default="dense", choices=["dense", "sparse"])
    ap.add_argument("--bias-speed", type=float, default=1e-3)
    ap.add_argument("--mix", default=None,
                    help="task weights, e.g. arithmetic=0.4,tool_use=0.3 (kinds left out get 0; default: the corpus mix)")
    a = ap.parse_args()

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(a.seed)
    cfg = k3_mini()
    model = K3ForCausalLM(cfg)
    if a.init_from:
        from .export import load_exported
        model.load_state_dict(load_exported(a.init_from).state_dict())
    model = model.to(dev).train()
    kda_impl = a.kda_impl if a.kda_impl != "auto" else ("fla" if _fla_chunk_kda is not None and dev == "cuda"
                                                          else "fast")
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n or n.endswith(("A_log", "dt_bias", ".proj.weight")) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    mix = None
    if a.mix:
        mix = {k: float(v) for k, v in (kv.split("=") for kv in a.mix.split(","))}
    stream = ConversationStream(a.tokenizer, a.seed, a.max_len, mix)
    loader = DataLoader(stream, batch_size=None, num_workers=a.workers, prefetch_factor=64 if a.workers else None,
                        persistent_workers=a.workers > 0)
    os.makedirs(a.out, exist_ok=True)
    log = open(os.path.join(a.out, "train_log.jsonl"), "w")
    t0 = time.time()
    step, tokens_seen, ema = 0, 0, None
    print(f"device={dev} kda_impl={kda_impl} params={sum(p.numel() for p in model.parameters())/1e6:.1f}M",
          flush=True)
    data_wait = 0.0
    batch_iter = batches(loader, a.token_budget)
    while True:
        tw = time.time()
        ids, mask = next(batch_iter)
        data_wait += time.time() - tw
        elapsed = time.time() - t0
        frac = elapsed / a.time_budget
        if frac >= 1.0 or step >= a.max_steps:
            break
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for grp in opt.param_groups:
            grp["lr"] = lr
        if a.profile_steps and step == 3:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        if a.profile_steps and step == a.profile_steps:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            with open(os.path.join(a.out, "profile.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
                f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        ids, mask = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits = model(ids[:, :-1], kda_impl=kda_impl, moe_dense=a.moe == "dense", fake_quant=True)
        tgt = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            imbalance = balance_router_bias(model, a.bias_speed)
        step += 1
        tokens_seen += int(ids.numel())
        if step % 25 == 0 or step == 1:
            lv = float(loss.detach())
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            rec = {"step": step, "loss": round(lv, 4), "loss_ema": round(ema, 4), "lr": round(lr, 6),
                   "grad_norm": round(float(gn), 3), "tokens": tokens_seen, "elapsed_s": round(elapsed, 1),
                   "tok_per_s": round(tokens_seen / max(elapsed, 1e-6)), "max_load_ratio": round(float(imbalance), 2),
                   "data_wait_s": round(data_wait, 1),
                   "batch": list(ids.shape),
                   "max_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else 0}
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
    summary = {"steps": step, "tokens_seen": tokens_seen, "train_seconds": round(time.time() - t0, 1),
               "final_loss_ema": ema, "kda_impl": kda_impl, "token_budget": a.token_budget, "lr": a.lr,
               "seed": a.seed}
    print(json.dumps(summary), flush=True)
    with open(os.path.join(a.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    torch.save(model.state_dict(), os.path.join(a.out, "model.pt"))


if __name__ == "__main__":
    main()
