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
(collective: rank 0 writes the index).

The fully reshardable form of the distributed optimizer is one tensor per parameter and state, which megatron-core
builds by gathering every DP rank's shards while it plans the save (4.7 of the 6.5 s a 103 M-parameter save blocked
training on 2 CPU cores). Here the plan is built on empty world tensors, this rank's shards are copied, and the
gather runs in the write, into the tensors this rank writes (`DeferredOptimizerState`)."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import io
import os
import pickle
import queue
import warnings

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from megatron_ais.checkpointing.formats.torch import CHECKPOINT_VERSION, copy_state, load_data, save_file
from megatron_ais.checkpointing.config import LoadedCheckpoint, RankFileWrite
from megatron_ais.checkpointing.optimizer_state import (check_optimizer_layout, is_distributed, rng_state,
                                                        set_rng_state, sub_optimizers, unshare_adam_steps)
from megatron_ais.checkpointing.ranks import CheckpointRanks, gather
from megatron_ais.errors import ArgumentValidationError, CheckpointError
from megatron_ais.model import unwrap_model

# megatron-core 0.16.1's dist_checkpointing calls torch.distributed.checkpoint's `load_state_dict` and builds
# ShardedTensors, both deprecated in torch 2.13 with a FutureWarning at every save and load of a run: megatron's
# choice, nothing a user can act on
for _message in (r"`load_state_dict` is deprecated", r"Please use DTensor instead"):
    warnings.filterwarnings("ignore", message=_message, category=FutureWarning)

NAME = "torch_dist"
RESHARDS_ON_LOAD = True  # vocabulary rows padded or cut by megatron-core (allow_shape_mismatch)
MODEL_DIR = "model"
RUN_STATE = "run_state.pt"
COMMON_STATE = "common.pt"  # megatron-core's non-sharded state
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards
COMMON_FILES = (DCP_METADATA, COMMON_STATE, "metadata.json")  # what rank 0 writes beside its own shards
# the layout-free form of the shards, keyed by the model's keys alone (no `chained_N.` prefix), so that experts saved
# by a separate expert optimizer (EP > 1) load into one optimizer (EP1) and the other way round
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
OPTIMIZER_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # the distributed optimizer's state of each parameter
OPTIMIZER_COUNT = "optimizer_count"  # how many optimizers the saving run chained (dense, and experts apart)
# the classes torch.distributed.checkpoint pickles into `.metadata` are defined in these modules
DCP_MODULES = {module.__name__: module for module in (dcp_metadata, dcp_filesystem, dcp_planner)}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _parallel_sizes() -> list[int]:
    # world, TP, PP, EP, DP: global ranks hold the same places in two runs with the same sizes
    if not ps.model_parallel_is_initialized():
        return [1, 1, 1, 1, 1]
    return [dist.get_world_size(), ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
            ps.get_data_parallel_world_size()]


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
        state[OPTIMIZER_COUNT] = len(sub_optimizers(optimizer))
    return state


@dataclasses.dataclass
class DeferredOptimizerState:
    """The distributed optimizers' part of a save, planned on empty world tensors and gathered when the files are
    written. `world`: per optimizer, megatron-core's gathered layout (gbuf -> dtype -> state key -> one tensor over
    every DP rank's shards), empty; `local`: per optimizer, this DP rank's shards per bucket, copied at the save;
    `targets`: per world tensor (its storage), the bucket tensors this rank writes of it and where each starts in
    it."""

    subs: list
    world: list[dict]
    local: list[dict] = dataclasses.field(default_factory=list)
    targets: dict[int, list[tuple[torch.Tensor, int]]] = dataclasses.field(default_factory=dict)

    def world_tensors(self):
        """(optimizer index, gbuf index, dtype, state key, world tensor) of every world tensor."""
        for index, world in enumerate(self.world):
            for gbuf_idx, by_dtype in world.items():
                for dtype, tensors in by_dtype.items():
                    for key in OPTIMIZER_STATE_KEYS:
                        yield index, gbuf_idx, dtype, key, tensors[key]


