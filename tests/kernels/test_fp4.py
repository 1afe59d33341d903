"""4-bit weight quantizers (the C kernels and the torch ops) bit for bit against the published references: NVFP4
against vLLM 0.32's `ref_nvfp4_quant` (its codes and e4m3 block scales) and compressed-tensors' `pack_fp4_to_uint8`
(the byte layout); MXFP4 against compressed-tensors' `generate_mx_scales` (e8m0 scales), vLLM's `cast_to_fp4` and the
same packer; dequantization against vLLM's `dequantize_to_dtype`; e2m1 rounding on every tie."""
import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import cast_to_fp4, dequantize_to_dtype, \
    ref_nvfp4_quant

from kernels.fp4.format import E2M1_MAGNITUDES, e2m1_codes, e2m1_values, pack_pairs, unpack_pairs
from kernels.fp4.format import MXFP4_BLOCK, NVFP4_BLOCK
from kernels.fp4.quantize import mxfp4_dequantize, mxfp4_quantize, mxfp4_quantize_torch, nvfp4_dequantize, \
    nvfp4_global_scale, nvfp4_quantize, nvfp4_quantize_torch
from kernels.fp8.cpu import supports_quantize

# the dispatching quantizers (the C kernel on CPU) and the torch ones: each must give the references' bits
NVFP4 = {"c": lambda w, scale: nvfp4_quantize(w, "w", scale), "torch": lambda w, scale: nvfp4_quantize_torch(w, "w",
                                                                                                         scale)}
MXFP4 = {"c": lambda w: mxfp4_quantize(w, "w"), "torch": lambda w: mxfp4_quantize_torch(w, "w")}


def _weight(rows, blocks, block, seed, dtype):
    """Rows of blocks spanning eight decades, with an all-zero block and blocks whose amax has each mantissa."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, blocks * block, generator=generator) * torch.logspace(-4, 4, blocks * block)
    w[0, :block] = 0.0
    if rows > 1:
        w[1, :block] = torch.linspace(-1.75, 1.0, block)  # amax mantissa exactly 1.75: the MX round-up edge
    return w.to(dtype)


def test_e2m1_rounds_to_nearest_with_ties_to_even_as_vllm_does():
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    around = torch.cat([magnitudes, midpoints, midpoints.nextafter(torch.tensor(0.0)),
                        midpoints.nextafter(torch.tensor(9.0)), torch.tensor([5.99, 6.0])])
    x = torch.cat([around, -around])
    assert torch.equal(e2m1_values(e2m1_codes(x)), cast_to_fp4(x.clone()))
    # ties go to the even index: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert e2m1_values(e2m1_codes(midpoints)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_the_c_kernels_take_host_weights():
    assert supports_quantize(torch.zeros(4, 32, dtype=torch.bfloat16))


def _weights(min_rows: int, max_blocks: int):
    """Hypothesis draws of a weight's rows and blocks, its seed and its dtype, 20 examples."""
    draws = given(rows=st.integers(min_rows, 40), blocks=st.integers(1, max_blocks), seed=st.integers(0, 1000),
                  dtype=st.sampled_from([torch.bfloat16, torch.float32]))
    return lambda test: settings(max_examples=20, deadline=None)(draws(test))


