"""Which HF tensors the rollout engine receives quantized, in which layout, and the engine's quantization_config.

Attention and MLP linear weights become, by precision:
- fp8: blockwise FP8 + `<name>_scale_inv` (vLLM's blockwise FP8 checkpoint names, as in DeepSeek-V3 / Qwen3-FP8);
- nvfp4: ModelOpt's W4A16 NVFP4 (`<module>.weight` packed e2m1, `.weight_scale` e4m3 per 16, `.weight_scale_2` fp32),
  the projections vLLM fuses into one layer sharing one global scale (vLLM keeps one per fused layer);
- mxfp4: compressed-tensors' mxfp4-pack-quantized (`<module>.weight_packed`, `.weight_scale` e8m0 per 32).
Embeddings, lm_head, norms, biases and MoE routers stay BF16. Patterns are configurable.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch

from kernels.fp4.format import MXFP4_BLOCK, NVFP4_BLOCK
from kernels.fp4.quantize import mxfp4_quantize, nvfp4_global_scale, nvfp4_quantize
from kernels.fp8.dispatch import blockwise_fp8_quantize
from kernels.fp8.format import scale_shape
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
FOUR_BIT_BLOCKS = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}
QUANTIZED_PRECISIONS = ("fp8", *FOUR_BIT_BLOCKS)


@dataclasses.dataclass(frozen=True)
class QuantizationPolicy(FlagConfig):
    """precisions 'fp8', 'nvfp4' and 'mxfp4' quantize names matching an include pattern and no exclude pattern;
    'bf16'/'fp32' cast."""

    precision: str = "fp8"
    include: tuple[str, ...] = DEFAULT_FP8_INCLUDE
    exclude: tuple[str, ...] = flag((), "HF tensor-name patterns to keep in BF16 under FP8 or 4-bit rollouts (q/k/v "
                                        "and gate/up together).", name="--bridge-fp8-exclude", metavar="REGEX",
                                    type=str)
    block_size: int = 128
    pow2_scale: bool = False

    def quantizes(self, name: str) -> bool:
        """Return True when the tensor `name` is sent quantized (codes + scales)."""
        if self.precision not in QUANTIZED_PRECISIONS or LINEAR_WEIGHT.match(name) is None:
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


def _four_bit_requirements(shape, engine_tp: int) -> list[tuple[str, str, int, str]]:
    """What vLLM's 4-bit layers need whole 1 x block groups of, per engine rank at TP `engine_tp`: every projection's
    input columns (row-parallel ones split by TP), MoE experts' too."""
    heads = shape.num_attention_heads * shape.head_dim // engine_tp
    attention = [("self_attn.q_proj", r"self_attn\.[qkv]_proj", shape.hidden_size, "input columns"),
                 ("self_attn.o_proj", r"self_attn\.o_proj", heads, "input columns")]
    if shape.is_moe:  # every expert alike: expert 0 stands for them
        return attention + [("mlp.experts.0.gate_proj", r"mlp\.experts\.", shape.hidden_size, "input columns"),
                            ("mlp.experts.0.down_proj", r"mlp\.experts\.", shape.moe_ffn_hidden_size // engine_tp,
                             "input columns")]
    ffn = shape.ffn_hidden_size // engine_tp
    return attention + [("mlp.gate_proj", r"mlp\.(gate|up)_proj", shape.hidden_size, "input columns"),
                        ("mlp.down_proj", r"mlp\.down_proj", ffn, "input columns")]


