"""Train, evaluate and export k3-mini's vision tower + projector with the decoder frozen (issue 22):

    PYTHONPATH=reference python3 -m k3ref.vision_train --model models/k3-mini --out $OUT --time-budget 420
    PYTHONPATH=reference python3 -m k3ref.vision_train --model models/k3-mini --out /tmp/v --smoke   # any machine

1. Training: seeded image chats (k3ref/vision_data.py: five image kinds, thinking on 60 % / off 40 %) in
   batches of `--batch-size` examples; each image's patches go through the tower (padded, masked), its rows
   replace the prompt's `<|media_pad|>` embeddings, and the frozen decoder (requires_grad False, eval mode;
   its weights never reach the optimiser, so k3-mini's text behaviour cannot change) scores the assistant's
   tokens only. AdamW, linear warmup, cosine to 5 % over the time budget, grad clip 1.0, bf16 autocast on
   CUDA. The tower starts from vision_export.random_init (or --init-from a vision.safetensors).
2. Export (before evaluation, so a late failure keeps them): `vision.safetensors` (bf16) and
   `vision-golden.safetensors` into --out, with vision_export's functions.
3. Evaluation of the exported (bf16-rounded) weights: held-out seeds, `--per-kind` images per kind, each
   asked with thinking on (the server's default generation prompt, effort max) and off; greedy decoding by
   the reference decoder in float32 with the image rows spliced in (batched, full recompute per step: the
   same numbers as the cached path, which a few prompts are checked against); exact-answer rate per kind
   and mode (check_answer on the response block) and the well-formed rate.

Outputs in --out: vision.safetensors, vision-golden.safetensors, vision_train_log.jsonl, vision_eval.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import traceback
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, IterableDataset

from .evaluate import held_out_examples
from .evaluate import evaluate as text_evaluate
from .export import load_exported, to_tensors
from .train import ConversationStream, balance_router_bias, batches
from .vision import PATCH_DIM, VisionTower, patches_from_hwc
from .vision_data import (IMAGE_KINDS, encode_prompt, held_out, image_token_count, score, splice_embeds,
                          training_example)
from .vision_export import export_all, load_vision, random_init, vision_config_of


def image_batch(images: list[np.ndarray]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """uint8 images -> uint8 patches [B, Nmax, 768] (each image's first, then zeros) and the grids."""
    pats, grids = zip(*(patches_from_hwc(im) for im in images))
    patches = np.zeros((len(images), max(p.shape[0] for p in pats), PATCH_DIM), np.uint8)
    for i, p in enumerate(pats):
        patches[i, : p.shape[0]] = p
    return torch.from_numpy(patches), list(grids)


def collate(items):
    """[(image, ids, mask)] -> uint8 patches [B, Nmax, 768], grids, ids [B, T] (pad 0), loss mask [B, T]."""
    patches, grids = image_batch([image for image, _, _ in items])
    t = max(len(ids) for _, ids, _ in items)
    ids = np.zeros((len(items), t), np.int64)
    mask = np.zeros((len(items), t), bool)
    for i, (_, s, m) in enumerate(items):
        ids[i, : len(s)] = s
        mask[i, : len(m)] = m
    return patches, grids, torch.from_numpy(ids), torch.from_numpy(mask)


class ImageStream(IterableDataset):
    """Endless seeded batches; worker w of seed s draws from random.Random(s * 1000 + w) (< 10^6: never a
    held-out seed)."""

    def __init__(self, tokenizer_path: str, seed: int, batch_size: int):
        self.tokenizer_path, self.seed, self.batch_size = tokenizer_path, seed, batch_size

    def __iter__(self):
        from tokenizers import Tokenizer
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.seed * 1000 + (info.id if info else 0))
        tok = Tokenizer.from_file(self.tokenizer_path)
        while True:
            yield collate([training_example(tok, rng) for _ in range(self.batch_size)])


