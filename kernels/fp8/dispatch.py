"""The blockwise FP8 quantizer for any tensor: the fastest implementation that takes it, all of them giving the
same bits."""
from __future__ import annotations

import torch

from kernels.fp8.cpu import fp8_blockwise_quantize_cpu, supports_quantize
from kernels.fp8.format import BLOCK_SIZE
from kernels.fp8.reference import blockwise_fp8_quantize_reference
from kernels.fp8.triton import blockwise_fp8_quantize_triton, fp8_kernels_available


def blockwise_fp8_quantize(w: torch.Tensor, block_size: int = BLOCK_SIZE, pow2_scale: bool = False,
                           name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q, scale_inv): the Triton kernel for tensors on a GPU it compiles e4m3 for, the C kernel
    (`kernels.fp8.cpu`) for CPU tensors it takes, the torch reference otherwise; all three give the same bits."""
    if fp8_kernels_available(w.device):
        return blockwise_fp8_quantize_triton(w, block_size, pow2_scale, name)
    if supports_quantize(w):
        return fp8_blockwise_quantize_cpu(w, block_size, pow2_scale, name)
    return blockwise_fp8_quantize_reference(w, block_size, pow2_scale, name)
