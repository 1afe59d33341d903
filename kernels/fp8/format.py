"""Blockwise FP8 (e4m3) weights in the DeepSeek-V3 / vLLM `weight_scale_inv` format: the constants, the scale
shape, the checks every quantizer makes, and dequantization (what the codes and scales mean).

`w` [M, N] is cut into block_size x block_size blocks (edge blocks partial); each block b gets
`scale_inv[b] = amax(|w_b|) / 448` (fp32) and `q_b = w_b * (448 / amax(|w_b|))` cast to float8_e4m3fn, so that
`q.float() * scale_inv` (each scale broadcast over its block) reconstructs `w`.
"""
from __future__ import annotations

import torch

from kernels.integrity import all_finite

BLOCK_SIZE = 128
FP8_E4M3_MAX = 448.0
# an all-zero block keeps a tiny finite scale (its codes are all zero either way)
AMAX_EPS = 1e-10


def scale_shape(shape: tuple[int, int], block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """Return the shape of `scale_inv` for a weight of `shape`: (ceil(M / bs), ceil(N / bs))."""
    return (-(-shape[0] // block_size), -(-shape[1] // block_size))


def check_shape(w: torch.Tensor, block_size: int, name: str) -> None:
    """Refuse a weight that is not 2-D, or a block size that is not positive."""
    if w.dim() != 2:
        raise ValueError(f"{name}: blockwise FP8 needs a 2-D tensor, got shape {tuple(w.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size {block_size} must be positive")


def refuse_non_finite(w: torch.Tensor, name: str) -> None:
    """Raise the error for a weight holding NaN/Inf, with their count and the tensor's name."""
    refuse_corrupt(name, int((~torch.isfinite(w)).sum()))


def refuse_corrupt(name: str, bad: int) -> None:
    """Raise the error for a weight holding `bad` NaN/Inf values."""
    raise ValueError(f"{name}: {bad} NaN/Inf values; refusing to quantize a corrupt weight")


def check(w: torch.Tensor, block_size: int, name: str) -> None:
    """`check_shape`, then refuse a weight holding NaN/Inf."""
    check_shape(w, block_size, name)
    if not all_finite(w):
        refuse_non_finite(w, name)


def round_up_to_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales: the smallest power of two >= x (x > 0), exactly. exp2(ceil(log2(x))) is not exact: for
    x = 2^k (1 + 2^-23) with large k, fp32 log2 rounds to k and the scale would round down, saturating values."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exponent - (mantissa == 0.5).to(exponent.dtype))


def _expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block_size: int) -> torch.Tensor:
    full = scale_inv.repeat_interleave(block_size, dim=0).repeat_interleave(block_size, dim=1)
    return full[: shape[0], : shape[1]]


def blockwise_fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block_size: int = BLOCK_SIZE,
                             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Return q * scale_inv (scales broadcast over their blocks) in `dtype`."""
    expected = scale_shape(tuple(q.shape), block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match {expected} for a "
                         f"{tuple(q.shape)} weight with block size {block_size}")
    return (q.float() * _expand_scales(scale_inv.float(), tuple(q.shape), block_size)).to(dtype)


# what an H100 runs for blockwise-FP8 layers' activations is vLLM's CUDA per-token-group quantizer (vLLM 0.32 turns its
# quant_fp8 custom op on for such models): it floors each group's amax here (its native path would floor the scale at
# 1/(448 x 512) instead, and round groups of amax below 1/512 on another grid)
ACTIVATION_AMAX_EPS = 1e-10


def per_token_group_fp8_dequantized(x: torch.Tensor, group: int = BLOCK_SIZE) -> torch.Tensor:
    """x [.., K] as H100's W8A8 block-FP8 layers see it, in fp32: each row cut into 1 x `group` groups (the last
    zero-padded), each group's fp32 scale max(amax, `ACTIVATION_AMAX_EPS`) / 448, x / scale saturated to ±448 and
    rounded to e4m3, times the scale (vLLM 0.32's `per_token_group_fp8_quant`, written out)."""
    k = x.shape[-1]
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).reshape(*x.shape[:-1], groups, group)
    scales = padded.abs().amax(dim=-1, keepdim=True).clamp(min=ACTIVATION_AMAX_EPS) / FP8_E4M3_MAX
    codes = (padded / scales).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scales).reshape(*x.shape[:-1], groups * group)[..., :k]


def per_token_group_fp8_round_trip(x: torch.Tensor, group: int = BLOCK_SIZE) -> torch.Tensor:
    """`per_token_group_fp8_dequantized` in x's dtype (what the next BF16 operation reads)."""
    return per_token_group_fp8_dequantized(x, group).to(x.dtype)