def check_engine_shapes(shape, policy: QuantizationPolicy, engine_tp: int, export: bool = False) -> None:
    """Refuse up front, naming the tensor, its size and the flags to change, a quantized tensor that vLLM could not
    load as whole blocks at this engine TP size (`shape`: the model's ModelShape): 128x128 for FP8, 1x16 (NVFP4) or
    1x32 (MXFP4) groups of input columns for 4-bit. Refusing beats keeping it in BF16 behind the user's back: an FP8
    run would then not be the FP8 run asked for. `export`: the HF export's check (its flag is --precision, whole
    tensors)."""
    if policy.precision not in QUANTIZED_PRECISIONS:
        return
    block = FOUR_BIT_BLOCKS.get(policy.precision, policy.block_size)
    blocks = f"{policy.block_size}x{policy.block_size} blocks" if policy.precision == "fp8" else f"1x{block} groups"
    needs = _fp8_requirements if policy.precision == "fp8" else _four_bit_requirements
    for layer in range(shape.num_layers):
        for module, group, size, what in needs(shape, engine_tp):
            name = f"model.layers.{layer}.{module}.weight"
            if not policy.quantizes(name) or size % block == 0:
                continue
            if export:
                raise ValueError(f"--precision {policy.precision}: {name} has {size} {what}, not whole {blocks} as "
                                 f"vLLM's {policy.precision.upper()} layers need; export it with --precision bf16")
            raise ValueError(
                f"--rollout-precision {policy.precision}: {name} has {size} {what} per engine rank "
                f"(--rollout-tensor-parallel-size {engine_tp}), not whole {blocks} as vLLM's "
                f"{policy.precision.upper()} layers need; keep it in BF16 with --bridge-fp8-exclude '{group}', "
                "use --rollout-precision bf16, or an engine TP size that splits it into whole blocks")


def fused_group(name: str) -> tuple[str, ...]:
    """The HF weights vLLM fuses with linear weight `name` into one layer (itself included): q/k/v, gate/up (of the
    dense MLP or of one expert), or `name` alone."""
    match = LINEAR_WEIGHT.match(name)
    if match is None:
        return (name,)
    head, _, last = match["module"].rpartition(".")
    for group in FUSED_GROUPS:
        lasts = tuple(member.rpartition(".")[2] for member in group)
        if last in lasts:
            return tuple(f"{match['prefix']}.{head}.{member}.weight" for member in lasts)
    return (name,)


