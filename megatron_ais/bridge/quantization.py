"""Which HF tensors the rollout engine receives in blockwise FP8, and the engine's quantization_config.

Attention and MLP linear weights become FP8 + `<name>_scale_inv` (vLLM's blockwise FP8 checkpoint names, as
in DeepSeek-V3 / Qwen3-FP8); embeddings, lm_head, norms and biases stay BF16. Patterns are configurable.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch

from kernels.fp8.dispatch import blockwise_fp8_quantize
from kernels.integrity import all_finite
from megatron_ais.flags import FlagConfig, flag

LINEAR_WEIGHT = re.compile(r"^(?P<prefix>model\.layers\.\d+)\.(?P<module>self_attn\.[qkvo]_proj|"
                           r"mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")
DEFAULT_FP8_INCLUDE = (r"\.self_attn\.[qkvo]_proj\.weight$", r"\.mlp\.(experts\.\d+\.)?(gate|up|down)_proj\.weight$")
# vLLM fuses these HF projections into one layer, which must share one quantization scheme
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
# all experts of a layer are one FusedMoE layer in vLLM; the router (mlp.gate) always stays BF16
EXPERT = re.compile(r"^mlp\.experts\.\d+\.")
ROUTER_WEIGHT = re.compile(r"^(?P<module>model\.layers\.\d+\.mlp\.gate)\.weight$")
SCALE_SUFFIX = "_scale_inv"


@dataclasses.dataclass(frozen=True)
class QuantizationPolicy(FlagConfig):
    """precision 'fp8' quantizes names matching an include pattern and no exclude pattern; 'bf16'/'fp32' cast."""

    precision: str = "fp8"
    include: tuple[str, ...] = DEFAULT_FP8_INCLUDE
    exclude: tuple[str, ...] = flag((), "HF tensor-name patterns to keep in BF16 under FP8 rollouts (q/k/v and "
                                        "gate/up together).", name="--bridge-fp8-exclude", metavar="REGEX", type=str)
    block_size: int = 128
    pow2_scale: bool = False

    def quantizes(self, name: str) -> bool:
        """Return True when the tensor `name` is sent as FP8 + scale_inv."""
        if self.precision != "fp8" or LINEAR_WEIGHT.match(name) is None:
            return False
        return any(re.search(p, name) for p in self.include) and not any(re.search(p, name) for p in self.exclude)

    @property
    def dense_dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "fp32" else torch.bfloat16


def _fp8_requirements(shape, engine_tp: int) -> list[tuple[str, str, int, str]]:
    """What vLLM's blockwise FP8 layers need whole blocks of, per engine rank at TP `engine_tp` (its
    `validate_fp8_block_shape` rules): (module, the regex that keeps its fused group in BF16, size, what). Output
    rows of every fused projection but the last (all when TP > 1), input columns of row-parallel projections when
    TP > 1, every expert's FFN rows."""
    hd, t, split = shape.head_dim, engine_tp, engine_tp > 1
    q, kv = shape.num_attention_heads * hd // t, max(shape.num_key_value_heads // t, 1) * hd
    qkv = r"self_attn\.[qkv]_proj"
    needs = [("self_attn.q_proj", qkv, q, "output rows"), ("self_attn.k_proj", qkv, kv, "output rows")]
    needs += [("self_attn.v_proj", qkv, kv, "output rows"), ("self_attn.o_proj", r"self_attn\.o_proj", q,
                                                              "input columns")] if split else []
    if shape.is_moe:
        return needs + [("mlp.experts.0.gate_proj", r"mlp\.experts\.", shape.moe_ffn_hidden_size // t, "output rows")]
    ffn, gate_up = shape.ffn_hidden_size // t, r"mlp\.(gate|up)_proj"
    needs.append(("mlp.gate_proj", gate_up, ffn, "output rows"))
    return needs + ([("mlp.up_proj", gate_up, ffn, "output rows"),
                     ("mlp.down_proj", r"mlp\.down_proj", ffn, "input columns")] if split else [])


def check_engine_shapes(shape, policy: QuantizationPolicy, engine_tp: int) -> None:
    """Refuse up front, naming the tensor, its size and the flags to change, an FP8 tensor that vLLM could not load as
    whole 128x128 blocks at this engine TP size (`shape`: the model's ModelShape). Refusing beats keeping it in BF16
    behind the user's back: an FP8 run would then not be the FP8 run asked for."""
    if policy.precision != "fp8":
        return
    for layer in range(shape.num_layers):
        for module, group, size, what in _fp8_requirements(shape, engine_tp):
            name = f"model.layers.{layer}.{module}.weight"
            if policy.quantizes(name) and size % policy.block_size:
                raise ValueError(
                    f"--rollout-precision fp8: {name} has {size} {what} per engine rank "
                    f"(--rollout-tensor-parallel-size {engine_tp}), not whole {policy.block_size}x{policy.block_size} "
                    f"blocks as vLLM's FP8 layers need; keep it in BF16 with --bridge-fp8-exclude '{group}', use "
                    "--rollout-precision bf16, or an engine TP size that splits it into whole blocks")


def quantize_for_engine(named_tensors: Iterable[tuple[str, torch.Tensor]], policy: QuantizationPolicy
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the engine's tensors: (name, fp8) and (name_scale_inv, fp32) for quantized weights, casts otherwise."""
    for name, tensor in named_tensors:
        if policy.quantizes(name):
            q, scale_inv = blockwise_fp8_quantize(tensor, policy.block_size, policy.pow2_scale, name=name)
            yield name, q
            yield name + SCALE_SUFFIX, scale_inv
        else:
            if not all_finite(tensor):
                raise ValueError(f"{name}: NaN/Inf values; refusing to send a corrupt weight to the engine")
            yield name, tensor.to(policy.dense_dtype)


def engine_quantization_config(policy: QuantizationPolicy, hf_names: Iterable[str]) -> dict | None:
    """Return the config.json `quantization_config` for the engine (None unless FP8).

    Linear layers the policy keeps in BF16 are listed in `ignored_layers`; projections vLLM fuses must agree.
    """
    if policy.precision != "fp8":
        return None
    decisions: dict[str, bool] = {}
    routers = []
    for name in hf_names:
        match = LINEAR_WEIGHT.match(name)
        if match:
            decisions[f"{match['prefix']}.{match['module']}"] = policy.quantizes(name)
        router = ROUTER_WEIGHT.match(name)
        if router:
            routers.append(router["module"])
    for module in decisions:
        prefix = module.split(".mlp.")[0].split(".self_attn.")[0]
        for group in FUSED_GROUPS:
            members = [f"{prefix}.{m}" for m in group if f"{prefix}.{m}" in decisions]
            if len({decisions[m] for m in members}) > 1:
                raise ValueError(f"the FP8 policy splits {members}: vLLM fuses them into one layer, quantize all "
                                 "or none (adjust --bridge-fp8-exclude)")
        experts = {d for m, d in decisions.items() if m.startswith(prefix + ".") and
                   EXPERT.match(m[len(prefix) + 1:])}
        if len(experts) > 1:
            raise ValueError(f"the FP8 policy quantizes some experts of {prefix} and not others: vLLM runs a layer's "
                             "experts as one fused MoE layer (adjust --bridge-fp8-exclude)")
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [policy.block_size, policy.block_size]}
    ignored = set(routers)
    for module, quantized in decisions.items():
        if not quantized:
            # a layer's experts are ignored as the one fused module vLLM builds for them
            ignored.add(module.split(".experts.")[0] + ".experts" if ".mlp.experts." in module else module)
    ignored = sorted(ignored)
    if ignored:
        config["ignored_layers"] = ignored
    return config
