"""FP4 e2m1 codes: 1 sign bit, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

A code is the 4-bit integer sign << 3 | index of the magnitude; two codes share a byte, the even element in the low
nibble (as ModelOpt, compressed-tensors and vLLM's kernels pack them). Rounding is to nearest, ties to the even
index (IEEE round-half-even on the e2m1 grid), saturating at ±6.
"""
from __future__ import annotations

import torch

from kernels.fp8.format import check_shape

E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGN_BIT = 0x8


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0-15) of x (fp32, already divided by its scale) rounded to the e2m1 grid. The grid's step is 0.5
    below 2, 1 below 4 and 2 up to 6, so rounding x / step half to even (torch.round) and scaling back rounds to the
    nearest magnitude with ties to the even index; the index is then 2v, v + 2 or v / 2 + 4."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    value = torch.where(magnitude < 2, torch.round(magnitude * 2) / 2,
                        torch.where(magnitude < 4, torch.round(magnitude), torch.round(magnitude / 2) * 2))
    index = torch.where(value < 2, value * 2, torch.where(value < 4, value + 2, value / 2 + 4)).to(torch.uint8)
    return index | torch.where(x < 0, SIGN_BIT, 0).to(torch.uint8)


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


def check_groups(w: torch.Tensor, block: int, name: str) -> None:
    """Refuse a weight that is not 2-D or not whole 1 x `block` groups (NaN/Inf: the quantizers' own check)."""
    check_shape(w, block, name)
    if w.shape[1] % block:
        raise ValueError(f"{name}: {w.shape[1]} columns are not whole 1x{block} blocks of a 4-bit format")
