"""Speculative decoding with the DSpark drafter against k3-mini: an exact simulation, confidence calibration
(Sequential Temperature Scaling) and the golden vectors for the Rust drafter.

The simulation runs the real protocol: each target step is one full forward over the committed tokens plus
the γ drafted ones (no cache, so nothing to roll back), which gives the target's distributions at the block's
positions and the tap rows of every committed position. Greedy accepts while draft == target argmax and
commits the target's token at the first mismatch (or the bonus); temperature 1 is the standard lossless rule
(accept x_k with probability min(1, p(x_k)/q(x_k)); on rejection sample norm(max(0, p - q)); bonus from p).
"""
from __future__ import annotations

import random
import time
from collections import defaultdict

import torch

from .data.tasks import EFFORTS, TASK_KINDS, prompt_text, sample_example
from .dspark import DSparkDrafter, target_taps
from .evaluate import HELD_OUT_SEED, MAX_NEW

CALIBRATION_SEED = 2_000_029  # held out from training (seeds < 10^6) and from evaluation (HELD_OUT_SEED + kind)


def prompt_groups(tokenizer, seed_base: int, per_kind: int, group: int):
    """[(kind, [(prompt ids, max_new), ...])]: `group` prompts of one kind per entry (decoded together),
    kinds round-robin so a time budget cut keeps every kind represented. Thinking on for two of every
    three, efforts cycling (as evaluate.held_out_examples)."""
    per = {}
    for kind in TASK_KINDS:
        rng = random.Random(seed_base + TASK_KINDS.index(kind))
        per[kind] = [sample_example(kind, rng, thinking=i % 3 != 2, effort=EFFORTS[i % 4]) for i in range(per_kind)]
    out = []
    for start in range(0, per_kind, group):
        for kind in TASK_KINDS:
            out.append((kind, [(tokenizer.encode(prompt_text(ex), add_special_tokens=False).ids, MAX_NEW[kind])
                               for ex in per[kind][start:start + group]]))
    return out