def to_pixels(patches_u8: torch.Tensor, dev: str) -> torch.Tensor:
    return patches_u8.to(dev, non_blocking=True).float() / 127.5 - 1.0


def batch_loss(decoder, tower, batch, dev: str, kda_impl: str, fake_quant: bool = False):
    """Mean cross-entropy over the assistant's tokens, and the token accuracy."""
    patches, grids, ids, mask = batch
    ids, mask = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        rows = torch.cat(tower.forward_batch(to_pixels(patches, dev), grids))
        emb = splice_embeds(decoder.model.embed_tokens(ids), ids, rows)
        logits = decoder(ids, inputs_embeds=emb, kda_impl=kda_impl, moe_dense=dev == "cuda", fake_quant=fake_quant)
    tgt_ok = mask[:, 1:]
    lg = logits[:, :-1][tgt_ok].float()
    tgt = ids[:, 1:][tgt_ok]
    loss = F.cross_entropy(lg, tgt)
    return loss, (lg.argmax(-1) == tgt).float().mean()


def text_loss(decoder, batch, dev: str, kda_impl: str):
    """The decoder's own objective on a batch of its original text mixture (k3ref/train.py), so fine-tuning
    it on image chats does not erode its text skills."""
    ids, mask = (t.to(dev, non_blocking=True) for t in batch)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        logits = decoder(ids[:, :-1], kda_impl=kda_impl, moe_dense=dev == "cuda", fake_quant=True)
    tgt = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)


