"""QaRL's rollout-aligned forward (Gu et al., arXiv 2604.07853): the trainer's forward computes with the weights the
engine holds, so that π ≈ μ by construction, while the optimizer keeps stepping the master weights.

While `RolloutAlignedForward()` is open, each linear weight the engine receives quantized (attention and MLP
projections, MoE experts; `QuantizationPolicy.quantizes`) holds, in this rank's Megatron layout, what the engine
computes with: the full HF tensors gathered over tensor parallelism, quantized by the bridge's own quantizer
(`quantize_for_engine`, the codes and scales a sync sends) and dequantized as the engine's kernels do (code × scale in
fp32, rounded once to the parameter's dtype). With FP8 activations (H100's W8A8, or the CPU engine's emulation) each
such layer's input is also rounded per token in 1×128 groups to e4m3 (`per_token_group_fp8_round_trip`: vLLM's
dynamic quantizer). The backward runs at those weights and inputs, straight through: the gradient of the loss at
the quantized weights lands on the master weights, which come back, unchanged, before the optimizer steps."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from kernels.fp4.quantize import mxfp4_dequantize, nvfp4_dequantize
from kernels.fp8.format import BLOCK_SIZE, blockwise_fp8_dequantize, per_token_group_fp8_round_trip
from megatron_ais.bridge.quantization import SCALE_SUFFIX, QuantizationPolicy, quantize_for_engine
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.mapping.distributed import gather_tp_shards, shard_context
from megatron_ais.mapping.hf_io import global_parameters, hf_tensors_from_shards
from megatron_ais.mapping.layouts import split_dim
from megatron_ais.mapping.rules import expert_index, is_expert_parameter, rules_for, split_layer
from megatron_ais.model import ModelBuildConfig, unwrap_model


@dataclasses.dataclass(frozen=True)
class AlignedForwardConfig(FlagConfig):
    """Whether the trainer's forward uses the rollout's quantized weights (QaRL)."""

    rollout_aligned_forward: bool = flag(
        False, "QaRL's rollout-aligned forward: every trainer forward (old log-probs and the updates) computes the "
               "quantized linear layers with the weights the engine holds (the codes the bridge sends, dequantized) "
               "and, with FP8 activations (W8A8: on a GPU, or --rollout-fp8-activations emulate), their inputs "
               "rounded as the engine's are; gradients pass straight through to the master weights. Needs "
               "--rollout-precision fp8, nvfp4 or mxfp4.")


def engine_weights(named: list[tuple[str, torch.Tensor]], policy: QuantizationPolicy
                   ) -> list[tuple[str, torch.Tensor]]:
    """The HF weights `named` as the engine computes with them, each in its own dtype: a quantized one through the
    bridge's quantizer and back (a fused group together: NVFP4's shared global scale), the others unchanged."""
    sent = dict(quantize_for_engine(named, policy))
    return [(name, dequantized(name, sent, policy).to(tensor.dtype) if policy.quantizes(name) else tensor)
            for name, tensor in named]


def dequantized(name: str, sent: dict[str, torch.Tensor], policy: QuantizationPolicy) -> torch.Tensor:
    """HF weight `name` from the engine tensors a sync sends for it (`engine_tensor_specs`' names), code × scale
    in fp32 rounded to BF16: what the W8A16 and W4A16 kernels multiply activations by."""
    module = name.removesuffix(".weight")
    if policy.precision == "fp8":
        return blockwise_fp8_dequantize(sent[name], sent[name + SCALE_SUFFIX], policy.block_size)
    if policy.precision == "nvfp4":
        return nvfp4_dequantize(sent[name], sent[module + ".weight_scale"], sent[module + ".weight_scale_2"])
    return mxfp4_dequantize(sent[module + ".weight_packed"], sent[module + ".weight_scale"])


def _round_activations(module, inputs):
    """A linear layer's input as the engine's W8A8 layer quantizes it, the gradient passed straight through."""
    x, *rest = inputs
    return (x + (per_token_group_fp8_round_trip(x, BLOCK_SIZE) - x).detach(), *rest)


class RolloutAlignedForward:
    """Calling it gives a context in which this rank's model chunks compute with the engine's weights (see the
    module's docstring); every rank of a tensor-parallel group (and expert one) enters it together. `activations`:
    round the quantized layers' inputs to FP8 as the engine's W8A8 layers do."""

    def __init__(self, chunks: list, build: ModelBuildConfig, policy: QuantizationPolicy, activations: bool,
                 tp_group, expert_group=None):
        self.chunks, self.build, self.policy, self.activations = chunks, build, policy, activations
        self.groups = {False: tp_group, True: expert_group if expert_group is not None else tp_group}
        self.contexts = {expert: shard_context(build, dist.get_rank(group) if group is not None else 0, expert)
                         for expert, group in self.groups.items()}
        if activations:
            self._check_activation_groups()

    @classmethod
    def from_parallel_state(cls, chunks: list, build: ModelBuildConfig, policy: QuantizationPolicy,
                            activations: bool) -> "RolloutAlignedForward":
        expert_group = ps.get_expert_tensor_parallel_group() if build.shape.is_moe else None
        return cls(chunks, build, policy, activations, ps.get_tensor_model_parallel_group(), expert_group)

    def quantized_parameters(self):
        """(module name, parameter name, its HF names, parameter) of each linear weight the engine gets quantized."""
        rules = rules_for(self.build.shape.model_type)
        for chunk in self.chunks:
            for name, layer, param in global_parameters(unwrap_model(chunk)):
                rule = rules.get(split_layer(name)[1])
                hf_names = rule.format(layer, expert_index(name))[1] if rule is not None else ()
                if any(self.policy.quantizes(hf) for hf in hf_names):
                    yield chunk, name, layer, param

    def _check_activation_groups(self) -> None:
        """Refuse a layer whose input the forward cannot round as the engine does: Transformer Engine's fused
        norm + linear takes the input before its norm, and a row-parallel layer's input columns split over tensor
        parallelism must be whole 1x128 groups."""
        rules = rules_for(self.build.shape.model_type)
        for chunk, name, _, param in self.quantized_parameters():
            owner = _owner(chunk, param)
            if hasattr(owner, "layer_norm_weight"):
                raise ValueError(f"--rollout-aligned-forward with FP8 activations: {name} is Transformer Engine's "
                                 "fused norm + linear, whose input is taken before the norm; use the local "
                                 "transformer spec, or --rollout-precision nvfp4 / mxfp4 (weight-only)")
            ctx = self.contexts[is_expert_parameter(name)]
            if ctx.tp_size > 1 and split_dim(rules[split_layer(name)[1]].layout) == 1 and param.shape[1] % BLOCK_SIZE:
                raise ValueError(
                    f"--rollout-aligned-forward with FP8 activations: {name} takes {param.shape[1]} input columns "
                    f"per tensor-parallel rank (of {ctx.tp_size}), not whole 1x{BLOCK_SIZE} groups as the engine "
                    "rounds them; use a tensor-parallel size that splits them into multiples of 128")

    @contextlib.contextmanager
    def __call__(self):
        masters = []
        hooks = []
        try:
            with torch.no_grad():
                for chunk, name, layer, param in self.quantized_parameters():
                    masters.append((param, param.detach().clone()))
                    param.copy_(self._engine_shard(name, layer, param))
                    if self.activations:
                        hooks.append(_owner(chunk, param).register_forward_pre_hook(_round_activations))
            yield
        finally:
            for hook in hooks:
                hook.remove()
            with torch.no_grad():
                for param, master in masters:
                    param.copy_(master)

    def _engine_shard(self, name: str, layer: int | None, param: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `param` built from the engine's weights of the HF tensors it maps to."""
        expert = is_expert_parameter(name)
        ctx, model_type = self.contexts[expert], self.build.shape.model_type
        shards = gather_tp_shards(param.detach(), self.groups[expert])
        hf = hf_tensors_from_shards(name, layer, model_type, ctx, shards, self.build.shape.tie_word_embeddings)
        rule = rules_for(model_type)[split_layer(name)[1]]
        return rule.layout.shard([tensor for _, tensor in engine_weights(hf, self.policy)], ctx)


def _owner(chunk, param: torch.nn.Parameter) -> torch.nn.Module:
    """The module that holds `param` directly (its linear layer)."""
    for module in chunk.modules():
        if any(p is param for p in module.parameters(recurse=False)):
            return module
    raise KeyError("parameter not found in its model chunk")
