"""Float64 checks of the DSpark drafter (k3ref/dspark.py) against the spec, its loss, calibration and the
speculative-decoding simulator. Skipped where torch is not installed."""
import math

import pytest

torch = pytest.importorskip("torch")

from k3ref.config import k3_mini  # noqa: E402
from k3ref.dspark import (DSparkConfig, DSparkDrafter, dspark_loss, load_drafter, save_drafter,  # noqa: E402
                          target_taps)
from k3ref.dspark_eval import (TargetRunner, cumulative_ece, ece, sequential_temperature_scaling,  # noqa: E402
                               speculative_decode, speculative_decode_batch, verify_block)
from k3ref.dspark_train import sample_anchors  # noqa: E402
from k3ref.model import K3ForCausalLM  # noqa: E402
from k3ref.norm import rms_norm  # noqa: E402

V, D = 96, 32


def tiny_drafter(seed=0, **kw) -> DSparkDrafter:
    torch.manual_seed(seed)
    cfg = DSparkConfig(hidden_size=D, num_layers=2, num_heads=2, head_dim=8, intermediate_size=48, block_size=4,
                       markov_rank=8, context_window=6, vocab_size=V, confidence_temperatures=[1.0] * 4, **kw)
    dr = DSparkDrafter(cfg, torch.randn(V, D) * 0.5, torch.randn(V, D) * 0.5)
    with torch.no_grad():  # non-zero everywhere so every path is exercised
        dr.markov.w2.normal_(std=0.3)
        dr.confidence.weight.normal_(std=0.3)
        dr.confidence.bias.fill_(0.1)
        dr.mask_embedding.normal_()
    return dr.double().eval()


