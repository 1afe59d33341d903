"""The C kernels of the 4-bit quantizers (`bridge_nvfp4_quantize`, `bridge_mxfp4_quantize` of
`kernels/csrc/bridge_cpu.c`, loaded by `kernels.cpu_library`): one pass over the weight, the same bits as the torch
quantizers of `kernels.fp4.quantize` (tested)."""
from __future__ import annotations

import torch

from kernels.cpu_library import DTYPE_CODES, library, rows_view
from kernels.fp4.format import MXFP4_BLOCK, NVFP4_BLOCK
from kernels.fp8.format import refuse_non_finite


def _outputs(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    return torch.empty(rows, cols // 2, dtype=torch.uint8), torch.empty(rows, cols // block, dtype=torch.uint8)


def nvfp4_quantize_cpu(w: torch.Tensor, global_scale: torch.Tensor, name: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes, e4m3 scales, weight_scale_2) of a CPU weight the kernel takes (`supports_quantize`)."""
    packed, scales = _outputs(w, NVFP4_BLOCK)
    status = library().bridge_nvfp4_quantize(w.data_ptr(), DTYPE_CODES[w.dtype], w.shape[0], w.shape[1],
                                             rows_view(w)[2], float(global_scale), packed.data_ptr(),
                                             packed.stride(0), scales.data_ptr(), scales.stride(0))
    if status != 0:
        refuse_non_finite(w, name)
    return packed, scales.view(torch.float8_e4m3fn), (1.0 / global_scale).float()


def mxfp4_quantize_cpu(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, e8m0 scales) of a CPU weight the kernel takes (`supports_quantize`)."""
    packed, scales = _outputs(w, MXFP4_BLOCK)
    status = library().bridge_mxfp4_quantize(w.data_ptr(), DTYPE_CODES[w.dtype], w.shape[0], w.shape[1],
                                             rows_view(w)[2], packed.data_ptr(), packed.stride(0), scales.data_ptr(),
                                             scales.stride(0))
    if status != 0:
        refuse_non_finite(w, name)
    return packed, scales