def _empty_world_state(sub) -> dict:
    """megatron-core's layout of a distributed optimizer's gathered state (`get_parameter_state_dp_zero`), its
    tensors allocated and never filled: megatron-core cuts the per-parameter tensors from them (and clones those it
    plans to write), the gather fills those clones."""
    return {gbuf_idx: {dtype: {**{key: torch.empty(sub.buffers[gbuf_idx].numel_unpadded, dtype=torch.float32)
                                  for key in OPTIMIZER_STATE_KEYS},
                               "numel_unpadded": sub.buffers[gbuf_idx].numel_unpadded}
                       for dtype in range_maps}
            for gbuf_idx, range_maps in enumerate(sub.gbuf_ranges)}


def _distributed_subs(optimizer) -> list:
    """The distributed optimizers among `optimizer`'s parts (none without an optimizer)."""
    return [sub for sub in sub_optimizers(optimizer) if is_distributed(sub)] if optimizer is not None else []


def check_optimizer_saveable(optimizer) -> None:
    """Refuse, before training, a distributed optimizer whose state megatron-core 0.16.1 would save shifted: its
    gathered state lies bucket after bucket, each cut to its unpadded size, while `sharded_param_state_dp_zero` cuts
    each parameter out of it at its place in the padded buffer (its "issue #504" warning), so a bucket padded before
    another (tied embeddings in a bucket of their own under pipeline parallelism, at some data-parallel sizes)
    shifts every later parameter's moments, and the last runs off the end (here: no checkpoint could be written).
    Collective on every rank: all refuse when one would."""
    subs = _distributed_subs(optimizer)
    shifted = any(bucket.numel_unpadded != bucket.grad_data.numel()
                  for sub in subs for buffer in sub.buffers for bucket in buffer.buckets[:-1])
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, shifted)
    if any(everywhere):
        raise ArgumentValidationError(
            "--ckpt-format torch_dist with --use-distributed-optimizer: megatron-core 0.16.1 would save this "
            "layout's optimizer state shifted (a gradient bucket padded before another: tied embeddings under "
            "pipeline parallelism at this data-parallel size); use --ckpt-format torch, or another "
            "--data-parallel layout")


@contextlib.contextmanager
def optimizer_state_deferred(optimizer):
    """While megatron-core builds the optimizer's sharded state dict for a save, let every distributed optimizer hand
    it empty world tensors instead of gathering its shards (an instance attribute shadowing the method, removed on
    exit). Yields the DeferredOptimizerState to fill at the write; None without a distributed optimizer."""
    subs = _distributed_subs(optimizer)
    if not subs:
        yield None
        return
    deferred = DeferredOptimizerState(subs, [_empty_world_state(sub) for sub in subs])
    for sub, world in zip(subs, deferred.world):
        sub.get_parameter_state_dp_zero = lambda *args, _world=world, **kwargs: {"buckets_coalesced": True, **_world}
    try:
        yield deferred
    finally:
        for sub in subs:
            del sub.get_parameter_state_dp_zero


def _bucket_local_numel(sub, gbuf_idx: int, bucket_idx: int) -> int:
    return sub.buffers[gbuf_idx].buckets[bucket_idx].grad_data.numel() // sub.data_parallel_group_gloo.size()


@torch.no_grad()
def local_optimizer_shards(sub) -> dict:
    """This DP rank's contiguous shards of a distributed optimizer's state, per bucket (what megatron-core gathers
    from each rank), copied to host memory."""
    shards = {}
    for gbuf_idx, range_maps in enumerate(sub.gbuf_ranges):
        shards[gbuf_idx] = {}
        for dtype, bucket_maps in range_maps.items():
            buckets = []
            for bucket_idx, bucket_map in enumerate(bucket_maps):
                numel = _bucket_local_numel(sub, gbuf_idx, bucket_idx)
                local = {key: torch.empty(numel, dtype=torch.float32) for key in OPTIMIZER_STATE_KEYS}
                for model_param, ranges in bucket_map["param_map"].items():
                    tensors = sub._get_main_param_and_optimizer_states(model_param)
                    start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
                    for key in OPTIMIZER_STATE_KEYS:
                        local[key][start:end].copy_(tensors[key].detach().view(-1))
                buckets.append(local)
            shards[gbuf_idx][dtype] = buckets
    return shards


