"""The vision tower's shape rules in float64 (k3ref/vision.py): token counts of native sizes,
patch order, the 2×2 merge, and 2-D RoPE depending only on relative positions. Skipped without
PyTorch (CI)."""
from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from k3ref.data.images import IMAGE_KINDS, sample_image_example  # noqa: E402
from k3ref.vision import PATCH, VisionConfig, VisionTower, image_tokens, patchify, rope_2d  # noqa: E402


def test_token_counts_and_bad_sizes():
    assert image_tokens(64, 96) == 6 and image_tokens(192, 192) == 36
    with pytest.raises(ValueError):
        image_tokens(48, 64)


def test_patches_are_row_major_and_scaled():
    img = np.zeros((64, 96, 3), np.uint8)
    img[16:32, 32:48] = 255  # patch (row 1, col 2)
    p, grid = patchify(img)
    assert grid == (4, 6) and p.shape == (24, PATCH * PATCH * 3)
    assert torch.all(p[1 * 6 + 2] == 1.0) and torch.all(p[0] == -1.0)


def test_merge_takes_each_two_by_two_block():
    tower = VisionTower(VisionConfig(width=6, heads=1, layers=1, mlp=8, hidden_size=4)).double()
    x = torch.arange(4 * 6, dtype=torch.float64)[:, None].repeat(1, 6)
    m = tower.merge(x, (4, 6))
    assert m.shape == (6, 24)
    # Merged token (0, 1) holds patches (0, 2), (0, 3), (1, 2), (1, 3).
    assert [m[1, i * 6].item() for i in range(4)] == [2, 3, 8, 9]


def test_rope_2d_depends_on_relative_positions_only():
    torch.manual_seed(0)
    q, k = torch.randn(5, 2, 8, dtype=torch.float64), torch.randn(5, 2, 8, dtype=torch.float64)
    rows, cols = torch.tensor([0, 0, 1, 2, 3]), torch.tensor([0, 1, 1, 0, 2])

    def scores(dr, dc):
        a = rope_2d(q, rows + dr, cols + dc, 100.0)
        b = rope_2d(k, rows + dr, cols + dc, 100.0)
        return torch.einsum("ihd,jhd->hij", a, b)

    assert torch.allclose(scores(0, 0), scores(7, 3), atol=1e-10)
    assert not torch.allclose(scores(0, 0), torch.einsum("ihd,jhd->hij", q, k))


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_tower_runs_on_the_generated_images(kind):
    torch.manual_seed(0)
    tower = VisionTower().double()
    ex = sample_image_example(kind, random.Random(3))
    h, w = (ex.image.shape[0] // 32) * 32, (ex.image.shape[1] // 32) * 32
    p, grid = patchify(ex.image[:h, :w])
    out = tower(p, grid)
    assert out.shape == (image_tokens(h, w), VisionConfig().hidden_size) and torch.isfinite(out).all()
