"""Load HF weights into a live, sharded GPTModel and export it back, at any TP x PP (x VPP)."""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ais.hf_assets import copy_hf_assets
from megatron_ais.mapping.hf_io import (HFCheckpointReader, checked_reader, global_parameters,
                                        hf_tensors_from_shards, megatron_shard_from_hf)
from megatron_ais.mapping.layouts import Replicated, ShardContext
from megatron_ais.mapping.rules import ROUTED_EXPERT_HF, is_expert_parameter, rules_for, split_layer
from megatron_ais.model import ModelBuildConfig, unwrap_model


def shard_context(build: ModelBuildConfig, tp_rank: int, expert: bool = False) -> ShardContext:
    """Return the layout context of one TP rank for a model build (of one expert-TP rank with `expert`)."""
    s = build.shape
    return ShardContext(tp_size=build.layout.expert_tensor_size if expert else build.layout.tensor, tp_rank=tp_rank,
                        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
                        head_dim=s.head_dim, vocab_size=s.vocab_size, padded_vocab_size=build.padded_vocab_size)


def expert_tensor_parallel_rank(build: ModelBuildConfig) -> int:
    """This rank's expert-TP rank (0 for dense models)."""
    if not build.shape.is_moe:
        return 0
    return ps.get_expert_tensor_parallel_rank()


@torch.no_grad()
def load_hf_weights(chunks: list, hf_dir: str, build: ModelBuildConfig, tp_rank: int,
                    expert_tp_rank: int | None = None) -> int:
    """Copy HF safetensors into this rank's model chunks, reading only the tensors they hold; return the count.

    Routed experts are split by the expert-TP rank (from megatron's parallel state unless given)."""
    read = checked_reader(HFCheckpointReader(hf_dir), build.shape)
    if expert_tp_rank is None:
        expert_tp_rank = expert_tensor_parallel_rank(build)
    contexts = {False: shard_context(build, tp_rank), True: shard_context(build, expert_tp_rank, expert=True)}
    loaded = 0
    for chunk in chunks:
        for name, layer, param in global_parameters(unwrap_model(chunk)):
            ctx = contexts[is_expert_parameter(name)]
            shard = megatron_shard_from_hf(name, layer, build.shape.model_type, ctx, read,
                                           build.shape.tie_word_embeddings)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: HF tensors give a shard of shape {tuple(shard.shape)}, the model expects "
                                 f"{tuple(param.shape)} (TP rank {ctx.tp_rank} of {ctx.tp_size})")
            param.copy_(shard)
            loaded += 1
    return loaded


def gather_tp_shards(tensor: torch.Tensor, group, to_first_rank: bool = False) -> list[torch.Tensor] | None:
    """Return every TP rank's copy of `tensor` in rank order: on all ranks (all-gather), or with
    `to_first_rank` only on TP rank 0 (gather; None elsewhere), which halves the traffic at TP2."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return [tensor]
    if not to_first_rank:
        shards = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(shards, tensor.contiguous(), group=group)
        return shards
    first = dist.get_global_rank(group, 0)
    shards = [torch.empty_like(tensor) for _ in range(size)] if dist.get_rank() == first else None
    dist.gather(tensor.contiguous(), shards, dst=first, group=group)
    return shards


@torch.no_grad()
def export_hf_weights(chunks: list, build: ModelBuildConfig, tp_group, to_first_rank: bool = False,
                      expert_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the layers of this pipeline stage; every TP rank must iterate together.

    With `to_first_rank`, only TP rank 0 receives (and yields) the tensors; the other ranks yield nothing. Routed
    experts are gathered over `expert_group` (the expert-TP group; the TP group when it is None) and each rank
    yields only the experts its expert-parallel rank holds.
    """
    if expert_group is None:
        expert_group = tp_group
    groups = {False: tp_group, True: expert_group}
    contexts = {expert: shard_context(build, dist.get_rank(group) if group is not None else 0, expert)
                for expert, group in groups.items()}
    rules = rules_for(build.shape.model_type)
    for chunk in chunks:
        for name, layer, param in global_parameters(unwrap_model(chunk)):
            expert = is_expert_parameter(name)
            group, ctx = groups[expert], contexts[expert]
            rule = rules.get(split_layer(name)[1])
            # replicated tensors (norms, router) are identical on every TP rank: no gather needed
            replicated = rule is not None and isinstance(rule.layout, Replicated)
            shards = [param.detach()] if replicated else gather_tp_shards(param.detach(), group, to_first_rank)
            if shards is None or (replicated and to_first_rank and ctx.tp_rank != 0):
                continue
            yield from hf_tensors_from_shards(name, layer, build.shape.model_type, ctx, shards,
                                              build.shape.tie_word_embeddings)


