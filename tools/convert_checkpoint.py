"""Convert between Hugging Face checkpoints and megatron-ais (Megatron-LM layout) checkpoints, and between the
two checkpoint formats.

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir DIR --save DIR \\
        --tensor-model-parallel-size T --pipeline-model-parallel-size P
    python tools/convert_checkpoint.py megatron-to-hf --load DIR --save DIR [--precision fp8|nvfp4|mxfp4]
    python tools/convert_checkpoint.py torch-to-torch-dist --load DIR --save DIR

Both HF directions use the one Megatron<->HF mapping in megatron_ais/mapping (the trainer's loader and the
resharding bridge use it too). Tensors keep their dtype, so HF -> Megatron -> HF is bit-exact. hf-to-megatron
writes the `torch` format in one process; megatron-to-hf reads either format (a `torch_dist` checkpoint through
megatron-core, resharded to one rank in one spawned process). torch-to-torch-dist rewrites a run's `torch`
checkpoint (model, optimizer, every data-parallel rank's RNG state, run state) as `torch_dist` at the same iteration:
it starts the saved layout's world as local gloo CPU processes, each resuming from it as a run does, and saves
through the store. To reshard a `torch` checkpoint, convert it to `torch_dist` (which reshards on load) or go
through HF: megatron-to-hf, then hf-to-megatron with the new sizes.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shutil
import sys
import time

import torch
from megatron.core import parallel_state as ps

from megatron_ais.arguments import TrainerConfig, build_parser as trainer_parser
from megatron_ais.checkpointing.config import HF_ASSETS, checkpoint_metadata, warn
from megatron_ais.checkpointing.formats import torch_dist
from megatron_ais.checkpointing.formats.torch import CHECKPOINT_VERSION, RANK_FILE, rank_dir_name, write_rank_state
from megatron_ais.checkpointing.lock import RunLock
from megatron_ais.checkpointing.preflight import check_room, check_writable
from megatron_ais.checkpointing.ranks import CheckpointRanks
from megatron_ais.checkpointing.store import (FORMATS, TRACKER, commit_checkpoint, committed_iterations,
                                              directory_format, iteration_dir, load_rank_state,
                                              newest_verified_iteration, prepare_staging, read_checkpoint_metadata,
                                              save_checkpoint, staging_dir, usable_iterations, write_checksums,
                                              write_metadata)
from megatron_ais.errors import ArgumentValidationError, CheckpointError, one_line
from megatron_ais.flags import FlagParser
from megatron_ais.bridge.quantization import (QUANTIZED_PRECISIONS, QuantizationPolicy, check_engine_shapes,
                                              engine_quantization_config, quantize_for_engine)
from megatron_ais.mapping.distributed import shard_context, write_hf_index_and_config
from megatron_ais.mapping.hf_io import (HFCheckpointReader, ShardedSafetensorsWriter, checked_reader,
                                        hf_tensors_from_shards, megatron_shard_from_hf)
from megatron_ais.mapping.rules import canonical_name, expert_index, megatron_param_names, split_layer, with_layer
from megatron_ais.initialize import initialize_megatron
from megatron_ais.launch import spawn
from megatron_ais.model import ModelBuildConfig, ModelShape, build_model_chunks, check_model_layout, \
    check_supported_hf_config, load_hf_config, unwrap_model
from megatron_ais.parallel import ParallelLayout
from megatron_ais.training import build_optimizer, initialize_trainer, load_policy_chunks, wrap_ddp

EXPORT_PRECISIONS = ("bf16", *QUANTIZED_PRECISIONS)


def _build_config(hf_config: dict, layout: ParallelLayout, divisible_by: int) -> ModelBuildConfig:
    return ModelBuildConfig(shape=ModelShape.from_hf_config(hf_config), layout=layout,
                            make_vocab_size_divisible_by=divisible_by)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Return the global layer indices of one pipeline stage (even split, as megatron's default)."""
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def _local_name(name: str, offset: int) -> str:
    layer, _ = split_layer(name)
    return name if layer is None else with_layer(name, layer - offset)


