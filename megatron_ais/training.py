"""Megatron DDP, optimizer and one optimizer step through megatron's pipeline schedules."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ais.checkpointing.config import HF_ASSETS
from megatron_ais.checkpointing.lock import hold_save_directory, refuse_directories_in_use
from megatron_ais.checkpointing.optimizer_state import sub_optimizers
from megatron_ais.checkpointing.preflight import (check_layout, check_room, check_save_holds_no_other_run,
                                                  check_vocab_padding, check_writable, checkpoint_bytes)
from megatron_ais.checkpointing.ranks import CheckpointRanks
from megatron_ais.checkpointing.store import (FORMATS, directory_format, iteration_dir, load_checkpoint,
                                              read_checkpoint_metadata, restore_interrupted_resave, usable_iterations)
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.initialize import initialize_megatron
from megatron_ais.mapping.distributed import load_hf_weights
from megatron_ais.model import (ModelBuildConfig, build_model_chunks, check_model_layout, check_supported_hf_config,
                                load_hf_config)


@dataclasses.dataclass(frozen=True)
class TrainingConfig(FlagConfig):
    """Seed, micro-batch size, Adam and gradient settings, and the optimizer's sharding."""

    seed: int = flag(1234, "Seed for data, initialisation and dropout.", at_least=0, below=2 ** 32)
    micro_batch_size: int = flag(2, "Sequences per micro-batch per DP rank.", at_least=1)
    lr: float = flag(1e-3, "Peak learning rate (Adam).", at_least=0)
    weight_decay: float = flag(0.0, "Decoupled weight decay (not of biases and 1-D parameters, as in Megatron-LM).",
                               at_least=0)
    adam_beta1: float = flag(0.9, "Adam beta1.", at_least=0, below=1)
    adam_beta2: float = flag(0.999, "Adam beta2.", at_least=0, below=1)
    adam_eps: float = flag(1e-8, "Adam epsilon.", above=0)
    clip_grad: float = flag(1.0, "Clip the global gradient norm to this value (0: no clipping).", at_least=0)
    use_distributed_optimizer: bool = flag(False, "Shard optimizer state over data-parallel ranks (ZeRO-1).")
    max_tokens_per_microbatch: int | None = flag(
        None, "Batch by tokens: each rank's sequences, longest first, fill micro-batches of at most this many padded "
              "tokens (rows x their own longest), each padded only to its own longest sequence, and a batch's "
              "sequences are shared out so that data-parallel ranks get equal token counts. Unset: "
              "--micro-batch-size rows per micro-batch, each padded to --seq-length.", type=int, at_least=1)



def wrap_ddp(chunks: list, use_distributed_optimizer: bool) -> list:
    """Wrap each model chunk in megatron's DistributedDataParallel and make DP replicas identical."""
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


def build_optimizer(ddp_chunks: list, settings: TrainingConfig):
    """Return megatron's optimizer (Adam; fp32 main weights under BF16) wired into the model config."""
    config = ddp_chunks[0].config
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=settings.lr, min_lr=settings.lr, weight_decay=settings.weight_decay,
                        adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
                        bf16=config.bf16, params_dtype=config.params_dtype, clip_grad=settings.clip_grad,
                        use_distributed_optimizer=settings.use_distributed_optimizer),
        ddp_chunks)
    set_hyperparameters(optimizer, settings)
    initialize_adam_state(optimizer)
    # what megatron/training wires up: DP grad reduction, embedding-grad sync across PP, loss scaling
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
    return optimizer


def initialize_adam_state(optimizer) -> None:
    """Give every parameter the Adam state its first step would (zero moments, torch Adam's step 0): a checkpoint
    saved before any update (a GRPO run whose first steps were all skipped) holds the optimizer state that megatron's
    loaders expect — without it the torch_dist format could not resume it and the distributed optimizer could not
    save it."""
    for sub in sub_optimizers(optimizer):
        if getattr(sub, "init_state_fn", None) is None:
            continue
        sub.init_state_fn(sub.optimizer, sub.config)
        if isinstance(sub.optimizer, torch.optim.Adam):  # AdamW too: its step lives in the state
            for group in sub.optimizer.param_groups:
                for param in group["params"]:
                    sub.optimizer.state[param].setdefault("step", torch.tensor(0.0))


