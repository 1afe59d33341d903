"""CPU kernels of the resharding bridge (`csrc/bridge_cpu.c`), built on first use with the system C compiler
and called through ctypes, beside their torch / NumPy references:

    fp8_blockwise_quantize_cpu   one pass per 128-row strip: amax, scale, divide, round to e4m3
                                 (reference: kernels.fp8_blockwise.blockwise_fp8_quantize_reference)
    copy_check_finite            copy a 2-D view and count NaN/Inf on the way (reference: copy_ + isfinite)
    checksum                     4-lane Fletcher-style 64-bit checksum (reference: checksum_reference, NumPy)

Without a compiler the references are used and one warning says so; `MEGATRON_AIS_CPU_KERNELS=0` forces that.
The shared object is cached under `$MEGATRON_AIS_KERNEL_CACHE` (default ~/.cache/megatron_ais/kernels), keyed by
the source, the flags and the CPU, so a cache shared between different machines never runs foreign code.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "bridge_cpu.c")
CFLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_error: str | None = None


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return os.uname().machine


def _build(path: str) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # build beside the target and rename: ranks that build at the same time never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, "-o", tmp, SOURCE], check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"{compiler} failed: {err.stderr.strip()[:2000]}") from err
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def library() -> ctypes.CDLL | None:
    """Return the loaded kernels, building them if needed; None (after one warning) when they cannot be."""
    global _library, _load_error
    if _library is not None or _load_error is not None:
        return _library
    with _lock:
        if _library is not None or _load_error is not None:
            return _library
        if os.environ.get("MEGATRON_AIS_CPU_KERNELS", "1") == "0":
            _load_error = "disabled by MEGATRON_AIS_CPU_KERNELS=0"
            return None
        with open(SOURCE, "rb") as f:
            key = hashlib.sha256(f.read() + " ".join(CFLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
        cache = os.environ.get("MEGATRON_AIS_KERNEL_CACHE",
                               os.path.join(os.path.expanduser("~"), ".cache", "megatron_ais", "kernels"))
        path = os.path.join(cache, f"bridge_cpu-{key}.so")
        try:
            if not os.path.exists(path):
                _build(path)
            lib = ctypes.CDLL(path)
        except (OSError, RuntimeError) as err:
            _load_error = str(err)
            log.warning("bridge CPU kernels unavailable (%s); using the torch references, which are slower", err)
            return None
        i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.bridge_fp8_blockwise_quantize.argtypes = [vp, c_int, i64, i64, i64, vp, i64, vp, i64, i64, c_int]
        lib.bridge_fp8_blockwise_quantize.restype = c_int
        lib.bridge_copy_rows_check_finite.argtypes = [vp, i64, vp, i64, i64, i64, c_int]
        lib.bridge_copy_rows_check_finite.restype = i64
        lib.bridge_checksum_lanes.argtypes = [vp, i64, vp]
        lib.bridge_checksum_lanes.restype = None
        _library = lib
        return lib


def _rows_view(t: torch.Tensor) -> tuple[int, int, int]:
    """Return (rows, row elements, row stride in elements) of a CPU tensor whose last dim is contiguous."""
    if t.dim() == 0:
        return 1, 1, 1
    if t.dim() == 1:
        if t.stride(0) != 1 and t.numel() > 1:
            raise ValueError("1-D tensor must be contiguous")
        return 1, t.numel(), t.numel()
    if t.dim() > 2:
        if not t.is_contiguous():
            raise ValueError("tensors of more than 2 dims must be contiguous")
        return t.numel() // t.shape[-1], t.shape[-1], t.shape[-1]
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError("the last dim must be contiguous")
    return t.shape[0], t.shape[1], t.stride(0)


def supports_quantize(w: torch.Tensor) -> bool:
    """True when the C quantizer handles `w` (CPU, 2-D, bf16/fp32, contiguous rows) and is available."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float32)
            and (w.stride(1) == 1 or w.shape[1] <= 1) and library() is not None)


