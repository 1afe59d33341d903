"""Supervised fine-tuning on a task's reference responses with megatron-core (the warm-up before GRPO)."""
from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ais import platform
from megatron_ais.batch import balanced_partition, row_lengths
from megatron_ais.checkpointing.checkpointer import Checkpointer
from megatron_ais.checkpointing.preflight import check_writable
from megatron_ais.data.tasks import Example, build_task
from megatron_ais.distributed import from_last_stage
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.forward import micro_batches, token_budget_plan
from megatron_ais.hf_assets import load_tokenizer
from megatron_ais.logging import RunLogger
from megatron_ais.mapping.distributed import save_hf_checkpoint
from megatron_ais.training import (lm_forward_step, prepare_trainer, reduce_lm_loss, setup_model_and_optimizer,
                                   start_trainer, tokenizer_dir, train_step)


@dataclasses.dataclass(frozen=True)
class SFTConfig(FlagConfig):
    """The supervised warm-up's schedule and export."""

    train_iters: int = flag(10, "Optimizer steps to run.", at_least=1)
    global_batch_size: int | None = flag(None, "Sequences per optimizer step over all DP ranks (default: micro batch "
                                               "x DP).", type=int, at_least=1)
    export_hf_dir: str | None = flag(None, "After training, export the model as a HF checkpoint here (each PP stage "
                                           "writes its file).", type=str)



def check_export_directory(export_hf_dir: str | None, hf_dir: str | None) -> None:
    """--export-hf-dir can be written, and is not the --hf-dir the run starts from (it would be overwritten)."""
    if not export_hf_dir:
        return
    if hf_dir and os.path.realpath(export_hf_dir) == os.path.realpath(hf_dir):
        raise ArgumentValidationError(f"--export-hf-dir {export_hf_dir} is the --hf-dir the run starts from: the "
                                      "export would overwrite it; choose another --export-hf-dir")
    check_writable(export_hf_dir, "--export-hf-dir")
    weights = [n for n in (os.listdir(export_hf_dir) if os.path.isdir(export_hf_dir) else ())
               if n.endswith(".safetensors") or n.endswith(".safetensors.index.json")]
    if weights:  # a loader would read an old model.safetensors before the new index
        raise ArgumentValidationError(f"--export-hf-dir {export_hf_dir} already holds weights ({sorted(weights)[0]}): "
                                      "choose a new directory (an export never overwrites)")


