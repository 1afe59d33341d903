"""One declarative Megatron <-> Hugging Face mapping per architecture, used in both directions.

A rule names a Megatron parameter (local-spec name, `{layer}` = global layer index), the HF tensors it is made
of, and its TP layout. Transformer Engine's fused-norm names and its grouped experts' names are aliases of the local
names. Adding an
architecture is adding one entry to `ARCHITECTURES`.
"""
from __future__ import annotations

import dataclasses
import re

from megatron_ais.mapping import layouts as L
from megatron_ais.registry import Registry


@dataclasses.dataclass(frozen=True)
class MappingRule:
    """Megatron parameter `megatron` is built from HF tensors `hf` with layout `layout`."""

    megatron: str
    hf: tuple[str, ...]
    layout: L.Layout

    def format(self, layer: int | None, expert: int | None = None) -> tuple[str, tuple[str, ...]]:
        """Return the concrete (megatron name, HF names) for a global layer (and global expert) index."""
        if layer is None:
            return self.megatron, self.hf
        return (self.megatron.format(layer=layer, expert=expert),
                tuple(h.format(layer=layer, expert=expert) for h in self.hf))


_ATTN = "model.layers.{layer}.self_attn"
_MLP = "model.layers.{layer}.mlp"
_LAYER = "decoder.layers.{layer}"

_DENSE_RULES = (
    MappingRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), L.VOCAB_PARALLEL),
    MappingRule(f"{_LAYER}.input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",), L.REPLICATED),
    MappingRule(f"{_LAYER}.self_attention.linear_qkv.weight",
                (f"{_ATTN}.q_proj.weight", f"{_ATTN}.k_proj.weight", f"{_ATTN}.v_proj.weight"), L.FUSED_QKV),
    MappingRule(f"{_LAYER}.self_attention.linear_proj.weight", (f"{_ATTN}.o_proj.weight",), L.ROW_PARALLEL),
    MappingRule(f"{_LAYER}.pre_mlp_layernorm.weight",
                ("model.layers.{layer}.post_attention_layernorm.weight",), L.REPLICATED),
    MappingRule(f"{_LAYER}.mlp.linear_fc1.weight", (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"),
                L.GATED_FC1),
    MappingRule(f"{_LAYER}.mlp.linear_fc2.weight", (f"{_MLP}.down_proj.weight",), L.ROW_PARALLEL),
    MappingRule("decoder.final_layernorm.weight", ("model.norm.weight",), L.REPLICATED),
    MappingRule("output_layer.weight", ("lm_head.weight",), L.VOCAB_PARALLEL),
)

_QKV_BIAS_RULES = (
    MappingRule(f"{_LAYER}.self_attention.linear_qkv.bias",
                (f"{_ATTN}.q_proj.bias", f"{_ATTN}.k_proj.bias", f"{_ATTN}.v_proj.bias"), L.FUSED_QKV),
)

_QK_NORM_RULES = (
    MappingRule(f"{_LAYER}.self_attention.q_layernorm.weight", (f"{_ATTN}.q_norm.weight",), L.REPLICATED),
    MappingRule(f"{_LAYER}.self_attention.k_layernorm.weight", (f"{_ATTN}.k_norm.weight",), L.REPLICATED),
)

_EXPERT = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}"
_HF_EXPERT = "model.layers.{layer}.mlp.experts.{expert}"
# MoE layers: the router is replicated over TP; experts are numbered globally in the rule (the local index of an
# expert-parallel rank's `local_experts` is translated by `global_parameters`) and split over expert-TP.
_MOE_RULES = (
    MappingRule(f"{_LAYER}.mlp.router.weight", ("model.layers.{layer}.mlp.gate.weight",), L.REPLICATED),
    MappingRule(f"{_EXPERT}.linear_fc1.weight", (f"{_HF_EXPERT}.gate_proj.weight", f"{_HF_EXPERT}.up_proj.weight"),
                L.GATED_FC1),
    MappingRule(f"{_EXPERT}.linear_fc2.weight", (f"{_HF_EXPERT}.down_proj.weight",), L.ROW_PARALLEL),
)
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")