def fp8_blockwise_quantize_cpu(w: torch.Tensor, block_size: int = 128, pow2_scale: bool = False,
                               name: str = "weight", q_out: torch.Tensor | None = None,
                               scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """C kernel, same contract and bits as the torch reference; may write into views `q_out` / `scale_out`
    (row-contiguous, e.g. a slice of a larger tensor in a shared bucket)."""
    from kernels.fp8_blockwise import scale_shape

    lib = library()
    if lib is None or not supports_quantize(w):
        raise RuntimeError(f"{name}: the CPU FP8 kernel cannot take this tensor ({w.dtype}, {tuple(w.shape)})")
    m, n = w.shape
    mb, nb = scale_shape((m, n), block_size)
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn) if q_out is None else q_out
    s = torch.empty((mb, nb), dtype=torch.float32) if scale_out is None else scale_out
    if tuple(q.shape) != (m, n) or tuple(s.shape) != (mb, nb):
        raise ValueError(f"{name}: output shapes {tuple(q.shape)}, {tuple(s.shape)} do not fit {(m, n)}")
    status = lib.bridge_fp8_blockwise_quantize(
        w.data_ptr(), DTYPE_CODES[w.dtype], m, n, _rows_view(w)[2], q.data_ptr(), _rows_view(q)[2],
        s.data_ptr(), _rows_view(s)[2], block_size, int(pow2_scale))
    if status != 0:
        bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"{name}: {bad} NaN/Inf values; refusing to quantize a corrupt weight")
    return q, s


def copy_check_finite(src: torch.Tensor, dst: torch.Tensor) -> int:
    """Copy `src` into `dst` (same shape and dtype, contiguous last dims) and return how many copied elements are
    NaN/Inf (always 0 for non-float dtypes)."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"copy of {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
    lib = library()
    if lib is None or src.device.type != "cpu" or dst.device.type != "cpu" or src.numel() == 0:
        dst.copy_(src)
        return int((~torch.isfinite(dst)).sum()) if dst.is_floating_point() else 0
    rows, cols, src_stride = _rows_view(src)
    _, _, dst_stride = _rows_view(dst)
    size = src.element_size()
    return int(lib.bridge_copy_rows_check_finite(src.data_ptr(), src_stride * size, dst.data_ptr(),
                                                 dst_stride * size, rows, cols * size,
                                                 DTYPE_CODES.get(src.dtype, -1)))


_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def _fold(nbytes: int, lanes) -> int:
    h = 0xCBF29CE484222325 ^ nbytes
    for v in lanes:
        h = ((h ^ int(v)) * _FNV_PRIME) & _MASK
    return h


def checksum(t: torch.Tensor) -> int:
    """Return the 64-bit checksum of a contiguous CPU tensor's bytes (any dtype)."""
    if not t.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    lib = library()
    if lib is None or t.device.type != "cpu":
        return checksum_reference(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    lanes = (ctypes.c_uint64 * 8)()
    lib.bridge_checksum_lanes(t.data_ptr() if nbytes else None, nbytes, lanes)
    return _fold(nbytes, lanes)


def checksum_reference(data: np.ndarray) -> int:
    """NumPy reference of `checksum` on raw bytes."""
    nbytes = int(data.nbytes)
    padded = np.zeros(-(-nbytes // 32) * 32, dtype=np.uint8)
    padded[:nbytes] = data.reshape(-1).view(np.uint8)
    words = padded.view("<u8").reshape(-1, 4)
    k = words.shape[0]
    with np.errstate(over="ignore"):
        a = words.sum(axis=0, dtype=np.uint64)
        weights = np.arange(k, 0, -1, dtype=np.uint64)[:, None]
        b = (words * weights).sum(axis=0, dtype=np.uint64)
    return _fold(nbytes, list(a) + list(b))
