"""Seeded synthetic images with checkable answers: the data for k3-mini's vision tower (issue 22).

Every example is an RGB image (uint8, height × width × 3, native resolution: each side one of
`SIDES`, multiples of 32 from 64 to 192, so every image is a whole number of the vision tower's
32×32-pixel image tokens and needs no resizing) with a question and an exact answer, in five kinds (`IMAGE_KINDS`):

- ``color``: one large shape; "What color is the shape?" / "What shape is it?";
- ``count``: 1–9 small shapes of one kind and colour; "How many circles are there?";
- ``position``: two shapes of different colours; "Is the red circle left or right of the blue
  square?" (or above/below);
- ``text``: 1–4 characters (digits, or capital letters) in a 5×7 bitmap font, scaled;
  "What does the image say?";
- ``bar_chart``: 3–5 labelled bars; "Which bar is the tallest?" (a letter).

Only the standard library and NumPy, so CI runs the tests. `sample_image_example(kind, rng)` draws
one (`size=(h, w)` fixes the canvas, e.g. for golden vectors); `check_answer(example, text)` scores a model's reply (the answer must appear as a word).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

IMAGE_KINDS = ["color", "count", "position", "text", "bar_chart"]
SIDES = [64, 96, 128, 160, 192]

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
    "black": (15, 15, 15),
}
SHAPES = ["circle", "square", "triangle"]
BACKGROUNDS = [(255, 255, 255), (235, 235, 235), (250, 245, 230)]

# 5×7 bitmap glyphs, one string of 7 rows of 5 pixels each ('#' = ink).
FONT: dict[str, str] = {
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "#####.....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "###..#..#.#...##...##...##..#.###..",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "J": "..###...#....#....#....#.#..#..##..", "K": "#...##..#.#.#..##...#.#..#..#.#...#",
    "L": "#....#....#....#....#....#....#####", "M": "#...###.###.#.##.#.##...##...##...#",
    "N": "#...##...###..##.#.##..###...##...#", "P": "####.#...##...#####.#....#....#....",
    "R": "####.#...##...#####.#.#..#..#.#...#", "S": ".#####....#.....###.....#....#####.",
    "T": "#####..#....#....#....#....#....#..", "U": "#...##...##...##...##...##...#.###.",
    "V": "#...##...##...##...##...#.#.#...#..", "W": "#...##...##...##.#.##.#.##.#.#.#.#.",
    "X": "#...##...#.#.#...#...#.#.#...##...#", "Y": "#...##...#.#.#...#....#....#....#..",
    "Z": "#####....#...#...#...#...#....#####",
}
# Letters whose glyphs no other glyph could be confused with at any scale (I, O and Q are left out:
# they read as 1, 0 and 0 in a bitmap font).
LETTERS = [c for c in FONT if c.isalpha()]
DIGITS = [c for c in FONT if c.isdigit()]


@dataclass
class ImageExample:
    kind: str
    image: np.ndarray  # uint8 [H, W, 3]
    question: str
    answer: str


def _canvas(rng: random.Random, size: tuple[int, int] | None = None) -> np.ndarray:
    h, w = (rng.choice(SIDES), rng.choice(SIDES)) if size is None else size
    bg = rng.choice(BACKGROUNDS)
    return np.broadcast_to(np.array(bg, np.uint8), (h, w, 3)).copy()


def _shape_mask(shape: str, h: int, w: int, cy: float, cx: float, r: float) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    y = y + 0.5
    x = x + 0.5
    if shape == "circle":
        return (y - cy) ** 2 + (x - cx) ** 2 <= r * r
    if shape == "square":
        return (abs(y - cy) <= r * 0.85) & (abs(x - cx) <= r * 0.85)
    # An upward triangle inside the square of side 2r.
    top, bottom = cy - r, cy + r
    half = (y - top) / (2 * r) * r
    return (y >= top) & (y <= bottom) & (abs(x - cx) <= half)


def _paint(img: np.ndarray, mask: np.ndarray, color: str) -> None:
    img[mask] = COLORS[color]


def _free_spot(rng: random.Random, h: int, w: int, r: float, taken: list[tuple[float, float, float]]):
    for _ in range(200):
        cy = rng.uniform(r + 1, h - r - 1)
        cx = rng.uniform(r + 1, w - r - 1)
        # Bounding squares apart (not just centres): two squares are apart along a diagonal too.
        if all(max(abs(cy - y), abs(cx - x)) > r + rr + 3 for y, x, rr in taken):
            return cy, cx
    return None


def _color(rng: random.Random, size=None) -> ImageExample:
    img = _canvas(rng, size)
    h, w, _ = img.shape
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    r = min(h, w) * rng.uniform(0.25, 0.4)
    _paint(img, _shape_mask(shape, h, w, h / 2 + rng.uniform(-4, 4), w / 2 + rng.uniform(-4, 4), r), color)
    if rng.random() < 0.5:
        return ImageExample("color", img, "What color is the shape?", color)
    return ImageExample("color", img, "What shape is it?", shape)


def _count(rng: random.Random, size=None) -> ImageExample:
    for _ in range(20):
        img = _canvas(rng, size)
        h, w, _ = img.shape
        shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        n = rng.randint(1, 9)
        r = max(4.0, min(h, w) / 14)
        taken: list[tuple[float, float, float]] = []
        for _ in range(n):
            spot = _free_spot(rng, h, w, r, taken)
            if spot is None:
                break
            taken.append((*spot, r))
            _paint(img, _shape_mask(shape, h, w, spot[0], spot[1], r), color)
        if len(taken) == n:
            return ImageExample("count", img, f"How many {shape}s are there?", str(n))
    raise RuntimeError("no room for the shapes")


def _position(rng: random.Random, size=None) -> ImageExample:
    img = _canvas(rng, size)
    h, w, _ = img.shape
    (s1, s2), (c1, c2) = rng.sample(SHAPES, 2), rng.sample(list(COLORS), 2)
    r = min(h, w) / 7
    horizontal = rng.random() < 0.5
    # Opposite halves along the asked axis, so the answer is never ambiguous.
    a, b = rng.uniform(0.15, 0.35), rng.uniform(0.65, 0.85)
    if rng.random() < 0.5:
        a, b = b, a
    off = lambda: rng.uniform(0.3, 0.7)  # noqa: E731
    if horizontal:
        p1, p2 = (off() * h, a * w), (off() * h, b * w)
        answer = "left" if a < b else "right"
        question = f"Is the {c1} {s1} left or right of the {c2} {s2}?"
    else:
        p1, p2 = (a * h, off() * w), (b * h, off() * w)
        answer = "above" if a < b else "below"
        question = f"Is the {c1} {s1} above or below the {c2} {s2}?"
    _paint(img, _shape_mask(s1, h, w, p1[0], p1[1], r), c1)
    _paint(img, _shape_mask(s2, h, w, p2[0], p2[1], r), c2)
    return ImageExample("position", img, question, answer)


def render_text(img: np.ndarray, text: str, top: int, left: int, scale: int, color) -> None:
    """Draw `text` in the 5×7 font, `scale` pixels per font pixel, one blank column between glyphs."""
    for i, ch in enumerate(text):
        glyph = np.array([c == "#" for c in FONT[ch]], bool).reshape(7, 5)
        block = np.kron(glyph, np.ones((scale, scale), bool))
        x0 = left + i * 6 * scale
        img[top:top + 7 * scale, x0:x0 + 5 * scale][block] = color


def _text(rng: random.Random, size=None) -> ImageExample:
    alphabet = DIGITS if rng.random() < 0.5 else LETTERS
    n = rng.randint(1, 4)
    text = "".join(rng.choice(alphabet) for _ in range(n))
    scale = rng.randint(2, 4)
    img = _canvas(rng, size)
    h, w, _ = img.shape
    need_w, need_h = (6 * n - 1) * scale, 7 * scale
    if need_w + 4 > w:
        if size is not None:
            raise ValueError(f"{n} characters at scale {scale} do not fit {size}")
        w = ((need_w + 4 + 31) // 32) * 32
        img = np.broadcast_to(img[0, 0], (h, w, 3)).copy()
    top = rng.randint(2, h - need_h - 2)
    left = rng.randint(2, w - need_w - 2)
    render_text(img, text, top, left, scale, COLORS[rng.choice(["black", "blue", "red"])])
    return ImageExample("text", img, "What does the image say?", text)


def _bar_chart(rng: random.Random, size=None) -> ImageExample:
    img = _canvas(rng, size)
    h, w, _ = img.shape
    n = rng.randint(3, 5)
    labels = rng.sample(LETTERS, n)
    heights = rng.sample(range(3, 10), n)
    color = COLORS[rng.choice(["blue", "green", "orange", "purple"])]
    scale = 2 if w >= 96 else 1
    slot = w // n
    base = h - 7 * scale - 6
    unit = (base - 4) / 9
    for i, (label, value) in enumerate(zip(labels, heights)):
        x0 = i * slot + slot // 5
        x1 = (i + 1) * slot - slot // 5
        img[int(base - value * unit):base, x0:x1] = color
        lx = i * slot + (slot - 5 * scale) // 2
        render_text(img, label, base + 3, lx, scale, COLORS["black"])
    tallest = labels[heights.index(max(heights))]
    return ImageExample("bar_chart", img, "Which bar is the tallest?", tallest)


_GENERATORS = {"color": _color, "count": _count, "position": _position, "text": _text,
               "bar_chart": _bar_chart}


def sample_image_example(kind: str, rng: random.Random, size: tuple[int, int] | None = None) -> ImageExample:
    """One example of `kind` (one of `IMAGE_KINDS`), fully determined by `rng`'s state (and `size`,
    (height, width), when given: a `text` example that does not fit it raises ValueError)."""
    return _GENERATORS[kind](rng, size)


def check_answer(ex: ImageExample, text: str | None) -> bool:
    """Whether a reply states the answer: as a whole word, case-insensitive (the expected text
    of a `text` example must appear exactly, in capitals)."""
    if not text:
        return False
    if ex.kind == "text":
        return re.search(rf"(?<![A-Z0-9]){re.escape(ex.answer)}(?![A-Z0-9])", text) is not None
    return re.search(rf"\b{re.escape(ex.answer)}\b", text, re.IGNORECASE) is not None