def _expert_name(name: str, expert: int) -> str:
    """Return an expert parameter's name with another expert index."""
    return re.sub(r"\.local_experts\.\d+\.", f".local_experts.{expert}.", name)


def hf_to_megatron(hf_dir: str, save: str, tp: int, pp: int, divisible_by: int = 128, iteration: int = 0,
                   ep: int = 1, etp: int | None = None) -> str:
    """Write a Megatron checkpoint of the HF model at TP x PP (x EP x expert-TP for MoE: one directory per position
    of `shard_directories`, with the dense TP shard and that EP rank's experts under their local index, split over
    expert-TP); return its iteration directory."""
    hf_config = load_hf_config(hf_dir)
    check_supported_hf_config(hf_config)  # what training would refuse is not converted either
    if os.path.isfile(os.path.join(save, TRACKER)):
        raise ArgumentValidationError(f"--save {save} already holds a checkpoint run (its {TRACKER}); converting into "
                                      "it would re-point the run at this iteration: choose an empty directory")
    layout = ParallelLayout(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp, sequence_parallel=tp > 1)
    check_model_layout(hf_config, layout, None, f"{hf_dir}/config.json")
    etp = layout.expert_tensor_size
    if tp % etp:
        raise ArgumentValidationError(f"--expert-tensor-parallel-size {etp} must divide --tensor-model-parallel-size "
                                      f"{tp} (megatron places expert-TP rank k on the TP ranks equal to k modulo it)")
    build = _build_config(hf_config, layout, divisible_by)
    shape = build.shape
    read = checked_reader(HFCheckpointReader(hf_dir), shape)
    created = not os.path.exists(save)
    os.makedirs(save, exist_ok=True)
    stage = prepare_staging(save, iteration)
    try:  # a tensor that cannot be read or is refused leaves nothing behind
        for pp_rank in range(pp):
            _write_stage_shards(stage, read, build, layout, pp_rank, iteration)
        write_metadata(stage, checkpoint_metadata(build, hf_config, iteration, source=os.path.abspath(hf_dir)),
                       hf_dir)
        write_checksums(stage)
    except BaseException:
        shutil.rmtree(save if created else stage, ignore_errors=True)
        raise
    return commit_checkpoint(save, iteration)


def _write_stage_shards(stage: str, read, build: ModelBuildConfig, layout: ParallelLayout, pp_rank: int,
                        iteration: int) -> None:
    """Write one pipeline stage's shard directories (each TP x EP position of `layout.shard_directories`)."""
    shape, pp, ep = build.shape, layout.pipeline, layout.expert
    layers = stage_layers(shape.num_layers, pp, pp_rank)
    num_local = shape.num_experts // ep
    names = megatron_param_names(shape.model_type, layers, pp_rank == 0, pp_rank == pp - 1,
                                 shape.tie_word_embeddings, range(num_local))
    for tp_rank, ep_rank in layout.shard_directories():
        ctx = shard_context(build, tp_rank)
        expert_ctx = shard_context(build, tp_rank % layout.expert_tensor_size, expert=True)
        state = {}
        for name in names:
            layer, _ = split_layer(name)
            local = expert_index(name)
            # read expert ep_rank * num_local + local, store it under its local index
            source = name if local is None else _expert_name(name, ep_rank * num_local + local)
            shard = megatron_shard_from_hf(source, layer, shape.model_type, ctx if local is None else expert_ctx,
                                           read, shape.tie_word_embeddings)
            state[_local_name(name, layers.start)] = shard.clone()
        write_rank_state(stage, tp_rank, pp_rank, pp,
                         {"model": state, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION},
                         ep_rank, ep)


