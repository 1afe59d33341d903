"""Megatron-LM's distributed format (`--ckpt-format torch_dist`): the model through megatron-core's
`sharded_state_dict` and `dist_checkpointing.save/load`, which reshards on load (a checkpoint saved at TP2 loads at
TP1 x PP2); the run state beside it, as data.

    iter_000000N/model/__R_K.distcp       the tensors global rank R wrote (torch.distributed.checkpoint files)
    iter_000000N/model/.metadata          where every tensor's pieces lie, written by rank 0
    iter_000000N/model/common.pt          megatron-core's common (non-sharded) state, written by rank 0
    iter_000000N/model/metadata.json      the sharded strategy, written by rank 0
    iter_000000N/run_state.pt             iteration, every rank's RNG state, the run state; written by rank 0

Not yet here: the optimizer (megatron-core's optimizer `sharded_state_dict`) and the trainer's --ckpt-format flag;
the store (store.py) writes, checksums, commits and verifies these files like the torch format's."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_ais.checkpointing.formats.torch import CHECKPOINT_VERSION, load_data
from megatron_ais.checkpointing.optimizer_state import rng_state
from megatron_ais.checkpointing.ranks import CheckpointRanks, gather
from megatron_ais.errors import CheckpointError
from megatron_ais.model import unwrap_model

MODEL_DIR = "model"
RUN_STATE = "run_state.pt"
COMMON_FILES = (".metadata", "common.pt", "metadata.json")  # what rank 0 writes beside its own shards


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _chunk_key(index: int, num_chunks: int) -> str:
    # Megatron-LM's convention: "model", or "model0", "model1", ... with virtual pipeline chunks
    return "model" if num_chunks == 1 else f"model{index}"


def sharded_model_state(chunks: list) -> dict:
    """This rank's model chunks as megatron-core sharded state dicts, keyed as Megatron-LM keys them."""
    return {_chunk_key(i, len(chunks)): unwrap_model(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def rank_files(directory: str) -> list[str]:
    """The files of a checkpoint directory that the format wrote (model shards and metadata, run state)."""
    model = os.path.join(directory, MODEL_DIR)
    names = [os.path.join(MODEL_DIR, n) for n in sorted(os.listdir(model))] if os.path.isdir(model) else []
    return names + ([RUN_STATE] if os.path.isfile(os.path.join(directory, RUN_STATE)) else [])


def write_rank_files(stage: str, iteration: int, ranks: CheckpointRanks, chunks: list, optimizer,
                     run_state: dict | None, dp_group) -> list[str]:
    """Save the model through dist_checkpointing into the staging directory and, on rank 0, the run state with every
    rank's RNG state; collective over all ranks. Return the names of the files this rank wrote, relative to `stage`."""
    del ranks, optimizer, dp_group  # the model's sharded state dict knows every rank's part; no optimizer yet
    model_dir = os.path.join(stage, MODEL_DIR)
    os.makedirs(model_dir, exist_ok=True)
    rng_states = gather(rng_state())
    dist_checkpointing.save(sharded_model_state(chunks), model_dir)
    rank = _rank()
    names = [os.path.join(MODEL_DIR, n) for n in sorted(os.listdir(model_dir))
             if n.startswith(f"__{rank}_") or (rank == 0 and n in COMMON_FILES)]
    if rank == 0:
        state = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION, "rng_state": rng_states,
                 "run_state": run_state}
        path = os.path.join(stage, RUN_STATE)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        names.append(RUN_STATE)
    return names


def files_to_read(directory: str, ranks: CheckpointRanks, distributed_optimizer: bool) -> list[str]:
    """Every file: a resharded load may read any rank's shards. The run state first."""
    del ranks, distributed_optimizer
    return [RUN_STATE] + [n for n in rank_files(directory) if n != RUN_STATE]


def read_rank_files(directory: str, files: list[str]) -> tuple[dict, None]:
    """The run state (as data; see formats/torch.load_data); the tensors are read by `load_model_state`, which needs
    the model to know what this rank's layout takes from them."""
    return load_data(os.path.join(directory, files[0])), None


def read_rank_state(directory: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1,
                    mmap: bool = False) -> dict:
    raise CheckpointError(f"{directory} is a torch_dist checkpoint; the offline tools read torch checkpoints only")


def load_model_state(chunks: list, directory: str) -> None:
    """Load this rank's part of the model from a checkpoint directory, whatever the layout it was saved at
    (collective over all ranks); a tensor missing or of another global shape is refused by megatron-core."""
    loaded = dist_checkpointing.load(sharded_model_state(chunks), os.path.join(directory, MODEL_DIR))
    for i, chunk in enumerate(chunks):
        unwrap_model(chunk).load_state_dict(loaded[_chunk_key(i, len(chunks))])
