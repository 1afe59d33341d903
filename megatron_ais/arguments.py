"""Megatron-style `--kebab-case` flags, grouped by concern, and their validation.

Validation runs before anything heavy (process groups, models) starts, and every error names the flag and the
fix. Flags describe what the run does; the model's shape comes from the Hugging Face `config.json` given by
`--hf-dir` (or stored in a `--load` checkpoint), so shape errors name both the config value and the flag.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Iterable


class ArgumentValidationError(ValueError):
    """A flag (or a flag together with the model config) describes an impossible run."""


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Model source, precision and implementation flags."""
    g = parser.add_argument_group("model")
    g.add_argument("--hf-dir", default=None,
                   help="Hugging Face model directory (config.json, *.safetensors, tokenizer). Its config defines "
                        "the architecture (llama, qwen2, qwen3, qwen3_moe); its weights initialise the run unless --load is given.")
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                           help="Train in BF16 through megatron's Float16Module with fp32 main weights (default).")
    precision.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                           help="Train in FP32 (exact comparisons, debugging).")
    g.set_defaults(precision="bf16")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this value times --tensor-model-parallel-size, as "
                        "Megatron-LM does. Padded rows are added on load and trimmed on export.")
    g.add_argument("--transformer-impl", choices=("auto", "transformer_engine", "local"), default="auto",
                   help="Layer spec: Transformer Engine when importable ('auto'), or megatron's local modules.")
    g.add_argument("--seq-length", type=int, default=256,
                   help="Longest sequence (prompt + response) the trainer sees; also the rotary table length.")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Tensor, pipeline, virtual-pipeline, context, expert and data parallel sizes."""
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="TP: shard attention heads, MLP and vocabulary over this many ranks.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="PP: split the layers into this many stages.")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="Model chunks per pipeline stage for the interleaved 1F1B schedule (needs PP > 1).")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP: split sequences over this many ranks. Not supported yet (only 1): the training steps "
                        "do not split sequences, and megatron's CP attention needs Transformer Engine.")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: distribute MoE experts over this many ranks.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="TP size inside each expert (default: --tensor-model-parallel-size).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism for norms and dropout (needs TP > 1).")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state over data-parallel ranks (ZeRO-1).")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Optimizer, batch and schedule flags."""
    g = parser.add_argument_group("training")
    g.add_argument("--seed", type=int, default=1234, help="Seed for data, initialisation and dropout.")
    g.add_argument("--micro-batch-size", type=int, default=2, help="Sequences per micro-batch per DP rank.")
    g.add_argument("--lr", type=float, default=1e-3, help="Peak learning rate (Adam).")
    g.add_argument("--weight-decay", type=float, default=0.0, help="Decoupled weight decay.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Clip the global gradient norm to this value.")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """Checkpoint load/save flags."""
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--load", default=None,
                   help="Megatron checkpoint directory to start from (written by tools/convert_checkpoint.py or "
                        "a previous run). Overrides the weights of --hf-dir.")
    g.add_argument("--save", default=None,
                   help="Directory to write checkpoints to (model, optimizer, RNG states, run state; atomic, with "
                        "a checksum per file). Point --load at it to resume.")
    g.add_argument("--save-interval", type=int, default=None, help="Save a checkpoint every this many steps.")
    g.add_argument("--keep-checkpoints", type=int, default=2,
                   help="Committed iterations kept under --save (older ones are removed); more than one lets a "
                        "corrupted newest checkpoint fall back to the previous one.")
    g.add_argument("--finetune", action="store_true",
                   help="Take only the weights of --load: fresh optimizer, RNG and step counter (like Megatron-LM). "
                        "Implied for weights-only checkpoints (converted from HF or written by SFT runs).")


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """Output, console and tensorboard flags."""
    g = parser.add_argument_group("logging")
    g.add_argument("--output-dir", default="runs/default",
                   help="Run directory: tensorboard events, summary.json, figures.")
    g.add_argument("--log-interval", type=int, default=1, help="Print one console line every this many steps.")
    g.add_argument("--tensorboard-dir", default=None,
                   help="Tensorboard event directory (default: <output-dir>/tensorboard).")


ALL_GROUPS: tuple[Callable[[argparse.ArgumentParser], None], ...] = (
    add_model_args, add_parallel_args, add_training_args, add_checkpoint_args, add_logging_args)


