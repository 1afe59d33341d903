"""Where every tensor of a weight sync lives, computed by each rank from its own shards with no communication
but one exchange of stage sizes on the first sync.

A stage's engine tensors (HF names; codes and scales or dense, per the policy: `engine_tensor_specs`) are laid out
back to back, 64-byte aligned, and cut into buckets of at most `bucket_bytes` (a larger tensor is a bucket of its
own; the projections NVFP4 gives one global scale travel in one bucket). Every TP rank of the stage writes its own
pieces of each tensor straight into that layout (`shard_placement`), so no rank gathers a full tensor. An FP8
tensor whose TP pieces start and end on 128-row (or -column) block boundaries is quantized piece by piece by the
rank that holds it; one whose pieces cut through blocks, and every 4-bit tensor (NVFP4's global scale is the whole
fused group's), is first assembled in a scratch area and then quantized whole (`pieces.scratch_share`: in host memory
the stage's writers share the work, on a GPU the stage's sender does it).
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais.bridge.quantization import QuantizationPolicy, engine_tensor_specs, scale_group
from megatron_ais.mapping.hf_io import global_parameters
from megatron_ais.mapping.layouts import Piece, shard_placement
from megatron_ais.mapping.rules import expert_index, rules_for, split_layer
from megatron_ais.model import unwrap_model

ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class EngineTensor:
    """One tensor the engine receives: its place in the stage's layout (offset relative to the stage)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Consecutive engine tensors [first, last) occupying bytes [start, end) of the stage layout; `scratch`
    maps an FP8 tensor's name to its assembly area's offset in the stage's scratch region."""

    first: int
    last: int
    start: int
    end: int
    scratch: tuple[tuple[str, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class HFTarget:
    """One HF tensor of this stage and how this rank contributes to it."""

    name: str
    shape: tuple[int, ...]
    param: torch.Tensor
    pieces: list[Piece]  # this rank's pieces (empty: other ranks write them all)
    quantized: bool
    blockwise_local: bool  # every rank's pieces respect block boundaries: quantize per piece


@dataclasses.dataclass
class StagePlan:
    """This rank's view of its pipeline stage's sync: HF targets, engine tensors, buckets, scratch size."""

    targets: list[HFTarget]
    tensors: list[EngineTensor]
    buckets: list[Bucket]
    scratch_bytes: int
    first_tensors: list[int]  # per target, the index of its first engine tensor

    def bucket_targets(self, bucket: Bucket) -> list[HFTarget]:
        """The targets whose engine tensors lie in `bucket`."""
        return [t for t, first in zip(self.targets, self.first_tensors) if bucket.first <= first < bucket.last]

    @property
    def nbytes(self) -> int:
        return self.buckets[-1].end if self.buckets else 0


def _block_aligned(pieces: list[list[Piece]], full: tuple[int, ...], block: int) -> bool:
    for rank_pieces in pieces:
        for p in rank_pieces:
            end = p.dst_start + p.length
            if p.dst_start % block or (end % block and end != full[p.dim]):
                return False
    return True


@dataclasses.dataclass(frozen=True)
class WriterRole:
    """What this rank writes: its share of the dense tensors, routed experts (expert-data-parallel replica 0), and
    where its experts sit among the expert-parallel ranks.

    Every data-parallel replica holds all dense tensors, so those of the replicas that run where the stage's
    writers already run (`dense_replicas` of them: replica 0, and others on the same node) share the dense writing:
    tensor by tensor, each to the replica with the fewest elements so far (`dense_owners`). `dense_replica` is this
    rank's index among them, None when its replica does not write dense tensors.
    """

    dense_replica: int | None = 0
    dense_replicas: int = 1
    experts: bool = True
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def dense(self) -> bool:
        return self.dense_replica is not None


def dense_owners(sizes: list[int], replicas: int) -> list[int]:
    """Assign tensors of `sizes` (elements, in stage order) to `replicas` writers: each to the least loaded so far
    (ties to the lowest index). The same on every rank, with no communication."""
    loads = [0] * replicas
    owners = []
    for size in sizes:
        owner = loads.index(min(loads))
        loads[owner] += size
        owners.append(owner)
    return owners


def hf_targets(chunks: list, build, ctx, policy: QuantizationPolicy, expert_ctx=None,
               role: WriterRole = WriterRole()) -> list[HFTarget]:
    """Return the HF tensors of this pipeline stage with this rank's pieces of each (routed experts: this
    expert-TP rank's, `expert_ctx`). Under expert parallelism the list holds every rank's experts (the same list on
    every rank, ordered by local expert index, then EP rank); a rank has pieces only of the experts it holds."""
    rules = rules_for(build.shape.model_type)
    num_local = build.shape.num_experts // role.ep_size if build.shape.is_moe else 0
    targets, dense = _stage_targets(chunks, build, ctx, policy, expert_ctx, role, rules, num_local)
    # a dense tensor is written by the TP ranks of its owner replica only
    for index, owner in zip(dense, dense_owners([_numel(targets[i].shape) for i in dense], role.dense_replicas)):
        if owner != role.dense_replica:
            targets[index].pieces = []
    return targets


def _stage_targets(chunks, build, ctx, policy, expert_ctx, role, rules, num_local
                   ) -> tuple[list[HFTarget], list[int]]:
    """hf_targets before the dense tensors are shared out (every data-parallel replica holds its TP pieces of all
    of them); also return the dense targets' indices."""
    targets, dense = [], []
    for chunk in chunks:
        for name, layer, param in global_parameters(unwrap_model(chunk)):
            rule = rules.get(split_layer(name)[1])
            if rule is None:
                raise KeyError(f"Megatron parameter {name!r} has no HF mapping for {build.shape.model_type!r}")
            if build.shape.tie_word_embeddings and rule.megatron == "output_layer.weight":
                continue  # the embedding carries the tied lm_head
            expert = expert_index(name)
            param_ctx = expert_ctx if expert_ctx is not None and expert is not None else ctx
            shapes, pieces = shard_placement(rule.layout, tuple(param.shape), param_ctx)
            # the same local expert on every EP rank: global ids local + r * num_local
            owners = [(expert, True)] if expert is None else [
                (expert % num_local + r * num_local, r == role.ep_rank) for r in range(role.ep_size)]
            for global_expert, held in owners:
                for index, (hf_name, shape) in enumerate(zip(rule.format(layer, global_expert)[1], shapes)):
                    quantized = policy.quantizes(hf_name)
                    per_rank = [[p for p in rank_pieces if p.hf_index == index] for rank_pieces in pieces]
                    writes = held and role.experts if expert is not None else role.dense
                    if expert is None:
                        dense.append(len(targets))
                    local = quantized and policy.precision == "fp8" and _block_aligned(per_rank, shape,
                                                                                        policy.block_size)
                    targets.append(HFTarget(hf_name, shape, param.detach(),
                                            per_rank[param_ctx.tp_rank] if writes else [], quantized, local))
    return targets, dense


def _bucket_units(targets: list[HFTarget], policy: QuantizationPolicy) -> list[int]:
    """How many consecutive targets from each one must share its bucket: a 4-bit `scale_group`'s members (an NVFP4
    fused group), quantized together by one writer (1 elsewhere, 0 inside a group)."""
    units = [1] * len(targets)
    index = {t.name: i for i, t in enumerate(targets)}
    for i, target in enumerate(targets):
        group = scale_group(target.name, policy)
        if target.quantized and len(group) > 1 and group[0] == target.name:
            members = [index.get(name) for name in group]
            if members != list(range(i, i + len(group))):
                raise ValueError(f"NVFP4: the fused projections {group} are not consecutive in the stage's tensors")
            units[i:i + len(group)] = [len(group)] + [0] * (len(group) - 1)
    return units


def plan_stage(targets: list[HFTarget], policy: QuantizationPolicy, bucket_bytes: int) -> StagePlan:
    """Lay out the engine tensors of `targets` and cut them into buckets."""
    tensors: list[EngineTensor] = []
    buckets: list[Bucket] = []
    offset = first = start = 0
    scratch: list[tuple[str, int]] = []
    scratch_used = scratch_max = 0
    first_tensors: list[int] = []

    def close():
        nonlocal first, start, scratch, scratch_used
        if len(tensors) > first:
            buckets.append(Bucket(first, len(tensors), start, offset, tuple(scratch)))
        first, start, scratch, scratch_used = len(tensors), offset, [], 0

    specs = [[(name, dtype, tuple(shape), _numel(shape) * getattr(torch, dtype).itemsize)
              for name, dtype, shape in engine_tensor_specs(t.name, t.shape, policy)] for t in targets]
    for index, (target, unit) in enumerate(zip(targets, _bucket_units(targets, policy))):
        # a weight and its scales travel in one bucket, and so do the targets of a unit
        together = sum(_aligned(spec[3]) for target_specs in specs[index:index + unit] for spec in target_specs)
        if unit and offset > start and offset + together - start > bucket_bytes:
            close()
        first_tensors.append(len(tensors))
        for name, dtype, shape, size in specs[index]:
            tensors.append(EngineTensor(name, dtype, shape, offset, size))
            offset = _aligned(offset + size)
        if target.quantized and not target.blockwise_local:
            scratch.append((target.name, scratch_used))
            scratch_used = _aligned(scratch_used + target.param.element_size() * _numel(target.shape))
            scratch_max = max(scratch_max, scratch_used)
    close()
    return StagePlan(targets, tensors, buckets, scratch_max, first_tensors)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