def engine_tensor_specs(name: str, shape: tuple[int, ...], policy: QuantizationPolicy
                        ) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of each engine tensor HF weight `name` of `shape` becomes under `policy`, in the order
    `quantize_for_engine` yields them."""
    if not policy.quantizes(name):
        return [(name, str(policy.dense_dtype).removeprefix("torch."), tuple(shape))]
    if policy.precision == "fp8":
        return [(name, "float8_e4m3fn", tuple(shape)),
                (name + SCALE_SUFFIX, "float32", scale_shape(tuple(shape), policy.block_size))]
    rows, cols = shape
    module = name.removesuffix(".weight")
    if policy.precision == "nvfp4":
        return [(name, "uint8", (rows, cols // 2)),
                (module + ".weight_scale", "float8_e4m3fn", (rows, cols // NVFP4_BLOCK)),
                (module + ".weight_scale_2", "float32", ())]
    return [(module + ".weight_packed", "uint8", (rows, cols // 2)), (module + ".weight_scale", "uint8",
                                                                        (rows, cols // MXFP4_BLOCK))]


def scale_group(name: str, policy: QuantizationPolicy) -> tuple[str, ...]:
    """The weights quantized together with 4-bit weight `name`: under NVFP4 its fused group (one global scale for
    the layer vLLM fuses), under MXFP4 itself alone."""
    return fused_group(name) if policy.precision == "nvfp4" else (name,)


def four_bit_tensors(members: list[tuple[str, torch.Tensor]], policy: QuantizationPolicy
                     ) -> list[tuple[str, torch.Tensor]]:
    """The engine's tensors of a `scale_group`'s 4-bit weights `<module>.weight`, in order (`engine_tensor_specs`'
    names); NVFP4 with the global scale of them all."""
    shared = nvfp4_global_scale(*(weight for _, weight in members)) if policy.precision == "nvfp4" else None
    out = []
    for name, weight in members:
        values = nvfp4_quantize(weight, name, shared) if shared is not None else mxfp4_quantize(weight, name)
        out += [(spec[0], value) for spec, value in zip(engine_tensor_specs(name, tuple(weight.shape), policy), values)]
    return out


def quantize_for_engine(named_tensors: Iterable[tuple[str, torch.Tensor]], policy: QuantizationPolicy
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the engine's tensors (`engine_tensor_specs`): codes and scales for quantized weights, casts otherwise.
    4-bit weights wait for the rest of their `scale_group` (NVFP4: a fused group's global scale)."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if not policy.quantizes(name):
            if not all_finite(tensor):
                raise ValueError(f"{name}: NaN/Inf values; refusing to send a corrupt weight to the engine")
            yield name, tensor.to(policy.dense_dtype)
        elif policy.precision == "fp8":
            q, scale_inv = blockwise_fp8_quantize(tensor, policy.block_size, policy.pow2_scale, name=name)
            yield name, q
            yield name + SCALE_SUFFIX, scale_inv
        else:
            waiting[name] = tensor
            group = scale_group(name, policy)
            if all(member in waiting for member in group):
                yield from four_bit_tensors([(member, waiting.pop(member)) for member in group], policy)
    if waiting:
        raise ValueError(f"NVFP4: {sorted(waiting)} came without the rest of their fused group "
                         f"{fused_group(next(iter(waiting)))}, whose global scale they share")


def _modules_kept_unquantized(policy: QuantizationPolicy, hf_names: Iterable[str]) -> list[str]:
    """The linear modules the engine runs unquantized: those the policy keeps in BF16 (a layer's experts as the one
    fused module vLLM builds for them) and the MoE routers; refuse a policy that splits what vLLM fuses."""
    decisions: dict[str, bool] = {}
    routers = []
    for name in hf_names:
        match = LINEAR_WEIGHT.match(name)
        if match:
            decisions[f"{match['prefix']}.{match['module']}"] = policy.quantizes(name)
        router = ROUTER_WEIGHT.match(name)
        if router:
            routers.append(router["module"])
    what = f"the {policy.precision.upper()} policy"
    for module in decisions:
        prefix = module.split(".mlp.")[0].split(".self_attn.")[0]
        for group in FUSED_GROUPS:
            members = [f"{prefix}.{m}" for m in group if f"{prefix}.{m}" in decisions]
            if len({decisions[m] for m in members}) > 1:
                raise ValueError(f"{what} splits {members}: vLLM fuses them into one layer, quantize all "
                                 "or none (adjust --bridge-fp8-exclude)")
        experts = {d for m, d in decisions.items() if m.startswith(prefix + ".") and
                   EXPERT.match(m[len(prefix) + 1:])}
        if len(experts) > 1:
            raise ValueError(f"{what} quantizes some experts of {prefix} and not others: vLLM runs a layer's "
                             "experts as one fused MoE layer (adjust --bridge-fp8-exclude)")
    kept = set(routers)
    for module, quantized in decisions.items():
        if not quantized:
            kept.add(module.split(".experts.")[0] + ".experts" if ".mlp.experts." in module else module)
    return sorted(kept)


def engine_quantization_config(policy: QuantizationPolicy, hf_names: Iterable[str]) -> dict | None:
    """Return the config.json `quantization_config` vLLM loads the engine's weights by (None for bf16/fp32): fp8
    blockwise; ModelOpt's W4A16_NVFP4 (vLLM's `modelopt_fp4`: Marlin FP4 on GPU); compressed-tensors'
    mxfp4-pack-quantized, weight only (Marlin MXFP4 on GPU). Linear layers kept in BF16 (`_modules_kept_unquantized`)
    and the lm_head are listed as ignored."""
    if policy.precision not in QUANTIZED_PRECISIONS:
        return None
    kept = _modules_kept_unquantized(policy, hf_names)
    if policy.precision == "nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": NVFP4_BLOCK,
                "ignore": ["lm_head", *kept]}
    if policy.precision == "mxfp4":
        weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_BLOCK, "symmetric": True,
                   "dynamic": False}
        # compressed-tensors matches a fused MoE layer's ignore entry against its experts' own names
        # (`...experts.0.gate_proj`), exactly or as a `re:` pattern
        kept = [f"re:^{re.escape(m)}\\." if m.endswith(".mlp.experts") else m for m in kept]
        return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "ignore": ["lm_head", *kept],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": weights}}}
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [policy.block_size, policy.block_size]}
    if kept:
        config["ignored_layers"] = kept
    return config
