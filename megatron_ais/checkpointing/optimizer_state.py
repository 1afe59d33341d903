"""Optimizer and RNG state: what a save takes from a rank (Python, NumPy, torch and CUDA random states; the
distributed optimizer's per-DP-rank shard) and what a resume restores (optimizer state, shard, this DP rank's RNG),
refusing an optimizer layout the checkpoint cannot resume into."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_ais.checkpointing.config import LoadedCheckpoint
from megatron_ais.errors import CheckpointError


def rng_state() -> dict[str, Any]:
    """Return this rank's Python, NumPy, torch (and CUDA + megatron tracker) random states."""
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        state["rng_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the random states returned by `rng_state`."""
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker"])


def sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer) -> bool:
    """Whether `optimizer` is (or chains) megatron's DistributedOptimizer."""
    return any(isinstance(o, DistributedOptimizer) for o in sub_optimizers(optimizer))


def distributed_optimizer_shard(optimizer) -> list:
    """Return this DP rank's distributed-optimizer state (fp32 main params, Adam moments and step), per
    sub-optimizer in megatron's bucket order."""
    return [o.get_parameter_state_dp_reshardable() for o in sub_optimizers(optimizer)]


@torch.no_grad()
def load_distributed_optimizer_shard(optimizer, shard: list) -> None:
    """Copy a `distributed_optimizer_shard` back into an optimizer of the same layout."""
    subs = sub_optimizers(optimizer)
    if len(subs) != len(shard):
        raise CheckpointError(f"distributed optimizer has {len(subs)} parts, the checkpoint {len(shard)}")
    for opt, state in zip(subs, shard):
        if state["per_bucket_numel_unpadded"] != opt.per_bucket_numel_unpadded:
            raise CheckpointError("distributed-optimizer buckets differ from the checkpoint's (saved with another "
                                  "data-parallel size or bucket size); resume with the saved layout")
        for gbuf_idx, range_maps in enumerate(opt.gbuf_ranges):
            for dtype, buckets in range_maps.items():
                for bucket_idx, range_map in enumerate(buckets):
                    saved = state[gbuf_idx][dtype][bucket_idx]
                    for tensors, model_param in zip(saved, range_map["param_map"]):
                        opt._set_main_param_and_optimizer_states(
                            model_param, {k: v for k, v in tensors.items() if not k.startswith("gbuf_local")})


def unshare_adam_steps(optimizer) -> None:
    # megatron's DistributedOptimizer.load_state_dict (without Apex/TE) gives every parameter's state the same
    # `step` tensor; torch Adam increments it in place once per parameter, so the bias correction would be wrong
    for sub in sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def check_optimizer_layout(metadata: dict[str, Any], distributed: bool, dp_size: int, root: str) -> None:
    """Raise a CheckpointError naming the flags when the optimizer state cannot be resumed as this run is laid out:
    distributed-optimizer shards belong to one data-parallel size, and the two optimizer kinds save different
    states (checkpoints that predate these records are not checked)."""
    saved_distributed, saved_dp = metadata.get("use_distributed_optimizer"), metadata.get("data_parallel_size")
    if saved_distributed is not None and saved_distributed != distributed:
        raise CheckpointError(f"--load {root} was saved {'with' if saved_distributed else 'without'} "
                              f"--use-distributed-optimizer; resume {'with' if saved_distributed else 'without'} it, "
                              "or start from its weights with --finetune")
    if distributed and saved_dp is not None and saved_dp != dp_size:
        raise CheckpointError(f"--load {root} holds distributed-optimizer shards of {saved_dp} data-parallel ranks, "
                              f"this run has {dp_size}: resume with world size = TP x PP x {saved_dp}, or start from "
                              "its weights with --finetune")


def restore_training_state(loaded: LoadedCheckpoint, optimizer, dp_rank: int, dp_size: int | None = None) -> None:
    """Restore optimizer state (and distributed-optimizer shard) and this DP rank's RNG state."""
    if "optimizer" not in loaded.state:
        raise CheckpointError(f"checkpoint {loaded.directory} holds no optimizer state (weights only); start from it "
                              "with --finetune")
    if dp_size is not None:
        check_optimizer_layout(loaded.metadata, is_distributed(optimizer), dp_size, loaded.root)
    optimizer.load_state_dict(loaded.state["optimizer"])
    unshare_adam_steps(optimizer)
    if is_distributed(optimizer):
        if loaded.distrib_optim is None:
            raise CheckpointError(f"checkpoint {loaded.directory} was saved without --use-distributed-optimizer; "
                                  "resume without it, or with --finetune")
        load_distributed_optimizer_shard(optimizer, loaded.distrib_optim)
    states = loaded.state.get("rng_state") or []
    if dp_rank < len(states):
        set_rng_state(states[dp_rank])
