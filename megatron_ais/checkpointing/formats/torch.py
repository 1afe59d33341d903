"""Today's checkpoint format: Megatron-LM's legacy per-rank layout, one `torch.save` file per shard directory and,
with the distributed optimizer, one optimizer file per DP rank; the only module that knows it.

    iter_000000N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt      model, optimizer, RNG of every DP rank, run state
    iter_000000N/mp_rank_TT[_PPP][_EEE]/distrib_optim_dpDDD.pt  distributed-optimizer shard of DP rank DDD

`_PPP` is appended under pipeline parallelism, `_EEE` under expert parallelism. Parameter names are stored with
local-spec names and stage-local layer indices, as Megatron-LM stores them. The store (store.py) calls the format's
functions listed in formats/__init__.py."""
from __future__ import annotations

import copy
import functools
import os
import pickle
from typing import Any

import numpy as np
import torch

from megatron_ais.checkpointing.config import LoadedCheckpoint, RankFileWrite
from megatron_ais.checkpointing.optimizer_state import (distributed_optimizer_shard, is_distributed,
                                                        restore_training_state as restore_optimizer_and_rng, rng_state)
from megatron_ais.checkpointing.ranks import CheckpointRanks, gather
from megatron_ais.errors import CheckpointError
from megatron_ais.mapping.rules import canonical_name
from megatron_ais.model import unwrap_model

NAME = "torch"
RESHARDS_ON_LOAD = False
RANK_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
# Beyond tensors and plain containers, a rank file holds only NumPy's random state (a uint32 array in a tuple);
# torch.load admits nothing else, so a crafted file cannot run code at --load
SAFE_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), np._core.multiarray._reconstruct]


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Return Megatron-LM's per-rank directory name: `mp_rank_TT`, `_PPP` appended under PP, `_EEE` under expert
    parallelism (each expert-parallel rank's directory holds the dense weights and its own experts)."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
            + (f"_{ep_rank:03d}" if ep_size > 1 else ""))


def shard_dir(ranks: CheckpointRanks) -> str:
    """The shard directory of a rank's position."""
    return rank_dir_name(ranks.tp_rank, ranks.pp_rank, ranks.pp_size, ranks.ep_rank, ranks.ep_size)


def rank_file(ranks: CheckpointRanks) -> str:
    """The shard file of a rank's position, relative to the iteration directory."""
    return os.path.join(shard_dir(ranks), RANK_FILE)


def distrib_optim_file(ranks: CheckpointRanks) -> str:
    """A DP rank's distributed-optimizer file, relative to the iteration directory."""
    return os.path.join(shard_dir(ranks), f"distrib_optim_dp{ranks.dp_rank:03d}.pt")


def rank_files(directory: str) -> list[str]:
    """The rank files of a checkpoint directory (model, optimizer shards), relative to it."""
    return sorted(os.path.relpath(os.path.join(d, name), directory) for d, _, names in os.walk(directory)
                  if os.path.basename(d).startswith("mp_rank_") for name in names if name.endswith(".pt"))


def write_rank_state(stage: str, tp_rank: int, pp_rank: int, pp_size: int, state: dict, ep_rank: int = 0,
                     ep_size: int = 1) -> None:
    """Write one rank's state file into a staging directory."""
    save_file(os.path.join(stage, rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size), RANK_FILE), state)