def set_hyperparameters(optimizer, settings: TrainingConfig) -> None:
    """Each parameter group's learning rate, Adam betas and epsilon from the flags, and its weight decay --weight-decay
    times its `wd_mult` (megatron-core groups biases and 1-D parameters, the norms', with 0), as Megatron-LM's
    scheduler sets them every step (torch's optimizer would apply --weight-decay to every group). Set again after a
    resume: loading the optimizer's state brings back the saved run's values, which this run's flags replace."""
    for group in optimizer.param_groups:
        group["lr"] = settings.lr * group.get("lr_mult", 1.0)
        group["betas"] = (settings.adam_beta1, settings.adam_beta2)
        group["eps"] = settings.adam_eps
        group["weight_decay"] = settings.weight_decay * group.get("wd_mult", 1.0)


@dataclasses.dataclass
class StepResult:
    """What one optimizer step reports: per-micro-batch loss dicts (last stage only), grad norm, success."""

    losses: list
    grad_norm: float | None
    update_successful: bool


def train_step(ddp_chunks: list, optimizer, forward_step: Callable, data_iterator: Iterator,
               num_microbatches: int, seq_length: int, micro_batch_size: int,
               forward_weights: Callable[[], ContextManager] = contextlib.nullcontext) -> StepResult:
    """Run forward/backward over the micro-batches with megatron's schedule, then one optimizer step.
    `forward_weights()`: the context the forward and backward run in (QaRL's rollout-aligned weights), closed
    before the optimizer steps."""
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if len(ddp_chunks) == 1:
        iterator = data_iterator
    else:  # the interleaved schedule takes every micro-batch once per model chunk, from that chunk's iterator
        micro_batches = list(data_iterator)
        iterator = [iter(micro_batches) for _ in ddp_chunks]
    with forward_weights():
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
    if not losses:
        return None
    total = torch.stack([d["lm loss"] for d in losses]).sum(0)
    dist.all_reduce(total, group=dp_group)
    return (total[0] / total[1]).item()


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """Where a policy's weights come from: a Megatron checkpoint (`load`; its `iteration`, or the newest usable one)
    or else a HF model directory."""

    load: str | None = None
    hf_dir: str | None = None
    iteration: int | None = None
    allow_unverified: bool = False  # a checkpoint without checksums.json is loaded (with a warning), not refused


def read_model_config(model, layout, load: str | None, allow_unverified: bool = False) -> dict:
    """Return the model's HF config, from the --load checkpoint's metadata or --hf-dir's config.json, once checked
    against the run: the checkpoint's layout and vocabulary padding (before any rank file is read: their directory
    names depend on the layout), the architecture's support, the layout's fit. The one place setup opens it."""
    if load is not None:
        restore_interrupted_resave(load)  # a re-save interrupted between its two renames is put back
        newest = usable_iterations(load, allow_unverified)[0]
        metadata = read_checkpoint_metadata(load, newest, allow_unverified)
        reshards = directory_format(iteration_dir(load, newest)).RESHARDS_ON_LOAD
        check_layout(metadata, layout, load, reshards)
        if not reshards:
            check_vocab_padding(metadata, model.make_vocab_size_divisible_by, layout.tensor, load)
        hf_config, source = metadata["hf_config"], f"checkpoint {load}"
    elif model.hf_dir is not None:
        hf_config, source = load_hf_config(model.hf_dir), f"{model.hf_dir}/config.json"
    else:
        raise ArgumentValidationError("no model given: pass --hf-dir DIR (Hugging Face model) or --load DIR "
                                      "(Megatron checkpoint)")
    check_supported_hf_config(hf_config)
    check_model_layout(hf_config, layout, model.seq_length, source)
    return hf_config


def tokenizer_dir(trainer) -> str:
    """Where the run's tokenizer is, read before anything starts: the --load checkpoint's newest usable iteration's HF
    assets, else --hf-dir."""
    checkpoint = trainer.checkpoint
    if checkpoint.load is None:
        return trainer.model.hf_dir
    iteration = usable_iterations(checkpoint.load, checkpoint.allow_unverified_checkpoint)[0]
    return os.path.join(iteration_dir(checkpoint.load, iteration), HF_ASSETS)


def check_output_directories(trainer) -> None:
    """--save, --output-dir, --tensorboard-dir and --wandb-save-dir can be written (or created), checked before
    anything is (wandb itself would fall back to the system's temporary directory)."""
    for option, path in (("--save", trainer.checkpoint.save), ("--output-dir", trainer.logging.output_dir),
                         ("--tensorboard-dir", trainer.logging.tensorboard_dir),
                         ("--wandb-save-dir", trainer.logging.wandb_save_dir)):
        if path:
            check_writable(path, option)


