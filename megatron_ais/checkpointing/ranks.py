"""Where a rank sits in a checkpoint (its TP / PP / EP shard, its DP rank, whether it writes its shard and whether it
commits) and the collectives of a save and a load, which are no-ops without torch.distributed."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist
from megatron.core import parallel_state as ps


@dataclasses.dataclass(frozen=True)
class CheckpointRanks:
    """Where this rank sits: its shard directory (TP, PP, EP), its DP rank, whether it writes its shard file (the
    directory's lowest rank: DP rank 0 without expert parallelism, expert-data-parallel rank 0 with it) and whether
    it commits. `from_parallel_state` is collective."""

    tp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    is_committer: bool = True
    ep_rank: int = 0
    ep_size: int = 1
    writes_shard: bool = True

    @classmethod
    def from_parallel_state(cls) -> "CheckpointRanks":
        rank, cp0 = dist.get_rank(), ps.get_context_parallel_rank() == 0
        position = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                    ps.get_expert_model_parallel_rank())
        marks = gather((rank, position, cp0))
        # the lowest rank of each shard directory writes it: expert-data-parallel rank 0 where it holds that TP rank's
        # dense shard, and also the ranks whose TP rank no such rank has (expert-TP x EP < TP)
        writes = cp0 and rank == min(r for r, p, c in marks if p == position and c)
        return cls(position[0], position[1], ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_rank(),
                   rank == 0, position[2], ps.get_expert_model_parallel_world_size(), writes)


def gather(obj, group=None) -> list:
    """Every rank's `obj` of `group` (the world by default), in rank order; [obj] without torch.distributed."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier() -> None:
    """Wait for every rank (nothing to wait for without torch.distributed)."""
    if dist.is_initialized():
        dist.barrier()