ARCHITECTURES: Registry = Registry("architecture", {
    "llama": _DENSE_RULES,
    "qwen2": _DENSE_RULES + _QKV_BIAS_RULES,
    "qwen3": _DENSE_RULES + _QK_NORM_RULES,
    "qwen3_moe": tuple(r for r in _DENSE_RULES if not r.megatron.endswith(_DENSE_MLP)) + _QK_NORM_RULES + _MOE_RULES,
})

# Transformer Engine's spec fuses the pre-attention / pre-MLP norms into the following linear layer.
TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

# TE's grouped experts (TEGroupedMLP: the TE spec's experts, moe_grouped_gemm) hold local expert i's
# weights as `linear_fc1.weight{i}` / `linear_fc2.weight{i}` of one TEGroupedLinear each, shaped as SequentialMLP's
# `local_experts.{i}.linear_fc1.weight` (megatron-core extensions/transformer_engine.py, TEGroupedLinear)
_TE_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_NAME = re.compile(r"\.local_experts\.(\d+)\.")
ROUTED_EXPERT_HF = re.compile(r"\.mlp\.experts\.\d+\.")


def canonical_name(name: str) -> str:
    """Return the local-spec name for a Megatron parameter name from either spec."""
    name = _TE_GROUPED_EXPERT.sub(r".mlp.experts.local_experts.\2.\1.weight", name)
    for te_name, local in TE_ALIASES.items():
        if name.endswith(te_name):
            return name[: -len(te_name)] + local
    return name


def split_layer(name: str) -> tuple[int | None, str]:
    """Return (layer index, name with `{layer}`, and `{expert}` for an expert) for `decoder.layers.N.*`, or
    (None, name) otherwise."""
    m = _LAYER_NAME.match(name)
    if m is None:
        return None, name
    return int(m.group(1)), "decoder.layers.{layer}." + _EXPERT_NAME.sub(".local_experts.{expert}.", m.group(2))


def expert_index(name: str) -> int | None:
    """Return the expert index in a Megatron expert parameter's name, None for other parameters."""
    m = _EXPERT_NAME.search(name)
    return int(m.group(1)) if m else None


def is_expert_parameter(name: str) -> bool:
    """True for the parameters of routed experts (split over expert-TP and expert-parallel ranks)."""
    return expert_index(name) is not None


def with_layer(name: str, layer: int) -> str:
    """Return `name` with its decoder layer index replaced."""
    return _LAYER_NAME.sub(lambda m: f"decoder.layers.{layer}.{m.group(2)}", name)


def rules_for(model_type: str) -> dict[str, MappingRule]:
    """Return the architecture's rules keyed by Megatron name template."""
    if model_type not in ARCHITECTURES:
        raise KeyError(f"no Megatron<->HF mapping for model_type {model_type!r}; known: {sorted(ARCHITECTURES)}")
    return {r.megatron: r for r in ARCHITECTURES[model_type]}


def megatron_param_names(model_type: str, layers: range, first_stage: bool, last_stage: bool,
                         tie_word_embeddings: bool, experts: range = range(0)) -> list[str]:
    """Return the local-spec parameter names of one pipeline stage holding `layers` (global indices) and, in MoE
    layers, `experts` (the indices of the rank's `local_experts`)."""
    names = []
    rules = ARCHITECTURES[model_type]
    if first_stage:
        names.append("embedding.word_embeddings.weight")
    for layer in layers:
        names += [r.megatron.format(layer=layer, expert=e) for r in rules if r.megatron.startswith("decoder.layers.")
                  for e in (experts if "{expert}" in r.megatron else [None])]
    if last_stage:
        names.append("decoder.final_layernorm.weight")
        # megatron keeps a synchronised copy of the tied embedding on the last stage when PP > 1
        if not tie_word_embeddings or not first_stage:
            names.append("output_layer.weight")
    return names


def hf_sources(rule: MappingRule, layer: int | None, tie_word_embeddings: bool, expert: int | None = None
               ) -> tuple[str, ...]:
    """Return the HF tensor names to read for a rule; a tied output layer reads the embedding."""
    _, hf = rule.format(layer, expert)
    if tie_word_embeddings and rule.megatron == "output_layer.weight":
        return ("model.embed_tokens.weight",)
    return hf
