"""The bridge's C kernels against their references, bit for bit: FP8 codes and scales against the torch
reference (bf16 and fp32 inputs, partial blocks, power-of-two scales, strided outputs), NaN/Inf detection of the
checked copy against torch.isfinite, the checksum sums against their NumPy definition (pieces add up to the
whole); and the fallback without them."""
import os
import platform
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_library, integrity
from kernels.fp8 import cpu as fp8_cpu
from kernels.fp8.reference import blockwise_fp8_quantize_reference

pytestmark = pytest.mark.skipif(cpu_library.library() is None, reason="no C compiler for the CPU kernels")


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 300), n=st.integers(1, 300), block=st.sampled_from([16, 64, 128]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), pow2=st.booleans(), seed=st.integers(0, 10 ** 6),
       spread=st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]))
def test_fp8_quantize_bit_exact_against_reference(m, n, block, dtype, pow2, seed, spread):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: subnormal e4m3 codes, saturation at 448 and zero blocks all occur
    w = (torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g) * spread).to(dtype)
    w[torch.rand(m, n, generator=g) < 0.05] = 0
    q_ref, s_ref = blockwise_fp8_quantize_reference(w, block, pow2)
    q, s = fp8_cpu.fp8_blockwise_quantize_cpu(w, block, pow2)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def _add(a, b):
    return tuple((x + y) % (1 << 64) for x, y in zip(a, b))


def test_fp8_quantize_into_strided_views_of_a_larger_tensor():
    """A row-parallel shard quantized straight into its columns of the full tensor, as the bridge does; the
    pieces' checksum sums add up to the whole tensor's."""
    full = torch.randn(256, 512).bfloat16()
    q_ref, s_ref = blockwise_fp8_quantize_reference(full)
    q = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    s = torch.zeros(2, 4)
    total = (0, 0)
    for c in (0, 256):
        sums = fp8_cpu.fp8_quantize_into(full[:, c:c + 256], q[:, c:c + 256], s[:, c // 128:c // 128 + 2],
                                            q_position=integrity.Position(0, 512, c))
        total = _add(total, sums)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert total == integrity.checksum_sums_reference(q_ref)


def test_large_outputs_stream_past_the_caches_bit_exact():
    """Outputs of 64 KiB and more take the streaming-store paths (row buffer + non-temporal stores): codes, copies
    and sums stay bit-exact, into strided views at an odd byte offset too."""
    w = torch.randn(1536, 1024).bfloat16() * torch.rand(1536, 1) * 100
    q_ref, s_ref = blockwise_fp8_quantize_reference(w)
    full = torch.zeros(1536, 2048 + 1, dtype=torch.uint8)
    q = full[:, 1:1025].view(torch.float8_e4m3fn)  # rows 2049 bytes apart, misaligned for 16-byte stores
    s = torch.zeros(12, 8)
    sums = fp8_cpu.fp8_quantize_into(w, q, s, q_position=integrity.Position(0, 1024, 0))
    assert torch.equal(s, s_ref) and torch.equal(q.contiguous().view(torch.uint8), q_ref.view(torch.uint8))
    assert sums == integrity.checksum_sums_reference(q_ref)
    src = torch.randn(3, 1 << 20).bfloat16()
    dst = torch.zeros(3 * (1 << 21) + 2, dtype=torch.uint8)[2:].view(torch.bfloat16).view(3, 1 << 20)
    bad, sums = integrity.copy_check_finite(src, dst)
    assert bad == 0 and torch.equal(dst, src) and sums == integrity.checksum_sums_reference(src)


@pytest.mark.parametrize("fill", ["random", "max"])
def test_long_byte_runs_sum_exactly(fill):
    """FP8 codes are checksummed 32 bytes at a time with 32-bit partial sums flushed every 2^16 chunks: a run of
    several flushes, all bytes 255 (the largest partial sums), equals the definition mod 2^64."""
    n = 5 * (1 << 21) + 13
    data = (torch.full((n,), 255, dtype=torch.uint8) if fill == "max" else
            torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    assert integrity.checksum_sums(data) == integrity.checksum_sums_reference(data)
    position = integrity.Position(7, 1 << 40, 3)  # large flat indices wrap mod 2^64 in both
    assert integrity.checksum_sums(data.view(1, -1), position) == integrity.checksum_sums_reference(
        data.view(1, -1), position)


def test_fp8_quantize_names_a_nonfinite_tensor():
    w = torch.ones(130, 130, dtype=torch.bfloat16)
    w[129, 3] = float("inf")
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj.weight: 1 NaN/Inf"):
        fp8_cpu.fp8_blockwise_quantize_cpu(w, name="layers.3.mlp.up_proj.weight")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32])
