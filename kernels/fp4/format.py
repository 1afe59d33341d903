"""FP4 e2m1 codes: 1 sign bit, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

A code is the 4-bit integer sign << 3 | index of the magnitude; two codes share a byte, the even element in the low
nibble (as ModelOpt, compressed-tensors and vLLM's kernels pack them). Rounding is to nearest, ties to the even
index (IEEE round-half-even on the e2m1 grid), saturating at ±6.
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring magnitudes: a value on one rounds to the neighbour of even index
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SIGN_BIT = 0x8


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0-15) of x (fp32, already divided by its scale) rounded to the e2m1 grid."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_MIDPOINTS, dtype=magnitude.dtype, device=x.device)
    index = torch.bucketize(magnitude, midpoints)  # a value on a midpoint counts as below it
    on_midpoint = midpoints[index.clamp(max=len(_MIDPOINTS) - 1)] == magnitude
    index = index + (on_midpoint & (index % 2 == 1)).to(index.dtype)
    return (index | torch.where(x < 0, SIGN_BIT, 0)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 codes (0-15)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    value = magnitudes[(codes & 0x7).long()]
    return torch.where((codes & SIGN_BIT) != 0, -value, value)


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes (K even) -> [..., K/2] bytes, element 2i in the low nibble of byte i."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (`pack_pairs` undone)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
