"""The MXFP8 activation rule (k3ref/mxfp8.py, the CUDA backend's `--dtype mxfp8`). Skipped without torch."""
import pytest

torch = pytest.importorskip("torch")

from k3ref import mxfp8  # noqa: E402


def test_representable_values_round_trip_exactly():
    # Every finite E4M3 value times a block scale comes back unchanged once the block's largest value
    # sets that scale (448 x 2^-3 in block 0, 1 x 2^10 in block 1).
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = codes[torch.isfinite(codes)][:32]
    x = torch.stack([torch.cat([vals[:31], torch.tensor([448.0])]) * 2.0 ** -3,
                     torch.cat([vals[:31] / 448, torch.tensor([1.0])]).float() * 2.0 ** 10]).reshape(1, 64)
    q, e = mxfp8.quantize(x)
    assert e.flatten().tolist() == [-3, 2]
    assert torch.equal(mxfp8.dequantize(q, e)[0, :32], x[0, :32].double())


def test_no_block_clips_and_the_scale_is_the_least():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32 * 8, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    q, e = mxfp8.quantize(x)
    amax = x.reshape(64, 8, 32).abs().amax(-1, keepdim=True).double()
    assert (amax / torch.exp2(e.double()) <= 448).all()
    assert (amax / torch.exp2(e.double() - 1) > 448).all()  # one less would clip
    # The largest value of a block whose top lies in (448, 512) x 2^e under OCP's rule keeps its value.
    y = torch.full((1, 32), 0.01)
    y[0, 0] = 480.0
    assert mxfp8.round_trip(y)[0, 0].item() == 480.0


def test_nearest_even_and_sign():
    x = torch.zeros(1, 32)
    x[0, 0] = 448.0  # e = 0
    x[0, 1], x[0, 2], x[0, 3] = 1.0625, 1.1875, -1.0625  # halfway below 1.125 / above 1.125 / negative
    r = mxfp8.round_trip(x)[0]
    assert r[1].item() == 1.0 and r[2].item() == 1.25 and r[3].item() == -1.0


def test_zero_and_tiny_blocks():
    x = torch.zeros(2, 32)
    x[1, 5] = 1e-40  # an f32 subnormal: e clamps to -127
    q, e = mxfp8.quantize(x)
    assert e.flatten().tolist() == [-127, -127]
    assert torch.equal(mxfp8.dequantize(q, e)[0], torch.zeros(32, dtype=torch.float64))
