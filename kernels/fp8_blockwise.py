"""Blockwise FP8 (e4m3) weight quantization in the DeepSeek-V3 / vLLM `weight_scale_inv` format.

`w` [M, N] is cut into block_size x block_size blocks (edge blocks partial); each block b gets
`scale_inv[b] = amax(|w_b|) / 448` (fp32) and `q_b = w_b * (448 / amax(|w_b|))` cast to float8_e4m3fn, so that
`q.float() * scale_inv` (each scale broadcast over its block) reconstructs `w`. The codes multiply by a per-block
factor, as DeepGEMM's `per_block_cast_to_fp8` does, rather than divide each element (an IEEE division per element
is many instructions on a GPU). With power-of-two scales the factor is `1 / scale_inv`, exactly. A torch reference runs
everywhere; the Triton kernel is used automatically for CUDA tensors and the C kernel of `cpu_bridge.py` for CPU
tensors, both tested against the reference.
"""
from __future__ import annotations

import contextlib

import torch

FP8_E4M3_MAX = 448.0
# an all-zero block keeps a tiny finite scale (its codes are all zero either way)
AMAX_EPS = 1e-10


def all_finite(t: torch.Tensor) -> bool:
    """Return True when every element is finite (one min/max pass: both propagate NaN, Inf is an extreme)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _check_shape(w: torch.Tensor, block_size: int, name: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{name}: blockwise FP8 needs a 2-D tensor, got shape {tuple(w.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size {block_size} must be positive")


def refuse_non_finite(w: torch.Tensor, name: str) -> None:
    """Raise the error for a weight holding NaN/Inf, with their count and the tensor's name."""
    bad = int((~torch.isfinite(w)).sum())
    raise ValueError(f"{name}: {bad} NaN/Inf values; refusing to quantize a corrupt weight")


def _check(w: torch.Tensor, block_size: int, name: str) -> None:
    _check_shape(w, block_size, name)
    if not all_finite(w):
        refuse_non_finite(w, name)