class TargetRunner:
    """The target in float32 (as a serving backend sees it), one full forward per call."""

    def __init__(self, target, taps, kda_impl: str = "fast"):
        self.target, self.taps, self.kda_impl = target, list(taps), kda_impl
        self.device = target.lm_head.weight.device

    @torch.no_grad()
    def __call__(self, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, taps = self.batch([seq])
        return logits[0], taps[0]

    @torch.no_grad()
    def batch(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded batch: the target is causal, so each sequence's rows are as if it ran alone."""
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        logits, taps = target_taps(self.target, ids.to(self.device), self.taps, kda_impl=self.kda_impl,
                                   moe_dense=True)
        return logits.float(), taps.float()


def verify_block(target_logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """Verify γ drafted tokens against the target's logits at the block's γ+1 positions. q None: greedy (accept
    while draft == argmax, then the target's argmax). q [γ, V] (the drafter's processed distributions): the
    standard lossless rule at temperature 1. Returns (accepted count n, the token committed after them)."""
    g = len(drafts)
    if q is None:
        tgt = torch.argmax(target_logits, -1).tolist()
        n = 0
        while n < g and drafts[n] == tgt[n]:
            n += 1
        return n, tgt[n]
    p = torch.softmax(target_logits.float(), -1)
    idx = torch.tensor(drafts, device=p.device).unsqueeze(-1)
    ratio = (p[:g].gather(-1, idx) / q.gather(-1, idx).clamp_min(1e-30)).squeeze(-1)
    u = torch.rand(g, device=p.device, generator=generator)
    ok = (u < ratio.clamp(max=1.0)).tolist()
    n = 0
    while n < g and ok[n]:
        n += 1
    if n < g:
        resid = (p[n] - q[n]).clamp_min(0)
        resid = p[n] if float(resid.sum()) <= 1e-8 else resid
    else:
        resid = p[g]
    return n, int(torch.multinomial(resid / resid.sum(), 1, generator=generator))


@torch.no_grad()
def speculative_decode_batch(runner: TargetRunner, drafter: DSparkDrafter, prompts: list[list[int]],
                             max_new: list[int], eos: int, *, greedy: bool, generator: torch.Generator | None = None,
                             deadline: float | None = None):
    """Speculative decoding of several prompts in lockstep (one batched target forward per step; a finished
    prompt leaves the batch). Returns per prompt (generated tokens, per-step records {accepted, committed, z}).
    The prefill's first token is not a speculative step. Past `deadline` (time.time()) no step starts: the
    outputs are cut short, the steps taken stay valid."""
    cfg = drafter.cfg
    g, win = cfg.block_size, cfg.context_window
    dev = runner.device
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    steps: list[list[dict]] = [[] for _ in prompts]
    logits, taps = runner.batch(seqs)
    feats = drafter.features(taps)
    last = logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]
    if greedy:
        first = torch.argmax(last, -1).tolist()
    else:
        first = torch.multinomial(torch.softmax(last, -1), 1, generator=generator).squeeze(-1).tolist()
    for b, t in enumerate(first):
        seqs[b].append(t)
        outs[b].append(t)

    def running(b):
        return len(outs[b]) < max_new[b] and outs[b][-1] != eos

    active = [b for b in range(len(seqs)) if running(b)]
    rows = list(range(len(seqs)))  # active prompt -> its row in the last forward (feats)
    while active and (deadline is None or time.time() < deadline):
        pos = [len(seqs[b]) - 1 for b in active]  # anchors: the target has processed every position before
        lo, hi = max(0, min(pos) - win), max(pos)
        f = feats[[rows[b] for b in active], lo:hi]
        fpos = torch.arange(lo, hi, device=dev).expand(len(active), hi - lo)
        anchor = torch.tensor([seqs[b][-1] for b in active], device=dev)
        y = drafter.block_hidden(f, fpos, anchor.unsqueeze(1), torch.tensor(pos, device=dev).unsqueeze(1))[:, 0]
        d = drafter.markov_decode(y, anchor, greedy=greedy, temperature=1.0, generator=generator)
        drafts = d["tokens"].tolist()
        logits, taps = runner.batch([seqs[b] + drafts[i] for i, b in enumerate(active)])
        feats = drafter.features(taps)  # rows past each accepted prefix are overwritten by the next step
        z = d["z"].float().tolist()
        for i, b in enumerate(active):
            q = None if greedy else torch.softmax(d["logits"][i].float(), -1)
            n, nxt = verify_block(logits[i, pos[i]:pos[i] + g + 1], drafts[i], q, generator)
            new = drafts[i][:n] + [nxt]
            if eos in new:
                new = new[: new.index(eos) + 1]
            new = new[: max_new[b] - len(outs[b])]
            seqs[b] += new
            outs[b] += new
            steps[b].append({"accepted": n, "committed": len(new), "z": z[i]})
            rows[b] = i
        active = [b for b in active if running(b)]
    return list(zip(outs, steps))


def speculative_decode(runner: TargetRunner, drafter: DSparkDrafter, prompt: list[int], max_new: int, eos: int,
                       *, greedy: bool, generator: torch.Generator | None = None):
    """One prompt: (generated tokens, per-step records)."""
    return speculative_decode_batch(runner, drafter, [prompt], [max_new], eos, greedy=greedy, generator=generator)[0]


def ece(conf: torch.Tensor, label: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error: equal-width bins, |mean confidence - mean outcome| weighted by bin size."""
    conf, label = conf.double().flatten(), label.double().flatten()
    if conf.numel() == 0:
        return float("nan")
    b = (conf * bins).long().clamp(0, bins - 1)
    # per bin, count * |mean conf - mean outcome| = |sum conf - sum outcome|
    gap = torch.bincount(b, weights=conf, minlength=bins) - torch.bincount(b, weights=label, minlength=bins)
    return float(gap.abs().sum()) / conf.numel()


def cumulative_ece(z: torch.Tensor, accepted: torch.Tensor, temps, valid: torch.Tensor | None = None) -> float:
    """ECE of prefix survival a_k = Π_{i<=k} sigmoid(z_i / T_i) against 1[accepted >= k], over all (step, k).
    z [N, γ], accepted [N]."""
    t = torch.tensor(list(temps), dtype=torch.float64)
    a = torch.cumprod(torch.sigmoid(z.double() / t), dim=-1)
    ks = torch.arange(1, z.shape[1] + 1)
    label = (accepted.unsqueeze(-1) >= ks).double()
    if valid is not None:
        a, label = a[valid], label[valid]
    return ece(a, label)


def sequential_temperature_scaling(z: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor | None = None,
                                   grid=None) -> list[float]:
    """Per position, left to right: the temperature T_k (grid search) that minimises the ECE of the cumulative
    product a_k = a_{k-1} · sigmoid(z_k / T_k) against 1[accepted >= k], earlier T fixed."""
    if grid is None:
        grid = torch.logspace(-1.5, 1.5, 121, dtype=torch.float64).tolist()  # 0.03 .. 31.6
    z = z.double()
    valid = torch.ones_like(z, dtype=torch.bool) if valid is None else valid
    prefix = torch.ones(z.shape[0], dtype=torch.float64)
    temps = []
    for k in range(z.shape[1]):
        m = valid[:, k]
        label = (accepted >= k + 1).double()
        best_t, best_e = 1.0, float("inf")
        if m.any():
            for t in grid:
                e = ece((prefix * torch.sigmoid(z[:, k] / t))[m], label[m])
                if e < best_e - 1e-12:
                    best_t, best_e = float(t), e
        temps.append(round(best_t, 5))
        prefix = prefix * torch.sigmoid(z[:, k] / best_t)
    return temps


@torch.no_grad()
def all_anchor_records(runner: TargetRunner, drafter: DSparkDrafter, seq: list[int], start: int,
                       chunk: int = 96):
    """Greedy drafts from every anchor P in [start, len(seq) - 2] of a target-greedy sequence: z [N, γ],
    accepted [N] (leading matches with seq[P+1 ..]), valid [N, γ] (row k's token exists in seq)."""
    g, win = drafter.cfg.block_size, drafter.cfg.context_window
    dev = runner.device
    _, taps = runner(seq)
    feats = drafter.features(taps).unsqueeze(0)
    fpos = torch.arange(len(seq), device=dev).unsqueeze(0)
    ids = torch.tensor(seq, device=dev)
    zs, acc, val = [], [], []
    anchors = torch.arange(start, len(seq) - 1, device=dev)
    for i in range(0, anchors.numel(), chunk):
        ap = anchors[i:i + chunk]
        lo = max(0, int(ap[0]) - win)  # only the rows any anchor in this chunk can see
        y = drafter.block_hidden(feats[:, lo:int(ap[-1])], fpos[:, lo:int(ap[-1])], ids[ap].unsqueeze(0),
                                 ap.unsqueeze(0))[0]
        d = drafter.markov_decode(y, ids[ap], greedy=True)
        want_pos = (ap.unsqueeze(-1) + torch.arange(1, g + 1, device=dev))
        valid = want_pos < len(seq)
        want = ids[want_pos.clamp(max=len(seq) - 1)]
        match = (d["tokens"] == want) & valid
        accepted = torch.cumprod(match.long(), dim=-1).sum(-1)
        zs.append(d["z"].float().cpu())
        acc.append(accepted.cpu())
        val.append(valid.cpu())
    return torch.cat(zs), torch.cat(acc), torch.cat(val)


def calibrate(runner, drafter, tokenizer, time_budget: float, per_kind: int = 48, group: int = 6,
              max_new_cap: int | None = None, log=print) -> dict:
    """Sets drafter.cfg.confidence_temperatures by STS on greedy drafts over held-out prompts: the target's
    greedy outputs are decoded speculatively, then every position of each output serves as an anchor."""
    eos = tokenizer.token_to_id("<|end_of_msg|>")
    t0 = time.time()
    zs, acc, val, prompts = [], [], [], 0
    for kind, items in prompt_groups(tokenizer, CALIBRATION_SEED, per_kind, group):
        if time.time() - t0 > time_budget:
            break
        ids = [p for p, _ in items]
        caps = [min(m, max_new_cap or m) for _, m in items]
        decoded = speculative_decode_batch(runner, drafter, ids, caps, eos, greedy=True,
                                           deadline=t0 + time_budget + 5)
        for p, (out, _) in zip(ids, decoded):
            z, a, v = all_anchor_records(runner, drafter, p + out, len(p))
            zs.append(z), acc.append(a), val.append(v)
            prompts += 1
    z, a, v = torch.cat(zs), torch.cat(acc), torch.cat(val)
    before = cumulative_ece(z, a, [1.0] * z.shape[1], v)
    temps = sequential_temperature_scaling(z, a, v)
    drafter.cfg.confidence_temperatures = temps
    after = cumulative_ece(z, a, temps, v)
    res = {"mode": "greedy", "prompts": prompts, "anchors": int(z.shape[0]), "seconds": round(time.time() - t0, 1),
           "temperatures": temps, "ece_cumulative_before": round(before, 4), "ece_cumulative_after": round(after, 4),
           "mean_accepted": round(float(a.float().mean()), 3)}
    log(f"calibration: {res}")
    return res


def _summary(records: list[dict], temps, g: int) -> dict:
    steps = len(records)
    if not steps:
        return {"steps": 0}
    committed = sum(r["committed"] for r in records)
    acc = torch.tensor([r["accepted"] for r in records])
    z = torch.tensor([r["z"] for r in records])
    by_pos = [round(float((acc >= k).double().mean()), 4) for k in range(1, g + 1)]
    return {"steps": steps, "tokens": committed, "acceptance_length": round(committed / steps, 3),
            "mean_accepted_plus_one": round(float(acc.double().mean()) + 1, 3),
            "prefix_accept_rate_by_position": by_pos,
            "ece_cumulative": round(cumulative_ece(z, acc, temps), 4),
            "ece_cumulative_uncalibrated": round(cumulative_ece(z, acc, [1.0] * g), 4),
            "mean_predicted_accept_length": round(
                float(torch.cumprod(torch.sigmoid(z.double() / torch.tensor(temps, dtype=torch.float64)), -1)
                      .sum(-1).mean()) + 1, 3)}


def evaluate_speculative(runner, drafter, tokenizer, time_budget: float, per_kind: int = 48, group: int = 6,
                         max_new_cap: int | None = None, seed: int = 0, log=print) -> dict:
    """Per task kind, greedy and temperature 1: acceptance length (tokens committed per target step) and ECE
    of the calibrated confidences. Prompts are evaluate.py's held-out seeds, `group` of one kind decoded
    together; stops at the time budget (checked between groups)."""
    eos = tokenizer.token_to_id("<|end_of_msg|>")
    g = drafter.cfg.block_size
    temps = list(drafter.cfg.confidence_temperatures)
    t0 = time.time()
    recs = {"greedy": defaultdict(list), "temperature_1": defaultdict(list)}
    prompts = defaultdict(int)
    samples = []
    gen = torch.Generator(device=runner.device)
    for i, (kind, items) in enumerate(prompt_groups(tokenizer, HELD_OUT_SEED, per_kind, group)):
        if time.time() - t0 > time_budget:
            break
        ids = [p for p, _ in items]
        caps = [min(m, max_new_cap or m) for _, m in items]
        stop = t0 + time_budget + 5  # a slow group is cut rather than overrunning the device call
        greedy = speculative_decode_batch(runner, drafter, ids, caps, eos, greedy=True, deadline=stop)
        gen.manual_seed(seed * 1_000_003 + i)
        sampled = speculative_decode_batch(runner, drafter, ids, caps, eos, greedy=False, generator=gen,
                                           deadline=stop)
        for (out, steps), (_, steps1) in zip(greedy, sampled):
            recs["greedy"][kind] += steps
            recs["temperature_1"][kind] += steps1
        prompts[kind] += len(items)
        if len(samples) < 6:
            samples.append({"kind": kind, "greedy": tokenizer.decode(greedy[0][0], skip_special_tokens=False)[:300]})
        log(f"eval {kind} x{len(items)}: greedy {sum(len(o) for o, _ in greedy)} tokens / "
            f"{sum(len(s) for _, s in greedy)} steps, T=1 {sum(len(o) for o, _ in sampled)} / "
            f"{sum(len(s) for _, s in sampled)} ({time.time() - t0:.0f}s)")
    res = {"prompts_per_kind": dict(prompts), "seconds": round(time.time() - t0, 1), "temperatures": temps,
           "block_size": g, "samples": samples}
    for mode, per in recs.items():
        res[mode] = {kind: _summary(r, temps, g) for kind, r in per.items()}
        res[mode]["all"] = _summary([x for r in per.values() for x in r], temps, g)
    return res


@torch.no_grad()
def check_greedy_lossless(runner, drafter, tokenizer, max_new: int = 48) -> dict:
    """Greedy speculative output == the target's plain greedy decoding (one full forward per token), on the
    first held-out prompt of each kind, decoded as one speculative batch."""
    eos = tokenizer.token_to_id("<|end_of_msg|>")
    groups = prompt_groups(tokenizer, HELD_OUT_SEED, 1, 1)
    prompts = [items[0][0] for _, items in groups]
    spec = speculative_decode_batch(runner, drafter, prompts, [max_new] * len(prompts), eos, greedy=True)
    res = {}
    for (kind, _), p, (out, _) in zip(groups, prompts, spec):
        seq, plain = list(p), []
        while len(plain) < max_new and (not plain or plain[-1] != eos):
            logits, _ = runner(seq)
            plain.append(int(torch.argmax(logits[-1])))
            seq.append(plain[-1])
        res[kind] = {"tokens": len(plain), "identical": out == plain}
    return res


GOLDEN_PROMPT = ('<|open|>message role="user"<|sep|>What is 47 + 85?<|close|>message<|sep|><|end_of_msg|>'
                 '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


@torch.no_grad()
def golden_vectors(target, drafter: DSparkDrafter, tokenizer, long_prompt: list[int]) -> dict[str, torch.Tensor]:
    """Float32 CPU vectors for host/dspark (names documented in k3ref/dspark_train.py). The target runs its
    plain path (chunked KDA, sparse MoE) as the Rust backend does."""
    out = {}
    for name, ids in (("short", tokenizer.encode(GOLDEN_PROMPT, add_special_tokens=False).ids),
                      ("long", long_prompt)):
        x = torch.tensor([ids])
        logits, taps = target_taps(target, x, drafter.cfg.target_taps)
        feats = drafter.features(taps[0])
        anchor, pos = int(torch.argmax(logits[0, -1])), len(ids)
        lo = max(0, pos - drafter.cfg.context_window)
        d = drafter.draft(feats[lo:], torch.arange(lo, pos), anchor, pos, greedy=True)
        top = torch.topk(d["logits"], 5, dim=-1)
        base = torch.topk(drafter.base_logits(d["y"]), 5, dim=-1)
        out[f"{name}.prompt_ids"] = torch.tensor(ids, dtype=torch.int64)
        if name == "short":  # the long case's taps would be 2 MB; its features are enough for the window
            out[f"{name}.taps"] = taps[0].float().contiguous()
        out[f"{name}.features"] = feats.float().contiguous()
        out[f"{name}.anchor_token"] = torch.tensor([anchor], dtype=torch.int64)
        out[f"{name}.anchor_position"] = torch.tensor([pos], dtype=torch.int64)
        out[f"{name}.y"] = d["y"].float().contiguous()
        out[f"{name}.base_logits_top5_ids"] = base.indices.to(torch.int64).contiguous()
        out[f"{name}.base_logits_top5_values"] = base.values.float().contiguous()
        out[f"{name}.greedy_tokens"] = d["tokens"].to(torch.int64).contiguous()
        out[f"{name}.greedy_logits_top5_ids"] = top.indices.to(torch.int64).contiguous()
        out[f"{name}.greedy_logits_top5_values"] = top.values.float().contiguous()
        out[f"{name}.confidence_logits"] = d["z"].float().contiguous()
        out[f"{name}.confidence"] = drafter.calibrated(d["z"]).float().contiguous()
    out["confidence_temperatures"] = torch.tensor(drafter.cfg.confidence_temperatures, dtype=torch.float32)
    return out