def stage_file_name(pp_rank: int, pp_size: int, ep_rank: int = 0) -> str:
    """Return the safetensors file name one pipeline stage writes (the experts of expert-parallel rank > 0 go
    to a file of their own)."""
    return f"model-{pp_rank + 1:05d}-of-{pp_size:05d}" + (f"-ep{ep_rank:03d}" if ep_rank else "") + ".safetensors"


def _expert_export_role(build: ModelBuildConfig) -> tuple[object, bool, int]:
    """(expert-TP group, whether this rank writes its EP rank's experts, EP rank) from megatron's state."""
    if not build.shape.is_moe:
        return None, False, 0
    writes = (ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
              and ps.get_context_parallel_rank() == 0)
    return ps.get_expert_tensor_parallel_group(), writes, ps.get_expert_model_parallel_rank()


def save_hf_checkpoint(chunks: list, build: ModelBuildConfig, hf_config: dict, out_dir: str, tp_group, pp_group,
                       is_stage_writer: bool, dtype: torch.dtype | None = None,
                       assets_from: str | None = None) -> None:
    """Write a HF checkpoint: each pipeline stage writes its own file (no stage ships the model to rank 0), and
    under expert parallelism each EP rank writes its own experts (no rank gathers all experts).

    `is_stage_writer` is True on exactly one rank per pipeline stage (TP rank 0, DP rank 0). The first stage's
    writer also writes the index and config.json after the stage files exist, and copies the tokenizer files
    from `assets_from`. Every rank takes part.
    """
    pp_rank = dist.get_rank(pp_group) if pp_group is not None else 0
    pp_size = dist.get_world_size(pp_group) if pp_group is not None else 1
    expert_group, writes_experts, ep_rank = _expert_export_role(build)
    if build.layout.expert == 1:
        writes_experts = writes_experts and is_stage_writer
    tensors = {}
    # writers are rank 0 of their TP / expert-TP group: gather there, not to every rank
    for hf_name, tensor in export_hf_weights(chunks, build, tp_group, to_first_rank=True, expert_group=expert_group):
        if writes_experts if ROUTED_EXPERT_HF.search(hf_name) else is_stage_writer:
            tensors[hf_name] = (tensor.to(dtype) if dtype is not None else tensor).contiguous()
    file = stage_file_name(pp_rank, pp_size, 0 if is_stage_writer else ep_rank)
    if tensors:
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (file, sorted(tensors)))
    else:
        gathered = [(file, sorted(tensors))]
    if is_stage_writer and pp_rank == 0:
        weight_map = {n: f for f, names in gathered for n in names}
        write_hf_index_and_config(out_dir, weight_map, hf_config, assets_from)


def write_hf_index_and_config(out_dir: str, weight_map: dict[str, str], hf_config: dict,
                              assets_from: str | None = None, total_size: int | None = None) -> None:
    """Write model.safetensors.index.json and config.json for a set of safetensors files (and the tokenizer files
    of `assets_from`), completing a HF model directory; `total_size`: the weights' bytes (else read from the files)."""
    total = total_size or 0
    for file in sorted(set(weight_map.values())) if total_size is None else ():
        with safe_open(os.path.join(out_dir, file), framework="pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}.get(t.get_dtype(), 4)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if assets_from:
        copy_hf_assets(assets_from, out_dir)