def encode_sft_example(tokenizer, example: Example, seq_length: int) -> dict[str, torch.Tensor]:
    """Return tokens / labels / loss_mask [seq_length] for one example; loss only on the response."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(example.response(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = prompt_ids + response_ids
    if len(ids) - 1 > seq_length:
        raise ArgumentValidationError(f"--seq-length {seq_length}: an example of the task is {len(ids)} tokens "
                                      f"long; raise --seq-length to at least {len(ids) - 1}")
    # a tokenizer without a pad token (Llama 3's) pads with its end token: padding is outside the loss mask
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens = torch.full((seq_length,), pad, dtype=torch.long)
    labels = torch.full((seq_length,), pad, dtype=torch.long)
    mask = torch.zeros(seq_length)
    n = len(ids) - 1
    tokens[:n] = torch.tensor(ids[:-1])
    labels[:n] = torch.tensor(ids[1:])
    mask[len(prompt_ids) - 1: n] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": mask}


def example_micro_batches(encoded: list[dict], indices: list[int], micro_batch_size: int) -> list[dict]:
    """Return the micro-batches (stacked dicts with position ids) for a list of example indices."""
    out = []
    for start in range(0, len(indices), micro_batch_size):
        rows = [encoded[i] for i in indices[start:start + micro_batch_size]]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        seq = batch["tokens"].shape[1]
        batch["position_ids"] = torch.arange(seq).unsqueeze(0).expand(len(rows), seq).contiguous()
        out.append(platform.to_device(batch))
    return out


def step_micro_batches(encoded: list[dict], window: list[int], config) -> list[dict]:
    """This DP rank's micro-batches of a global batch (`window`: example indices): an equal share in rows of
    --micro-batch-size, or with a token budget a token-balanced share in token-budget micro-batches
    (`forward`), as many on every DP rank."""
    training = config.trainer.training
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if training.max_tokens_per_microbatch is None:
        per_rank = len(window) // dp_size
        return example_micro_batches(encoded, window[dp_rank * per_rank:(dp_rank + 1) * per_rank],
                                     training.micro_batch_size)
    rows = {k: torch.stack([encoded[i][k] for i in window]) for k in encoded[0]}
    mine = balanced_partition(row_lengths(rows["loss_mask"]), dp_size)[dp_rank]
    rows = {k: v[mine] for k, v in rows.items()}
    layout = config.trainer.layout
    multiple = layout.tensor if layout.sequence_parallel else 1
    plan = token_budget_plan(row_lengths(rows["loss_mask"]), training.max_tokens_per_microbatch, multiple)
    count = torch.tensor([len(plan)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return micro_batches(rows, plan.with_placeholders(int(count), multiple))


def _train(setup, encoded: list[dict], config, log, checkpointer: Checkpointer, first_step: int) -> list[float]:
    """Run optimizer steps `first_step`..--train-iters over the encoded examples (each DP rank its share of every
    global batch; the data order depends on the step only, so a resumed run continues it), saving at --save-interval
    and after the last; return the loss history (last stage)."""
    training, iters = config.trainer.training, config.sft.train_iters
    dp_size = ps.get_data_parallel_world_size()
    global_batch = config.sft.global_batch_size or training.micro_batch_size * dp_size
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(training.seed)).tolist()
    history = []
    for step in range(first_step, iters + 1):
        t0 = time.time()
        first = ((step - 1) * global_batch) % len(order)
        window = [order[(first + i) % len(order)] for i in range(global_batch)]
        batches = step_micro_batches(encoded, window, config)
        result = train_step(setup.ddp_chunks, setup.optimizer, lm_forward_step, iter(batches), len(batches),
                            max(b["tokens"].shape[1] for b in batches), max(b["tokens"].shape[0] for b in batches))
        if not result.update_successful:
            raise RuntimeError(f"step {step}: optimizer skipped the update (non-finite gradients)")
        loss = reduce_lm_loss(result.losses, ps.get_data_parallel_group()) if ps.is_pipeline_last_stage() else None
        seconds = time.time() - t0
        if loss is not None:
            history.append(loss)
        log.step(step, {"sft/loss": loss, "sft/grad_norm": result.grad_norm, "sft/step_seconds": seconds},
                 _console_line(step, iters, loss, result.grad_norm, batches, dp_size, seconds)
                 if config.trainer.logging.prints(step, iters) else None)
        if checkpointer.saves_at(step, iters):
            checkpointer.save(step, {"kind": "sft", "step": step}, training_goes_on=step < iters)
        checkpointer.poll()
    return history


def _console_line(step: int, iters: int, loss: float | None, grad_norm: float, batches: list[dict], dp_size: int,
                  seconds: float) -> str:
    # processed: every position of the step's micro-batches (prompt, response, padding); trained: the loss's
    trained = sum(int(b["loss_mask"].sum()) for b in batches) * dp_size
    processed = sum(b["tokens"].numel() for b in batches) * dp_size
    return (f"step {step:5d}/{iters} | loss {loss if loss is None else f'{loss:.4f}'} | grad norm {grad_norm:.3f} | "
            f"{processed / seconds:6.0f} tok/s processed, {trained / seconds:5.0f} trained | {seconds:.2f}s")


def _export(setup, hf_config: dict, config) -> None:
    """The trained model as a HF directory (--export-hf-dir)."""
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    save_hf_checkpoint(setup.chunks, setup.build, hf_config, config.sft.export_hf_dir,
                       ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                       is_stage_writer=writer, assets_from=setup.assets_dir,
                       dtype=torch.bfloat16 if hf_config.get("dtype") == "bfloat16" else None)


def run_sft(config) -> dict:
    """Train with megatron-core on the task's reference responses (`config`: an arguments.SFTRunConfig); return
    the summary (also written on the logging rank)."""
    trainer = config.trainer
    examples = build_task(trainer.task, trainer.training.seed).train  # bad task flags fail before anything heavy
    hf_config, build = prepare_trainer(trainer, "sft")
    check_export_directory(config.sft.export_hf_dir, trainer.model.hf_dir)
    tokenizer = load_tokenizer(tokenizer_dir(trainer))
    encoded = [encode_sft_example(tokenizer, e, build.seq_length) for e in examples]  # each fits, before any write
    # with a token budget the loss is the token mean over the global batch whatever the grouping (Megatron-LM's
    # --calculate-per-token-loss); by default each micro-batch's token mean counts the same
    build = dataclasses.replace(build, per_token_loss=trainer.training.max_tokens_per_microbatch is not None)
    lock = start_trainer(trainer)
    # a --load of an SFT run's checkpoint resumes it (its optimizer, RNG and step), unless --finetune
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training, trainer.checkpoint.finetune, "sft")
    done = setup.run_state["step"] if setup.run_state else 0
    is_logger = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
        and ps.get_data_parallel_rank() == 0
    log = RunLogger(trainer.logging, is_logger, resume_step=done if setup.run_state else None,
                    run_config=trainer.flags)
    dp_size = ps.get_data_parallel_world_size()
    log.info(f"SFT: {build.shape.model_type} {build.shape.num_layers} layers, TP{trainer.layout.tensor} "
             f"PP{trainer.layout.pipeline} DP{dp_size}, {build.precision}, global batch "
             f"{config.sft.global_batch_size or trainer.training.micro_batch_size * dp_size}, "
             f"{config.sft.train_iters} steps")
    start = time.time()
    checkpointer = Checkpointer(trainer.checkpoint, setup.build, hf_config, setup.chunks, setup.optimizer,
                                setup.assets_dir, (ps.get_data_parallel_group(), dp_size),
                                trainer.training.use_distributed_optimizer)
    history = from_last_stage(_train(setup, encoded, config, log, checkpointer, done + 1),
                              ps.get_pipeline_model_parallel_group())
    if config.sft.export_hf_dir:  # while a background save is written
        _export(setup, hf_config, config)
    checkpointer.wait()
    summary = {"loss_first": history[0] if history else None, "loss_last": history[-1] if history else None,
               "losses": history, "steps": config.sft.train_iters, "first_step": done + 1,
               "wall_s": time.time() - start}
    log.summary(summary)
    log.close()
    if lock is not None:
        lock.release()
    return summary
