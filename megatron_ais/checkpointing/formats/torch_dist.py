"""Megatron-LM's distributed format (`--ckpt-format torch_dist`): the model through megatron-core's
`sharded_state_dict` and `dist_checkpointing.save/load`, which reshards on load (a checkpoint saved at TP2 loads at
TP1 x PP2); the run state beside it, as data.

    iter_000000N/model/__R_K.distcp       the tensors global rank R wrote (torch.distributed.checkpoint files)
    iter_000000N/model/.metadata          where every tensor's pieces lie, written by rank 0
    iter_000000N/model/common.pt          megatron-core's common (non-sharded) state, written by rank 0
    iter_000000N/model/metadata.json      the sharded strategy, written by rank 0
    iter_000000N/run_state.pt             iteration, the RNG state of rank 0's data-parallel group, the run state

The optimizer's state (fp32 main params, Adam moments, step) lies beside the model's in the same files, saved
through megatron-core's optimizer `sharded_state_dict` in the fully reshardable form, so it too loads at another
TP / PP / DP layout. The store (store.py) writes, checksums, commits and verifies these files like the torch
format's. A save is megatron-core's asynchronous one in three parts: the plan (collective), the write of this rank's
buckets (in the calling thread, or --async-save's writer thread; no fork of a training process), the finalisation
(collective: rank 0 writes the index)."""
from __future__ import annotations

import functools
import os
import queue

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_ais.checkpointing.formats.torch import CHECKPOINT_VERSION, copy_state, load_data
from megatron_ais.checkpointing.config import LoadedCheckpoint, RankFileWrite
from megatron_ais.checkpointing.optimizer_state import (check_optimizer_layout, is_distributed, rng_state,
                                                        set_rng_state, sub_optimizers, unshare_adam_steps)
from megatron_ais.checkpointing.ranks import CheckpointRanks, gather
from megatron_ais.errors import CheckpointError
from megatron_ais.model import unwrap_model

NAME = "torch_dist"
MODEL_DIR = "model"
RUN_STATE = "run_state.pt"
COMMON_FILES = (".metadata", "common.pt", "metadata.json")  # what rank 0 writes beside its own shards
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}  # the layout-free form of the shards


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _chunk_key(index: int, num_chunks: int) -> str:
    # Megatron-LM's convention: "model", or "model0", "model1", ... with virtual pipeline chunks
    return "model" if num_chunks == 1 else f"model{index}"


def sharded_model_state(chunks: list) -> dict:
    """This rank's model chunks as megatron-core sharded state dicts, keyed as Megatron-LM keys them."""
    return {_chunk_key(i, len(chunks)): unwrap_model(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def sharded_state(chunks: list, optimizer, is_loading: bool) -> dict:
    """The model's sharded state dict and, with an optimizer, the optimizer's (megatron-core builds it from the
    model's, matching parameters by identity)."""
    state = sharded_model_state(chunks)
    if optimizer is not None:
        if is_loading and is_distributed(optimizer):
            # a fresh DistributedOptimizer has no Adam state, and its state_dict() asserts one step count exists
            for sub in sub_optimizers(optimizer):
                sub._init_optimizer_states_with_dummy_values()
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading,
                                                          metadata=OPTIMIZER_METADATA)
    return state


def is_format_of(directory: str) -> bool:
    """Whether a checkpoint directory was written in this format."""
    return os.path.isdir(os.path.join(directory, MODEL_DIR))


def rank_files(directory: str) -> list[str]:
    """The files of a checkpoint directory that the format wrote (model shards and metadata, run state)."""
    model = os.path.join(directory, MODEL_DIR)
    names = [os.path.join(MODEL_DIR, n) for n in sorted(os.listdir(model))] if os.path.isdir(model) else []
    return names + ([RUN_STATE] if os.path.isfile(os.path.join(directory, RUN_STATE)) else [])


def prepare_rank_files(stage: str, iteration: int, ranks: CheckpointRanks, chunks: list, optimizer,
                       run_state: dict | None, dp_group, snapshot: bool = False) -> RankFileWrite:
    """Plan the save of the model and optimizer through dist_checkpointing into the staging directory (collective
    over all ranks: megatron-core checks the shards and agrees on where each lies; rank 0 writes the common state).
    The returned write puts this rank's shards and, on rank 0, the run state with its data-parallel group's RNG
    states into their files; its finish writes megatron-core's metadata once every rank has written. `snapshot`:
    copy the tensors and run state first, so that the files may be written while training changes them."""
    del ranks  # the sharded state dicts know every rank's part
    model_dir = os.path.join(stage, MODEL_DIR)
    os.makedirs(model_dir, exist_ok=True)
    rng_states = gather(rng_state(), dp_group)
    use_in_process_write_results()
    # the asynchronous form splits the save into plan (here), write (the request's buckets) and finalisation; the
    # synchronous form runs the same three in a row
    request = dist_checkpointing.save(sharded_state(chunks, optimizer, is_loading=False), model_dir,
                                      async_sharded_save=True)
    run_file = None
    if _rank() == 0:
        run_file = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION, "rng_state": rng_states,
                    "run_state": copy_state(run_state) if snapshot else run_state}
    buckets = host_buckets(request.async_fn_args[1], snapshot) if request.async_fn is not None else []
    return RankFileWrite(functools.partial(_write_files, request, buckets, stage, run_file),
                         functools.partial(_finish_files, request, stage))


