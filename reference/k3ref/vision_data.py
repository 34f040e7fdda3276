"""Image chat examples for training and evaluating k3-mini's vision tower (issue 22).

An example is one user message with an image part and a question part (the question first in 30 %), an
optional system prompt, and the assistant's answer, rendered by data/render.py (the image part becomes
`<|kimi_image_placeholder|>`, id 6). The placeholder is then expanded exactly as the server does: the i-th
id-6 token becomes n = (H/32)·(W/32) copies of `<|media_pad|>` (id 7), whose input embeddings the tower's
output rows replace, in order (`splice_embeds`).

Thinking: the server's default generation prompt opens the think block, so training mixes thinking on (half
with an empty think block, half with one short sentence that does not state the answer; the effort message
any of the four efforts) and thinking off (40 %). Evaluation runs every held-out image both ways.

Everything but `splice_embeds` needs only NumPy and `tokenizers` (CI has no torch).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from .data.images import IMAGE_KINDS, ImageExample, check_answer, sample_image_example
from .data.tasks import EFFORTS, SYSTEM_PROMPTS, Example, parse_assistant_turn, prompt_text, train_segments

PLACEHOLDER_ID = 6
MEDIA_PAD_ID = 7
TILE = 32  # pixels per image token side (16-px patches, 2x2 merge)
THINKING_RATE = 0.6
# Held-out images: seeds never used by training (training streams use seeds < 10^6).
HELD_OUT_SEED = 2_000_003

_THINK = {
    "color": "The question is about the shape in the image.",
    "count": "I count the shapes in the image.",
    "position": "I compare where the two shapes are.",
    "text": "I read the characters in the image.",
    "bar_chart": "I compare the heights of the bars.",
}


def answer_sentence(ex: ImageExample) -> str:
    """The assistant's response: one sentence holding the exact answer."""
    q = ex.question
    if ex.kind == "color":
        return f"The shape is {ex.answer}." if q.startswith("What color") else f"It is a {ex.answer}."
    if ex.kind == "count":
        shape = q.split()[2][:-1]  # "How many circles are there?"
        return f"There is 1 {shape}." if ex.answer == "1" else f"There are {ex.answer} {shape}s."
    if ex.kind == "position":
        w = q.rstrip("?").split()  # "Is the red circle left or right of the blue square?"
        first, second = " ".join(w[2:4]), " ".join(w[-2:])
        rel = f"{ex.answer} of" if ex.answer in ("left", "right") else ex.answer
        return f"The {first} is {rel} the {second}."
    if ex.kind == "text":
        return f"The image says {ex.answer}."
    return f"Bar {ex.answer} is the tallest."


def image_chat(ex: ImageExample, rng: random.Random, thinking: bool, effort: str = "max",
               reasoning: str | None = None) -> Example:
    """A tasks.Example (one user turn with the image, one assistant turn). `reasoning` None draws it."""
    parts = [{"type": "image"}, {"type": "text", "text": ex.question}]
    if rng.random() < 0.3:
        parts.reverse()
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": parts})
    reply = {"role": "assistant", "content": answer_sentence(ex)}
    if thinking:
        if reasoning is None:
            reasoning = _THINK[ex.kind] if rng.random() < 0.5 else ""
        reply["reasoning_content"] = reasoning
    messages.append(reply)
    return Example(f"image_{ex.kind}", messages, None, {"thinking": thinking, "thinking_effort": effort},
                   {"answer": ex.answer})


def image_token_count(image: np.ndarray) -> int:
    h, w = image.shape[:2]
    if h % TILE or w % TILE:
        raise ValueError(f"{h}x{w} is not a multiple of {TILE} on each side")
    return (h // TILE) * (w // TILE)


def expand_placeholders(ids: list[int], counts: list[int]) -> list[int]:
    """Replace the i-th placeholder id by counts[i] media-pad ids (the server's layout)."""
    out: list[int] = []
    k = 0
    for t in ids:
        if t == PLACEHOLDER_ID:
            if k >= len(counts):
                raise ValueError(f"more image placeholders than the {len(counts)} images")
            out.extend([MEDIA_PAD_ID] * counts[k])
            k += 1
        else:
            out.append(t)
    if k != len(counts):
        raise ValueError(f"{k} image placeholders for {len(counts)} images")
    return out


def encode_training(tok, chat: Example, counts: list[int]) -> tuple[list[int], list[bool]]:
    """Token ids (placeholders expanded) and the loss mask (True on the assistant's tokens)."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, on in train_segments(chat):
        seg = tok.encode(text, add_special_tokens=False).ids
        ids += seg
        mask += [on] * len(seg)
    out_ids: list[int] = []
    out_mask: list[bool] = []
    k = 0
    for t, m in zip(ids, mask):
        if t == PLACEHOLDER_ID:
            if m or k >= len(counts):
                raise ValueError("an image placeholder in the assistant's text, or too many")
            out_ids += [MEDIA_PAD_ID] * counts[k]
            out_mask += [False] * counts[k]
            k += 1
        else:
            out_ids.append(t)
            out_mask.append(m)
    if k != len(counts):
        raise ValueError(f"{k} image placeholders for {len(counts)} images")
    return out_ids, out_mask


def encode_prompt(tok, chat: Example, counts: list[int]) -> list[int]:
    """The generation prompt's ids, placeholders expanded."""
    return expand_placeholders(tok.encode(prompt_text(chat), add_special_tokens=False).ids, counts)


def training_example(tok, rng: random.Random):
    """(image uint8 [H, W, 3], ids, loss mask) of one seeded training example."""
    kind = rng.choice(IMAGE_KINDS)
    ex = sample_image_example(kind, rng)
    thinking = rng.random() < THINKING_RATE
    chat = image_chat(ex, rng, thinking, rng.choice(EFFORTS))
    ids, mask = encode_training(tok, chat, [image_token_count(ex.image)])
    return ex.image, ids, mask


@dataclass
class HeldOut:
    example: ImageExample
    chat: Example  # the conversation; its prompt is what the model sees
    thinking: bool


def held_out(per_kind: int) -> list[HeldOut]:
    """Per kind `per_kind` images from held-out seeds, each asked with thinking on (effort max, the server's
    default) and off (the same image, question and part order)."""
    out = []
    for kind in IMAGE_KINDS:
        rng = random.Random(HELD_OUT_SEED + IMAGE_KINDS.index(kind))
        for _ in range(per_kind):
            ex = sample_image_example(kind, rng)
            order_seed = rng.random()
            for thinking in (True, False):
                out.append(HeldOut(ex, image_chat(ex, random.Random(order_seed), thinking, "max", ""), thinking))
    return out


def score(item: HeldOut, generated: str) -> dict:
    """Exact answer (check_answer on the response block) and well-formedness of a generated turn."""
    turn = parse_assistant_turn(generated, thinking=item.thinking)
    return {"exact": check_answer(item.example, turn.response), "well_formed": turn.well_formed}


def splice_embeds(embeds, ids, rows, where=None):
    """Replace the rows of `embeds` [B, T, d] at the media-pad ids of `ids` [B, T] (or at `where` [B, T],
    e.g. the prompt's image positions only while decoding) by `rows` [R, d] (the images' tokens, sequence by
    sequence, each sequence's images in order). Differentiable in `rows`."""
    pad = ids == MEDIA_PAD_ID if where is None else where
    n = int(pad.sum())
    if n != rows.shape[0]:
        raise ValueError(f"{n} media-pad positions for {rows.shape[0]} image rows")
    return embeds.masked_scatter(pad.unsqueeze(-1), rows.to(embeds.dtype))