@pytest.mark.parametrize("implementation", NVFP4)
@_weights(min_rows=1, max_blocks=40)
def test_nvfp4_equals_vllms_reference_quantizer(implementation, rows, blocks, seed, dtype):
    w = _weight(rows, blocks, NVFP4_BLOCK, seed, dtype)
    global_scale = nvfp4_global_scale(w)
    weight, weight_scale, weight_scale_2 = NVFP4[implementation](w, global_scale)
    values, scales = ref_nvfp4_quant(w, global_scale, NVFP4_BLOCK)
    assert weight.dtype == torch.uint8 and weight.shape == (rows, blocks * NVFP4_BLOCK // 2)
    assert weight_scale.dtype == torch.float8_e4m3fn and weight_scale.shape == (rows, blocks)
    assert weight_scale_2.dtype == torch.float32 and weight_scale_2.numel() == 1
    assert torch.equal(weight, pack_fp4_to_uint8(values))
    assert torch.equal(weight_scale.float(), scales)
    assert weight_scale_2 == 1.0 / global_scale
    dequantized = dequantize_to_dtype(weight, weight_scale, weight_scale_2, torch.float32, NVFP4_BLOCK, swizzle=False)
    assert torch.equal(nvfp4_dequantize(weight, weight_scale, weight_scale_2, torch.float32), dequantized)


def test_nvfp4_fused_shards_share_the_global_scale_they_are_given():
    q, k = _weight(8, 2, NVFP4_BLOCK, 0, torch.bfloat16), _weight(4, 2, NVFP4_BLOCK, 1, torch.bfloat16) * 100
    shared = nvfp4_global_scale(torch.cat([q, k]))
    for part in (q, k):
        weight, weight_scale, weight_scale_2 = nvfp4_quantize(part, global_scale=shared)
        values, scales = ref_nvfp4_quant(part, shared, NVFP4_BLOCK)
        assert torch.equal(weight, pack_fp4_to_uint8(values)) and torch.equal(weight_scale.float(), scales)
        assert weight_scale_2 == 1.0 / shared


@pytest.mark.parametrize("implementation", MXFP4)
@_weights(min_rows=2, max_blocks=20)
def test_mxfp4_equals_compressed_tensors_scales_and_vllms_rounding(implementation, rows, blocks, seed, dtype):
    w = _weight(rows, blocks, MXFP4_BLOCK, seed, dtype)
    w[0, :MXFP4_BLOCK] = 0.5  # an all-zero block has no exponent in the reference (log2 0)
    codes, scales = MXFP4[implementation](w)
    block_view = w.float().reshape(rows, blocks, MXFP4_BLOCK)
    reference_scales = generate_mx_scales(block_view.abs().amax(-1)).to(torch.uint8)
    factor = 2.0 ** (reference_scales.to(torch.int32) - 127).float()
    reference_values = cast_to_fp4(torch.clamp(block_view / factor.unsqueeze(-1), -6.0, 6.0))
    assert torch.equal(scales, reference_scales)
    assert torch.equal(codes, pack_fp4_to_uint8(reference_values.reshape(rows, -1)))
    assert torch.equal(mxfp4_dequantize(codes, scales, torch.float32), (reference_values * factor.unsqueeze(-1))
                       .reshape(rows, -1))
    assert scales[1, 0] == 127 + 1 - 2  # amax 1.75 takes the next exponent


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0x7, 0x9, 0xF]], dtype=torch.uint8)
    assert pack_pairs(codes).tolist() == [[0x71, 0xF9]]
    assert torch.equal(unpack_pairs(pack_pairs(codes)), codes)


@pytest.mark.parametrize("quantize", [nvfp4_quantize, mxfp4_quantize, mxfp4_quantize_torch,
                                      lambda w, name: nvfp4_quantize_torch(w, name, torch.tensor(1.0))])
def test_4bit_quantizers_refuse_bad_weights_by_name(quantize):
    with pytest.raises(ValueError, match="layers.0.mlp.down_proj.weight: 1 NaN/Inf"):
        quantize(torch.tensor([[float("nan")] + [0.0] * 31]), name="layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="not whole 1x"):
        quantize(torch.ones(2, 24), name="w")


def test_the_c_kernels_equal_the_torch_quantizers_at_the_exponent_range_edges():
    """Zero, subnormal and near-overflow blocks, the MX round-up edge and its neighbours: the C kernels' bit tricks
    for exponents against the torch quantizers (which match the references above)."""
    edges = (0.0, 1e-39, 1e-38, 3e-38, 2.0 ** -125, 1.74, 1.75, 7.0, 2.0 ** 126, 1.7e38)
    w = torch.stack([torch.full((32 * 17,), value) for value in edges])  # 17 groups: a batch of 16 and one more
    assert all(torch.equal(c, t) for c, t in zip(mxfp4_quantize(w, "w"), mxfp4_quantize_torch(w, "w")))
    w = torch.randn(64, 16 * 17, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 16 * 17)
    scale = nvfp4_global_scale(w)
    for c, t in zip(nvfp4_quantize(w, "w", scale), nvfp4_quantize_torch(w, "w", scale)):
        assert torch.equal(c.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
