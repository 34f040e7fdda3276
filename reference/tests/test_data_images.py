"""The synthetic image tasks (k3ref/data/images.py): seeded, of native sizes, and every answer
recovered from the pixels by a plain reading of the image (template matching, flood fill,
centroids, column heights), so a training set built from them is never wrong."""
from __future__ import annotations

import random

import numpy as np
import pytest

from k3ref.data.images import (COLORS, FONT, IMAGE_KINDS, SIDES, ImageExample, check_answer,
                               render_text, sample_image_example)


def examples(kind: str, n: int = 60, seed: int = 0) -> list[ImageExample]:
    rng = random.Random(seed + IMAGE_KINDS.index(kind))
    return [sample_image_example(kind, rng) for _ in range(n)]


def ink(img: np.ndarray) -> np.ndarray:
    """Pixels that are not the background (the corner pixel's colour)."""
    return np.any(img != img[0, 0], axis=-1)


def color_mask(img: np.ndarray, name: str) -> np.ndarray:
    return np.all(img == np.array(COLORS[name], np.uint8), axis=-1)


def components(mask: np.ndarray) -> int:
    seen = np.zeros_like(mask)
    n = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        n += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return n


def read_text(img: np.ndarray) -> str:
    """OCR by the font itself: find the ink's box, infer the scale from its height (every glyph
    spans the font's 7 rows), and match each 6-column cell against every glyph, trying each left
    offset a glyph with blank left columns could have."""
    m = ink(img)
    ys, xs = np.nonzero(m)
    top, height = ys.min(), ys.max() - ys.min() + 1
    scale = height // 7
    glyphs = {c: np.array([ch == "#" for ch in g]).reshape(7, 5) for c, g in FONT.items()}
    for dx in range(0, 5 * scale, scale):
        x, out = xs.min() - dx, ""
        while x <= xs.max():
            cell = m[top:top + 7 * scale:scale, max(x, 0):x + 5 * scale:scale]
            found = [c for c, g in glyphs.items() if cell.shape == (7, 5) and np.array_equal(cell, g)]
            if len(found) != 1:
                break
            out += found[0]
            x += 6 * scale
        else:
            return out
    raise AssertionError("no reading of the text")


def test_glyphs_are_distinct_and_well_formed():
    assert all(len(g) == 35 and set(g) <= {"#", "."} for g in FONT.values())
    assert len(set(FONT.values())) == len(FONT)


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_seeded_native_sizes(kind):
    a, b = examples(kind, 5), examples(kind, 5)
    for x, y in zip(a, b):
        assert np.array_equal(x.image, y.image) and x.question == y.question and x.answer == y.answer
    for ex in a:
        h, w, c = ex.image.shape
        assert c == 3 and ex.image.dtype == np.uint8 and h in SIDES and w in SIDES


def test_text_reads_back():
    for ex in examples("text"):
        assert read_text(ex.image) == ex.answer


def test_counts_match_the_shapes_drawn():
    for ex in examples("count"):
        assert components(ink(ex.image)) == int(ex.answer)


def test_color_and_shape_answers():
    for ex in examples("color"):
        if ex.question.startswith("What color"):
            assert color_mask(ex.image, ex.answer).sum() == ink(ex.image).sum()


def test_positions_follow_the_centroids():
    for ex in examples("position"):
        words = ex.question.split()
        first, second = words[2], words[-2]
        (y1, x1), (y2, x2) = (np.argwhere(color_mask(ex.image, c)).mean(0) for c in (first, second))
        expected = (("left" if x1 < x2 else "right") if "left" in ex.question
                    else ("above" if y1 < y2 else "below"))
        assert ex.answer == expected


def test_tallest_bar_by_column_height():
    for ex in examples("bar_chart"):
        img = ex.image
        bar = [n for n in ("blue", "green", "orange", "purple") if color_mask(img, n).any()]
        assert len(bar) == 1
        bars = color_mask(img, bar[0])
        n = components(bars)
        slot = img.shape[1] // n
        tallest = int(np.argmax(bars.sum(0))) // slot
        # The label under the tallest bar is the answer.
        label = color_mask(img, "black")
        label[:, : tallest * slot] = False
        label[:, (tallest + 1) * slot:] = False
        crop = np.where(label[..., None], np.uint8(0), np.uint8(255))
        assert read_text(crop) == ex.answer


def test_check_answer():
    ex = ImageExample("count", np.zeros((64, 64, 3), np.uint8), "How many?", "3")
    assert check_answer(ex, "There are 3 circles.") and not check_answer(ex, "33") and not check_answer(ex, None)
    t = ImageExample("text", ex.image, "What does it say?", "AB7")
    assert check_answer(t, "It says AB7.") and not check_answer(t, "ab7") and not check_answer(t, "AB78")


@pytest.mark.parametrize("kind", ["color", "count", "position", "bar_chart"])
def test_fixed_size(kind):
    ex = sample_image_example(kind, random.Random(5), size=(64, 96))
    assert ex.image.shape == (64, 96, 3)