def use_in_process_write_results() -> None:
    """Hand the write results to megatron-core's finalisation through a queue of this process. megatron-core uses a
    multiprocessing Manager's (a server process per rank, started at the first save, taking seconds, and left running
    when the rank is killed) because its writers are forked processes; ours is a thread of this process."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def host_buckets(buckets: list, copied: bool) -> list:
    """megatron-core's write buckets (file path, storage key, (byte items, tensor items)) with every tensor in host
    memory, `copied` ones cloned (the byte items are serialised already)."""
    return [(path, key, (byte_items, [(item, tensor.detach().to("cpu", copy=copied)) for item, tensor in tensors]))
            for path, key, (byte_items, tensors) in buckets]


def write_buckets(transforms: list, buckets: list) -> dict | Exception:
    """Write megatron-core's buckets one after another in this thread, as its writer processes would (no fork of
    a process that is training); return the write results by bucket, or the first failure, as its finalisation
    expects them."""
    outcomes, pending = queue.Queue(), queue.Queue()
    results = {}
    for index, bucket in enumerate(buckets):
        pending.put(index)  # the writer marks its bucket done on this queue
        filesystem_async.FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, outcomes, pending,
                                                                    use_fsync=True)
        index, outcome = outcomes.get()
        if isinstance(outcome, Exception):
            return outcome
        results[index] = outcome
    return results


def _write_files(request, buckets: list, stage: str, run_file: dict | None) -> list[str]:
    names = []
    if request.async_fn is not None:
        # what megatron-core's writer bound: its storage transforms, and whether it writes through the multi-storage
        # client (off unless enabled: local files)
        transforms, _ = request.async_fn.args
        request.async_fn_args[2].put(write_buckets(transforms, buckets))  # where its finalisation reads them
        names = [os.path.join(MODEL_DIR, os.path.basename(path)) for path, _, _ in buckets]
    if run_file is not None:
        path = os.path.join(stage, RUN_STATE)
        torch.save(run_file, path + ".tmp")
        os.replace(path + ".tmp", path)
        names.append(RUN_STATE)
    return names


def _finish_files(request, stage: str) -> list[str]:
    """megatron-core's finalisation (collective): rank 0 writes the index of every shard and the strategy; return
    the common files rank 0 wrote."""
    for finalize in request.finalize_fns:
        finalize()
    model_dir = os.path.join(stage, MODEL_DIR)
    return [os.path.join(MODEL_DIR, n) for n in sorted(os.listdir(model_dir)) if _rank() == 0 and n in COMMON_FILES]


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


def _sub_states(optimizer, state) -> list:
    # a ChainedOptimizer of one gives that optimizer's state itself, of several a dict keyed by index
    return [state] if len(sub_optimizers(optimizer)) == 1 else [state[i] for i in sorted(state)]


def _load_distributed_sub(sub, state: dict) -> None:
    # megatron-core 0.16.1's fully reshardable load raises KeyError 'step' when the per-param states hold one, and
    # load_state_dict gives every parameter the same step tensor (Adam would advance it once per parameter): load the
    # rest first, set the steps aside, load the parameter state, then give each parameter its own step back
    param_state = state.pop("param_state")
    state.pop("param_state_sharding_type", None)
    sub.load_state_dict(state)
    steps = {param: entry.pop("step") for param, entry in sub.optimizer.state.items() if "step" in entry}
    sub.load_parameter_state_from_fully_reshardable(param_state)
    for param, step in steps.items():
        sub.optimizer.state[param]["step"] = step.clone()


def load_model(chunks: list, loaded: LoadedCheckpoint) -> None:
    """Load this rank's part of the model from a loaded checkpoint, at whatever layout it was saved."""
    load_model_state(chunks, loaded.directory)


def restore_training_state(loaded: LoadedCheckpoint, chunks: list, optimizer, dp_rank: int, dp_size: int) -> None:
    """Restore the optimizer (resharded to this run's TP / PP / DP layout) and this DP rank's RNG state from a
    torch_dist checkpoint; collective over all ranks."""
    del dp_size  # the shards are resharded to any data-parallel size
    check_optimizer_layout({"use_distributed_optimizer": loaded.metadata.get("use_distributed_optimizer")},
                           is_distributed(optimizer), 0, loaded.root)
    state = dist_checkpointing.load(sharded_state(chunks, optimizer, is_loading=True),
                                    os.path.join(loaded.directory, MODEL_DIR))["optimizer"]
    for sub, sub_state in zip(sub_optimizers(optimizer), _sub_states(optimizer, state)):
        if is_distributed(sub):
            _load_distributed_sub(sub, sub_state)
        else:
            sub.load_state_dict(sub_state)
    unshare_adam_steps(optimizer)
    states = loaded.state.get("rng_state") or []
    if dp_rank < len(states):
        set_rng_state(states[dp_rank])