def prepare_trainer(trainer, run_kind: str | None = None) -> tuple[dict, object]:
    """Everything a trainer checks before it starts (`trainer`: an arguments.TrainerConfig), in an order that writes
    nothing: its output directories can be written, no live run holds --save or --load, --save holds no other run's
    checkpoints (a run of `run_kind` resumes from a --load of its kind), the model's config is read and
    checked once, --save has room for a checkpoint. Return (the HF config, the ModelBuildConfig)."""
    check_output_directories(trainer)
    checkpoint = trainer.checkpoint
    if is_first_rank():
        refuse_directories_in_use(checkpoint)
    if checkpoint.save:
        check_save_holds_no_other_run(checkpoint.save, checkpoint.load, checkpoint.replace_checkpoints, run_kind,
                                      checkpoint.finetune)
    hf_config = read_model_config(trainer.model, trainer.layout, checkpoint.load,
                                  checkpoint.allow_unverified_checkpoint)
    build = ModelBuildConfig.create(trainer.model, trainer.layout, hf_config,
                                    variable_seq_lengths=trainer.training.max_tokens_per_microbatch is not None)
    if checkpoint.save:
        check_room(checkpoint.save, checkpoint_bytes(build), "--save")
    return hf_config, build


def start_trainer(trainer):
    """The first rank holds --save's lock for the life of the run (returned; None elsewhere or without --save), then
    megatron starts at the trainer's layout."""
    lock = hold_save_directory(trainer.checkpoint) if is_first_rank() else None
    initialize_megatron(trainer.layout, trainer.training.seed)
    return lock


def initialize_trainer(trainer) -> tuple[dict, object]:
    """`prepare_trainer`, then megatron started at the trainer's layout; return (the HF config, the
    ModelBuildConfig). A --save directory stays locked for the life of the process."""
    hf_config, build = prepare_trainer(trainer)
    start_trainer(trainer)
    return hf_config, build


def is_first_rank() -> bool:
    """Whether this process is global rank 0 (from the launcher's environment, before torch.distributed starts)."""
    return os.environ.get("RANK", "0") == "0"


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


def load_policy_chunks(build, source: WeightSource, distributed_optimizer: bool = False):
    """Return (this rank's model chunks with the weights of `source`, directory of the tokenizer, the
    LoadedCheckpoint or None)."""
    chunks = build_model_chunks(build)
    if source.load:
        loaded = load_checkpoint(source.load, CheckpointRanks.from_parallel_state(), distributed_optimizer,
                                 source.iteration, source.allow_unverified)
        # an older iteration may have another layout (or format)
        check_layout(loaded.metadata, build.layout, source.load, reshards=FORMATS[loaded.format].RESHARDS_ON_LOAD)
        FORMATS[loaded.format].load_model(chunks, loaded)
        return chunks, loaded.assets_dir, loaded
    load_hf_weights(chunks, source.hf_dir, build, ps.get_tensor_model_parallel_rank())
    return chunks, source.hf_dir, None


def build_reference_chunks(build, source: WeightSource) -> list:
    """Return a frozen copy of a policy for the KL penalty, in the trainer's layout."""
    chunks, _, _ = load_policy_chunks(build, source)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def setup_model_and_optimizer(build, source: WeightSource, training: TrainingConfig, finetune: bool = False,
                              run_kind: str | None = None) -> TrainingSetup:
    """Build this rank's model chunks, load their weights from `source`, wrap in DDP and build the optimizer. A
    checkpoint whose run state was saved by a run of kind `run_kind` is resumed: optimizer, RNG and run state are
    restored, unless `finetune` asks for its weights only. Parallel state must be initialised."""
    chunks, assets, loaded = load_policy_chunks(build, source, training.use_distributed_optimizer)
    ddp_chunks = wrap_ddp(chunks, training.use_distributed_optimizer)
    optimizer = build_optimizer(ddp_chunks, training)
    run_state = None
    saved_kind = (loaded.run_state or {}).get("kind") if loaded is not None else None
    if saved_kind is not None and saved_kind == run_kind and not finetune:
        FORMATS[loaded.format].restore_training_state(loaded, chunks, optimizer, ps.get_data_parallel_rank(),
                                                      ps.get_data_parallel_world_size())
        set_hyperparameters(optimizer, training)
        run_state = loaded.run_state
    return TrainingSetup(build, chunks, ddp_chunks, optimizer, assets, loaded, run_state)