def train(decoder, tower, a, dev: str, log) -> dict:
    """The tower always trains; with --decoder-lr > 0 the decoder trains too, at its own (lower) rate that
    starts after --decoder-start steps (a random tower's rows would only teach it noise), with text batches
    from its original mixture weighted --text-frac of the loss."""
    decay = [p for n, p in tower.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in tower.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay, "base": a.lr, "tower": True},
              {"params": no_decay, "weight_decay": 0.0, "base": a.lr, "tower": True}]
    train_dec = a.decoder_lr > 0
    if train_dec:
        dd, dn = [], []
        for n, p in decoder.named_parameters():  # requires_grad is switched on at --decoder-start
            (dn if p.ndim < 2 or "norm" in n or n.endswith(("A_log", "dt_bias", ".proj.weight")) else dd).append(p)
        groups += [{"params": dd, "weight_decay": 0.05, "base": a.decoder_lr, "tower": False},
                   {"params": dn, "weight_decay": 0.0, "base": a.decoder_lr, "tower": False}]
        decoder.train()
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.98))
    stream = ImageStream(a.tokenizer, a.seed, a.batch_size)
    loader = DataLoader(stream, batch_size=None, num_workers=a.workers, pin_memory=dev == "cuda",
                        prefetch_factor=4 if a.workers else None)
    it = iter(loader)
    text_it = None
    if train_dec and a.text_frac > 0:
        mix = {k: float(v) for k, v in (kv.split("=") for kv in a.text_mix.split(","))}
        tstream = ConversationStream(a.tokenizer, a.seed + 7, a.text_max_len, mix)
        tloader = DataLoader(tstream, batch_size=None, num_workers=a.text_workers,
                             prefetch_factor=64 if a.text_workers else None)
        text_it = batches(tloader, a.text_tokens, pool=64 if a.smoke else 256)
    text_ema = None
    logf = open(os.path.join(a.out, "vision_train_log.jsonl"), "w")
    t0 = time.time()
    step, examples, ema, acc_ema, data_wait, skipped = 0, 0, None, None, 0.0, 0
    tower.train()
    while True:
        tw = time.time()
        batch = next(it)
        data_wait += time.time() - tw
        elapsed = time.time() - t0
        frac = elapsed / a.time_budget
        if frac >= 1.0 or step >= a.max_steps:
            break
        cos = 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * cos
        dec_on = train_dec and step >= a.decoder_start
        if dec_on and step == a.decoder_start:
            for p in decoder.parameters():
                p.requires_grad_(True)
        dec_scale = min(1.0, (step + 1 - a.decoder_start) / a.decoder_warmup) * cos if dec_on else 0.0
        for grp in opt.param_groups:
            grp["lr"] = lr if grp["tower"] else grp["base"] * dec_scale
        opt.zero_grad(set_to_none=True)
        try:
            loss, acc = batch_loss(decoder, tower, batch, dev, a.kda_impl, fake_quant=train_dec)
            tl = None
            if text_it is not None and dec_on:
                tl = text_loss(decoder, next(text_it), dev, a.kda_impl)
                total = (1 - a.text_frac) * loss + a.text_frac * tl
            else:
                total = loss
            if not bool(torch.isfinite(total)):
                raise FloatingPointError("non-finite loss")
            total.backward()
        except (torch.cuda.OutOfMemoryError, FloatingPointError) as e:  # one bad batch must not end the run
            skipped += 1
            log(f"step {step}: skipped a batch: {type(e).__name__}")
            opt.zero_grad(set_to_none=True)
            if dev == "cuda":
                torch.cuda.empty_cache()
            if skipped > 20:
                raise
            continue
        gn = torch.nn.utils.clip_grad_norm_(tower.parameters(), 1.0)
        if train_dec:
            torch.nn.utils.clip_grad_norm_(decoder.parameters(), 1.0)
        opt.step()
        if dec_on:  # keep the experts' loads even (the decoder's own recipe; gentler speed)
            with torch.no_grad():
                balance_router_bias(decoder, a.bias_speed)
        step += 1
        examples += batch[2].shape[0]
        if step % a.log_every == 0 or step == 1:
            lv, av = float(loss.detach()), float(acc)
            if tl is not None:
                tv = float(tl.detach())
                text_ema = tv if text_ema is None else 0.8 * text_ema + 0.2 * tv
            ema = lv if ema is None else 0.8 * ema + 0.2 * lv
            acc_ema = av if acc_ema is None else 0.8 * acc_ema + 0.2 * av
            rec = {"step": step, "loss": round(lv, 4), "loss_ema": round(ema, 4), "token_acc": round(av, 4),
                   "token_acc_ema": round(acc_ema, 4), "lr": round(lr, 7),
                   "text_loss": None if tl is None else round(float(tl.detach()), 4),
                   "text_loss_ema": None if text_ema is None else round(text_ema, 4),
                   "decoder_lr": round(a.decoder_lr * dec_scale, 8), "grad_norm": round(float(gn), 3),
                   "examples": examples, "batch": list(batch[2].shape), "elapsed_s": round(elapsed, 1),
                   "data_wait_s": round(data_wait, 1),
                   "max_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else 0}
            log(json.dumps(rec))
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
    summary = {"steps": step, "examples": examples, "skipped_batches": skipped,
               "train_seconds": round(time.time() - t0, 1), "final_loss_ema": ema, "final_token_acc_ema": acc_ema,
               "data_wait_s": round(data_wait, 1), "lr": a.lr, "batch_size": a.batch_size, "seed": a.seed,
               "decoder_lr": a.decoder_lr, "text_frac": a.text_frac, "final_text_loss_ema": text_ema,
               "decoder_trained": train_dec and step > a.decoder_start}
    logf.write(json.dumps({"summary": summary}) + "\n")
    logf.close()
    del it, loader, text_it
    tower.eval()
    decoder.eval()
    for p in decoder.parameters():
        p.requires_grad_(False)
    return summary


@torch.no_grad()
def greedy_batch(decoder, tower, tok, items, dev: str, max_new: int) -> list[str]:
    """Greedy continuations of the items' prompts, batched: right-padded, the whole prefix recomputed each
    step (the decoder is causal, so padding after a sequence never changes it)."""
    eos = tok.token_to_id("<|end_of_msg|>")
    prompts = [encode_prompt(tok, it.chat, [image_token_count(it.example.image)]) for it in items]
    patches, grids = image_batch([it.example.image for it in items])
    rows = torch.cat(tower.forward_batch(to_pixels(patches, dev), grids))
    b = len(items)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    buf = torch.zeros(b, int(lens.max()) + max_new, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(p)
    where = torch.zeros_like(buf, dtype=torch.bool)
    where[:, : buf.shape[1] - max_new] = buf[:, : buf.shape[1] - max_new] == 7
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    out: list[list[int]] = [[] for _ in range(b)]
    for _ in range(max_new):
        t = int(lens.max())
        ids = buf[:, :t]
        emb = splice_embeds(decoder.model.embed_tokens(ids), ids, rows, where[:, :t])
        logits = decoder(ids, inputs_embeds=emb, kda_impl="fast")  # exact in exact arithmetic; checked below
        nxt = logits[torch.arange(b, device=dev), lens - 1].float().argmax(-1)
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
        buf[torch.arange(b, device=dev), lens.clamp(max=buf.shape[1] - 1)] = torch.where(done, 0, nxt)
        lens = lens + (~done).long()
        done = done | (nxt == eos)
        if bool(done.all()):
            break
    return [tok.decode(o, skip_special_tokens=False) for o in out]


@torch.no_grad()
def greedy_cached(decoder, tower, tok, item, dev: str, max_new: int) -> str:
    """One prompt through K3ForCausalLM.generate_greedy (recurrent/latent caches): the serving path."""
    eos = tok.token_to_id("<|end_of_msg|>")
    ids = encode_prompt(tok, item.chat, [image_token_count(item.example.image)])
    patches, grids = image_batch([item.example.image])
    rows = tower.forward_batch(to_pixels(patches, dev), grids)[0]
    t = torch.tensor([ids], device=dev)
    emb = splice_embeds(decoder.model.embed_tokens(t), t, rows)
    out = decoder.generate_greedy(ids, max_new, stop_ids=(eos,), inputs_embeds=emb)
    return tok.decode(out, skip_special_tokens=False)


def evaluate(decoder, tower, tok, a, dev: str, time_budget: float, log) -> dict:
    items = held_out(a.per_kind)
    t0 = time.time()
    cells = defaultdict(lambda: {"exact": [], "well_formed": []})
    samples, gens = [], {}
    batched = a.eval_path == "batched" or (a.eval_path == "auto" and dev == "cuda")
    group = a.eval_batch if batched else 1
    if batched:  # similar lengths together
        order = sorted(range(len(items)), key=lambda i: (items[i].thinking, items[i].example.image.size))
    else:  # round-robin over kinds and modes, so a cut budget still leaves every cell evaluated
        per = 2 * a.per_kind
        order = [k * per + j for j in range(per) for k in range(len(IMAGE_KINDS))]
    for s in range(0, len(order), group):
        if time.time() - t0 > time_budget:
            log(f"eval time budget reached after {s} of {len(items)} prompts")
            break
        chunk = [items[i] for i in order[s: s + group]]
        texts = (greedy_batch(decoder, tower, tok, chunk, dev, a.max_new) if batched
                 else [greedy_cached(decoder, tower, tok, chunk[0], dev, a.max_new)])
        for i, it, text in zip(order[s: s + group], chunk, texts):
            m = score(it, text)
            gens[i] = text
            kind = it.example.kind
            for key in (kind, "all"):
                for mode in ("thinking on" if it.thinking else "thinking off", "both"):
                    for k, v in m.items():
                        cells[(key, mode)][k].append(bool(v))
            if len(samples) < 30 and (not m["exact"] or sum(x["kind"] == kind for x in samples) < 2):
                samples.append({"kind": kind, "thinking": it.thinking, "question": it.example.question,
                                "answer": it.example.answer, "ok": m, "generated": text[:300]})
    table = {}
    for (key, mode), m in sorted(cells.items()):
        table.setdefault(key, {})[mode] = {k: round(sum(v) / len(v), 4) for k, v in m.items()} | {"n": len(m["exact"])}
    agree = []
    if batched:  # the batched path against the cached serving path on a few prompts
        for i in sorted(gens)[:: max(1, len(gens) // 10)][:10]:
            agree.append(greedy_cached(decoder, tower, tok, items[i], dev, a.max_new) == gens[i])
    return {"table": table, "path": "batched" if batched else "cached",
            "cached_path_agrees": f"{sum(agree)}/{len(agree)}" if batched else "n/a (cached path used)",
            "samples": samples, "seconds": round(time.time() - t0, 1), "per_kind": a.per_kind}


CARD_ROWS = [("arithmetic", "exact"), ("tool_use", "well_formed"), ("tool_use", "schema_valid"),
             ("tool_use", "args_exact"), ("recall", "exact"), ("kv_retrieval", "exact"),
             ("json_answer", "valid_json"), ("json_answer", "exact"), ("prose", "well_formed")]


@torch.no_grad()
def text_greedy_batch(decoder, tok, prompts: list[list[int]], dev: str, max_new: int,
                      deadline: float = float("inf")) -> list[str] | None:
    """greedy_batch without images: right-padded, the whole prefix recomputed each step. None when the
    deadline passes first (truncated answers would score as wrong ones)."""
    eos = tok.token_to_id("<|end_of_msg|>")
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    buf = torch.zeros(b, int(lens.max()) + max_new, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(p)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    out: list[list[int]] = [[] for _ in range(b)]
    for _ in range(max_new):
        if time.time() > deadline:
            return None
        logits = decoder(buf[:, : int(lens.max())], kda_impl="fast")
        nxt = logits[torch.arange(b, device=dev), lens - 1].float().argmax(-1)
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
        buf[torch.arange(b, device=dev), lens.clamp(max=buf.shape[1] - 1)] = torch.where(done, 0, nxt)
        lens = lens + (~done).long()
        done = done | (nxt == eos)
        if bool(done.all()):
            break
    return [tok.decode(o, skip_special_tokens=False) for o in out]


def text_table_batched(decoder, tok, n: int, budget: float, dev: str, log):
    """k3ref.evaluate's table (same held-out examples, MAX_NEW, check), one batch per kind, kv retrieval
    (2.7k-token prompts) last so a cut budget loses the least."""
    from .data.tasks import check, prompt_text
    from .evaluate import MAX_NEW
    exs = held_out_examples(n)
    kinds = sorted({ex.kind for ex, _ in exs}, key=lambda k: (k == "kv_retrieval", k))
    res, samples, t0 = defaultdict(lambda: defaultdict(list)), [], time.time()
    for kind in kinds:
        if time.time() - t0 > budget:
            log(f"text eval budget reached before {kind}")
            break
        group = [(ex, th) for ex, th in exs if ex.kind == kind]
        prompts = [tok.encode(prompt_text(ex), add_special_tokens=False).ids for ex, _ in group]
        texts = text_greedy_batch(decoder, tok, prompts, dev, MAX_NEW[kind], t0 + budget)
        if texts is None:
            log(f"text eval budget reached during {kind} (not scored)")
            break
        for (ex, thinking), text in zip(group, texts):
            m = check(ex, text)
            res[kind]["_n"].append(1)
            for k, v in m.items():
                res[kind][k].append(bool(v))
                res[kind][f"{k} (thinking {'on' if thinking else 'off'})"].append(bool(v))
            if len(samples) < 24 and not all(m.values()):
                samples.append({"kind": kind, "ok": m, "generated": text[:400]})
    table = {k: {x: round(sum(v) / len(v), 4) for x, v in m.items() if x != "_n"} | {"n": len(m["_n"])}
             for k, m in res.items()}
    return table, samples


def text_eval(decoder, tok, a, budget: float, log) -> dict:
    """The MODEL_CARD's text table (k3ref.evaluate, held-out seeds) for the fine-tuned decoder (batched on
    CUDA; on CPU one at a time, kinds interleaved so a cut budget still scores every kind); printed as the
    card's rows."""
    n = a.text_eval_per_kind
    t0 = time.time()
    dev = next(decoder.parameters()).device.type
    if dev == "cuda" and not a.smoke:
        table, samples = text_table_batched(decoder, tok, n, budget, dev, log)
    else:
        per_kind = held_out_examples(n)
        order = [per_kind[k * n + i] for i in range(n) for k in range(len(per_kind) // n)]
        table, samples = text_evaluate(decoder, tok, n, budget, log=log, examples=order,
                                       max_new_cap=48 if a.smoke else None)
    log(f"text eval ({time.time() - t0:.0f}s; committed card: 30 per kind, CPU) kind/metric: all | on | off")
    for kind, metric in CARD_ROWS:
        m = table.get(kind, {})
        cells = [m.get(metric), m.get(f"{metric} (thinking on)"), m.get(f"{metric} (thinking off)")]
        log(f"  {kind:12s} {metric:12s} " + " | ".join("-" if v is None else f"{v:.3f}" for v in cells)
            + f"  (n={m.get('n', 0)})")
    offs = [v for m in table.values() for k, v in m.items() if k == "no_think (thinking off)"]
    if offs:
        log(f"  no think text when thinking is off: {sum(offs) / len(offs):.3f}")
    return {"table": table, "samples": samples, "seconds": round(time.time() - t0, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/k3-mini")
    ap.add_argument("--tokenizer", default=None, help="default: <model>/tokenizer.json")
    ap.add_argument("--out", default="runs/k3-mini-vision")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds of training (420; --smoke: 8)")
    ap.add_argument("--wall-budget", type=float, default=540.0, help="the whole run: evaluation is cut to fit")
    ap.add_argument("--eval-time", type=float, default=75.0, help="seconds of evaluation at most")
    ap.add_argument("--init-from", default=None, help="a vision.safetensors to continue from")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--kda-impl", default="fast", help="KDA form in training (fast: the 64-token chunk form)")
    ap.add_argument("--per-kind", type=int, default=50, help="held-out images per kind (each asked twice)")
    ap.add_argument("--eval-batch", type=int, default=100)
    ap.add_argument("--eval-path", choices=["auto", "batched", "cached"], default="auto",
                    help="batched full-recompute greedy (auto on CUDA) or one prompt at a time with caches (CPU)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--decoder-lr", type=float, default=1e-4, help="0: the decoder stays frozen")
    ap.add_argument("--decoder-start", type=int, default=100, help="steps of tower-only training first")
    ap.add_argument("--decoder-warmup", type=int, default=200)
    ap.add_argument("--bias-speed", type=float, default=1e-4, help="router bias balancing while the decoder trains")
    ap.add_argument("--text-frac", type=float, default=0.5, help="share of the loss from text batches")
    ap.add_argument("--text-mix", default="arithmetic=0.4,tool_use=0.3,recall=0.15,kv_retrieval=0.02,"
                    "json_answer=0.07,prose=0.06", help="the MODEL_CARD's run-4 mix")
    ap.add_argument("--text-tokens", type=int, default=16384, help="padded tokens per text batch")
    ap.add_argument("--text-max-len", type=int, default=3200)
    ap.add_argument("--text-workers", type=int, default=4)
    ap.add_argument("--text-eval-per-kind", type=int, default=24, help="MODEL_CARD text table, held-out seeds")
    ap.add_argument("--text-eval-time", type=float, default=100.0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and budgets: the whole pipeline in seconds")
    a = ap.parse_args()
    t_start = time.time()
    if a.smoke:
        a.time_budget = 8.0 if a.time_budget is None else a.time_budget
        a.eval_time = min(a.eval_time, 15.0)
        a.batch_size, a.workers, a.warmup, a.log_every, a.per_kind, a.max_new = 4, 1, 3, 1, 1, 40
        a.decoder_start, a.decoder_warmup, a.text_tokens, a.text_max_len, a.text_workers = 1, 2, 1024, 500, 1
        a.text_eval_per_kind, a.text_eval_time = 1, min(a.text_eval_time, 8.0)
    a.time_budget = 420.0 if a.time_budget is None else a.time_budget
    a.tokenizer = a.tokenizer or os.path.join(a.model, "tokenizer.json")
    os.makedirs(a.out, exist_ok=True)

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    from tokenizers import Tokenizer
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(a.seed)
    tok = Tokenizer.from_file(a.tokenizer)
    decoder = load_exported(a.model).to(dev).eval()
    for p in decoder.parameters():
        p.requires_grad_(False)
    cfg = vision_config_of(a.model)
    tower = load_vision(a.init_from, cfg) if a.init_from else random_init(VisionTower(cfg), a.seed)
    tower = tower.float().to(dev)
    log(f"device={dev} tower params={sum(p.numel() for p in tower.parameters()) / 1e6:.2f}M args={vars(a)}")
    result = {}
    try:
        result["train"] = {"steps": 0} if a.time_budget <= 0 else train(decoder, tower, a, dev, log)
    except Exception:  # keep what was learnt: export and evaluation still run
        result["train"] = {"error": traceback.format_exc(), "decoder_trained": a.decoder_lr > 0}
    decoder.eval()
    for p in decoder.parameters():
        p.requires_grad_(False)
    log(f"training done: {json.dumps(result['train'])}")
    weights = os.path.join(a.out, "vision.safetensors")
    export_all(tower.cpu(), None, weights, os.path.join(a.out, "vision-golden.safetensors"))
    log(f"exported {weights} and vision-golden.safetensors")
    served = load_vision(weights, cfg).to(dev)  # evaluate what was exported (bf16-rounded)
    if result["train"].get("decoder_trained"):
        dec_path = os.path.join(a.out, "model.safetensors")
        save_file(to_tensors(decoder.cpu()), dec_path, metadata={"format": "pt"})
        del decoder
        decoder = load_exported(a.model, weights=dec_path).to(dev)  # the numbers the Rust side will load
        log(f"exported {dec_path} ({os.path.getsize(dec_path) / 2**20:.1f} MiB; same layout as {a.model})")
    else:
        decoder = decoder.to(dev)
    left = a.wall_budget - (time.time() - t_start) - 15
    text_budget = max(1.0, min(a.text_eval_time, left * 0.5)) if result["train"].get("decoder_trained") else 0
    budget = max(1.0, min(a.eval_time, left - text_budget))
    log(f"evaluation: {budget:.0f}s")
    try:
        result["eval"] = evaluate(decoder, served, tok, a, dev, budget, log)
        for kind in IMAGE_KINDS + ["all"]:
            row = result["eval"]["table"].get(kind, {})
            log(f"{kind:10s} " + "  ".join(f"{mode}: {v['exact']:.3f} (n={v['n']}, well-formed {v['well_formed']:.2f})"
                                           for mode, v in row.items()))
        log(f"cached path agrees: {result['eval']['cached_path_agrees']}")
    except Exception:
        result["eval_error"] = traceback.format_exc()
        log(result["eval_error"])
    if text_budget:
        try:
            result["text_eval"] = text_eval(decoder, tok, a, text_budget, log)
        except Exception:
            result["text_eval_error"] = traceback.format_exc()
            log(result["text_eval_error"])
    result["wall_seconds"] = round(time.time() - t_start, 1)
    result["args"] = {k: v for k, v in vars(a).items()}
    with open(os.path.join(a.out, "vision_eval.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    log(f"done in {result['wall_seconds']}s; wrote {sorted(os.listdir(a.out))}")


if __name__ == "__main__":
    main()