def build_parser(description: str, groups: Iterable[Callable[[argparse.ArgumentParser], None]] = ALL_GROUPS
                 ) -> argparse.ArgumentParser:
    """Return a parser with the given flag groups."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in groups:
        add(parser)
    return parser


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"), None)
        if value is not None and value < 1:
            raise ArgumentValidationError(f"--{name} {value} must be a positive integer")


def model_parallel_size(args: argparse.Namespace) -> int:
    """Return TP x PP x CP: the ranks one data-parallel replica spans."""
    return args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size


def validate_parallel_args(args: argparse.Namespace, world_size: int | None = None) -> None:
    """Check the parallel sizes against each other and against the world size."""
    _positive(args, "tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size",
              "expert-model-parallel-size", "expert-tensor-parallel-size", "virtual-pipeline-model-parallel-size",
              "make-vocab-size-divisible-by", "micro-batch-size", "seq-length")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is not None and pp == 1:
        raise ArgumentValidationError(
            "--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1; drop the flag or "
            "raise the PP size")
    from megatron_ais import platform

    if args.virtual_pipeline_model_parallel_size is not None and pp == 2 and not platform.is_cuda():
        # at PP2 a stage's previous and next stage are one rank, and the interleaved schedule exchanges activations
        # and gradients with it in both directions in one batch: gloo matches them by peer and tag only and swaps
        # them (wrong losses, found by tests/training/test_ddp_training.py); NCCL keeps their order
        raise ArgumentValidationError(
            "--virtual-pipeline-model-parallel-size with --pipeline-model-parallel-size 2 gives wrong results over "
            "gloo (CPU): use a PP size of 3 or more, or drop the virtual pipeline")
    if args.sequence_parallel and tp == 1:
        raise ArgumentValidationError("--sequence-parallel needs --tensor-model-parallel-size > 1; drop the flag")
    if args.sequence_parallel and args.seq_length % tp:
        raise ArgumentValidationError(f"--sequence-parallel splits sequences over TP: --seq-length {args.seq_length} "
                                      f"must be a multiple of --tensor-model-parallel-size {tp}")
    if args.context_parallel_size > 1:
        raise ArgumentValidationError(
            f"--context-parallel-size {args.context_parallel_size}: the training steps do not split sequences over "
            "context-parallel ranks (and megatron's context-parallel attention needs Transformer Engine); use 1")
    if world_size is not None:
        mp = model_parallel_size(args)
        if world_size % mp:
            raise ArgumentValidationError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp} x --context-parallel-size {args.context_parallel_size} = {mp}; "
                f"launch a multiple of {mp} ranks or change the parallel sizes")
        dp = world_size // mp
        # megatron forms expert groups from the TP x DP (x CP) ranks of each pipeline stage
        expert_mp = args.expert_model_parallel_size * (args.expert_tensor_parallel_size or tp) * pp
        if world_size % expert_mp:
            raise ArgumentValidationError(
                f"world size {world_size} is not divisible by --expert-model-parallel-size "
                f"{args.expert_model_parallel_size} x expert-TP {args.expert_tensor_parallel_size or tp} x "
                f"--pipeline-model-parallel-size {pp} = {expert_mp}; change the expert-parallel sizes")
        gbs = getattr(args, "global_batch_size", None)
        if gbs is not None and gbs % (args.micro_batch_size * dp):
            raise ArgumentValidationError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size {args.micro_batch_size} x "
                f"data-parallel size {dp}; use a multiple of {args.micro_batch_size * dp}")


def validate_model_args(args: argparse.Namespace, hf_config: dict[str, Any], source: str = "config.json") -> None:
    """Check the model's shape (from a HF config) against the parallel flags."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    layers = hf_config["num_hidden_layers"]
    ffn = hf_config["intermediate_size"]
    if heads % tp:
        raise ArgumentValidationError(
            f"--num-attention-heads {heads} ({source}) is not divisible by --tensor-model-parallel-size {tp}; "
            f"use a TP size that divides {heads}")
    if kv_heads % tp and tp % kv_heads:
        raise ArgumentValidationError(
            f"--num-key-value-heads {kv_heads} ({source}) and --tensor-model-parallel-size {tp} must divide one "
            f"another (KV heads are split over TP, or shared by several TP ranks when fewer); use a TP size that divides "
            f"or is a multiple of {kv_heads}")
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    qkv_rows = head_dim * (heads + 2 * kv_heads)
    if qkv_rows % tp:
        raise ArgumentValidationError(
            f"the fused QKV projection has {qkv_rows} rows (head_dim {head_dim} x (heads {heads} + 2 x KV heads "
            f"{kv_heads})), not divisible by --tensor-model-parallel-size {tp}; choose a smaller TP size")
    if ffn % tp:
        raise ArgumentValidationError(
            f"--intermediate-size {ffn} ({source}) is not divisible by --tensor-model-parallel-size {tp}")
    validate_moe_args(args, hf_config, source)
    chunks = pp * (args.virtual_pipeline_model_parallel_size or 1)
    if layers % chunks:
        raise ArgumentValidationError(
            f"--num-layers {layers} ({source}) is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--virtual-pipeline-model-parallel-size {args.virtual_pipeline_model_parallel_size or 1} = {chunks}; "
            "choose sizes whose product divides the layer count")
    max_pos = hf_config.get("max_position_embeddings")
    if max_pos is not None and args.seq_length > max_pos:
        raise ArgumentValidationError(
            f"--seq-length {args.seq_length} exceeds max_position_embeddings {max_pos} ({source}); lower it")