def scale_shape(shape: tuple[int, int], block_size: int = 128) -> tuple[int, int]:
    """Return the shape of `scale_inv` for a weight of `shape`: (ceil(M / bs), ceil(N / bs))."""
    return (-(-shape[0] // block_size), -(-shape[1] // block_size))


def round_up_to_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales: the smallest power of two >= x (x > 0), exactly. exp2(ceil(log2(x))) is not exact: for
    x = 2^k (1 + 2^-23) with large k, fp32 log2 rounds to k and the scale would round down, saturating values."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exponent - (mantissa == 0.5).to(exponent.dtype))


def _expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block_size: int) -> torch.Tensor:
    full = scale_inv.repeat_interleave(block_size, dim=0).repeat_interleave(block_size, dim=1)
    return full[: shape[0], : shape[1]]


def blockwise_fp8_quantize_reference(w: torch.Tensor, block_size: int = 128, pow2_scale: bool = False,
                                     name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: return (q float8_e4m3fn [M, N], scale_inv float32 [ceil(M/bs), ceil(N/bs)])."""
    _check(w, block_size, name)
    return _quantize_reference(w, block_size, pow2_scale)


def blockwise_fp8_quantize_reference_deferred(w: torch.Tensor, block_size: int = 128, pow2_scale: bool = False,
                                              name: str = "weight"
                                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference under the Triton kernel's deferred contract (`blockwise_fp8_quantize_deferred`), for
    devices without it: (q, scale_inv, corrupt), `corrupt` an int64 [1] count of the NaN/Inf elements, computed
    where `w` lives without a host synchronisation; the codes are garbage where it is non-zero."""
    _check_shape(w, block_size, name)
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


def blockwise_fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block_size: int = 128,
                             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Return q * scale_inv (scales broadcast over their blocks) in `dtype`."""
    expected = scale_shape(tuple(q.shape), block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match {expected} for a "
                         f"{tuple(q.shape)} weight with block size {block_size}")
    return (q.float() * _expand_scales(scale_inv.float(), tuple(q.shape), block_size)).to(dtype)


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU images ship a metadata-only triton stub or none
    triton = None

if triton is not None:
    @triton.jit
    def _blockwise_fp8_quantize_kernel(w_ptr, q_ptr, s_ptr, m, n, stride_wm, stride_qm, n_blocks_n,
                                       BLOCK: tl.constexpr, POW2: tl.constexpr):
        # consecutive programs walk along a row of blocks: their reads share DRAM pages (+7-9 % on an H100)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rows = pid_m * BLOCK + tl.arange(0, BLOCK)
        cols = pid_n * BLOCK + tl.arange(0, BLOCK)
        inside = (rows[:, None] < m) & (cols[None, :] < n)
        x = tl.load(w_ptr + rows[:, None] * stride_wm + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        magnitude = tl.abs(x)
        finite = magnitude <= 3.4028234663852886e38  # false for NaN and Inf
        amax = tl.maximum(tl.max(tl.where(finite, magnitude, 0.0)), 1e-10)
        scale = tl.math.div_rn(amax, 448.0)  # IEEE division: the reference's bits (plain / is approximate)
        factor = tl.math.div_rn(448.0, amax)
        if POW2:  # round up to a power of two on the bits: clear the mantissa, bump the exponent if it was not 0
            bits = scale.to(tl.int32, bitcast=True)
            bits = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
            scale = bits.to(tl.float32, bitcast=True)
            factor = tl.math.div_rn(1.0, scale)
        q = tl.clamp(x * factor, -448.0, 448.0)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(tl.float8e4nv), mask=inside)
        # the NaN/Inf check rides on this pass: a corrupt block gets scale -1 (valid scales are > 0), so the host
        # reads the small scale tensor instead of the weight a second time
        corrupt = tl.max(tl.where(finite, 0, 1))
        tl.store(s_ptr + pid_m * n_blocks_n + pid_n, tl.where(corrupt > 0, -1.0, scale))


# a 128x128 block held in registers: 16 warps keep it at 32 fp32 values per thread, the fastest of 4/8/16 on an H100
# (docs/benchmarks.md; tools/bench_fp8_quant.py sweeps it)
TRITON_NUM_WARPS = 16


def blockwise_fp8_quantize_triton_into(w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor,
                                       block_size: int = 128, pow2_scale: bool = False, *,
                                       num_warps: int = TRITON_NUM_WARPS) -> None:
    """Launch the kernel into preallocated outputs (contiguous `w` [M, N] on CUDA). A block holding NaN/Inf gets
    scale -1: the caller checks the scales (`blockwise_fp8_quantize_triton` does)."""
    m, n = w.shape
    mb, nb = scale_shape((m, n), block_size)
    # Triton launches on the current device: make it the tensor's (an arena view may live on another GPU)
    with torch.cuda.device(w.device) if w.is_cuda else contextlib.nullcontext():
        _blockwise_fp8_quantize_kernel[(nb, mb)](w, q_out, scale_out, m, n, w.stride(0), q_out.stride(0), nb,
                                                 BLOCK=block_size, POW2=pow2_scale, num_warps=num_warps)


def blockwise_fp8_quantize_deferred(w: torch.Tensor, block_size: int = 128, pow2_scale: bool = False,
                                    name: str = "weight", *, num_warps: int = TRITON_NUM_WARPS
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel without a host synchronisation: (q, scale_inv, corrupt), `corrupt` an int64 [1] count of
    the blocks holding NaN/Inf (their codes are garbage), for the caller to read back with its other figures and
    refuse the weight if non-zero (`refuse_non_finite`)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check_shape(w, block_size, name)
    w = w.contiguous()
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale_inv = torch.empty(scale_shape(tuple(w.shape), block_size), dtype=torch.float32, device=w.device)
    blockwise_fp8_quantize_triton_into(w, q, scale_inv, block_size, pow2_scale, num_warps=num_warps)
    return q, scale_inv, (~(scale_inv > 0)).sum().reshape(1).to(torch.int64)  # a NaN scale counts too


def blockwise_fp8_quantize_triton(w: torch.Tensor, block_size: int = 128, pow2_scale: bool = False,
                                  name: str = "weight", *, num_warps: int = TRITON_NUM_WARPS
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel (one program per block, one read of `w`); same contract as the reference."""
    q, scale_inv, corrupt = blockwise_fp8_quantize_deferred(w, block_size, pow2_scale, name, num_warps=num_warps)
    if int(corrupt):
        refuse_non_finite(w, name)
    return q, scale_inv


def blockwise_fp8_quantize(w: torch.Tensor, block_size: int = 128, pow2_scale: bool = False,
                           name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q, scale_inv): the Triton kernel for CUDA tensors, the C kernel (`kernels/cpu_bridge.py`) for CPU
    tensors it takes, the torch reference otherwise; all three give the same bits."""
    from kernels.cpu_bridge import fp8_blockwise_quantize_cpu, supports_quantize

    if w.is_cuda and triton is not None:
        return blockwise_fp8_quantize_triton(w, block_size, pow2_scale, name)
    if supports_quantize(w):
        return fp8_blockwise_quantize_cpu(w, block_size, pow2_scale, name)
    return blockwise_fp8_quantize_reference(w, block_size, pow2_scale, name)