def test_copy_check_finite_counts_like_isfinite_and_sums_its_piece(dtype):
    src = torch.randn(40, 3000).to(dtype)
    if dtype.is_floating_point:
        src[3, 5], src[39, 2999], src[20, 0] = float("nan"), float("inf"), -float("inf")
    full = torch.zeros(40, 6000, dtype=dtype)
    dst = full[:, 1000:4000]  # strided rows: a row-parallel piece of a wider tensor
    bad, sums = integrity.copy_check_finite(src, dst, integrity.Position(0, 6000, 1000))
    assert torch.equal(dst.contiguous().view(torch.uint8), src.view(torch.uint8))  # NaN != NaN: compare bits
    assert bad == (int((~torch.isfinite(src)).sum()) if dtype.is_floating_point else 0)
    assert sums == integrity.checksum_sums_reference(dst, integrity.Position(0, 6000, 1000))
    # the rest of the tensor is zero, so this piece's sums are the whole tensor's
    assert sums == integrity.checksum_sums_reference(full)


@pytest.mark.parametrize("fill", ["zeros", "ones", "random"])
@pytest.mark.parametrize("rows, cols, offset", [(1, 5 * 2048 + 37, 3), (3, 70000, 0), (600, 1000, 5)])
def test_16_bit_rows_in_one_pass_sum_exactly(fill, rows, cols, offset):
    """16-bit elements are copied, checked and summed in one pass (the vector path: signed 32-bit lanes, flushed
    every 2048 elements; a scalar head up to an aligned streaming store and a scalar tail): all-zero and all-one
    bits (the largest lanes of either sign), rows of several flushes, short rows, streaming (>= 64 KiB) and cached
    copies into a wider tensor at an offset; NaN/Inf counted in the head, the body and the tail."""
    g = torch.Generator().manual_seed(rows)
    if fill == "random":
        bits = torch.randint(-(1 << 15), 1 << 15, (rows, cols), dtype=torch.int16, generator=g)
    else:
        bits = torch.full((rows, cols), 0 if fill == "zeros" else -1, dtype=torch.int16)
    for dtype in (torch.bfloat16, torch.int16):
        src = bits.view(dtype)
        full = torch.zeros(rows, cols + offset + 9, dtype=dtype)
        dst = full[:, offset:offset + cols]
        position = integrity.Position(0, full.shape[1], offset)
        bad, sums = integrity.copy_check_finite(src, dst, position)
        assert torch.equal(dst.contiguous().view(torch.int16), bits)
        expected_bad = int((~torch.isfinite(src)).sum()) if dtype.is_floating_point else 0
        assert bad == expected_bad
        assert sums == integrity.checksum_sums_reference(dst, position) == integrity.checksum_sums(dst, position)
    if fill == "random":
        src = bits.view(torch.bfloat16).clone()
        src[src.isnan() | src.isinf()] = 0
        for col in (0, 1, cols // 2, cols - 1):  # head, body, tail
            src[-1, col] = float("nan")
        assert integrity.copy_check_finite(src, torch.empty_like(src))[0] == len({0, 1, cols // 2, cols - 1})


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 33, 4099])
def test_checksum_matches_its_definition_and_pieces_add_up(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    data = torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8,
                         generator=g).view(dtype)
    assert integrity.checksum_sums(data) == integrity.checksum_sums_reference(data)
    if numel >= 8:
        moved = data.view(torch.uint8).clone()
        moved[1:] = data.view(torch.uint8)[:-1].clone()  # shifted by one byte
        assert integrity.checksum(moved.view(dtype)) != integrity.checksum(data)
        swapped = data.clone().view(torch.uint8).view(-1, data.element_size())
        a, b = 0, numel - 1
        if not torch.equal(swapped[a], swapped[b]):  # two elements trade places: an additive sum would not see it
            swapped[[a, b]] = swapped[[b, a]]
            assert integrity.checksum(swapped.view(-1).view(dtype)) != integrity.checksum(data)
    matrix = torch.randn(37, 300).to(torch.bfloat16)
    rows = [integrity.checksum_sums(matrix[r0:r0 + 10], integrity.Position(r0, 300, 0)) for r0 in range(0, 37, 10)]
    cols = [integrity.checksum_sums(matrix[:, c0:c0 + 128], integrity.Position(0, 300, c0))
            for c0 in range(0, 300, 128)]
    whole = integrity.checksum_sums(matrix.view(-1))
    for parts in (rows, cols):
        total = (0, 0)
        for part in parts:
            total = _add(total, part)
        assert total == whole


def test_without_the_kernels_the_references_are_used():
    code = ("import torch\nfrom kernels import cpu_library, integrity\n"
            "from kernels.fp8.dispatch import blockwise_fp8_quantize\nassert cpu_library.library() is None\n"
            "d = torch.arange(100, dtype=torch.uint8)\n"
            "assert integrity.checksum_sums(d) == integrity.checksum_sums_reference(d)\n"
            "x = torch.randn(4, 4)\nx[0, 0] = float('nan')\ny = torch.empty_like(x)\n"
            "assert integrity.copy_check_finite(x, y)[0] == 1\n"
            "q, s = blockwise_fp8_quantize(torch.randn(130, 200))\nprint('ok')\n")
    _prints_ok_in_a_fresh_process(code, MEGATRON_AIS_CPU_KERNELS="0")


def _prints_ok_in_a_fresh_process(code: str, **environ: str) -> None:
    """Run `code` in a fresh interpreter at the repository's root with `environ` added; it must print 'ok'."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root, **environ})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        return next(line for line in f if line.startswith("flags")).split()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 vector paths")
def test_native_build_takes_this_cpus_vector_paths():
    """The kernels tested here are the ones this CPU runs: AVX2 and AVX-512 paths exactly where it has them."""
    flags = _cpu_flags()
    assert cpu_library.simd_paths() == [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"))
                                        if flag in flags]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for x86-64 CPUs")
@pytest.mark.parametrize("arch, paths, needs", [
    ("x86-64", [], []), ("haswell", ["AVX2"], ["avx2", "fma", "bmi2"]),
    ("skylake-avx512", ["AVX2", "AVX-512"], ["avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl"])])
def test_builds_for_other_cpus_equal_the_references(arch, paths, needs, tmp_path):
    """What other CPUs run — the scalar paths (-march=x86-64: no AVX2 either), AVX2 sums, checked copies and FP8 and
    4-bit quantizers 8 lanes wide (-march=haswell, as on AMD Zen 1-3), or the quantizers 16 lanes wide without
    AVX-512 VBMI's byte permute (-march=skylake-avx512) — gives the references' FP8 codes and scales, the torch
    quantizers' NVFP4 and MXFP4 codes and scales (at the exponent range's edges too), checksum sums and NaN/Inf
    counts (this machine's own paths are checked above and in test_fp4.py)."""
    if not set(needs) <= set(_cpu_flags()):
        pytest.skip(f"this CPU cannot run a {arch} build")
    code = ("import torch\nfrom kernels import cpu_library, integrity\nfrom kernels.fp8 import cpu as fp8_cpu\n"
            "from kernels.fp8.reference import blockwise_fp8_quantize_reference\n"
            "from kernels.fp4 import cpu as fp4_cpu\n"
            "from kernels.fp4.quantize import mxfp4_quantize_torch, nvfp4_global_scale, nvfp4_quantize_torch\n"
            f"assert cpu_library.simd_paths() == {paths!r}, cpu_library.simd_paths()\n"
            "g = torch.Generator().manual_seed(0)\n"
            "for dtype in (torch.bfloat16, torch.float32):\n"
            "    for pow2 in (False, True):\n"
            "        w = (torch.randn(300, 1100, generator=g) * torch.rand(300, 1, generator=g) * 10).to(dtype)\n"
            "        q, s = fp8_cpu.fp8_blockwise_quantize_cpu(w, 128, pow2)\n"
            "        q_ref, s_ref = blockwise_fp8_quantize_reference(w, 128, pow2)\n"
            "        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))\n"
            "edges = torch.tensor([0.0, 1e-39, 1e-38, 3e-38, 2.0 ** -125, 1.74, 1.75, 7.0, 2.0 ** 126, 1.7e38])\n"
            "for dtype in (torch.bfloat16, torch.float32):\n"
            "    w = (torch.randn(40, 640, generator=g) * torch.logspace(-30, 30, 640)).to(dtype)\n"
            "    w[:10, :32] = edges.unsqueeze(1).to(dtype)\n"
            "    scale = nvfp4_global_scale(w)\n"
            "    pairs = [*zip(fp4_cpu.nvfp4_quantize_cpu(w, scale, 'w'), nvfp4_quantize_torch(w, 'w', scale)),\n"
            "             *zip(fp4_cpu.mxfp4_quantize_cpu(w, 'w'), mxfp4_quantize_torch(w, 'w'))]\n"
            "    assert all(torch.equal(c.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))\n"
            "               for c, t in pairs)\n"
            "    w[39, 600] = float('inf')\n"
            "    for quantize in (lambda: fp4_cpu.nvfp4_quantize_cpu(w, scale, 'w'),\n"
            "                     lambda: fp4_cpu.mxfp4_quantize_cpu(w, 'w')):\n"
            "        try:\n"
            "            quantize()\n"
            "        except ValueError:\n"
            "            continue\n"
            "        raise AssertionError('a 4-bit kernel took an Inf')\n"
            "for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.int64):\n"
            "    d = torch.randint(0, 256, (8 * 70001,), dtype=torch.uint8, generator=g).view(dtype)\n"
            "    assert integrity.checksum_sums(d) == integrity.checksum_sums_reference(d)\n"
            "src = torch.randn(600, 1000, generator=g).bfloat16()\nsrc[5, 7] = float('nan')\n"
            "dst = torch.zeros(600, 1009, dtype=torch.bfloat16)[:, 5:1005]\n"
            "bad, sums = integrity.copy_check_finite(src, dst, integrity.Position(0, 1009, 5))\n"
            "assert bad == 1 and sums == integrity.checksum_sums_reference(dst, integrity.Position(0, 1009, 5))\n"
            "print('ok')\n")
    _prints_ok_in_a_fresh_process(code, MEGATRON_AIS_CPU_ARCH=arch, MEGATRON_AIS_KERNEL_CACHE=str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int64])
