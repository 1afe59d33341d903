"""Weight-only 4-bit quantizers into the layouts vLLM loads.

NVFP4 (ModelOpt's layout): `w` [N, K] in 1x16 blocks; a per-tensor fp32 `weight_scale_2` = amax(|w|) / (6 * 448) and
per block an e4m3 `weight_scale` = amax(|block|) / 6 / weight_scale_2; the codes are w / (weight_scale *
weight_scale_2) rounded to e2m1, packed two per byte (`weight` uint8 [N, K/2]). w ≈ code * weight_scale *
weight_scale_2. The arithmetic is vLLM's reference quantizer's (`ref_nvfp4_quant`), operation for operation, with its
global scale 6 * 448 / amax, whose reciprocal ModelOpt stores.

MXFP4 (OCP Microscaling Formats v1.0, e2m1 elements): `w` [N, K] in 1x32 blocks; per block the shared scale
2^(floor(log2(amax(|block|))) - 2) (2: the largest e2m1 exponent) stored as an e8m0 byte (exponent + 127), the
elements w / scale rounded to e2m1 (saturating at ±6), packed two per byte. w ≈ code * 2^(byte - 127). As
compressed-tensors' `generate_mx_scales` and vLLM's MXFP4 quantizer do, an amax whose mantissa is >= 1.75 takes the
next exponent: the spec's floor would map it to 7 or more, where ±6 saturates it.
"""
from __future__ import annotations

import torch

from kernels.fp4.cpu import mxfp4_quantize_cpu, nvfp4_quantize_cpu
from kernels.fp4.format import E2M1_MAX, MXFP4_BLOCK, NVFP4_BLOCK, check_groups, e2m1_codes, e2m1_values, \
    pack_pairs, unpack_pairs
from kernels.fp8.cpu import supports_quantize
from kernels.fp8.format import FP8_E4M3_MAX, check

E8M0_BIAS = 127
E2M1_MAX_EXPONENT = 2
# 1.75 / 2: frexp's mantissa of an amax whose block exponent is rounded up
ROUND_UP_MANTISSA = 0.875
# an all-zero tensor keeps a finite global scale (its codes are all zero either way)
AMAX_EPS = 1e-12


def _blocks(w: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """w [N, K] as fp32 [N, K / block, block], refusing a non-2-D, non-finite or ragged weight."""
    check_groups(w, block, name)
    check(w, block, name)
    return w.float().reshape(w.shape[0], -1, block)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x, and 1e-8 where x is 0 (vLLM's `get_reciprocal`: an all-zero block's codes stay 0)."""
    return 1.0 / (x + (x == 0) * 1e8)


def _amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| in fp32, in one pass that does not materialize |w| (aminmax: 13x abs().amax() on a 4096x4096 bf16 CPU
    weight)."""
    low, high = torch.aminmax(w)
    return torch.maximum(-low, high).float()


def nvfp4_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """6 * 448 / amax(|w|) over `weights` as an fp32 scalar tensor: the factor that maps the largest block scale to
    e4m3's max (the tensors vLLM fuses into one layer share one)."""
    amax = torch.stack([_amax(w) for w in weights]).amax()
    return (E2M1_MAX * FP8_E4M3_MAX / amax.clamp(min=AMAX_EPS)).reshape(())


def nvfp4_quantize(w: torch.Tensor, name: str = "weight", global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 fp32 scalar) of `w` [N, K]:
    the C kernel for CPU weights it takes, torch ops otherwise (`nvfp4_quantize_torch`; the same bits).
    `global_scale`: the tensors vLLM fuses into one layer share one (`nvfp4_global_scale` of them all)."""
    check_groups(w, NVFP4_BLOCK, name)
    if global_scale is None:
        global_scale = nvfp4_global_scale(w)
    if supports_quantize(w):
        return nvfp4_quantize_cpu(w, global_scale, name)
    return nvfp4_quantize_torch(w, name, global_scale)


def nvfp4_quantize_torch(w: torch.Tensor, name: str, global_scale: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`nvfp4_quantize` in torch ops, wherever `w` lives."""
    blocks = _blocks(w, NVFP4_BLOCK, name)
    block_max = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (global_scale * (block_max * (1 / E2M1_MAX))).clamp(min=-FP8_E4M3_MAX, max=FP8_E4M3_MAX)
    scale = scale.to(torch.float8_e4m3fn)
    scaled = blocks * _reciprocal(scale.float() * _reciprocal(global_scale))
    codes = e2m1_codes(scaled.clamp(-E2M1_MAX, E2M1_MAX).reshape(w.shape))
    return pack_pairs(codes), scale.squeeze(-1), (1.0 / global_scale).float()


def nvfp4_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """code * (weight_scale * weight_scale_2) in fp32 (vLLM's `dequantize_to_dtype`), then `dtype`: what a W4A16
    kernel multiplies activations by."""
    values = e2m1_values(unpack_pairs(weight)).reshape(weight.shape[0], -1, NVFP4_BLOCK)
    block_scales = weight_scale.float() * weight_scale_2.float()
    return (values * block_scales.unsqueeze(-1)).reshape(weight.shape[0], -1).to(dtype)


def mxfp4_quantize(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K/2], e8m0 scales uint8 [N, K/32]) of `w` [N, K]: the C kernel for CPU weights it takes,
    torch ops otherwise (`mxfp4_quantize_torch`; the same bits)."""
    check_groups(w, MXFP4_BLOCK, name)
    if supports_quantize(w):
        return mxfp4_quantize_cpu(w, name)
    return mxfp4_quantize_torch(w, name)


def mxfp4_quantize_torch(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`mxfp4_quantize` in torch ops, wherever `w` lives."""
    blocks = _blocks(w, MXFP4_BLOCK, name)
    mantissa, exponent = torch.frexp(blocks.abs().amax(dim=-1, keepdim=True))  # amax = m * 2^e, m in [0.5, 1)
    # floor(log2 amax) - 2, one higher where amax's mantissa is >= 1.75 (it would saturate past 6 otherwise)
    shared = exponent - 1 + (mantissa >= ROUND_UP_MANTISSA).to(exponent.dtype) - E2M1_MAX_EXPONENT
    shared = shared.clamp(min=-E8M0_BIAS, max=E8M0_BIAS)
    codes = e2m1_codes((blocks * torch.ldexp(torch.ones_like(blocks[..., :1]), -shared)).reshape(w.shape))
    return pack_pairs(codes), (shared + E8M0_BIAS).to(torch.uint8).squeeze(-1)


def mxfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """code * 2^(scale - 127) in fp32, then `dtype`."""
    values = e2m1_values(unpack_pairs(codes)).reshape(codes.shape[0], -1, MXFP4_BLOCK)
    factor = torch.ldexp(torch.ones_like(values[..., :1]), scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS)
    return (values * factor).reshape(codes.shape[0], -1).to(dtype)