def _written_optimizer_items(deferred: DeferredOptimizerState, state: dict) -> dict:
    """(checkpoint key, global offset) -> (world tensor storage, start in it) of every optimizer tensor megatron-core
    built on the empty world tensors (views of them, factories included)."""
    storages = {tensor.untyped_storage().data_ptr() for *_, tensor in deferred.world_tensors()}
    items = {}
    for sharded in nested_values(state.get("optimizer", {})):
        if isinstance(sharded, ShardedTensor) and sharded.data.untyped_storage().data_ptr() in storages:
            items[(sharded.key, tuple(sharded.global_offset))] = (sharded.data.untyped_storage().data_ptr(),
                                                                 sharded.data.storage_offset())
    return items


def gather_optimizer_state(deferred: DeferredOptimizerState) -> None:
    """Gather every DP rank's copied shards, bucket by bucket, over each optimizer's gloo data-parallel group (used
    by checkpointing alone, so this collective never meets one of training's, from any thread), into the tensors this
    rank writes. The world position of a bucket's data is megatron-core's: buckets one after another, each cut to
    its unpadded size."""
    for index, gbuf_idx, dtype, key, world in deferred.world_tensors():
        sub, targets = deferred.subs[index], deferred.targets.get(world.untyped_storage().data_ptr(), [])
        group, offset = sub.data_parallel_group_gloo, 0
        for bucket_idx, local in enumerate(deferred.local[index][gbuf_idx][dtype]):
            unpadded = sub.buffers[gbuf_idx].buckets[bucket_idx].numel_unpadded
            gathered = torch.empty(local[key].numel() * group.size(), dtype=torch.float32)
            dist.all_gather_into_tensor(gathered, local[key], group=group)
            for tensor, start in targets:
                if offset <= start < offset + unpadded:
                    tensor.view(-1).copy_(gathered[start - offset:start - offset + tensor.numel()])
            offset += unpadded


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
    The returned write puts this rank's shards and, on rank 0, the run state with every rank's RNG states (each
    pipeline stage and tensor-parallel rank draws its own) into their files; its finish writes megatron-core's
    metadata once every rank has written. `snapshot`: copy the tensors and run state first, so that the files may be
    written while training changes them."""
    del ranks  # the sharded state dicts know every rank's part
    model_dir = os.path.join(stage, MODEL_DIR)
    os.makedirs(model_dir, exist_ok=True)
    rng_states = gather(rng_state())
    use_in_process_write_results()
    # the asynchronous form splits the save into plan (here), write (the request's buckets) and finalisation; the
    # synchronous form runs the same three in a row. The data-parallel replicas share the writing (megatron-core's
    # fully parallel save, Megatron-LM's default), so every rank may write shards
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), dp_group)
    with optimizer_state_deferred(optimizer) as deferred:
        state = sharded_state(chunks, optimizer, is_loading=False)
    request = dist_checkpointing.save(state, model_dir, sharded_strategy=strategy, async_sharded_save=True)
    run_file = None
    if _rank() == 0:
        run_file = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION, "rng_state": rng_states,
                    "parallel_sizes": _parallel_sizes(), "run_state": copy_state(run_state) if snapshot else run_state}
    buckets = request.async_fn_args[1] if request.async_fn is not None else []
    buckets = host_buckets(buckets, _live_storages(state, deferred) if snapshot else set())
    if deferred is not None:
        deferred.local = [local_optimizer_shards(sub) for sub in deferred.subs]
        deferred.targets = _deferred_targets(buckets, _written_optimizer_items(deferred, state))
    return RankFileWrite(functools.partial(_write_files, request, buckets, deferred, stage, run_file),
                         functools.partial(_finish_files, request, stage))


def use_in_process_write_results() -> None:
    """Hand the write results to megatron-core's finalisation through a queue of this process. megatron-core uses a
    multiprocessing Manager's (a server process per rank, started at the first save, taking seconds, and left running
    when the rank is killed) because its writers are forked processes; ours is a thread of this process."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _live_storages(state: dict, deferred: DeferredOptimizerState | None) -> set[int]:
    """The storages of the tensors in a sharded state dict that training goes on changing (the model's parameters,
    a plain optimizer's state), not the deferred gather's world tensors."""
    world = {t.untyped_storage().data_ptr() for *_, t in deferred.world_tensors()} if deferred is not None else set()
    return {sharded.data.untyped_storage().data_ptr() for sharded in nested_values(state)
            if isinstance(sharded, ShardedTensor)} - world


