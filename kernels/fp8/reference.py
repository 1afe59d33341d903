"""The torch reference of the blockwise FP8 quantizer (`format.py`): it runs on every device, and the Triton and
C kernels are tested against it bit for bit.

The codes multiply by a per-block factor, as DeepGEMM's `per_block_cast_to_fp8` does, rather than divide each
element (an IEEE division per element is many instructions on a GPU). With power-of-two scales the factor is
`1 / scale_inv`, exactly.
"""
from __future__ import annotations

import torch

from kernels.fp8.format import (AMAX_EPS, BLOCK_SIZE, FP8_E4M3_MAX, check, check_shape, round_up_to_power_of_two,
                                scale_shape)


def blockwise_fp8_quantize_reference(w: torch.Tensor, block_size: int = BLOCK_SIZE, pow2_scale: bool = False,
                                     name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: return (q float8_e4m3fn [M, N], scale_inv float32 [ceil(M/bs), ceil(N/bs)])."""
    check(w, block_size, name)
    return _quantize_reference(w, block_size, pow2_scale)


def blockwise_fp8_quantize_reference_deferred(w: torch.Tensor, block_size: int = BLOCK_SIZE,
                                              pow2_scale: bool = False, name: str = "weight"
                                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference under the Triton kernel's deferred contract (`blockwise_fp8_quantize_deferred`), for
    devices without it: (q, scale_inv, corrupt), `corrupt` an int64 [1] count of the NaN/Inf elements, computed
    where `w` lives without a host synchronisation; the codes are garbage where it is non-zero."""
    check_shape(w, block_size, name)
    corrupt = (~torch.isfinite(w)).sum().reshape(1).to(torch.int64)
    return (*_quantize_reference(w, block_size, pow2_scale), corrupt)


def _quantize_reference(w: torch.Tensor, block_size: int, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = w.shape
    mb, nb = scale_shape((m, n), block_size)
    if m % block_size or n % block_size:
        padded = torch.zeros(mb * block_size, nb * block_size, dtype=w.dtype, device=w.device)
        padded[:m, :n] = w
    else:
        padded = w.contiguous()
    blocks = padded.view(mb, block_size, nb, block_size)
    # amax over the contiguous dim first, in the input dtype (max/min are exact in any float format)
    amax = torch.maximum(blocks.amax(dim=3), -blocks.amin(dim=3)).amax(dim=1).float().clamp(min=AMAX_EPS)
    # true divisions on every device: CUDA turns `tensor / python scalar` into a multiplication by the reciprocal
    # (one bit off amax / 448 for some amax), and `scalar / tensor` is reciprocal * scalar everywhere
    e4m3_max = torch.full_like(amax, FP8_E4M3_MAX)
    scale_inv = amax / e4m3_max
    factor = e4m3_max / amax
    if pow2_scale:
        scale_inv = round_up_to_power_of_two(scale_inv)
        factor = 1.0 / scale_inv
    # |w * factor| <= 448 up to fp32 rounding; the clamp keeps a 448.00003 from becoming NaN in e4m3fn
    q = torch.mul(blocks, factor[:, None, :, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(mb * block_size, nb * block_size)[:m, :n].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.float().contiguous()
