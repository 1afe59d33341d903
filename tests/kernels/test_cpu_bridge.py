"""The bridge's C kernels against their references, bit for bit: FP8 codes and scales against the torch
reference (bf16 and fp32 inputs, partial blocks, power-of-two scales, strided outputs), NaN/Inf detection of the
checked copy against torch.isfinite, the checksum against its NumPy definition; and the fallback without them."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_bridge
from kernels.fp8_blockwise import blockwise_fp8_quantize_reference

pytestmark = pytest.mark.skipif(cpu_bridge.library() is None, reason="no C compiler for the CPU kernels")


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
    q, s = cpu_bridge.fp8_blockwise_quantize_cpu(w, block, pow2)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_fp8_quantize_into_strided_views_of_a_larger_tensor():
    """A row-parallel shard quantized straight into its columns of the full tensor, as the bridge does."""
    full = torch.randn(256, 512).bfloat16()
    q_ref, s_ref = blockwise_fp8_quantize_reference(full)
    q = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    s = torch.zeros(2, 4)
    for c in (0, 256):
        cpu_bridge.fp8_blockwise_quantize_cpu(full[:, c:c + 256], q_out=q[:, c:c + 256],
                                              scale_out=s[:, c // 128:c // 128 + 2])
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_fp8_quantize_names_a_nonfinite_tensor():
    w = torch.ones(130, 130, dtype=torch.bfloat16)
    w[129, 3] = float("inf")
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj.weight: 1 NaN/Inf"):
        cpu_bridge.fp8_blockwise_quantize_cpu(w, name="layers.3.mlp.up_proj.weight")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32])
def test_copy_check_finite_counts_like_isfinite(dtype):
    src = torch.randn(40, 3000).to(dtype)
    if dtype.is_floating_point:
        src[3, 5], src[39, 2999], src[20, 0] = float("nan"), float("inf"), -float("inf")
    dst = torch.zeros(40, 6000, dtype=dtype)[:, 1000:4000]  # strided rows
    bad = cpu_bridge.copy_check_finite(src, dst)
    assert torch.equal(dst.contiguous().view(torch.uint8), src.view(torch.uint8))  # NaN != NaN: compare bits
    assert bad == (int((~torch.isfinite(src)).sum()) if dtype.is_floating_point else 0)
    one_d = torch.randn(100_000).bfloat16()
    out = torch.empty_like(one_d)
    assert cpu_bridge.copy_check_finite(one_d, out) == 0 and torch.equal(out, one_d)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 31, 32, 33, 4096, 100_003])
def test_checksum_matches_its_definition(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    assert cpu_bridge.checksum(data) == cpu_bridge.checksum_reference(data.numpy())
    if nbytes >= 64:
        moved = data.clone()
        moved[1:] = data[:-1].clone()  # shifted by one byte
        assert cpu_bridge.checksum(moved) != cpu_bridge.checksum(data)


def test_without_the_kernels_the_references_are_used():
    code = ("import torch\nfrom kernels import cpu_bridge\nfrom kernels.fp8_blockwise import blockwise_fp8_quantize\n"
            "assert cpu_bridge.library() is None\nd = torch.arange(100, dtype=torch.uint8)\n"
            "assert cpu_bridge.checksum(d) == cpu_bridge.checksum_reference(d.numpy())\n"
            "x = torch.randn(4, 4)\nx[0, 0] = float('nan')\ny = torch.empty_like(x)\n"
            "assert cpu_bridge.copy_check_finite(x, y) == 1\nprint('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "MEGATRON_AIS_CPU_KERNELS": "0", "PYTHONPATH": root})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