def host_buckets(buckets: list, live: set[int]) -> list:
    """megatron-core's write buckets (file path, storage key, (byte items, tensor items)) with every tensor in host
    memory, those still sharing a `live` storage copied (megatron-core has cloned the views of host tensors it
    planned already, and serialised the byte items)."""
    def on_host(tensor):
        return tensor.detach().to("cpu", copy=tensor.untyped_storage().data_ptr() in live)

    return [(path, key, (byte_items, [(item, on_host(tensor)) for item, tensor in tensors]))
            for path, key, (byte_items, tensors) in buckets]


def _deferred_targets(buckets: list, items: dict) -> dict[int, list[tuple[torch.Tensor, int]]]:
    """Per world tensor (storage), the bucket tensors of this rank that the deferred gather fills, and where each
    starts in it."""
    targets = {}
    for _, _, (_, tensors) in buckets:
        for item, tensor in tensors:
            found = items.get((item.index.fqn, tuple(item.index.offset)))
            if found is None and item.index.fqn.startswith("optimizer.state."):
                raise RuntimeError(f"{item.index.fqn} at {tuple(item.index.offset)} is distributed-optimizer state "
                                   "megatron-core did not build on the deferred world tensors")
            if found is not None:
                targets.setdefault(found[0], []).append((tensor, found[1]))
    return targets


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


