"""The C kernel of the blockwise FP8 quantizer (`bridge_fp8_blockwise_quantize` of `kernels/csrc/bridge_cpu.c`,
loaded by `kernels.cpu_library`): one pass per 128-row strip (amax, scale, multiply, round to e4m3), the same bits
as the torch reference, with the checksum sums of the codes it writes."""
from __future__ import annotations

import torch

from kernels.cpu_library import DTYPE_CODES, library, rows_view, sums_array
from kernels.fp8.format import BLOCK_SIZE, refuse_non_finite, scale_shape
from kernels.integrity import Position


def supports_quantize(w: torch.Tensor) -> bool:
    """True when the C quantizer handles `w` (CPU, 2-D, bf16/fp32, contiguous rows) and is available."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float32)
            and (w.stride(1) == 1 or w.shape[1] <= 1) and library() is not None)


def fp8_quantize_into(w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, block_size: int = BLOCK_SIZE,
                      pow2_scale: bool = False, name: str = "weight", q_position: Position | None = None
                      ) -> tuple[int, int]:
    """C kernel: quantize `w` into row-contiguous views `q_out` / `scale_out` (same bits as the torch reference)
    and return the checksum sums of the codes written, `q_out` sitting at `q_position` in its tensor."""
    lib = library()
    if lib is None or not supports_quantize(w):
        raise RuntimeError(f"{name}: the CPU FP8 kernel cannot take this tensor ({w.dtype}, {tuple(w.shape)})")
    if q_out.device.type != "cpu" or scale_out.device.type != "cpu":
        raise RuntimeError(f"{name}: the CPU FP8 kernel writes host memory only, not {q_out.device}")
    m, n = w.shape
    if tuple(q_out.shape) != (m, n) or tuple(scale_out.shape) != scale_shape((m, n), block_size):
        raise ValueError(f"{name}: output shapes {tuple(q_out.shape)}, {tuple(scale_out.shape)} do not fit {(m, n)}")
    position = q_position or Position.whole(q_out)
    sums = sums_array()
    status = lib.bridge_fp8_blockwise_quantize(
        w.data_ptr(), DTYPE_CODES[w.dtype], m, n, rows_view(w)[2], q_out.data_ptr(), rows_view(q_out)[2],
        scale_out.data_ptr(), rows_view(scale_out)[2], block_size, int(pow2_scale), position.row0,
        position.ncols, position.col0, sums)
    if status != 0:
        refuse_non_finite(w, name)
    return sums[0], sums[1]


def fp8_blockwise_quantize_cpu(w: torch.Tensor, block_size: int = BLOCK_SIZE, pow2_scale: bool = False,
                               name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """C kernel with the contract of the torch reference: return (q, scale_inv)."""
    q = torch.empty(tuple(w.shape), dtype=torch.float8_e4m3fn)
    s = torch.empty(scale_shape(tuple(w.shape), block_size), dtype=torch.float32)
    fp8_quantize_into(w, q, s, block_size, pow2_scale, name)
    return q, s
