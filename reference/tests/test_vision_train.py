"""The vision tower's training and serving paths (PyTorch; skipped in CI): the batched tower equals one image
at a time, the splice, the decoder's `inputs_embeds` leaving existing behaviour alone, a frozen-decoder
training step that learns, batched greedy equal to the cached path, and the export round trip (the committed
golden file regenerates from the committed weights)."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from k3ref.config import k3_mini  # noqa: E402
from k3ref.data.images import sample_image_example  # noqa: E402
from k3ref.model import K3ForCausalLM  # noqa: E402
from k3ref.vision import VisionConfig, VisionTower, chw_pixels, patchify, patchify_chw  # noqa: E402
from k3ref.vision_data import held_out, image_chat, splice_embeds, training_example  # noqa: E402
from k3ref.vision_export import (golden_vectors, load_vision, random_init, save_vision,  # noqa: E402
                                 vision_config_of)
from k3ref.vision_train import batch_loss, collate, greedy_batch, greedy_cached, image_batch  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MODEL = os.path.join(ROOT, "models", "k3-mini")
GOLDEN = os.path.join(ROOT, "host", "model", "tests", "golden", "vision-golden.safetensors")
D = 32  # the tiny decoder's width


def tiny_decoder(seed=0) -> K3ForCausalLM:
    """k3-mini's vocabulary (the real tokenizer's ids), everything else tiny."""
    torch.manual_seed(seed)
    cfg = k3_mini().replace(hidden_size=D, intermediate_size=48, kda_num_heads=1, kda_head_dim=16,
                            gate_low_rank_dim=8, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                            qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            routed_expert_hidden_size=32)
    m = K3ForCausalLM(cfg).eval()
    with torch.no_grad():  # confident logits, so what the image rows do shows in the loss
        m.lm_head.weight.normal_(std=0.5)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def tiny_tower(seed=0) -> VisionTower:
    return random_init(VisionTower(VisionConfig(width=24, layers=2, heads=2, mlp=32, hidden_size=D)), seed)


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json"))


def test_chw_pixels_patch_like_the_reference():
    img = sample_image_example("text", random.Random(1), size=(64, 128)).image
    a, ga = patchify(img)
    b, gb = patchify_chw(torch.from_numpy(chw_pixels(img)).double())
    assert ga == gb == (4, 8) and torch.allclose(a, b, atol=1e-7)


def test_batched_tower_equals_one_image_at_a_time():
    tower = random_init(VisionTower(), 3).double()
    images = [sample_image_example(k, random.Random(i), size=s).image
              for i, (k, s) in enumerate([("color", (64, 96)), ("count", (192, 160)), ("position", (96, 64))])]
    patches, grids = image_batch(images)
    batched = tower.forward_batch(patches.double() / 127.5 - 1.0, grids)
    for img, out in zip(images, batched):
        p, g = patchify(img)
        assert torch.allclose(out, tower(p, g), atol=1e-10)


def test_splice_puts_rows_in_order_and_passes_gradient():
    ids = torch.tensor([[1, 7, 7, 3, 0], [7, 4, 7, 7, 2]])
    emb = torch.zeros(2, 5, 3)
    rows = torch.arange(15, dtype=torch.float32).view(5, 3).requires_grad_(True)
    out = splice_embeds(emb, ids, rows)
    assert torch.equal(out[0, 1], rows[0]) and torch.equal(out[0, 2], rows[1])
    assert torch.equal(out[1, 0], rows[2]) and torch.equal(out[1, 3], rows[4])
    assert torch.equal(out[0, 0], emb[0, 0])
    out.sum().backward()
    assert torch.equal(rows.grad, torch.ones(5, 3))
    with pytest.raises(ValueError):
        splice_embeds(emb, ids, rows[:4])


def test_inputs_embeds_leave_the_decoder_unchanged():
    m = tiny_decoder().double()
    ids = torch.randint(8, 8192, (2, 19))
    plain = m(ids)
    assert torch.equal(plain, m(ids, inputs_embeds=m.model.embed_tokens(ids)))
    prompt = ids[0, :11].tolist()
    emb = m.model.embed_tokens(torch.tensor([prompt]))
    assert m.generate_greedy(prompt, 6) == m.generate_greedy(prompt, 6, inputs_embeds=emb)
    emb2 = emb.clone()
    emb2[0, 3] += 1.0  # a spliced row changes what follows
    assert not torch.allclose(m(torch.tensor([prompt]), inputs_embeds=emb2)[0, 4:],
                              m(torch.tensor([prompt]))[0, 4:])


def test_frozen_decoder_training_steps_learn(tok):
    decoder, tower = tiny_decoder(), tiny_tower()
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    tower0 = {k: v.clone() for k, v in tower.state_dict().items()}
    rng = random.Random(5)
    batch = collate([training_example(tok, rng) for _ in range(3)])
    opt = torch.optim.AdamW(tower.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss, _ = batch_loss(decoder, tower, batch, "cpu", "fast")
        loss.backward()
        assert all(p.grad is None for p in decoder.parameters())
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1 and losses[-1] == min(losses), losses
    assert all(torch.equal(before[k], v) for k, v in decoder.state_dict().items())
    assert any(not torch.equal(tower0[k], v) for k, v in tower.state_dict().items())


def test_batched_greedy_equals_the_cached_path(tok):
    decoder, tower = tiny_decoder(1), tiny_tower(1)
    items = held_out(1)[:4]  # two kinds, thinking on and off, prompts of different lengths
    texts = greedy_batch(decoder, tower, tok, items, "cpu", 6)
    assert texts == [greedy_cached(decoder, tower, tok, it, "cpu", 6) for it in items]
    assert len(set(texts)) > 1


def test_export_round_trip_and_committed_golden(tmp_path):
    tower = tiny_tower(2)
    path = tmp_path / "v.safetensors"
    save_vision(tower, str(path))
    stored = load_file(str(path))
    assert set(stored) == set(tower.state_dict()) and {t.dtype for t in stored.values()} == {torch.bfloat16}
    back = load_vision(str(path), tower.cfg)
    for k, v in tower.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16).float())
    # The committed golden vectors are those of the committed weights.
    committed = load_vision(os.path.join(MODEL, "vision.safetensors"), vision_config_of(MODEL))
    gold, again = load_file(GOLDEN), golden_vectors(committed)
    assert set(gold) == set(again)
    for k in gold:
        assert torch.allclose(gold[k], again[k], rtol=1e-6, atol=1e-6), k


def test_random_init_rows_look_like_token_embeddings():
    tower = random_init(VisionTower(), 0)
    img = sample_image_example("bar_chart", random.Random(0), size=(128, 160)).image
    p, g = patchify(img)
    rms = float(tower.double()(p, g).pow(2).mean().sqrt())
    assert 0.02 < rms < 0.08 and np.isfinite(rms)
