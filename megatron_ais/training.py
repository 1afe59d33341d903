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
    iterator = data_iterator if len(ddp_chunks) == 1 else [data_iterator] * len(ddp_chunks)
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
    """A built, loaded and wrapped model with its optimizer; `assets_dir` holds the tokenizer."""

    build: object
    chunks: list
    ddp_chunks: list
    optimizer: object
    assets_dir: str


def build_loaded_chunks(args, build) -> tuple[list, str]:
    """Return (this rank's model chunks with the --load or --hf-dir weights, directory of the tokenizer)."""
    import os

    from megatron.core import parallel_state as ps

    from megatron_ais.checkpointing import (HF_ASSETS, check_layout, iteration_dir, load_model_state,
                                            load_rank_state, read_checkpoint_metadata, read_tracker)
    from megatron_ais.mapping.distributed import load_hf_weights
    from megatron_ais.model import build_model_chunks

    chunks = build_model_chunks(build)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    if args.load:
        check_layout(read_checkpoint_metadata(args.load), build.tensor_model_parallel_size, pp_size, args.load)
        load_model_state(chunks, load_rank_state(args.load, tp_rank, pp_rank, pp_size))
        return chunks, os.path.join(iteration_dir(args.load, read_tracker(args.load)), HF_ASSETS)
    load_hf_weights(chunks, args.hf_dir, build, tp_rank)
    return chunks, args.hf_dir


def build_reference_chunks(args, build) -> list:
    """Return a frozen copy of the initial policy (for the KL penalty), in the trainer's layout."""
    chunks, _ = build_loaded_chunks(args, build)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def setup_model_and_optimizer(args, hf_config: dict) -> TrainingSetup:
    """Build this rank's model chunks, load --load (Megatron checkpoint) or --hf-dir weights, wrap in DDP and
    build the optimizer. Parallel state must be initialised."""
    from megatron_ais.model import ModelBuildConfig

    build = ModelBuildConfig.from_args(args, hf_config)
    chunks, assets = build_loaded_chunks(args, build)
    ddp_chunks = wrap_ddp(chunks, args.use_distributed_optimizer)
    optimizer = build_optimizer(ddp_chunks, OptimizerSettings.from_args(args))
    return TrainingSetup(build, chunks, ddp_chunks, optimizer, assets)
