"""Read Hugging Face safetensors into Megatron shards and turn Megatron shards back into HF tensors.

Both directions go through `rules.py` (names) and `layouts.py` (TP layout); nothing here knows an architecture.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_ais.errors import CheckpointError
from megatron_ais.mapping.layouts import ShardContext
from megatron_ais.mapping.rules import (ROUTED_EXPERT_HF, canonical_name, expert_index, hf_sources, rules_for,
                                       split_layer)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class HFCheckpointReader:
    """Lazy reader of a HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, hf_dir: str):
        self._safe_open = safe_open
        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, SAFETENSORS_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(hf_dir, SAFETENSORS_SINGLE)):
            with safe_open(os.path.join(hf_dir, SAFETENSORS_SINGLE), framework="pt") as f:
                self.weight_map = {k: SAFETENSORS_SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(f"{hf_dir} holds neither {SAFETENSORS_SINGLE} nor {SAFETENSORS_INDEX}")
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        """Return every tensor name in the checkpoint."""
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        """Return one tensor, reading only its file entry."""
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the HF checkpoint {self.hf_dir}")
        file = self.weight_map[name]
        try:
            if file not in self._handles:
                self._handles[file] = self._safe_open(os.path.join(self.hf_dir, file), framework="pt")
            return self._handles[file].get_tensor(name)
        except (SafetensorError, OSError) as err:  # a truncated or missing file: name it, not a traceback
            raise CheckpointError(f"the HF checkpoint {self.hf_dir}: cannot read {name} from {file} ({err})") from err


def expected_hf_shape(name: str, shape) -> tuple[int, ...]:
    """The shape a HF tensor of a model of `shape` (model.ModelShape) must have, from its name."""
    h, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    ffn = shape.moe_ffn_hidden_size if ROUTED_EXPERT_HF.search(name) else shape.ffn_hidden_size
    by_suffix = (("embed_tokens.weight", (shape.vocab_size, h)), ("lm_head.weight", (shape.vocab_size, h)),
                 ("q_proj.weight", (q, h)), ("k_proj.weight", (kv, h)), ("v_proj.weight", (kv, h)),
                 ("q_proj.bias", (q,)), ("k_proj.bias", (kv,)), ("v_proj.bias", (kv,)), ("o_proj.weight", (h, q)),
                 ("gate_proj.weight", (ffn, h)), ("up_proj.weight", (ffn, h)), ("down_proj.weight", (h, ffn)),
                 ("mlp.gate.weight", (shape.num_experts, h)), ("q_norm.weight", (hd,)), ("k_norm.weight", (hd,)),
                 ("norm.weight", (h,)))
    return next(expected for suffix, expected in by_suffix if name.endswith(suffix))


def checked_reader(reader: HFCheckpointReader, shape) -> Callable[[str], torch.Tensor]:
    """`reader.get` that refuses a tensor whose shape is not the config's, that is not a float tensor of
    unquantized weights (an FP8 code read as a weight is its code), or that holds NaN/Inf: CheckpointError."""
    def get(name: str) -> torch.Tensor:
        tensor = reader.get(name)
        where = f"the HF checkpoint {reader.hf_dir}: {name}"
        expected = expected_hf_shape(name, shape)
        if tuple(tensor.shape) != expected:
            raise CheckpointError(f"{where} has shape {tuple(tensor.shape)}, its config.json gives {expected}")
        if not tensor.is_floating_point() or tensor.element_size() < 2:
            raise CheckpointError(f"{where} is {tensor.dtype}, not unquantized (BF16/FP16/FP32) weights")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"{where} holds NaN/Inf")
        return tensor
    return get


def megatron_shard_from_hf(name: str, layer: int | None, model_type: str, ctx: ShardContext,
                           read: Callable[[str], torch.Tensor], tie_word_embeddings: bool) -> torch.Tensor:
    """Return the TP shard of Megatron parameter `name` (canonical, global layer index) built from HF tensors."""
    _, template = split_layer(name)
    rule = rules_for(model_type).get(template)
    if rule is None:
        raise KeyError(f"Megatron parameter {name!r} has no HF mapping for model_type {model_type!r}")
    return rule.layout.shard([read(h) for h in hf_sources(rule, layer, tie_word_embeddings, expert_index(name))],
                             ctx)


def hf_tensors_from_shards(name: str, layer: int | None, model_type: str, ctx: ShardContext,
                           shards: list[torch.Tensor], tie_word_embeddings: bool
                           ) -> list[tuple[str, torch.Tensor]]:
    """Return (HF name, full tensor) pairs for Megatron parameter `name` from its TP shards in rank order.

    A tied output layer returns nothing: the embedding already carries it.
    """
    _, template = split_layer(name)
    rule = rules_for(model_type).get(template)
    if rule is None:
        raise KeyError(f"Megatron parameter {name!r} has no HF mapping for model_type {model_type!r}")
    if tie_word_embeddings and rule.megatron == "output_layer.weight":
        return []
    _, hf_names = rule.format(layer, expert_index(name))
    return list(zip(hf_names, rule.layout.merge(shards, ctx)))


def global_parameters(gpt_model) -> Iterator[tuple[str, int | None, torch.nn.Parameter]]:
    """Yield (canonical name with global layer and expert indices, global layer or None, parameter) of one
    GPTModel chunk."""
    for name, param in gpt_model.named_parameters():
        name = canonical_name(name)
        local_layer, template = split_layer(name)
        if local_layer is None:
            yield name, None, param
            continue
        # layer_number is megatron's 1-based global index; it accounts for PP stages and virtual chunks
        module = gpt_model.decoder.layers[local_layer]
        layer = module.layer_number - 1
        local_expert = expert_index(name)
        # an expert-parallel rank holds experts local_expert_indices (global ids) as local_experts.0, 1, ...
        expert = None if local_expert is None else module.mlp.local_expert_indices[local_expert]
        yield template.format(layer=layer, expert=expert), layer, param


class ShardedSafetensorsWriter:
    """A HF model's weights written tensor by tensor into safetensors shards of at most `max_shard_bytes` (a larger
    tensor is a shard of its own): a shard is written as soon as the next tensor would overflow it, so no more than
    one shard is held in memory. `close` names the shards model-0000i-of-0000N.safetensors."""

    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.total_bytes = 0
        self.parts: list[list[str]] = []
        os.makedirs(out_dir, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _part(self, index: int) -> str:
        return os.path.join(self.out_dir, f"model-part-{index + 1:05d}.safetensors.tmp")

    def _flush(self) -> None:
        save_file(self.pending, self._part(len(self.parts)), metadata={"format": "pt"})
        self.parts.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Write the last shard, give every shard its final name; return the weight map (tensor -> file)."""
        if self.pending:
            self._flush()
        weight_map = {}
        for index, names in enumerate(self.parts):
            file = f"model-{index + 1:05d}-of-{len(self.parts):05d}.safetensors"
            os.replace(self._part(index), os.path.join(self.out_dir, file))
            weight_map.update({name: file for name in names})
        return weight_map
