"""Image chat examples (k3ref/vision_data.py), NumPy + tokenizers only: the placeholder expansion the server
does, the loss mask, prompts that are prefixes of the training text, answers that check."""
from __future__ import annotations

import os
import random

import pytest

from k3ref.data.images import IMAGE_KINDS, check_answer, sample_image_example
from k3ref.data.tasks import parse_assistant_turn
from k3ref.vision_data import (MEDIA_PAD_ID, PLACEHOLDER_ID, answer_sentence, encode_prompt, encode_training,
                               expand_placeholders, held_out, image_chat, image_token_count, score,
                               training_example)

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "models", "k3-mini", "tokenizer.json")


@pytest.fixture(scope="module")
def tok():
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(TOKENIZER)


def test_expand_placeholders():
    assert expand_placeholders([5, 6, 9, 6, 1], [2, 3]) == [5, 7, 7, 9, 7, 7, 7, 1]
    assert expand_placeholders([5, 9], []) == [5, 9]
    with pytest.raises(ValueError):
        expand_placeholders([6, 6], [1])
    with pytest.raises(ValueError):
        expand_placeholders([6], [1, 2])


def test_image_token_count():
    assert image_token_count(sample_image_example("color", random.Random(0), size=(64, 96)).image) == 6
    assert image_token_count(sample_image_example("color", random.Random(0), size=(192, 192)).image) == 36


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_answer_sentences_check(kind):
    rng = random.Random(7)
    for _ in range(40):
        ex = sample_image_example(kind, rng)
        text = answer_sentence(ex)
        assert check_answer(ex, text), (ex.question, text)
        if kind == "position":  # only the right direction is named
            other = {"left": "right", "right": "left", "above": "below", "below": "above"}[ex.answer]
            assert other not in text


@pytest.mark.parametrize("thinking", [True, False])
def test_training_ids_mask_and_prompt_prefix(tok, thinking):
    rng = random.Random(3)
    for _ in range(10):
        ex = sample_image_example(rng.choice(IMAGE_KINDS), rng)
        chat = image_chat(ex, rng, thinking, "high")
        n = image_token_count(ex.image)
        ids, mask = encode_training(tok, chat, [n])
        assert len(ids) == len(mask) and PLACEHOLDER_ID not in ids
        pads = [i for i, t in enumerate(ids) if t == MEDIA_PAD_ID]
        assert len(pads) == n and pads == list(range(pads[0], pads[0] + n))  # one contiguous span
        assert not any(mask[i] for i in pads)
        # Loss on exactly the assistant's turn after its opening marker: a suffix of the sequence.
        first = mask.index(True)
        assert all(mask[first:]) and not any(mask[:first])
        target = tok.decode(ids[first:], skip_special_tokens=False)
        assert target.endswith("<|end_of_msg|>") and answer_sentence(ex) in target
        # The generation prompt (what the server sends) is a prefix of the training ids.
        prompt = encode_prompt(tok, chat, [n])
        assert ids[: len(prompt)] == prompt
        assert tok.decode(prompt, skip_special_tokens=False).endswith(
            "<|open|>think<|sep|>" if thinking else "<|open|>response<|sep|>")
        # And the training continuation parses as a well-formed turn holding the answer.
        cont = tok.decode(ids[len(prompt):], skip_special_tokens=False)
        turn = parse_assistant_turn(cont, thinking=thinking)
        assert turn.well_formed and check_answer(ex, turn.response)


def test_training_stream_mixes_modes_and_orders(tok):
    rng = random.Random(11)
    seen = set()
    for _ in range(60):
        image, ids, mask = training_example(tok, rng)
        text = tok.decode(ids, skip_special_tokens=False)
        seen.add(("think" if "<|open|>think<|sep|>" in text else "no-think",
                  "image-first" if 'role="user"<|sep|><|media_pad|>' in text else "question-first"))
        assert ids.count(MEDIA_PAD_ID) == image_token_count(image)
    assert len(seen) == 4


def test_held_out_is_seeded_and_scored():
    a, b = held_out(2), held_out(2)
    assert len(a) == 2 * 2 * len(IMAGE_KINDS)
    assert [x.example.answer for x in a] == [x.example.answer for x in b]
    assert [x.thinking for x in a[:2]] == [True, False]
    on, off = a[0], a[1]
    right = f"<|close|>think<|sep|><|open|>response<|sep|>{answer_sentence(on.example)}<|close|>response<|sep|>" \
            "<|close|>message<|sep|><|end_of_msg|>"
    assert score(on, right) == {"exact": True, "well_formed": True}
    assert score(off, right)["well_formed"] is False  # thinking off: a think block is not expected
    assert score(off, right.split("<|open|>response<|sep|>", 1)[1]) == {"exact": True, "well_formed": True}
    assert score(on, "<|close|>think<|sep|><|open|>response<|sep|>no idea<|close|>response<|sep|>")["exact"] is False
