"""The bridge's CPU kernels (`csrc/bridge_cpu.c`), built on first use with the system C compiler and loaded
through ctypes; their bindings live beside their torch / NumPy references:

    bridge_fp8_blockwise_quantize   one pass per 128-row strip: amax, scale, multiply, round to e4m3
                                    (`kernels.fp8.cpu`; reference: `kernels.fp8.reference`)
    bridge_copy_rows_check_finite   copy a 2-D view and count NaN/Inf on the way (`kernels.integrity`)
    bridge_block_sums               position-weighted checksum sums of a tensor's elements (`kernels.integrity`)

Without a compiler the references are used and one warning says so; `MEGATRON_AIS_CPU_KERNELS=0` forces that,
and `=1` (or a `MEGATRON_AIS_CPU_ARCH`) makes a failed build an error rather than a silent fallback.
Built for this CPU (`-march=native`: the AVX2 / AVX-512 paths where it has them); `MEGATRON_AIS_CPU_ARCH` builds
for another (`x86-64`: the portable scalar paths; `haswell`: AVX2 without AVX-512, as on AMD Zen 3;
`skylake-avx512`: AVX-512 without VBMI), which the tests compare with the references too. The shared object is
cached under `$MEGATRON_AIS_KERNEL_CACHE` (default ~/.cache/megatron_ais/kernels), keyed by the source, the flags
and the CPU, so a cache shared between different machines never runs foreign code.
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

import torch

log = logging.getLogger(__name__)

# found from this module's own location: kernels/csrc/bridge_cpu.c
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "bridge_cpu.c")
SIMD_PATHS = {1: "AVX2", 2: "AVX-512"}  # bits of bridge_simd()
DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}
KERNELS_ENV, ARCH_ENV = "MEGATRON_AIS_CPU_KERNELS", "MEGATRON_AIS_CPU_ARCH"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_error: str | None = None


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return os.uname().machine


def _cflags() -> tuple[str, ...]:
    return ("-O3", f"-march={os.environ.get(ARCH_ENV, 'native')}", "-fPIC", "-shared", "-std=c11")


def kernels_wanted() -> bool | None:
    """MEGATRON_AIS_CPU_KERNELS: True (1: the kernels, a failed build is an error), False (0: the references), None
    (unset: the kernels where they build). Any other value raises ValueError."""
    value = os.environ.get(KERNELS_ENV)
    if value not in (None, "0", "1"):
        raise ValueError(f"{KERNELS_ENV}={value}: expected 1 (the CPU kernels) or 0 (the torch references), or "
                         "leave it unset")
    return None if value is None else value == "1"


def _build(path: str) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # build beside the target and rename: ranks that build at the same time never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run([compiler, *_cflags(), "-o", tmp, SOURCE, "-lm"], check=True, capture_output=True, text=True)
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
        wanted = kernels_wanted()
        if wanted is False:
            _load_error = f"disabled by {KERNELS_ENV}=0"
            return None
        with open(SOURCE, "rb") as f:
            key = hashlib.sha256(f.read() + " ".join(_cflags()).encode() + _cpu_signature().encode()).hexdigest()[:16]
        cache = os.environ.get("MEGATRON_AIS_KERNEL_CACHE",
                               os.path.join(os.path.expanduser("~"), ".cache", "megatron_ais", "kernels"))
        path = os.path.join(cache, f"bridge_cpu-{key}.so")
        try:
            if not os.path.exists(path):
                _build(path)
            lib = ctypes.CDLL(path)
        except (OSError, RuntimeError) as err:
            if wanted or ARCH_ENV in os.environ:  # a forced path that silently became the references would hide it
                raise RuntimeError(f"the bridge's CPU kernels were asked for ({KERNELS_ENV}, {ARCH_ENV}) and did "
                                   f"not build: {err}") from err
            _load_error = str(err)
            log.warning("bridge CPU kernels unavailable (%s); using the torch references, which are slower", err)
            return None
        i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.bridge_fp8_blockwise_quantize.argtypes = [vp, c_int, i64, i64, i64, vp, i64, vp, i64, i64, c_int,
                                                      i64, i64, i64, vp]
        lib.bridge_fp8_blockwise_quantize.restype = c_int
        lib.bridge_copy_rows_check_finite.argtypes = [vp, i64, vp, i64, i64, i64, c_int, c_int, i64, i64, i64, vp]
        lib.bridge_copy_rows_check_finite.restype = i64
        lib.bridge_block_sums.argtypes = [vp, i64, i64, i64, c_int, i64, i64, i64, vp]
        lib.bridge_block_sums.restype = None
        lib.bridge_nvfp4_quantize.argtypes = [vp, c_int, i64, i64, i64, ctypes.c_float, vp, i64, vp, i64]
        lib.bridge_nvfp4_quantize.restype = c_int
        lib.bridge_mxfp4_quantize.argtypes = [vp, c_int, i64, i64, i64, vp, i64, vp, i64]
        lib.bridge_mxfp4_quantize.restype = c_int
        lib.bridge_simd.argtypes = []
        lib.bridge_simd.restype = c_int
        _library = lib
        return lib


def simd_paths() -> list[str]:
    """The vector instruction sets the loaded kernels were built with (empty: the portable scalar paths)."""
    lib = library()
    bits = lib.bridge_simd() if lib is not None else 0
    return [name for bit, name in SIMD_PATHS.items() if bits & bit]


def rows_view(t: torch.Tensor) -> tuple[int, int, int]:
    """Return (rows, row elements, row stride in elements) of a tensor whose last dim is contiguous."""
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


def sums_array() -> ctypes.Array:
    """The (A, B) checksum sums a kernel writes: two unsigned 64-bit integers."""
    return (ctypes.c_uint64 * 2)()
