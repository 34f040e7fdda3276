"""Train, calibrate, evaluate and export the DSpark drafter for k3-mini in one run (the lent H200; CPU for smoke):

    python3 -m k3ref.dspark_train --target models/k3-mini --out $OUT --time-budget 330
    python3 -m k3ref.dspark_train --target models/k3-mini --out /tmp/dspark --smoke     # seconds, any machine

1. Training: k3-mini (frozen, bf16 autocast) runs teacher-forced over seeded training conversations (train.py's
   stream and length-grouped batches, the k3-mini mix); its tap rows feed the drafter and its logits are the
   targets. Anchors are random positions inside assistant spans; block row k-1 learns position i+k-1's target
   distribution with the Markov input set to the sequence's token there (k3ref/dspark.py dspark_loss).
   AdamW, bf16 autocast, cosine lr over the time budget. Right after training the drafter is written to --out.
2. Calibration: Sequential Temperature Scaling on greedy drafts over held-out prompts (dspark_eval.calibrate);
   config.json is rewritten with `confidence_temperatures`.
3. Golden vectors (`dspark-golden.safetensors`, CPU float32) for host/dspark. Two cases, prefix `short.` (the
   arithmetic prompt of export_golden.py) and `long.` (the first 640 tokens of a held-out kv_retrieval prompt, so
   the 512-row context window cuts). Per case: `prompt_ids` [n] i64; `taps` [n, 3d] (short only: the tap rows
   of every prompt position, taps 2, 5, 8 concatenated); `features` [n, d] (c_p); `anchor_token` [1] i64 (the
   target's greedy token after the prompt) at `anchor_position` [1] = n; `y` [γ, d] (the final-normed block
   rows); `base_logits_top5_{ids,values}` [γ, 5] (U = y lm_headᵀ); `greedy_tokens` [γ] i64 (the greedy
   Markov path x_1..x_γ); `greedy_logits_top5_{ids,values}` [γ, 5] (logits_k along that path);
   `confidence_logits` [γ] (z_k); `confidence` [γ] (c_k = sigmoid(z_k / T_k)). Plus `confidence_temperatures`.
4. Evaluation (dspark_eval.evaluate_speculative): speculative decoding simulated exactly against the float32
   target on evaluate.py's held-out seeds, block 7, greedy and temperature 1: acceptance length per task kind
   and the ECE of the calibrated confidences; one greedy output checked identical to plain greedy decoding.

Outputs in --out: config.json, model.safetensors, dspark_train_log.jsonl, dspark_eval.json,
dspark-golden.safetensors.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from .dspark import DSparkConfig, DSparkDrafter, dspark_loss, save_drafter, shared_weights, target_taps
from .export import load_exported
from .train import ConversationStream, batches


def sample_anchors(ids: torch.Tensor, mask: torch.Tensor, block: int, rate: float, max_anchors: int,
                   per_seq: int = 256, generator: torch.Generator | None = None):
    """Anchors i with an assistant token at i and i+1, about `rate` of them per sequence (at most `per_seq` per
    sequence: the block-to-block attention mask grows with its square; at most max_anchors per batch).
    Returns (anchor_idx [B, A], row_ok [B, A, γ]): row k' is used when tokens i+1 .. i+k'+1 are all assistant
    tokens (a block never trains across the end of a turn)."""
    b, t = ids.shape
    dev = ids.device
    valid = torch.zeros_like(mask)
    valid[:, :-1] = mask[:, :-1] & mask[:, 1:]
    most = int(valid.sum(1).max())
    a = max(1, min(math.ceil(rate * most), per_seq, max(1, max_anchors // b), t))
    score = torch.rand(b, t, device=dev, generator=generator).masked_fill(~valid, -1.0)
    top = torch.topk(score, a, dim=1)
    idx, ok = top.indices, top.values >= 0
    tgt = idx.unsqueeze(-1) + torch.arange(1, block + 1, device=dev)  # predicted positions i+1 .. i+γ
    in_seq = tgt < t
    tgt_mask = mask.gather(1, tgt.clamp(max=t - 1).reshape(b, -1)).reshape(b, a, block) & in_seq
    row_ok = torch.cumprod(tgt_mask.long(), dim=-1).bool() & ok.unsqueeze(-1)
    return idx, row_ok


def train_step_loss(target, drafter: DSparkDrafter, ids, mask, a, dev):
    """One batch: target taps/logits (no grad), anchors, drafter forward, loss."""
    cfg = drafter.cfg
    g = cfg.block_size
    b, t = ids.shape
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        t_logits, taps = target_taps(target, ids, cfg.target_taps, kda_impl="fast", moe_dense=True)
    idx, row_ok = sample_anchors(ids, mask, g, a.anchor_rate, a.max_anchors, a.max_anchors_per_seq)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        feats = drafter.features(taps)
        fpos = torch.arange(t, device=ids.device).expand(b, t)
        y = drafter.block_hidden(feats, fpos, ids.gather(1, idx), idx)  # [B, A, γ, d]
        bi, ai, ki = row_ok.nonzero(as_tuple=True)
        pos = idx[bi, ai] + ki  # the row's position: its Markov input token and the target's distribution
        loss, parts = dspark_loss(drafter, y[bi, ai, ki], ids[bi, pos], t_logits[bi, pos], ki)
    return loss, parts, int(bi.numel()), idx.shape[1]


def train(target, drafter: DSparkDrafter, a, dev: str, log_path: str, log=print) -> dict:
    decay, no_decay = [], []
    for n, p in drafter.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    stream = ConversationStream(a.tokenizer, a.seed, a.max_len)
    loader = DataLoader(stream, batch_size=None, num_workers=a.workers, prefetch_factor=32 if a.workers else None,
                        persistent_workers=False)
    batch_iter = batches(loader, a.token_budget, pool=a.pool)
    logf = open(log_path, "w")
    t0 = time.time()
    step, tokens, rows_seen, ema, data_wait, skipped = 0, 0, 0, None, 0.0, 0
    g = drafter.cfg.block_size
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
        ids, mask = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        try:
            loss, parts, nrows, anchors = train_step_loss(target, drafter, ids, mask, a, dev)
            if not bool(torch.isfinite(loss)):
                raise FloatingPointError("non-finite loss")
            loss.backward()
        except (torch.cuda.OutOfMemoryError, FloatingPointError) as e:  # one bad batch must not end the run
            skipped += 1
            log(f"step {step}: skipped batch {list(ids.shape)}: {type(e).__name__}")
            opt.zero_grad(set_to_none=True)
            loss = parts = None
            if dev == "cuda":
                torch.cuda.empty_cache()
            if skipped > 20:
                raise
            continue
        gn = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(ids.numel())
        rows_seen += nrows
        if step % a.log_every == 0 or step == 1:
            lv = float(loss.detach())
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            agree = parts["agree"].float()
            kk = parts["row_k"]
            acc_k = [round(float(agree[kk == k].mean()), 3) if bool((kk == k).any()) else None for k in range(g)]
            rec = {"step": step, "loss": round(lv, 4), "loss_ema": round(ema, 4),
                   "ce": round(float(parts["ce"].detach()), 4), "tv": round(float(parts["tv"].detach()), 4),
                   "bce": round(float(parts["bce"].detach()), 4), "top1_agree_by_row": acc_k, "lr": round(lr, 6),
                   "grad_norm": round(float(gn), 3), "tokens": tokens, "rows": rows_seen, "batch": list(ids.shape),
                   "anchors_per_seq": anchors, "elapsed_s": round(elapsed, 1), "data_wait_s": round(data_wait, 1),
                   "max_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else 0}
            log(json.dumps(rec))
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
    summary = {"steps": step, "skipped_batches": skipped, "tokens_seen": tokens, "rows_seen": rows_seen,
               "train_seconds": round(time.time() - t0, 1),
               "final_loss_ema": ema, "lr": a.lr, "token_budget": a.token_budget, "anchor_rate": a.anchor_rate,
               "max_anchors": a.max_anchors, "max_anchors_per_seq": a.max_anchors_per_seq, "seed": a.seed}
    logf.write(json.dumps({"summary": summary}) + "\n")
    logf.close()
    del batch_iter, loader
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="models/k3-mini")
    ap.add_argument("--tokenizer", default=None, help="default: <target>/tokenizer.json")
    ap.add_argument("--out", default="runs/k3-mini-dspark")
    ap.add_argument("--time-budget", type=float, default=330.0, help="seconds of training")
    ap.add_argument("--calib-time", type=float, default=35.0, help="seconds of calibration decoding")
    ap.add_argument("--eval-time", type=float, default=90.0, help="seconds of speculative-decoding evaluation")
    ap.add_argument("--wall-budget", type=float, default=500.0,
                    help="the whole run from process start: evaluation is cut to fit")
    ap.add_argument("--init-from", default=None,
                    help="drafter directory to continue from (with --time-budget 0: calibrate/evaluate only)")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--token-budget", type=int, default=32 * 1024)
    ap.add_argument("--max-len", type=int, default=3200)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--anchor-rate", type=float, default=0.5)
    ap.add_argument("--max-anchors", type=int, default=6144, help="per batch")
    ap.add_argument("--max-anchors-per-seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--workers", type=int, default=13)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--max-new-cap", type=int, default=None, help="cap generated tokens per prompt (smoke)")
    ap.add_argument("--decode-group", type=int, default=6,
                    help="prompts of one kind decoded speculatively together (calibration, evaluation)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and budgets: checks the whole pipeline")
    a = ap.parse_args()
    t_start = time.time()
    if a.smoke:
        a.time_budget, a.calib_time, a.eval_time = min(a.time_budget, 6.0), 1.0, 1.0
        a.token_budget, a.max_len, a.pool, a.workers = 2048, 900, 16, 1
        a.max_anchors, a.log_every, a.warmup, a.max_new_cap, a.decode_group = 64, 1, 2, 12, 2
    a.tokenizer = a.tokenizer or os.path.join(a.target, "tokenizer.json")
    os.makedirs(a.out, exist_ok=True)

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    from tokenizers import Tokenizer
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(a.seed)
    tok = Tokenizer.from_file(a.tokenizer)
    target = load_exported(a.target).to(dev)
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = DSparkConfig(vocab_size=target.cfg.vocab_size, hidden_size=target.cfg.hidden_size)
    embed, head = shared_weights(target)
    drafter = DSparkDrafter(cfg, embed, head)
    if a.init_from:
        from safetensors.torch import load_file
        drafter.load_state_dict(load_file(os.path.join(a.init_from, "model.safetensors")))
        drafter.cfg.confidence_temperatures = DSparkConfig.load(
            os.path.join(a.init_from, "config.json")).confidence_temperatures
    drafter = drafter.to(dev).train()
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"device={dev} drafter params={n_params / 1e6:.2f}M taps={cfg.target_taps} args={vars(a)}")

    try:
        summary = {"steps": 0} if a.time_budget <= 0 else train(target, drafter, a, dev,
                                                                  os.path.join(a.out, "dspark_train_log.jsonl"), log)
    except Exception:  # keep what was learnt: calibration, golden vectors and evaluation still run
        summary = {"error": traceback.format_exc()}
    log(f"training done: {json.dumps(summary)}")
    drafter.eval()
    save_drafter(drafter, a.out)  # safe copy before anything else can fail
    result = {"train": summary, "drafter_params": n_params}
    runner_kw = {"kda_impl": "fast"}
    from .dspark_eval import (TargetRunner, calibrate, check_greedy_lossless, evaluate_speculative,
                              golden_vectors, prompt_groups)
    from .evaluate import HELD_OUT_SEED
    runner = TargetRunner(target, cfg.target_taps, **runner_kw)
    try:
        result["calibration"] = calibrate(runner, drafter, tok, a.calib_time, group=a.decode_group,
                                          max_new_cap=a.max_new_cap, log=log)
        save_drafter(drafter, a.out)
    except Exception:  # keep going: the uncalibrated drafter is still worth evaluating
        result["calibration_error"] = traceback.format_exc()
        log(result["calibration_error"])
    try:
        kv = [items[0][0] for kind, items in prompt_groups(tok, HELD_OUT_SEED, 1, 1) if kind == "kv_retrieval"][0]
        cpu_target = load_exported(a.target)
        cpu_drafter = DSparkDrafter(cfg, *shared_weights(cpu_target))
        cpu_drafter.load_state_dict({k: v.float().cpu() for k, v in drafter.state_dict().items()})
        gold = golden_vectors(cpu_target, cpu_drafter.eval(), tok, kv[:640])
        save_file(gold, os.path.join(a.out, "dspark-golden.safetensors"), metadata={"format": "pt"})
        log(f"golden vectors: {len(gold)} tensors; short greedy draft {gold['short.greedy_tokens'].tolist()}")
        del cpu_target, cpu_drafter
    except Exception:
        result["golden_error"] = traceback.format_exc()
        log(result["golden_error"])
    try:
        result["greedy_lossless_check"] = check_greedy_lossless(runner, drafter, tok, 8 if a.smoke else 32)
        log(f"greedy lossless check: {result['greedy_lossless_check']}")
        budget = max(1.0, min(a.eval_time, a.wall_budget - (time.time() - t_start) - 15))
        log(f"evaluation: {budget:.0f}s")
        result["eval"] = evaluate_speculative(runner, drafter, tok, budget, group=a.decode_group,
                                              max_new_cap=a.max_new_cap, log=log)
        for mode in ("greedy", "temperature_1"):
            for kind, s in result["eval"][mode].items():
                log(f"{mode:14s} {kind:13s} acceptance length {s.get('acceptance_length')} "
                    f"ECE {s.get('ece_cumulative')} steps {s.get('steps')}")
    except Exception:
        result["eval_error"] = traceback.format_exc()
        log(result["eval_error"])
    result["wall_seconds"] = round(time.time() - t_start, 1)
    with open(os.path.join(a.out, "dspark_eval.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    log(f"done in {result['wall_seconds']}s; wrote {sorted(os.listdir(a.out))}")


if __name__ == "__main__":
    main()
