"""MXFP4 (OCP MX v1.0) in K3's compressed-tensors layout: weight_packed u8 [out, in/2], weight_scale u8 [out, in/32].

Element 2j sits in the low nibble, 2j+1 in the high nibble; codes are FP4 E2M1 (bit 3 = sign).
scale = 2^(s - 127) (E8M0); s = floor(log2(amax)) - 2 + 127, clamped to [0, 254].
"""
import torch

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
BLOCK = 32
EMAX_E2M1 = 2


def _lut(device, dtype) -> torch.Tensor:
    mags = torch.tensor(FP4_VALUES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def _shared_exponent(w: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent per 32-block of the last dim; w is [..., n/32, 32]."""
    amax = w.abs().amax(-1).to(torch.float64 if w.dtype == torch.float64 else torch.float32)
    e = torch.floor(torch.log2(amax.clamp_min(torch.finfo(amax.dtype).tiny))) - EMAX_E2M1 + 127
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    return e.clamp(0, 254)


def _round_to_code(mag: torch.Tensor) -> torch.Tensor:
    """|x|/scale -> magnitude code 0..7, round to nearest, ties to the even code, saturating at 6."""
    # ties go down where the lower neighbour's code is even, up where the upper one's is
    code = (mag > 0.25).to(torch.uint8)
    code += (mag >= 0.75).to(torch.uint8)
    code += (mag > 1.25).to(torch.uint8)
    code += (mag >= 1.75).to(torch.uint8)
    code += (mag > 2.5).to(torch.uint8)
    code += (mag >= 3.5).to(torch.uint8)
    code += (mag > 5.0).to(torch.uint8)
    return code


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (weight_packed u8 [out, in/2], weight_scale u8 [out, in/32])."""
    out, n = w.shape
    assert n % BLOCK == 0, "input dim must be a multiple of 32"
    dt = torch.float64 if w.dtype == torch.float64 else torch.float32
    wb = w.to(dt).reshape(out, n // BLOCK, BLOCK)
    s = _shared_exponent(wb)
    scale = torch.exp2(s - 127).unsqueeze(-1)
    x = wb / scale
    code = _round_to_code(x.abs()) | ((x < 0).to(torch.uint8) << 3)
    code = code.reshape(out, n)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), s.to(torch.uint8).contiguous()


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    out, half = packed.shape
    lut = _lut(packed.device, dtype)
    lo = lut[(packed & 0xF).long()]
    hi = lut[(packed >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(out, half * 2)
    sc = torch.exp2(scale.to(dtype) - 127).repeat_interleave(BLOCK, dim=-1)
    return vals * sc


def fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """Straight-through MXFP4 round trip on the last dim, for [..., in] weights (training)."""
    shape = w.shape
    n = shape[-1]
    wb = w.float().reshape(-1, n // BLOCK, BLOCK)
    s = _shared_exponent(wb)
    scale = torch.exp2(s - 127).unsqueeze(-1)
    x = wb / scale
    lut = torch.tensor(FP4_VALUES, device=w.device, dtype=torch.float32)
    q = lut[_round_to_code(x.abs()).long()] * torch.sign(x)
    wq = (q * scale).reshape(shape).to(w.dtype)
    return w + (wq - w).detach()
