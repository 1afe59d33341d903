"""Read Hugging Face safetensors into Megatron shards and turn Megatron shards back into HF tensors.

Both directions go through `rules.py` (names) and `layouts.py` (TP layout); nothing here knows an architecture.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ais.mapping.layouts import ShardContext
from megatron_ais.mapping.rules import canonical_name, expert_index, hf_sources, rules_for, split_layer

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
        if file not in self._handles:
            self._handles[file] = self._safe_open(os.path.join(self.hf_dir, file), framework="pt")
        return self._handles[file].get_tensor(name)


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