def test_device_checksum_in_torch_ops_equals_the_definition(dtype, monkeypatch):
    """The checksum of device tensors (GPU arenas) is computed with torch int64 ops where the tensor lives; on CPU
    it must equal the definition: strided views, positions whose products wrap mod 2^64, several row chunks, and a
    row longer than a chunk (a flat tensor) taken in pieces."""
    monkeypatch.setattr(integrity, "_TORCH_CHUNK", 1000)
    g = torch.Generator().manual_seed(3)
    size = torch.empty(0, dtype=dtype).element_size()
    data = torch.randint(0, 256, (37 * 301 * size,), dtype=torch.uint8, generator=g).view(dtype).view(37, 301)
    for view, position in ((data, integrity.Position(0, 301, 0)), (data[:, 3:200], integrity.Position(5, 1 << 40, 7)),
                           (data.view(-1)[:1234], integrity.Position(0, 1234, 0))):
        assert integrity.checksum_sums_torch(view, position) == integrity.checksum_sums_reference(view, position)
    assert integrity.checksum_sums_torch(data[:0]) == (0, 0)
    # a tensor of 3 dimensions is its rows over every leading dimension, as the C kernel takes it
    cube = data.reshape(-1)[:37 * 300].view(37, 12, 25)
    expected = integrity.copy_check_finite(cube, torch.empty_like(cube))[1]
    assert integrity.checksum_sums_reference(cube) == integrity.checksum_sums_torch(cube) == expected
    assert integrity.checksum_sums_reference(cube.reshape(-1, 25)) == expected


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn])
def test_a_checked_copy_counts_nan_in_the_float_dtypes_the_c_kernel_has_no_code_for(dtype):
    src = torch.randn(4, 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    src.view(torch.uint8 if src.element_size() == 1 else torch.int64)[1, 3] = 0x7F if src.element_size() == 1 \
        else 0x7FF8000000000000  # e4m3's NaN; float64's
    dst = torch.zeros_like(src)
    assert integrity.copy_check_finite(src, dst) == (1, integrity.checksum_sums_reference(src))
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    assert integrity.copy_check_finite_torch(src, torch.zeros_like(src), integrity.Position.whole(src))[0] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_torch_copy_check_equals_the_c_kernel(dtype):
    """The device path of copy_check_finite (torch ops, one read-back per piece: GPU shards) gives the C kernel's
    NaN/Inf count and checksum sums, and copies the same bytes."""
    g = torch.Generator().manual_seed(11)
    src = (torch.randn(53, 300, generator=g) * 100).to(dtype)
    if dtype.is_floating_point:
        src[7, 9], src[40, 299] = float("nan"), float("-inf")
    position = integrity.Position(3, 1 << 33, 17)
    c_dst, torch_dst = torch.zeros_like(src), torch.zeros_like(src)
    expected = integrity.copy_check_finite(src, c_dst, position)
    assert integrity.copy_check_finite_torch(src, torch_dst, position) == expected
    assert expected[0] == (2 if dtype.is_floating_point else 0)
    assert torch.equal(torch_dst.view(torch.uint8), c_dst.view(torch.uint8))


def test_read_back_and_batched_checksums():
    from kernels.integrity import (checksum_sums_device, checksum_sums_reference, checksums, fold_checksum,
                                   read_back, unsigned_sums)

    figures = [torch.tensor([3]), torch.arange(5), torch.tensor([-1, 2**62])]
    assert read_back(figures) == [[3], [0, 1, 2, 3, 4], [-1, 2**62]]
    tensors = [torch.randn(7, 300).to(torch.bfloat16), torch.randint(0, 255, (1000,), dtype=torch.uint8),
               torch.randn(3, 5)]
    assert checksums(tensors) == [fold_checksum(t.numel() * t.element_size(), checksum_sums_reference(t.reshape(-1)))
                                  for t in tensors]
    # the device-side sums (what a GPU rank reads back in one transfer) equal the C kernel's unsigned ones
    assert [unsigned_sums(*v) for v in read_back([checksum_sums_device(t.reshape(-1)) for t in tensors])] == \
        [checksum_sums_reference(t.reshape(-1)) for t in tensors]
