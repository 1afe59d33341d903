"""Convert between Hugging Face checkpoints and megatron-ais (Megatron-LM layout) checkpoints, in one process.

    python tools/convert_checkpoint.py hf-to-megatron --hf-dir DIR --save DIR \\
        --tensor-model-parallel-size T --pipeline-model-parallel-size P
    python tools/convert_checkpoint.py megatron-to-hf --load DIR --save DIR [--precision fp8]

Both directions use the one Megatron<->HF mapping in megatron_ais/mapping (the trainer's loader and the
resharding bridge use it too). Tensors keep their dtype, so HF -> Megatron -> HF is bit-exact. To reshard a
Megatron checkpoint, go through HF: megatron-to-hf, then hf-to-megatron with the new sizes.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time

import torch

from megatron_ais.arguments import FlagParser
from megatron_ais.checkpointing.config import HF_ASSETS, checkpoint_metadata
from megatron_ais.checkpointing.formats.torch import CHECKPOINT_VERSION, RANK_FILE, rank_dir_name, write_rank_state
from megatron_ais.checkpointing.store import (TRACKER, commit_checkpoint, iteration_dir, load_rank_state,
                                              newest_verified_iteration, prepare_staging, read_checkpoint_metadata,
                                              write_checksums, write_metadata)
from megatron_ais.errors import ArgumentValidationError, CheckpointError
from megatron_ais.bridge.quantization import (QuantizationPolicy, check_engine_shapes, engine_quantization_config,
                                              quantize_for_engine)
from megatron_ais.mapping.distributed import shard_context, write_hf_index_and_config
from megatron_ais.mapping.hf_io import (HFCheckpointReader, ShardedSafetensorsWriter, hf_tensors_from_shards,
                                        megatron_shard_from_hf)
from megatron_ais.mapping.rules import canonical_name, expert_index, megatron_param_names, split_layer, with_layer
from megatron_ais.model import ModelBuildConfig, ModelShape, check_model_layout, check_supported_hf_config, \
    load_hf_config
from megatron_ais.parallel import ParallelLayout


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
    reader = HFCheckpointReader(hf_dir)
    os.makedirs(save, exist_ok=True)
    stage = prepare_staging(save, iteration)
    for pp_rank in range(pp):
        layers = stage_layers(shape.num_layers, pp, pp_rank)
        num_local = shape.num_experts // ep
        names = megatron_param_names(shape.model_type, layers, pp_rank == 0, pp_rank == pp - 1,
                                     shape.tie_word_embeddings, range(num_local))
        for tp_rank, ep_rank in layout.shard_directories():
            ctx, expert_ctx = shard_context(build, tp_rank), shard_context(build, tp_rank % etp, expert=True)
            state = {}
            for name in names:
                layer, _ = split_layer(name)
                local = expert_index(name)
                # read expert ep_rank * num_local + local, store it under its local index
                source = name if local is None else _expert_name(name, ep_rank * num_local + local)
                shard = megatron_shard_from_hf(source, layer, shape.model_type, ctx if local is None else expert_ctx,
                                               reader.get, shape.tie_word_embeddings)
                state[_local_name(name, layers.start)] = shard.clone()
            write_rank_state(stage, tp_rank, pp_rank, pp,
                             {"model": state, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION},
                             ep_rank, ep)
    write_metadata(stage, checkpoint_metadata(build, hf_config, iteration, source=os.path.abspath(hf_dir)), hf_dir)
    write_checksums(stage)
    return commit_checkpoint(save, iteration)


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


def megatron_to_hf(load: str, save: str, allow_unverified: bool = False, precision: str = "bf16",
                   max_shard_bytes: int = 5 * 10 ** 9) -> str:
    """Write a HF model directory (sharded safetensors with their index, config, tokenizer, generation config) from a
    Megatron checkpoint saved at any layout; return it. `precision` bf16 keeps the checkpoint's tensors bit for bit
    (BF16 for a BF16 run); fp8 writes what the bridge sends an FP8 engine: blockwise e4m3 (128x128, fp32
    `weight_scale_inv`) where the bridge's policy quantizes, BF16 elsewhere, with the `quantization_config` vLLM and
    SGLang read. Tensors are written one by one into shards of at most `max_shard_bytes`."""
    if precision not in ("bf16", "fp8"):
        raise ArgumentValidationError(f"--precision {precision!r} must be bf16 or fp8")
    if max_shard_bytes <= 0:
        raise ArgumentValidationError("--max-shard-size-mb must be positive")
    if os.path.isdir(save) and os.listdir(save):
        raise ArgumentValidationError(f"--save {save} is not empty: name a new directory (an export never overwrites)")
    iteration = newest_verified_iteration(load, allow_unverified)
    meta = read_checkpoint_metadata(load, iteration, allow_unverified)
    hf_config = dict(meta["hf_config"])
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    ep = meta.get("expert_model_parallel_size", 1)
    etp = meta.get("expert_tensor_parallel_size") or tp
    if tp % etp:
        raise CheckpointError(f"{load}: expert-TP {etp} does not divide TP {tp}; the converter cannot place its shards")
    build = _build_config(hf_config, ParallelLayout(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp),
                          meta["make_vocab_size_divisible_by"])
    policy = QuantizationPolicy(precision="fp8") if precision == "fp8" else None
    if policy is not None:
        check_engine_shapes(build.shape, policy, 1)
    # written beside `save` and renamed at the end: a failed export (a non-finite tensor, a full disk) leaves nothing
    staging = f"{os.path.normpath(save)}.partial-{os.getpid()}"
    try:
        writer, names = ShardedSafetensorsWriter(staging, max_shard_bytes), []
        for pp_rank in range(pp):
            for hf_name, tensor in _stage_hf_tensors(load, iteration, build, pp_rank):
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise CheckpointError(f"{load} iteration {iteration}: {hf_name} holds NaN/Inf; nothing exported")
                names.append(hf_name)
                for name, out in quantize_for_engine([(hf_name, tensor)], policy) if policy else [(hf_name, tensor)]:
                    writer.add(name, out)
        weight_map = writer.close()
        if policy is not None:
            hf_config.pop("quantization_config", None)
            hf_config.update(quantization_config=engine_quantization_config(policy, names), dtype="bfloat16")
        write_hf_index_and_config(staging, weight_map, hf_config,
                                  os.path.join(iteration_dir(load, iteration), HF_ASSETS), total_size=writer.total_bytes)
        os.replace(staging, save)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return save


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
    to_h.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                      help="bf16: the checkpoint's tensors bit for bit (BF16 for a BF16 run); fp8: what an FP8 engine "
                           "serves, as the bridge sends it (blockwise e4m3, 128x128, fp32 weight_scale_inv, with the "
                           "quantization_config vLLM and SGLang read).")
    to_h.add_argument("--max-shard-size-mb", type=float, default=5000.0,
                      help="Largest safetensors shard (a larger tensor is a shard of its own); tensors are written one "
                           "by one, so the converter holds about one shard in memory.")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
        else:
            out = megatron_to_hf(args.load, args.save, args.allow_unverified_checkpoint, args.precision,
                                 int(args.max_shard_size_mb * 1e6))
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as err:  # ArgumentValidationError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.direction}: wrote {out} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