def save_file(path: str, state) -> None:
    """torch.save a state into `path` (its directory made), whole or not at all (written aside, then renamed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def _write_files(stage: str, files: dict[str, Any]) -> list[str]:
    for name, state in files.items():
        save_file(os.path.join(stage, name), state)
    return list(files)


def copy_state(state):
    """A copy of a rank file's state that training cannot change: tensors copied into host memory (a background
    save must not double what an accelerator holds; copy.deepcopy would also refuse the views an optimizer's state
    holds), containers rebuilt, anything else deep-copied."""
    if torch.is_tensor(state):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: copy_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(copy_state(value) for value in state)
    return copy.deepcopy(state)


def prepare_rank_files(stage: str, iteration: int, ranks: CheckpointRanks, chunks: list, optimizer,
                       run_state: dict | None, dp_group, snapshot: bool = False) -> RankFileWrite:
    """This rank's files, ready to write into a staging directory; collective over all ranks (every DP rank's RNG
    state is gathered). The lowest rank of each (TP, PP, EP) position writes the shard file (model, optimizer, RNG
    states, run state); with the distributed optimizer every rank also writes its shard. `snapshot`: copy whatever
    training will change (the optimizer's tensors, the run state) so that the files may be written later."""
    rng_states = gather(rng_state(), dp_group)
    copied = copy_state if snapshot else (lambda state: state)
    files = {}
    if ranks.writes_shard:
        live = {"rng_state": rng_states, "run_state": run_state}
        if optimizer is not None:
            live["optimizer"] = optimizer.state_dict()
        files[rank_file(ranks)] = {**model_state(chunks), "iteration": iteration,
                                   "checkpoint_version": CHECKPOINT_VERSION, **copied(live)}
    if optimizer is not None and is_distributed(optimizer):
        files[distrib_optim_file(ranks)] = copied(distributed_optimizer_shard(optimizer))
    return RankFileWrite(functools.partial(_write_files, stage, files))


def files_to_read(directory: str, ranks: CheckpointRanks, distributed_optimizer: bool) -> list[str]:
    """The files this rank reads from a checkpoint directory: its shard file, and its distributed-optimizer file when
    the run uses the distributed optimizer and the checkpoint has one."""
    files = [rank_file(ranks)]
    if distributed_optimizer and os.path.isfile(os.path.join(directory, distrib_optim_file(ranks))):
        files.append(distrib_optim_file(ranks))
    return files


def read_rank_files(directory: str, files: list[str]) -> tuple[dict, list | None]:
    """Return (the shard state, the distributed-optimizer shard or None) from the files of `files_to_read`."""
    state = load_data(os.path.join(directory, files[0]))
    distrib = load_data(os.path.join(directory, files[1])) if len(files) > 1 else None
    return state, distrib


def read_rank_state(directory: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1,
                    mmap: bool = False) -> dict:
    """Return one shard's saved state from a checkpoint directory (`mmap`: tensors mapped from the file, read when
    used)."""
    path = os.path.join(directory, rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size), RANK_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    return load_data(path, mmap)


def load_data(source, mmap: bool = False, name: str | None = None):
    """torch.load a rank file (a path, or a file object named `name`) as data only: a pickle that calls anything
    outside SAFE_GLOBALS is refused unrun, the file and the global named."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        called = _disallowed_globals(source)
        if not called:  # no global outside the allowlist: a damaged file, which the caller reports as unreadable
            raise
        raise CheckpointError(f"{name or source} is refused: its pickle calls {', '.join(called)} outside the "
                              "checkpoint allowlist (a checkpoint is data, never code); nothing of it was "
                              "run") from None


def _disallowed_globals(source) -> list[str]:
    """The globals a rank file's pickle names outside SAFE_GLOBALS, read from its opcodes (nothing is run to list
    them); none when the file cannot be read that far."""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    try:
        if hasattr(source, "seek"):
            source.seek(0)
        return [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(source) if g not in allowed]
    except Exception:  # a damaged archive or pickle: nothing can be named
        return []


def _model_keys(num_chunks: int) -> list[str]:
    # Megatron-LM's convention: "model", or "model0", "model1", ... with virtual pipeline chunks
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def model_state(chunks: list) -> dict[str, dict[str, torch.Tensor]]:
    """Return this rank's parameters keyed by local-spec name (TE names canonicalised), per model chunk."""
    return {key: {canonical_name(n): p.detach().clone() for n, p in unwrap_model(chunk).named_parameters()}
            for key, chunk in zip(_model_keys(len(chunks)), chunks)}


@torch.no_grad()
def load_model_state(chunks: list, state: dict) -> None:
    """Copy saved parameters into this rank's chunks; every parameter must be present with the right shape."""
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        if key not in state:
            raise CheckpointError(f"checkpoint has no {key!r} entry (saved with another virtual pipeline size?)")
        saved = dict(state[key])
        for name, param in unwrap_model(chunk).named_parameters():
            tensor = saved.pop(canonical_name(name), None)
            if tensor is None:
                raise CheckpointError(f"checkpoint is missing parameter {canonical_name(name)!r}")
            if tensor.shape != param.shape:
                raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            param.copy_(tensor)
        if saved:
            raise CheckpointError(f"checkpoint has parameters the model lacks: {sorted(saved)[:5]}")


def load_model(chunks: list, loaded: LoadedCheckpoint) -> None:
    """Copy a loaded checkpoint's parameters into this rank's chunks (saved at this layout)."""
    load_model_state(chunks, loaded.state)


def restore_training_state(loaded: LoadedCheckpoint, chunks: list, optimizer, dp_rank: int, dp_size: int) -> None:
    """Restore the optimizer (and distributed-optimizer shard) and this DP rank's RNG state."""
    del chunks  # the rank files hold the optimizer state itself
    restore_optimizer_and_rng(loaded, optimizer, dp_rank, dp_size)