def _stage_hf_tensors(load: str, iteration: int, build: ModelBuildConfig, pp_rank: int):
    """Yield (HF name, tensor) of one pipeline stage, tensor by tensor, from its shard directories (mapped, not
    read whole: a tensor's pages are read when it is built).

    Under expert parallelism the shard directories are those of the ranks that saved (expert-data-parallel rank 0):
    with expert-TP = TP every TP x EP directory, with expert-TP < TP only some (at TP2 x EP2 x expert-TP 1:
    `mp_rank_00_000` and `mp_rank_01_001`). Dense weights come from any directory of each TP rank (they are the
    same in every EP rank's); EP rank e's experts, expert-TP shard k, from a directory (t, e) with t % expert-TP == k
    (megatron lays expert-TP rank k on the ranks whose TP rank is k modulo expert-TP)."""
    shape, layout = build.shape, build.layout
    tp, pp, ep, etp = layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor_size
    offset, num_local = stage_layers(shape.num_layers, pp, pp_rank).start, shape.num_experts // ep
    saved = {(t, e) for t in range(tp) for e in range(ep)
             if os.path.isfile(os.path.join(iteration_dir(load, iteration), rank_dir_name(t, pp_rank, pp, e, ep),
                                            RANK_FILE))}

    def models(pairs: list[tuple[int, int]], experts: bool) -> list[dict]:
        """The model states of these shard directories, with only the expert (or only the dense) tensors."""
        out = []
        for t, e in pairs:
            state = load_rank_state(load, t, pp_rank, pp, iteration, e, ep, mmap=True)
            if "model" not in state:
                raise CheckpointError("checkpoints saved with --virtual-pipeline-model-parallel-size are not "
                                      "supported by the converter yet")
            out.append({k: v for k, v in state["model"].items() if not k.endswith("_extra_state")
                        and (expert_index(canonical_name(k)) is not None) == experts})
        return out

    def first_saved(candidates, what: str) -> tuple[int, int]:
        found = next((c for c in candidates if c in saved), None)
        if found is None:
            raise CheckpointError(f"{load} iteration {iteration}: no shard directory holds {what} of pipeline "
                                  f"stage {pp_rank}")
        return found

    jobs = [(models([first_saved([(t, e) for e in range(ep)], f"TP rank {t}") for t in range(tp)], False),
             shard_context(build, 0), None)]
    for e in range(ep if shape.is_moe else 0):
        pairs = [first_saved([(t, e) for t in range(k, tp, etp)], f"expert-TP rank {k} of EP rank {e}")
                 for k in range(etp)]
        jobs.append((models(pairs, True), shard_context(build, 0, expert=True), e))
    for states, ctx, ep_rank in jobs:
        for local_name in states[0]:
            name = canonical_name(local_name)
            if ep_rank is not None:
                name = _expert_name(name, ep_rank * num_local + expert_index(name))
            layer, _ = split_layer(name)
            if layer is not None:
                layer += offset
                name = with_layer(name, layer)
            yield from hf_tensors_from_shards(name, layer, shape.model_type, ctx, [m[local_name] for m in states],
                                              shape.tie_word_embeddings)


def precision_of(dtype: torch.dtype) -> str:
    """The trainer's --bf16 / --fp32 for a checkpoint whose model tensors have `dtype` (fp32 stays fp32; anything
    else is what a run trains in BF16)."""
    return "fp32" if dtype == torch.float32 else "bf16"


def _write_hf_model(staging: str, tensors, hf_config: dict, policy: QuantizationPolicy | None, max_shard_bytes: int,
                    assets_dir: str, where: str) -> None:
    """Write (HF name, tensor) pairs into a HF model directory: safetensors shards of at most `max_shard_bytes`
    (quantized for an FP8 or 4-bit engine under `policy`), their index, the config and the checkpoint's HF assets."""
    writer, names = ShardedSafetensorsWriter(staging, max_shard_bytes), []

    def checked():
        for hf_name, tensor in tensors:
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise CheckpointError(f"{where}: {hf_name} holds NaN/Inf; nothing exported")
            names.append(hf_name)
            yield hf_name, tensor

    for name, out in quantize_for_engine(checked(), policy) if policy else checked():
        writer.add(name, out)
    weight_map = writer.close()
    hf_config = dict(hf_config)
    if policy is not None:
        hf_config.pop("quantization_config", None)
        hf_config.update(quantization_config=engine_quantization_config(policy, names), dtype="bfloat16")
    write_hf_index_and_config(staging, weight_map, hf_config, assets_dir, total_size=writer.total_bytes)


