"""MXFP8 activations (E4M3 values, one power-of-two scale per 32 along the last dim): K3's precision for
the routed experts' inputs, the CUDA backend's `--dtype mxfp8` (docs/k3-model.md, section 7).

The block's exponent e is the least with max |x| / 2^e <= 448 (E4M3's largest value), at least -127
(E8M0's least), computed from the f32 bits of max |x| as the kernel does: floor(log2 max |x|) - 8, plus one
where the mantissa of max |x| is past 1.75 (448 = 1.75 x 2^8). The OCP MX rule floor(log2 max |x|) - 8 alone
would clip every block whose largest value lies in (448, 512) x 2^e to 448. Values x / 2^e round to the
nearest E4M3, ties to even. Everything is computed on the f32 value of x.
"""
import torch

BLOCK = 32
E4M3_MAX = 448.0
MIN_EXP = -127


def block_exponents(x: torch.Tensor) -> torch.Tensor:
    """e per 32-block of the last dim (int32 [..., n/32, 1]) of x as f32."""
    b = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    bits = b.abs().amax(-1, keepdim=True).view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).int()
    return e.clamp(min=MIN_EXP)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n a multiple of 32) -> (E4M3 values as torch.float8_e4m3fn [..., n/32, 32], e int32
    [..., n/32, 1])."""
    e = block_exponents(x)
    b = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scaled = (b.double() * torch.exp2(-e.double())).float()  # exact: a power of two within f32's range
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), e


def dequantize(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """quantize's pair -> float64 [..., n]."""
    return (q.double() * torch.exp2(e.double())).reshape(*q.shape[:-2], -1)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x through MXFP8 and back, in float64 (the values the FP8 tensor cores multiply)."""
    return dequantize(*quantize(x))