def tiny_target(seed=0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    cfg = k3_mini().replace(vocab_size=V, hidden_size=D, intermediate_size=48, kda_num_heads=1, kda_head_dim=16,
                            gate_low_rank_dim=8, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                            qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            routed_expert_hidden_size=32)
    return K3ForCausalLM(cfg).double().eval()


def naive_block(dr: DSparkDrafter, feats, feat_pos, anchor: int, pos: int):
    """The spec's forward of one block, written out row by row."""
    cfg = dr.cfg
    g, h, hd, eps = cfg.block_size, cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    ctx = [(feats[i], int(feat_pos[i])) for i in range(len(feat_pos))
           if pos - cfg.context_window <= int(feat_pos[i]) < pos]

    def rot(vec, p):  # NeoX: pairs (i, i + hd/2)
        out = vec.clone()
        for i in range(hd // 2):
            ang = p * cfg.rope_theta ** (-2 * i / hd)
            a, b = vec[i], vec[i + hd // 2]
            out[i], out[i + hd // 2] = a * math.cos(ang) - b * math.sin(ang), b * math.cos(ang) + a * math.sin(ang)
        return out

    x = [dr.embed[anchor].clone()] + [dr.mask_embedding.clone() for _ in range(g - 1)]
    for L in dr.layers:
        u = [rms_norm(r, L.input_norm.weight, eps) for r in x]
        keys = [(c @ L.k_proj.weight.t(), c @ L.v_proj.weight.t(), p) for c, p in ctx]
        keys += [(r @ L.k_proj.weight.t(), r @ L.v_proj.weight.t(), pos + j) for j, r in enumerate(u)]
        new = []
        for j, r in enumerate(u):
            q = r @ L.q_proj.weight.t()
            heads = []
            for hh in range(h):
                sl = slice(hh * hd, (hh + 1) * hd)
                qh = rot(q[sl], pos + j)
                s = torch.stack([rot(k[sl], p) @ qh for k, _, p in keys]) / math.sqrt(hd)
                w = torch.softmax(s, 0)
                heads.append(sum(w[i] * keys[i][1][sl] for i in range(len(keys))))
            o = torch.cat(heads) @ L.o_proj.weight.t()
            xr = x[j] + o
            z = rms_norm(xr, L.post_norm.weight, eps)
            gate, up = z @ L.gate_proj.weight.t(), z @ L.up_proj.weight.t()
            f = (torch.nn.functional.silu(gate) * up) @ L.down_proj.weight.t()
            new.append(xr + f)
        x = new
    return torch.stack([rms_norm(r, dr.norm.weight, eps) for r in x])


def context(dr, n=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(n, len(dr.cfg.target_taps) * D, generator=g, dtype=torch.float64)
    return dr.features(taps)


def test_block_matches_row_by_row_spec():
    dr = tiny_drafter()
    feats = context(dr)
    fpos = torch.arange(9)
    y = dr.block_hidden(feats[None], fpos[None], torch.tensor([[5]]), torch.tensor([[9]]))[0, 0]
    assert (y - naive_block(dr, feats, fpos, 5, 9)).abs().max() < 1e-10


def test_block_is_non_causal_and_anchors_independent():
    dr = tiny_drafter()
    feats, fpos = context(dr), torch.arange(9)
    y0 = dr.block_hidden(feats[None], fpos[None], torch.tensor([[5]]), torch.tensor([[9]]))[0, 0]
    with torch.no_grad():
        dr.mask_embedding.add_(0.5)  # only rows 1.. read it: row 0 changes only if it sees later rows
    y1 = dr.block_hidden(feats[None], fpos[None], torch.tensor([[5]]), torch.tensor([[9]]))[0, 0]
    assert (y1[0] - y0[0]).abs().max() > 1e-4
    # several anchors in one call = one call each (blocks never see each other)
    both = dr.block_hidden(feats[None], fpos[None], torch.tensor([[5, 7]]), torch.tensor([[9, 6]]))[0]
    one = dr.block_hidden(feats[None], fpos[None], torch.tensor([[7]]), torch.tensor([[6]]))[0, 0]
    assert (both[0] - y1).abs().max() < 1e-12 and (both[1] - one).abs().max() < 1e-12


def test_positions_window_and_gaps():
    dr = tiny_drafter()
    feats, fpos = context(dr), torch.arange(9)
    run = lambda f, p, a: dr.block_hidden(f[None], p[None], torch.tensor([[5]]), torch.tensor([[a]]))[0, 0]  # noqa
    y = run(feats, fpos, 9)
    assert (run(feats, fpos + 100, 109) - y).abs().max() < 1e-9  # RoPE: only relative positions matter
    assert (run(feats, fpos, 10) - y).abs().max() > 1e-4  # the anchor's position matters
    gap = fpos.clone()
    gap[5:] -= 1  # a hole at 8 (prefix-cache gap): rows keep their own positions
    assert (run(feats, gap, 9) - y).abs().max() > 1e-6
    far = feats.clone()
    far[:3] += 5.0  # positions 0..2 are outside the 6-row window of an anchor at 9
    assert (run(far, fpos, 9) - y).abs().max() < 1e-12
    near = feats.clone()
    near[3] += 5.0
    assert (run(near, fpos, 9) - y).abs().max() > 1e-4


@torch.no_grad()
def test_markov_decode_and_confidence():
    dr = tiny_drafter()
    feats = context(dr).detach()
    d = dr.draft(feats, torch.arange(9), 5, 9, greedy=True)
    base = d["y"] @ dr.lm_head.t()
    prev = 5
    for k in range(dr.cfg.block_size):
        logits = base[k] + dr.markov.w1[prev] @ dr.markov.w2
        assert (d["logits"][k] - logits).abs().max() < 1e-12
        z = dr.confidence.weight[0] @ torch.cat([d["y"][k], dr.markov.w1[prev]]) + dr.confidence.bias[0]
        assert abs(float(d["z"][k] - z)) < 1e-12
        prev = int(torch.argmax(logits))
        assert int(d["tokens"][k]) == prev
    dr.cfg.confidence_temperatures = [2.0, 1.0, 0.5, 1.0]
    c = dr.calibrated(d["z"])
    assert abs(float(c[0]) - 1 / (1 + math.exp(-float(d["z"][0]) / 2.0))) < 1e-12


def test_loss_terms_are_the_spec():
    dr = tiny_drafter()
    g = torch.Generator().manual_seed(3)
    n = 10
    y = torch.randn(n, D, generator=g, dtype=torch.float64)
    prev = torch.randint(0, V, (n,), generator=g)
    teacher = torch.randn(n, V, generator=g, dtype=torch.float64) * 3
    row_k = torch.arange(n) % dr.cfg.block_size
    total, parts = dspark_loss(dr, y, prev, teacher, row_k)
    w = torch.exp(-row_k.double() / dr.cfg.block_size)
    ce, tv, bce = [], [], []
    for i in range(n):
        logits = y[i] @ dr.lm_head.t() + dr.markov.w1[prev[i]] @ dr.markov.w2
        pd, pt = torch.softmax(logits, 0), torch.softmax(teacher[i], 0)
        ce.append(-torch.log(pd[int(pt.argmax())]))
        tv.append(0.5 * (pd - pt).abs().sum())
        c = torch.sigmoid(dr.confidence(torch.cat([y[i], dr.markov.w1[prev[i]]]))[0])
        lab = 1 - tv[-1]
        bce.append(-(lab * torch.log(c) + (1 - lab) * torch.log(1 - c)))
    mean = lambda xs: float((w * torch.stack(xs)).sum().detach() / w.sum())  # noqa: E731
    assert abs(parts["ce"].item() - mean(ce)) < 1e-10
    assert abs(parts["tv"].item() - mean(tv)) < 1e-10
    assert abs(parts["bce"].item() - mean(bce)) < 1e-10
    assert abs(total.item() - (0.1 * mean(ce) + 0.9 * mean(tv) + mean(bce))) < 1e-10
    total.backward()
    assert dr.confidence.weight.grad.abs().sum() > 0 and dr.markov.w2.grad.abs().sum() > 0


def test_anchor_sampling_stays_in_assistant_spans():
    ids = torch.arange(40).unsqueeze(0).repeat(2, 1)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, 10:20] = True
    mask[0, 30:34] = True
    mask[1, 5:8] = True
    idx, row_ok = sample_anchors(ids, mask, 4, rate=1.0, max_anchors=1000)
    for b in range(2):
        for a in range(idx.shape[1]):
            i = int(idx[b, a])
            for k in range(4):
                if row_ok[b, a, k]:
                    assert all(mask[b, i:i + k + 2]), (b, i, k)
    assert int(row_ok[0].any(-1).sum()) == 9 + 3 and int(row_ok[1].any(-1).sum()) == 2


def test_taps_are_the_streams_the_spec_names():
    m = tiny_target()
    ids = torch.randint(0, V, (1, 13))
    logits, taps = target_taps(m, ids, [2, 5, 8])
    assert taps.shape == (1, 13, 3 * D)
    # tap L is the final mix: the LM head of its norm gives the logits
    y = rms_norm(taps[..., 2 * D:], m.model.norm.weight, m.cfg.rms_norm_eps)
    assert (m.lm_head(y) - logits).abs().max() < 1e-12
    # tap 2 is layer 2's mixed input: re-run layer 2's AttnRes from collected partial sums
    coll = []
    m(ids, collect=coll)
    h2 = m.model.layers[2].self_attention_res(coll[1], [m.model.embed_tokens(ids)], m.cfg.rms_norm_eps)
    assert (h2 - taps[..., :D]).abs().max() < 1e-12


def test_calibration_recovers_a_temperature():
    g = torch.Generator().manual_seed(5)
    n, gam = 20000, 3
    z = torch.randn(n, gam, generator=g, dtype=torch.float64) * 3
    ok = torch.rand(n, gam, generator=g, dtype=torch.float64) < torch.sigmoid(z / 2.0)  # true temperature 2
    accepted = torch.cumprod(ok.long(), -1).sum(-1)
    temps = sequential_temperature_scaling(z, accepted)
    assert all(1.6 < t < 2.5 for t in temps), temps
    assert cumulative_ece(z, accepted, temps) < cumulative_ece(z, accepted, [1.0] * gam)
    assert ece(torch.tensor([0.25, 0.25]), torch.tensor([0.0, 1.0])) == pytest.approx(0.25)
    assert ece(torch.tensor([0.05, 0.95, 0.95]), torch.tensor([0.0, 1.0, 0.0])) == pytest.approx(0.95 / 3)


def test_files_have_the_spec_names(tmp_path):
    dr = tiny_drafter().float()
    save_drafter(dr, str(tmp_path))
    from safetensors.torch import load_file
    names = set(load_file(str(tmp_path / "model.safetensors")))
    want = {"fc.weight", "hidden_norm.weight", "mask_embedding", "norm.weight", "markov.w1", "markov.w2",
            "confidence.weight", "confidence.bias"}
    for i in range(2):
        want |= {f"layers.{i}.{n}.weight" for n in ("input_norm", "q_proj", "k_proj", "v_proj", "o_proj",
                                                       "post_norm", "gate_proj", "up_proj", "down_proj")}
    assert names == want

    class Shell:  # load_drafter reads only the target's embedding and LM head
        model = type("M", (), {"embed_tokens": type("E", (), {"weight": dr.embed})})()
        lm_head = type("H", (), {"weight": dr.lm_head})()
    back = load_drafter(str(tmp_path), Shell())
    assert back.cfg == dr.cfg and torch.equal(back.markov.w1, dr.markov.w1)


def test_greedy_speculative_decoding_is_lossless():
    m = tiny_target(seed=2)
    dr = tiny_drafter(seed=3, target_taps=[2, 5, 8])
    runner = TargetRunner(m, dr.cfg.target_taps, kda_impl="exact")
    prompt = torch.randint(0, V, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    spec, steps = speculative_decode(runner, dr, prompt, 12, eos=-1, greedy=True)
    plain = m.generate_greedy(prompt, 12)
    assert spec == plain
    assert sum(s["committed"] for s in steps) == 11  # the prefill's token is not a step
    assert all(1 <= s["committed"] <= dr.cfg.block_size + 1 for s in steps)
    # lockstep batches (right-padded, different lengths and budgets) decode each prompt as if alone
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 14, 9)]
    batch = speculative_decode_batch(runner, dr, prompts, [10, 6, 13], eos=-1, greedy=True)
    for p, n, (out, _) in zip(prompts, [10, 6, 13], batch):
        assert out == m.generate_greedy(p, n)
    # past the deadline no step starts: only the prefill's token
    late = speculative_decode_batch(runner, dr, prompts[:1], [10], eos=-1, greedy=True, deadline=0.0)
    assert late == [(m.generate_greedy(prompts[0], 1), [])]


def test_sampled_verification_keeps_the_target_distribution():
    """The temperature-1 rule commits tokens distributed as the target's p, whatever the drafter's q."""
    g = torch.Generator().manual_seed(9)
    target_logits = torch.tensor([[2.0, 0.5, 0.0, -1.0, 1.0], [0.0, 1.5, 1.5, -0.5, 0.2], [0.0] * 5],
                                 dtype=torch.float64)
    q = torch.softmax(torch.tensor([[0.0, 2.0, 0.5, 0.5, -1.0], [1.0, 0.0, 0.0, 0.0, 3.0]], dtype=torch.float64), -1)
    p = torch.softmax(target_logits, -1)
    trials = 6000
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[k], 1, generator=g)) for k in range(2)]
        n, nxt = verify_block(target_logits, drafts, q, g)
        committed = drafts[:n] + [nxt]
        first[committed[0]] += 1
        if len(committed) > 1:
            second[committed[1]] += 1

    def chi2(counts, probs):
        exp = probs.float() * counts.sum()
        return float(((counts - exp) ** 2 / exp).sum())
    assert chi2(first, p[0]) < 25.0  # 4 degrees of freedom: p < 1e-4
    assert chi2(second, p[1]) < 25.0
    assert verify_block(target_logits, [0, 1], None) == (2, 0)  # greedy: both are the argmax, bonus = argmax
    assert verify_block(target_logits, [0, 2], None) == (1, 1)  # ties go to the lower id


def test_full_acceptance_commits_block_plus_bonus():
    """A target and a drafter that both always pick token 0 (all-zero logits, ties to the lower id): every
    step accepts the whole block and adds the bonus token; the last step is cut at max_new."""
    m = tiny_target(seed=5)
    dr = tiny_drafter(seed=6, target_taps=[2, 5, 8])
    with torch.no_grad():
        m.lm_head.weight.zero_()
        dr.lm_head.zero_()
        dr.markov.w2.zero_()
    runner = TargetRunner(m, dr.cfg.target_taps, kda_impl="exact")
    g = dr.cfg.block_size
    for (out, steps), n in zip(speculative_decode_batch(runner, dr, [[3, 4, 5], [7] * 9], [12, 23], eos=-1,
                                                        greedy=True), [12, 23]):
        assert out == [0] * n
        assert [s["accepted"] for s in steps] == [g] * len(steps)
        assert [s["committed"] for s in steps] == [g + 1] * ((n - 1) // (g + 1)) + [(n - 1) % (g + 1)] * (
            (n - 1) % (g + 1) > 0)