def validate_moe_args(args: argparse.Namespace, hf_config: dict[str, Any], source: str = "config.json") -> None:
    """Check the expert-parallel flags against the model's experts (and refuse them for a dense model)."""
    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not experts:
        if ep > 1 or args.expert_tensor_parallel_size:
            raise ArgumentValidationError(
                f"--expert-model-parallel-size / --expert-tensor-parallel-size need a MoE model; {source} has "
                "no experts: drop the flags")
        return
    if experts % ep:
        raise ArgumentValidationError(
            f"num_experts {experts} ({source}) is not divisible by --expert-model-parallel-size {ep}")
    if hf_config["moe_intermediate_size"] % etp:
        raise ArgumentValidationError(
            f"moe_intermediate_size {hf_config['moe_intermediate_size']} ({source}) is not divisible by the expert "
            f"tensor-parallel size {etp}")
    if tp > 1 and not args.sequence_parallel:
        raise ArgumentValidationError(
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core refuses to train "
            "the token dispatcher without it); add the flag")


def load_hf_config(hf_dir: str) -> dict[str, Any]:
    """Return the parsed config.json of a HF model directory, with a clear error when it is missing."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ArgumentValidationError(
            f"--hf-dir {hf_dir} has no config.json; point it at a Hugging Face model directory "
            "(e.g. one made by tools/make_tiny_model.py)")
    with open(path) as f:
        return json.load(f)


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> dict[str, Any]:
    """Validate all flags before anything heavy starts; return the model's HF config."""
    validate_parallel_args(args, world_size)
    _positive(args, "log-interval")
    if args.load is not None:
        from megatron_ais.checkpointing import check_layout, read_checkpoint_metadata, restore_interrupted_resave
        restore_interrupted_resave(args.load)  # a re-save interrupted between its two renames is put back
        metadata = read_checkpoint_metadata(args.load)
        # before anything reads a rank's files, whose directory names depend on the layout
        check_layout(metadata, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.load,
                     args.expert_model_parallel_size, args.expert_tensor_parallel_size)
        hf_config = metadata["hf_config"]
        source = f"checkpoint {args.load}"
    elif args.hf_dir is not None:
        hf_config = load_hf_config(args.hf_dir)
        source = f"{args.hf_dir}/config.json"
    else:
        raise ArgumentValidationError("no model given: pass --hf-dir DIR (Hugging Face model) or --load DIR "
                                      "(Megatron checkpoint)")
    from megatron_ais.model import check_supported_hf_config
    check_supported_hf_config(hf_config)
    validate_model_args(args, hf_config, source)
    if args.load is not None:
        from megatron_ais.checkpointing import check_vocab_padding
        check_vocab_padding(metadata, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size, args.load)
    if getattr(args, "save_interval", None) is not None and not args.save:
        raise ArgumentValidationError("--save-interval needs --save DIR")
    if getattr(args, "keep_checkpoints", 1) < 1:
        raise ArgumentValidationError(f"--keep-checkpoints {args.keep_checkpoints} must be at least 1")
    if getattr(args, "rollout_kv_cache_scale_margin", 1.0) < 1.0:
        raise ArgumentValidationError(f"--rollout-kv-cache-scale-margin {args.rollout_kv_cache_scale_margin} must be "
                                      "at least 1 (below 1 the largest calibrated K/V values already saturate)")
    if getattr(args, "rollout_kv_cache_calibration_sequences", 1) < 1:
        raise ArgumentValidationError("--rollout-kv-cache-calibration-sequences "
                                      f"{args.rollout_kv_cache_calibration_sequences} must be at least 1")
    utilization = getattr(args, "rollout_gpu_memory_utilization", None)
    if utilization is not None and not 0 < utilization <= 1:
        raise ArgumentValidationError(f"--rollout-gpu-memory-utilization {utilization} must be in (0, 1] (or left "
                                      "out: the engine then asks vLLM for its own budget)")
    return hf_config
