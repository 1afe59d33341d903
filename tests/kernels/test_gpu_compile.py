"""The Triton kernels built for the GPUs they target, here on CPU: Triton's NVIDIA backend and its ptxas compile
without a device. Every launch the bridge's one-pass kernel makes (`kernels.bucket_pass`: copies, conversions,
blockwise FP8, the receiver's sums) and the standalone FP8 quantizer compile for Hopper (sm_90) and Ada (sm_89)
into a binary that spills nothing; the launches whose pieces the host found aligned move 16 bytes per access; the
e4m3 codes come from the hardware's saturating conversion and the sums from 64-bit atomic adds. A kernel that would
not build on a GPU, or build slow, fails here rather than at a user's first sync. Before sm_89 Triton has no e4m3:
such a GPU quantizes with torch (`fp8_kernels_available`), and the test shows the kernel would not build there."""
import os
import re
import subprocess

import pytest
import torch

pytest.importorskip("triton.backends.nvidia.compiler")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import bucket_pass  # noqa: E402
from kernels.fp8 import triton as fp8_triton  # noqa: E402

CUDA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TABLES = {"pieces_ptr": "*i64", "tiles_ptr": "*i64", "figures_ptr": "*i64"}
QUANTIZER = {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "m": "i32", "n": "i32", "stride_wm": "i32",
             "stride_qm": "i32", "n_blocks_n": "i32"}
# (kind, source dtype, output dtype, aligned): what the bridge launches for BF16 and FP8 syncs and their checks
LAUNCHES = [("copy", torch.bfloat16, torch.bfloat16, True), ("copy", torch.bfloat16, torch.bfloat16, False),
            ("copy", torch.float32, torch.bfloat16, True), ("quantize", torch.bfloat16, torch.float8_e4m3fn, True),
            ("quantize", torch.bfloat16, torch.float8_e4m3fn, False), ("sums", torch.uint8, torch.uint8, True),
            ("sums", torch.bfloat16, torch.bfloat16, True), ("sums", torch.float32, torch.float32, True)]


def _compile(fn, arguments: dict, constants: dict, arch: int, num_warps: int):
    """`fn` compiled for NVIDIA sm_`arch` as Triton's launcher specializes it for torch tensors and sizes that are
    multiples of 16: pointers 16-byte aligned, integers divisible by 16."""
    signature = {**arguments, **{name: "constexpr" for name in constants}}
    divisible = {(i,): [["tt.divisibility", 16]] for i in range(len(arguments))}
    return triton.compile(ASTSource(fn, signature, constants, divisible), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps})


def _resources(kernel, tmp_path) -> dict:
    """Registers, stack and local memory of the compiled binary (`cuobjdump -res-usage`)."""
    cubin = tmp_path / f"{kernel.metadata.hash}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([os.path.join(CUDA_BIN, "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}


def _check_binary(kernel, tmp_path, aligned: bool, stores: bool) -> str:
    """An aligned launch (every real model's: sizes multiples of 16) spills nothing and moves 16 bytes per access;
    an unaligned one (odd shapes) accesses element by element."""
    resources = _resources(kernel, tmp_path)
    assert resources["REG"] * kernel.metadata.num_warps * 32 <= 65536, resources  # a block fits an SM's registers
    if aligned:
        assert resources["STACK"] == 0 and resources["LOCAL"] == 0, resources
    ptx = kernel.asm["ptx"]
    assert ("ld.global.v4" in ptx) == aligned
    if stores:
        assert ("st.global.v4" in ptx) == aligned
    return ptx


@pytest.mark.parametrize("arch", [89, 90])
@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda launch: "-".join(map(str, launch)).replace("torch.", ""))
def test_bucket_pass_launch_builds_for_the_gpu(launch, arch, tmp_path):
    kind, src, out, aligned = launch
    constants = bucket_pass.launch_constants(kind, src, out, aligned, 128, False)
    kernel = _compile(bucket_pass._bucket_pass_kernel, TABLES, constants, arch, bucket_pass.NUM_WARPS[kind])
    ptx = _check_binary(kernel, tmp_path, aligned, stores=kind == "copy")
    assert re.search(r"atom\.global\.[\w.]*add\.u64", ptx)  # the figures: 64-bit sums, wrapping mod 2^64
    assert ("cvt.rn.satfinite.e4m3x2" in ptx) == (kind == "quantize")


@pytest.mark.parametrize("arch", [89, 90])
def test_fp8_quantizer_builds_for_the_gpu(arch, tmp_path):
    kernel = _compile(fp8_triton._blockwise_fp8_quantize_kernel, QUANTIZER, {"BLOCK": 128, "POW2": False}, arch,
                      fp8_triton.TRITON_NUM_WARPS)
    assert "cvt.rn.satfinite.e4m3x2" in _check_binary(kernel, tmp_path, aligned=True, stores=False)


def test_no_e4m3_before_sm89():
    assert [fp8_triton.triton_writes_e4m3(GPUTarget("cuda", arch, 32)) for arch in (80, 86, 89, 90)] == \
        [False, False, True, True]
    constants = bucket_pass.launch_constants("quantize", torch.bfloat16, torch.float8_e4m3fn, True, 128, False)
    with pytest.raises(triton.CompilationError, match="fp8e4nv not supported"):  # why an A100 takes the torch path
        _compile(bucket_pass._bucket_pass_kernel, TABLES, constants, 80, 16)
    assert not fp8_triton.fp8_kernels_available(torch.device("cpu"))