def _whole_model_hf_tensors(chunks: list, build: ModelBuildConfig):
    """Yield (HF name, tensor) of a model held whole by one rank (TP1 x PP1 x EP1: its layer and expert indices are
    the global ones)."""
    shape = build.shape
    for local_name, param in unwrap_model(chunks[0]).named_parameters():
        name = canonical_name(local_name)
        layer, _ = split_layer(name)
        ctx = shard_context(build, 0, expert=expert_index(name) is not None)
        yield from hf_tensors_from_shards(name, layer, shape.model_type, ctx, [param.detach()],
                                          shape.tie_word_embeddings)


def hide_gpus() -> None:
    """The converter's ranks are gloo CPU processes, as many as the saved layout has, whatever GPUs the host has
    (before CUDA starts in this process: megatron would put rank r on GPU r, and load a whole model onto GPU 0)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _export_torch_dist(directory: str, build: ModelBuildConfig, staging: str, hf_config: dict,
                       policy: QuantizationPolicy | None, max_shard_bytes: int) -> None:
    """The one rank of a one-process world: load a torch_dist checkpoint into a model held whole (megatron-core
    reshards it from the saved layout; built in the saved tensors' dtype, so they stay bit for bit) and write it as
    a HF model into `staging`."""
    hide_gpus()
    initialize_megatron(build.layout, seed=0)
    model_dir = os.path.join(directory, torch_dist.MODEL_DIR)
    torch_dist.check_is_data(model_dir)  # before anything unpickles it
    saved = torch_dist.read_dcp_metadata(model_dir).state_dict_metadata["embedding.word_embeddings.weight"]
    build = dataclasses.replace(build, precision=precision_of(saved.properties.dtype))
    chunks = build_model_chunks(build)
    torch_dist.load_model_state(chunks, directory)
    _write_hf_model(staging, _whole_model_hf_tensors(chunks, build), hf_config, policy, max_shard_bytes,
                    os.path.join(directory, HF_ASSETS), directory)


def megatron_to_hf(load: str, save: str, allow_unverified: bool = False, precision: str = "bf16",
                   max_shard_bytes: int = 5 * 10 ** 9) -> str:
    """Write a HF model directory (sharded safetensors with their index, config, tokenizer, generation config) from a
    Megatron checkpoint saved in either format at any layout; return it. `precision` bf16 keeps the checkpoint's
    tensors bit for bit (BF16 for a BF16 run); fp8 writes what the bridge sends an FP8 engine: blockwise e4m3
    (128x128, fp32 `weight_scale_inv`) where the bridge's policy quantizes, BF16 elsewhere, with the
    `quantization_config` vLLM and SGLang read; nvfp4 / mxfp4 what a 4-bit engine loads (ModelOpt's W4A16 NVFP4,
    compressed-tensors' MXFP4), with the `quantization_config` vLLM reads. Tensors are written one by
    one into shards of at most `max_shard_bytes`; a torch_dist checkpoint is read whole into one spawned process."""
    if precision not in EXPORT_PRECISIONS:
        raise ArgumentValidationError(f"--precision {precision!r} must be one of {', '.join(EXPORT_PRECISIONS)}")
    if max_shard_bytes <= 0:
        raise ArgumentValidationError("--max-shard-size-mb must be positive")
    if os.path.exists(save) and not os.path.isdir(save):
        raise ArgumentValidationError(f"--save {save} is a file: name a new directory")
    if os.path.isdir(save) and os.listdir(save):
        raise ArgumentValidationError(f"--save {save} is not empty: name a new directory (an export never overwrites)")
    check_writable(os.path.dirname(os.path.abspath(save)), "--save's parent directory")
    iteration = newest_verified_iteration(load, allow_unverified)
    directory = iteration_dir(load, iteration)
    meta = read_checkpoint_metadata(load, iteration, allow_unverified)
    hf_config = dict(meta["hf_config"])
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    ep = meta.get("expert_model_parallel_size", 1)
    etp = meta.get("expert_tensor_parallel_size") or tp
    if tp % etp:
        raise CheckpointError(f"{load}: expert-TP {etp} does not divide TP {tp}; the converter cannot place its shards")
    build = _build_config(hf_config, ParallelLayout(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp),
                          meta["make_vocab_size_divisible_by"])
    policy = QuantizationPolicy(precision=precision) if precision != "bf16" else None
    if policy is not None:
        check_engine_shapes(build.shape, policy, 1, export=True)
    # written beside `save` and renamed at the end: a failed export (a non-finite tensor, a full disk) leaves nothing
    staging = f"{os.path.normpath(save)}.partial-{os.getpid()}"
    try:
        if directory_format(directory) is torch_dist:
            whole = _build_config(hf_config, ParallelLayout(), meta["make_vocab_size_divisible_by"])
            # no time limit: a large model is read whole
            spawn(1, _export_torch_dist, directory, whole, staging, hf_config, policy, max_shard_bytes, timeout=None)
        else:
            tensors = (t for pp_rank in range(pp) for t in _stage_hf_tensors(load, iteration, build, pp_rank))
            _write_hf_model(staging, tensors, hf_config, policy, max_shard_bytes, os.path.join(directory, HF_ASSETS),
                            f"{load} iteration {iteration}")
        os.replace(staging, save)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return save


def saved_layout_flags(metadata: dict, precision: str) -> list[str]:
    """The trainer flags that build a checkpoint's model, parallel layout and optimizer as they were saved. The
    conversion runs no forward, so --seq-length is the shortest the layout accepts."""
    tp = metadata["tensor_model_parallel_size"]
    ep = metadata.get("expert_model_parallel_size", 1)
    etp = metadata.get("expert_tensor_parallel_size") or tp
    flags = [f"--{precision}", "--tensor-model-parallel-size", tp,
             "--pipeline-model-parallel-size", metadata["pipeline_model_parallel_size"],
             "--make-vocab-size-divisible-by", metadata["make_vocab_size_divisible_by"], "--seq-length", tp]
    flags += ["--expert-model-parallel-size", ep] if ep > 1 else []
    flags += ["--expert-tensor-parallel-size", etp] if etp != tp else []
    # as hf-to-megatron lays TP out (megatron needs it for MoE under TP); it changes no parameter or optimizer state
    flags += ["--sequence-parallel"] if tp > 1 else []
    flags += ["--use-distributed-optimizer"] if metadata.get("use_distributed_optimizer") else []
    return [str(f) for f in flags]


def saved_world_size(metadata: dict) -> int:
    """The number of ranks a checkpoint was saved by: TP x PP x DP (expert parallelism lies within TP x DP). A
    weights-only checkpoint records no DP size: it is rewritten at the fewest DP ranks its EP x expert-TP fits in."""
    tp = metadata["tensor_model_parallel_size"]
    experts = metadata.get("expert_model_parallel_size", 1) * (metadata.get("expert_tensor_parallel_size") or tp)
    dp = metadata.get("data_parallel_size") or experts // math.gcd(tp, experts)
    return tp * metadata["pipeline_model_parallel_size"] * dp


def _directory_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(directory) for n in names)


def _convertible_iteration(load: str) -> int:
    """The newest usable iteration of a torch checkpoint directory; a source that is none is refused naming --load."""
    if not os.path.isdir(load):
        raise ArgumentValidationError(f"--load {load} is not a directory: name a megatron-ais checkpoint directory "
                                      f"(one with {TRACKER})")
    iteration = usable_iterations(load)[0]
    directory = iteration_dir(load, iteration)
    if directory_format(directory) is torch_dist:
        raise ArgumentValidationError(f"--load {load}: iteration {iteration} is a torch_dist checkpoint already; "
                                      "nothing to convert (runs and megatron-to-hf read it as it is)")
    return iteration


def _check_destination(load: str, save: str, nbytes: int) -> None:
    """Refuse a --save that is --load, holds checkpoints, cannot be written or lacks room for `nbytes`."""
    if os.path.realpath(save) == os.path.realpath(load):
        raise ArgumentValidationError(f"--save {save} is --load: name another, empty directory")
    committed = committed_iterations(save)
    if committed or os.path.isfile(os.path.join(save, TRACKER)):
        newest = f" (newest: iteration {committed[0]})" if committed else f" (its {TRACKER})"
        raise ArgumentValidationError(f"--save {save} already holds checkpoints{newest}: name an empty directory (a "
                                      "conversion never writes over checkpoints)")
    check_writable(save, "--save")
    check_room(save, nbytes, "--save")


def _torch_precision(load: str, iteration: int, metadata: dict) -> str:
    """The precision the checkpoint was saved in, from its first shard's model tensors (mapped, not read whole)."""
    state = load_rank_state(load, 0, 0, metadata["pipeline_model_parallel_size"], iteration, 0,
                            metadata.get("expert_model_parallel_size", 1), mmap=True)
    if "model" not in state:
        raise CheckpointError(f"--load {load}: checkpoints saved with --virtual-pipeline-model-parallel-size are not "
                              "supported by the converter yet")
    return precision_of(next(t.dtype for t in state["model"].values() if t.is_floating_point()))


def _rewrite_rank(trainer: TrainerConfig, iteration: int, save: str) -> None:
    """One rank of the saved layout: resume from --load as a run does (model; optimizer, with the distributed
    optimizer's shards; this DP rank's RNG state), then save the same iteration, metadata and run state as
    torch_dist through the store."""
    hide_gpus()
    _, build = initialize_trainer(trainer)
    distributed = trainer.training.use_distributed_optimizer
    source = dataclasses.replace(trainer.weights, iteration=iteration)  # the iteration checked, not a fallback
    chunks, _, loaded = load_policy_chunks(build, source, distributed)
    optimizer = None
    if "optimizer" in loaded.state:  # a weights-only checkpoint (converted from HF) stays one
        optimizer = build_optimizer(wrap_ddp(chunks, distributed), trainer.training)
        FORMATS[loaded.format].restore_training_state(loaded, chunks, optimizer, ps.get_data_parallel_rank(),
                                                      ps.get_data_parallel_world_size())
    save_checkpoint(save, iteration, chunks, loaded.metadata, loaded.assets_dir, CheckpointRanks.from_parallel_state(),
                    optimizer, loaded.run_state, ps.get_data_parallel_group(), fmt=torch_dist)


def torch_to_torch_dist(load: str, save: str) -> str:
    """Rewrite the newest usable torch checkpoint of `load` as a torch_dist checkpoint of the same iteration in the
    empty directory `save`; return its iteration directory. The saved layout's world runs as local gloo CPU
    processes, each resuming from `load` as a run does (files verified against their checksums, read as data only)
    and saving through the store: staged, checksummed, committed by rename, so a failure leaves no checkpoint."""
    iteration = _convertible_iteration(load)
    metadata = read_checkpoint_metadata(load, iteration)
    _check_destination(load, save, _directory_bytes(iteration_dir(load, iteration)))
    flags = ["--load", load, *saved_layout_flags(metadata, _torch_precision(load, iteration, metadata))]
    world = saved_world_size(metadata)
    trainer = TrainerConfig.from_args(trainer_parser("torch-to-torch-dist").parse_args(flags), world)
    lock = RunLock(save)  # no run starts saving into `save` while the conversion writes there
    message = lock.acquire()
    if message:
        warn(message)
    try:
        spawn(world, _rewrite_rank, trainer, iteration, save, timeout=None)  # a large run's optimizer takes long
    except BaseException:
        shutil.rmtree(staging_dir(save, iteration), ignore_errors=True)
        raise
    finally:
        lock.release()
    return iteration_dir(save, iteration)


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_m = sub.add_parser("hf-to-megatron", help="HF safetensors -> sharded Megatron checkpoint",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    to_m.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors).")
    to_m.add_argument("--save", required=True, help="Megatron checkpoint directory to write.")
    to_m.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size of the checkpoint.")
    to_m.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size of the checkpoint.")
    to_m.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                      help="Expert-TP size of the checkpoint (MoE; default: TP). Below TP only the shard directories "
                           "megatron's ranks hold are written, as a run at that layout saves them.")
    to_m.add_argument("--expert-model-parallel-size", type=int, default=1,
                      help="EP size of the checkpoint (MoE: one directory per expert-parallel rank).")
    to_m.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                      help="Pad the vocabulary to a multiple of this x TP (must match training).")
    to_h = sub.add_parser("megatron-to-hf", help="sharded Megatron checkpoint -> HF safetensors",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    to_h.add_argument("--load", required=True, help="Megatron checkpoint directory to read (latest iteration).")
    to_h.add_argument("--save", required=True, help="HF model directory to write.")
    to_h.add_argument("--allow-unverified-checkpoint", action="store_true",
                      help="Read a checkpoint that has no checksums.json (written by another tool); refused otherwise.")
    to_h.add_argument("--precision", choices=EXPORT_PRECISIONS, default="bf16",
                      help="bf16: the checkpoint's tensors bit for bit (BF16 for a BF16 run); fp8: what an FP8 engine "
                           "serves, as the bridge sends it (blockwise e4m3, 128x128, fp32 weight_scale_inv, with the "
                           "quantization_config vLLM and SGLang read); nvfp4 / mxfp4: what a 4-bit engine serves "
                           "(ModelOpt's W4A16 NVFP4, compressed-tensors' MXFP4).")
    to_h.add_argument("--max-shard-size-mb", type=float, default=5000.0,
                      help="Largest safetensors shard (a larger tensor is a shard of its own); tensors are written one "
                           "by one, so the converter holds about one shard in memory (a torch_dist checkpoint is "
                           "read whole into one process).")
    to_d = sub.add_parser("torch-to-torch-dist", help="a run's torch checkpoint -> torch_dist, same iteration",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    to_d.add_argument("--load", required=True,
                      help="torch checkpoint directory to read (its newest usable iteration: model, optimizer, RNG "
                           "states, run state). Its saved layout's world runs here as TP x PP x DP gloo CPU processes.")
    to_d.add_argument("--save", required=True,
                      help="Empty directory to write the torch_dist checkpoint into (same iteration and metadata); "
                           "a run resumes from it with --load, at any TP / PP / EP / DP layout.")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    start = time.time()
    try:
        if args.direction == "hf-to-megatron":
            for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                         "expert_tensor_parallel_size", "make_vocab_size_divisible_by"):
                if getattr(args, flag) is not None and getattr(args, flag) < 1:
                    raise ArgumentValidationError(f"--{flag.replace('_', '-')} must be a positive integer")
            out = hf_to_megatron(args.hf_dir, args.save, args.tensor_model_parallel_size,
                                 args.pipeline_model_parallel_size, args.make_vocab_size_divisible_by,
                                 ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
        elif args.direction == "megatron-to-hf":
            if not (math.isfinite(args.max_shard_size_mb) and args.max_shard_size_mb > 0):
                raise ArgumentValidationError(f"--max-shard-size-mb {args.max_shard_size_mb} must be a positive number")
            out = megatron_to_hf(args.load, args.save, args.allow_unverified_checkpoint, args.precision,
                                 int(args.max_shard_size_mb * 1e6))
        else:
            out = torch_to_torch_dist(args.load, args.save)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as err:  # ArgumentValidationError is a ValueError
        print(one_line(parser.prog, err), file=sys.stderr)
        return 2
    print(f"{args.direction}: wrote {out} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