def _write_files(request, buckets: list, deferred: DeferredOptimizerState | None, stage: str,
                 run_file: dict | None) -> list[str]:
    if deferred is not None:
        gather_optimizer_state(deferred)  # collective: every rank, whether it writes shards or not
        deferred.local = []
    names = []
    if request.async_fn is not None:
        # what megatron-core's writer bound: its storage transforms, and whether it writes through the multi-storage
        # client (off unless enabled: local files)
        transforms, _ = request.async_fn.args
        request.async_fn_args[2].put(write_buckets(transforms, buckets))  # where its finalisation reads them
        names = [os.path.join(MODEL_DIR, os.path.basename(path)) for path, _, _ in buckets]
    if run_file is not None:
        save_file(os.path.join(stage, RUN_STATE), run_file)
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
    """The run state (as data; see formats/torch.load_data), once every pickle megatron-core and
    torch.distributed.checkpoint would read is found to be data (a LoadedCheckpoint's files are checked here, once);
    the tensors are read by `load_model` / `restore_training_state`, which need the model to know what this rank's
    layout takes from them."""
    check_is_data(os.path.join(directory, MODEL_DIR))
    return load_data(os.path.join(directory, files[0])), None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a `.metadata` file as data: the only globals it resolves are the checkpoint-metadata classes of
    torch.distributed.checkpoint, torch.Size, dtypes and layouts; any other is refused before it is imported."""

    def find_class(self, module: str, name: str):
        if module in DCP_MODULES:  # its record types (dataclasses, enums): never a function, a method or other class
            found = "." not in name and _is_record_type(getattr(DCP_MODULES[module], name, None), module)
        elif module == "torch":
            found = name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        else:
            found = (module, name) == ("torch.serialization", "_get_layout")
        if not found:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def _is_record_type(obj, module: str) -> bool:
    """Whether `obj` is a dataclass or an enum defined in `module` (building one runs no code of the file's)."""
    return isinstance(obj, type) and obj.__module__ == module and (dataclasses.is_dataclass(obj)
                                                                   or issubclass(obj, enum.Enum))


class _Refused(Exception):
    """A global outside what a data pickle may name."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles plain data only (containers, numbers, strings, None): any global is refused before it is imported,
    and without one nothing can be called."""

    def find_class(self, module: str, name: str):
        raise _Refused(f"{module}.{name}")


def read_dcp_metadata(model_dir: str) -> Metadata:
    """torch.distributed.checkpoint's `.metadata`, read as data (torch itself reads it with pickle.load)."""
    path = os.path.join(model_dir, DCP_METADATA)
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except _Refused as refused:
        raise CheckpointError(f"{path} is refused: its pickle calls {refused} outside the checkpoint allowlist (a "
                              "checkpoint is data, never code); nothing of it was run") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint Metadata")
    return metadata


def check_is_data(model_dir: str) -> None:
    """Raise a CheckpointError naming the file and the global when a pickle that megatron-core or
    torch.distributed.checkpoint would unpickle with code allowed could run code: `.metadata` (pickle.load), every
    byte item of the .distcp files (torch.load(weights_only=False)) and megatron-core's common state."""
    load_data(os.path.join(model_dir, COMMON_STATE))
    metadata = read_dcp_metadata(model_dir)
    byte_items = {fqn for fqn, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in byte_items:
            continue
        path = os.path.join(model_dir, info.relative_path)
        if os.path.dirname(os.path.normpath(info.relative_path)) or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{os.path.join(model_dir, DCP_METADATA)} places {index.fqn} at "
                                  f"{info.relative_path} {info.transform_descriptors or ''}: outside what this "
                                  "format writes, so it cannot be read as data")
        with open(path, "rb") as file:
            file.seek(info.offset)
            item = load_data(io.BytesIO(file.read(info.length)), name=f"{path} (item {index.fqn})")
        if index.fqn.split("/")[0].endswith("_extra_state"):  # megatron-core's ShardedObject key: name/shard_..
            check_extra_state_is_data(item, f"{path} (item {index.fqn})")


def check_extra_state_is_data(state, name: str) -> None:
    """Transformer Engine (and megatron-core's grouped TE layers, `_decode_extra_state`) unpickle a layer's non-empty
    `_extra_state` byte tensor with pickle.loads when the model loads: its bytes must be plain data (a BF16 run's
    are empty; an FP8 run's hold TE's scaling recipe and tensors, whose pickle names code: refused)."""
    if not isinstance(state, torch.Tensor) or state.numel() == 0:
        return
    try:
        _PlainDataUnpickler(io.BytesIO(state.cpu().numpy().tobytes())).load()
    except _Refused as refused:
        raise CheckpointError(f"{name} is refused: its pickle calls {refused} outside the checkpoint allowlist "
                              "(Transformer Engine unpickles a layer's _extra_state bytes when the model loads; a "
                              "checkpoint is data, never code); nothing of it was run") from None
    except Exception as err:  # a damaged pickle: pickle.loads would fail on it too
        raise CheckpointError(f"{name}: its _extra_state bytes are not a readable pickle ({err})") from None


def read_rank_state(directory: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1,
                    mmap: bool = False) -> dict:
    raise CheckpointError(f"{directory} is a torch_dist checkpoint; the offline tools read torch checkpoints only")


def load_model_state(chunks: list, directory: str) -> None:
    """Load this rank's part of the model from a checkpoint directory (one no store load has checked: its pickles
    are read as data first), whatever the layout it was saved at (collective over all ranks); a tensor missing or of
    another global shape is refused by megatron-core."""
    check_is_data(os.path.join(directory, MODEL_DIR))
    _load_model(chunks, directory)


def _load_model(chunks: list, directory: str) -> None:
    loaded = dist_checkpointing.load(sharded_model_state(chunks), os.path.join(directory, MODEL_DIR))
    for i, chunk in enumerate(chunks):
        unwrap_model(chunk).load_state_dict(loaded[_chunk_key(i, len(chunks))])


def _by_optimizer(state, count: int, key=None) -> list:
    # a ChainedOptimizer of one gives that optimizer's state itself, of several a dict keyed by index
    parts = [state] if count == 1 else [state[i] for i in range(count)]
    return parts if key is None else [part[key] for part in parts]


def _saved_common_parts(state: dict, saved_count: int) -> list[dict]:
    """The saving run's optimizers' non-parameter state (param groups with the step), one per optimizer."""
    return [{k: v for k, v in part.items() if not k.startswith("param_state")}
            for part in _by_optimizer(state, saved_count)]


def _common_part_at_step(sub, saved: list[dict]) -> dict:
    """`sub`'s own non-parameter state (its param groups, from this run's config) at the saving run's step: the runs
    chain different optimizers (experts apart at EP > 1), so the saved groups do not map onto this run's."""
    steps = {group["step"] for part in saved for group in part["optimizer"]["param_groups"] if "step" in group}
    if len(steps) != 1:
        raise CheckpointError(f"the checkpoint's optimizers are at different steps ({sorted(steps)}); resume at the "
                              "expert-parallel size it was saved at")
    common = sub.state_dict()
    for group in common["optimizer"]["param_groups"]:
        group["step"] = next(iter(steps))
    return common


def _load_distributed_sub(sub, common: dict, param_state) -> None:
    # megatron-core 0.16.1's fully reshardable load raises KeyError 'step' when the per-param states hold one, and
    # load_state_dict gives every parameter the same step tensor (Adam would advance it once per parameter): load the
    # rest first, set the steps aside, load the parameter state, then give each parameter its own step back
    sub.load_state_dict(common)
    steps = {param: entry.pop("step") for param, entry in sub.optimizer.state.items() if "step" in entry}
    sub.load_parameter_state_from_fully_reshardable(param_state)
    for param, step in steps.items():
        sub.optimizer.state[param]["step"] = step.clone()


def load_model(chunks: list, loaded: LoadedCheckpoint) -> None:
    """Load this rank's part of the model from a loaded checkpoint (its pickles checked by `read_rank_files`), at
    whatever layout it was saved."""
    _load_model(chunks, loaded.directory)


def restore_training_state(loaded: LoadedCheckpoint, chunks: list, optimizer, dp_rank: int, dp_size: int) -> None:
    """Restore the optimizer (resharded to this run's TP / PP / EP / DP layout) from a loaded torch_dist checkpoint
    (its pickles checked by `read_rank_files`) and, at the saved layout, this rank's RNG state (at another, the
    streams cannot continue: the run's seed stands); collective over all ranks."""
    del dp_rank, dp_size  # the shards are resharded to any data-parallel size
    check_optimizer_layout({"use_distributed_optimizer": loaded.metadata.get("use_distributed_optimizer")},
                           is_distributed(optimizer), 0, loaded.root)
    state = dist_checkpointing.load(sharded_state(chunks, optimizer, is_loading=True),
                                    os.path.join(loaded.directory, MODEL_DIR))
    subs = sub_optimizers(optimizer)
    saved_count = state.get(OPTIMIZER_COUNT, len(subs))
    saved = _saved_common_parts(state["optimizer"], saved_count)
    if saved_count != len(subs) and not all(is_distributed(sub) for sub in subs):
        raise CheckpointError(f"--load {loaded.root} was saved by {saved_count} chained optimizer(s) (experts apart at "
                              f"EP > 1), this run chains {len(subs)}: without --use-distributed-optimizer only the "
                              "saved --expert-model-parallel-size (1, or above 1) can restore them")
    for i, sub in enumerate(subs):
        if not is_distributed(sub):
            part = _by_optimizer(state["optimizer"], len(subs))[i]
            # megatron-core 0.16.1 saves Adam's shared step only when it is not 0 (`if step:`): a checkpoint saved
            # before the first update has none, which torch's Adam cannot load
            torch_state = part["optimizer"] if "optimizer" in part else part  # under BF16: beside the fp32 params
            torch_state["state"].setdefault("common_step", torch.tensor(0.0))
            sub.load_state_dict(part)
            continue
        common = saved[i] if saved_count == len(subs) else _common_part_at_step(sub, saved)
        _load_distributed_sub(sub, common, _by_optimizer(state["optimizer"], len(subs), "param_state")[i])
    unshare_adam_steps(optimizer)
    if loaded.state.get("parallel_sizes") == _parallel_sizes():
        set_rng_state(loaded.state["rng_state"][_rank()])
