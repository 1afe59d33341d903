"""The Triton kernel of the blockwise FP8 quantizer (`format.py`): one program per block, one read of `w`, the
NaN/Inf check on the same pass; the same bits as the torch reference on any GPU Triton compiles e4m3 for, and under
the interpreter on CPU (it rounds on the e4m3 grid itself, so the backend's cast only converts exact values)."""
from __future__ import annotations

import contextlib
import functools
import threading

import torch

from kernels.fp8.format import BLOCK_SIZE, check_shape, refuse_non_finite, scale_shape

try:
    import triton
    import triton.language as tl
    from triton.compiler.compiler import make_backend
except ImportError:  # optional: CPU images ship a metadata-only triton stub or none
    triton = None

if triton is not None:
    @triton.jit
    def round_to_e4m3(v):
        """`v` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: its conversion to
        e4m3 is then exact whatever rounding the backend's conversion does (Triton 3.6 converts on sm_89 through a
        truncation to fp16, a double rounding that moves about 0.4 % of codes one step down)."""
        bits = v.to(tl.int32, bitcast=True)
        # normal e4m3 (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits, rounding the other 20 to nearest even (a
        # carry moves into the exponent, as it should); sign and exponent are kept by the mask 0xFFF00000
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # subnormal e4m3 (steps of 2^-9): adding and taking away 1.5 * 2^23 rounds |v| * 2^9 (< 8) to an integer,
        # to nearest even; the sign put back on the bits keeps a negative zero negative
        magnitude = (tl.abs(v) * 512.0 + 12582912.0 - 12582912.0) * 0.001953125
        tiny = (magnitude.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
        return tl.where(tl.abs(v) < 0.015625, tiny, normal)

    @triton.jit
    def quantize_block(x, POW2: tl.constexpr):
        """One block's blockwise FP8 quantization in registers (`x` fp32, out-of-range lanes 0): (codes, scale_inv,
        finite mask). Shared by this quantizer and the bridge's one-pass kernel (`kernels.bucket_pass`)."""
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
        q = round_to_e4m3(tl.clamp(x * factor, -448.0, 448.0)).to(tl.float8e4nv)
        return q, scale, finite

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
        q, scale, finite = quantize_block(x, POW2)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=inside)
        # the NaN/Inf check rides on this pass: a corrupt block gets scale -1 (valid scales are > 0), so the host
        # reads the small scale tensor instead of the weight a second time
        corrupt = tl.max(tl.where(finite, 0, 1))
        tl.store(s_ptr + pid_m * n_blocks_n + pid_n, tl.where(corrupt > 0, -1.0, scale))


def triton_available() -> bool:
    """Whether Triton is installed (the kernel's launchers raise without it)."""
    return triton is not None


def triton_writes_e4m3(target) -> bool:
    """Whether Triton compiles e4m3 (`tl.float8e4nv`) for a GPU target (`triton.backends.compiler.GPUTarget`): its
    backend's own rule — on NVIDIA from sm_89 (Ada, Hopper and later); an A100 (sm_80) has no e4m3 in Triton and
    fails to compile any kernel that names it."""
    return "fp8e4nv" in make_backend(target).parse_options({}).supported_fp8_dtypes


@functools.cache
def _device_writes_e4m3(index: int) -> bool:
    with torch.cuda.device(index):
        return triton_writes_e4m3(triton.runtime.driver.active.get_current_target())


def fp8_kernels_available(device: torch.device) -> bool:
    """Whether the Triton FP8 kernels run on `device`: Triton installed and a GPU it compiles e4m3 for. Elsewhere
    (the CPU, a GPU before sm_89) the other quantizers write the same bits."""
    if triton is None or device.type != "cuda":
        return False
    return _device_writes_e4m3(torch.cuda.current_device() if device.index is None else device.index)


# One launch of this project's Triton kernels at a time in a process: Triton's runtime does not serialize its JIT
# caches and compilation across threads, nor its interpreter's global state, and the bridge's writer and verifier
# threads launch the same kernels. A launch only enqueues work, so the lock is held for microseconds.
LAUNCH_LOCK = threading.Lock()

# a 128x128 block held in registers: 16 warps keep it at 32 fp32 values per thread, the fastest of 4/8/16 on an H100
# (docs/benchmarks.md; tools/bench_fp8_quant.py sweeps it)
TRITON_NUM_WARPS = 16


def blockwise_fp8_quantize_triton_into(w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor,
                                       block_size: int = BLOCK_SIZE, pow2_scale: bool = False, *,
                                       num_warps: int = TRITON_NUM_WARPS) -> None:
    """Launch the kernel into preallocated outputs (contiguous `w` [M, N] on CUDA). A block holding NaN/Inf gets
    scale -1: the caller checks the scales (`blockwise_fp8_quantize_triton` does)."""
    m, n = w.shape
    mb, nb = scale_shape((m, n), block_size)
    # Triton launches on the current device: make it the tensor's (an arena view may live on another GPU)
    with LAUNCH_LOCK, torch.cuda.device(w.device) if w.is_cuda else contextlib.nullcontext():
        _blockwise_fp8_quantize_kernel[(nb, mb)](w, q_out, scale_out, m, n, w.stride(0), q_out.stride(0), nb,
                                                 BLOCK=block_size, POW2=pow2_scale, num_warps=num_warps)


def blockwise_fp8_quantize_deferred(w: torch.Tensor, block_size: int = BLOCK_SIZE, pow2_scale: bool = False,
                                    name: str = "weight", *, num_warps: int = TRITON_NUM_WARPS
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel without a host synchronisation: (q, scale_inv, corrupt), `corrupt` an int64 [1] count of
    the blocks holding NaN/Inf (their codes are garbage), for the caller to read back with its other figures and
    refuse the weight if non-zero (`refuse_non_finite`)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    check_shape(w, block_size, name)
    w = w.contiguous()
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale_inv = torch.empty(scale_shape(tuple(w.shape), block_size), dtype=torch.float32, device=w.device)
    blockwise_fp8_quantize_triton_into(w, q, scale_inv, block_size, pow2_scale, num_warps=num_warps)
    return q, scale_inv, (~(scale_inv > 0)).sum().reshape(1).to(torch.int64)  # a NaN scale counts too


def blockwise_fp8_quantize_triton(w: torch.Tensor, block_size: int = BLOCK_SIZE, pow2_scale: bool = False,
                                  name: str = "weight", *, num_warps: int = TRITON_NUM_WARPS
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel (one program per block, one read of `w`); same contract as the reference."""
    q, scale_inv, corrupt = blockwise_fp8_quantize_deferred(w, block_size, pow2_scale, name, num_warps=num_warps)
    if int(corrupt):
        refuse_non_finite(w, name)
    return q, scale_inv
