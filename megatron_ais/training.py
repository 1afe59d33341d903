"""Megatron DDP, optimizer and one optimizer step through megatron's pipeline schedules."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """Adam and gradient settings, built once from the training flags."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False

    @classmethod
    def from_args(cls, args) -> "OptimizerSettings":
        """Return the settings named by the training and parallelism flags."""
        return cls(lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                   adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                   use_distributed_optimizer=args.use_distributed_optimizer)


def wrap_ddp(chunks: list, use_distributed_optimizer: bool) -> list:
    """Wrap each model chunk in megatron's DistributedDataParallel and make DP replicas identical."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=True,  # NaN/Inf gradients raise instead of being applied
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        ddp = DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                      # only the first chunk's buckets start the DP all-reduce early
                                      disable_bucketing=i > 0)
        ddp.broadcast_params()
        wrapped.append(ddp)
    return wrapped


def build_optimizer(ddp_chunks: list, settings: OptimizerSettings):
    """Return megatron's optimizer (Adam; fp32 main weights under BF16) wired into the model config."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = ddp_chunks[0].config
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=settings.lr, min_lr=settings.lr, weight_decay=settings.weight_decay,
                        adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
                        bf16=config.bf16, params_dtype=config.params_dtype, clip_grad=settings.clip_grad,
                        use_distributed_optimizer=settings.use_distributed_optimizer),
        ddp_chunks)
    # what megatron/training wires up: DP grad reduction, embedding-grad sync across PP, loss scaling
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
    return optimizer


@dataclasses.dataclass
class StepResult:
    """What one optimizer step reports: per-micro-batch loss dicts (last stage only), grad norm, success."""

    losses: list
    grad_norm: float | None
    update_successful: bool


def train_step(ddp_chunks: list, optimizer, forward_step: Callable, data_iterator: Iterator,
               num_microbatches: int, seq_length: int, micro_batch_size: int) -> StepResult:
    """Run forward/backward over the micro-batches with megatron's schedule, then one optimizer step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if len(ddp_chunks) == 1:
        iterator = data_iterator
    else:  # the interleaved schedule takes every micro-batch once per model chunk, from that chunk's iterator
        micro_batches = list(data_iterator)
        iterator = [iter(micro_batches) for _ in ddp_chunks]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterator,
        model=ddp_chunks if len(ddp_chunks) > 1 else ddp_chunks[0],
        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    return StepResult(losses=losses, grad_norm=grad_norm, update_successful=bool(ok))


def lm_forward_step(data_iterator, model):
    """Megatron forward step for next-token prediction; the loss is summed over tokens with their count."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].float()
        loss = (output_tensor.float() * mask).sum()
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), mask.sum()])}

    return output, loss_func


def reduce_lm_loss(losses: list, dp_group) -> float | None:
    """Return the token-mean LM loss over micro-batches and DP ranks (None off the last stage)."""
    import torch.distributed as dist

    if not losses:
        return None
    total = torch.stack([d["lm loss"] for d in losses]).sum(0)
    dist.all_reduce(total, group=dp_group)
    return (total[0] / total[1]).item()


@dataclasses.dataclass
class TrainingSetup:
    """A built, loaded and wrapped model with its optimizer; `assets_dir` holds the tokenizer; `loaded` is the
    --load checkpoint (None when starting from --hf-dir); `run_state` is what a resumed run continues from
    (None for a fresh start or --finetune)."""

    build: object
    chunks: list
    ddp_chunks: list
    optimizer: object
    assets_dir: str
    loaded: object = None
    run_state: dict | None = None


def build_loaded_chunks(args, build, iteration: int | None = None):
    """Return (this rank's model chunks with the --load (its newest usable iteration, or `iteration`) or --hf-dir
    weights, directory of the tokenizer, the LoadedCheckpoint or None)."""
    from megatron.core import parallel_state as ps

    from megatron_ais.checkpointing import CheckpointRanks, check_layout, load_checkpoint, load_model_state
    from megatron_ais.mapping.distributed import load_hf_weights
    from megatron_ais.model import build_model_chunks

    chunks = build_model_chunks(build)
    if args.load:
        ranks = CheckpointRanks.from_parallel_state()
        loaded = load_checkpoint(args.load, ranks, args.use_distributed_optimizer, iteration)
        check_layout(loaded.metadata, build.tensor_model_parallel_size, ranks.pp_size, args.load, ranks.ep_size,
                     build.expert_tensor_parallel_size)
        load_model_state(chunks, loaded.state)
        return chunks, loaded.assets_dir, loaded
    load_hf_weights(chunks, args.hf_dir, build, ps.get_tensor_model_parallel_rank())
    return chunks, args.hf_dir, None


def build_reference_chunks(args, build, source: dict | None = None) -> list:
    """Return a frozen copy of a policy for the KL penalty, in the trainer's layout: `source` is
    {"load": checkpoint dir, "iteration": its iteration (None: the newest)} or {"hf_dir": HF dir}; default the run's
    own --load / --hf-dir."""
    import argparse

    if source is not None:
        args = argparse.Namespace(**{**vars(args), "load": source.get("load"), "hf_dir": source.get("hf_dir")})
    chunks, _, _ = build_loaded_chunks(args, build, (source or {}).get("iteration"))
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def setup_model_and_optimizer(args, hf_config: dict, run_kind: str | None = None) -> TrainingSetup:
    """Build this rank's model chunks, load --load (Megatron checkpoint) or --hf-dir weights, wrap in DDP and
    build the optimizer. A --load checkpoint whose run state was saved by a run of kind `run_kind` is resumed:
    optimizer, RNG and run state are restored, unless --finetune asks for its weights only. Parallel state must
    be initialised."""
    from megatron.core import parallel_state as ps

    from megatron_ais.checkpointing import restore_training_state
    from megatron_ais.model import ModelBuildConfig

    build = ModelBuildConfig.from_args(args, hf_config)
    chunks, assets, loaded = build_loaded_chunks(args, build)
    ddp_chunks = wrap_ddp(chunks, args.use_distributed_optimizer)
    optimizer = build_optimizer(ddp_chunks, OptimizerSettings.from_args(args))
    run_state = None
    saved_kind = (loaded.run_state or {}).get("kind") if loaded is not None else None
    if saved_kind is not None and saved_kind == run_kind and not args.finetune:
        restore_training_state(loaded, optimizer, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        run_state = loaded.run_state
    return TrainingSetup(build, chunks, ddp_chunks, optimizer, assets, loaded, run_state)
