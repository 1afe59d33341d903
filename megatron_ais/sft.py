"""Supervised fine-tuning on a task's reference responses with megatron-core (the warm-up before GRPO)."""
from __future__ import annotations

import argparse
import os
import time

import torch

from megatron_ais import platform
from megatron_ais.data.tasks import Example


def add_sft_args(parser: argparse.ArgumentParser) -> None:
    """SFT schedule and export flags."""
    g = parser.add_argument_group("sft")
    g.add_argument("--train-iters", type=int, default=10, help="Optimizer steps to run.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Sequences per optimizer step over all DP ranks (default: micro batch x DP).")
    g.add_argument("--export-hf-dir", default=None,
                   help="After training, export the model as a HF checkpoint here (each PP stage writes its file).")


def load_tokenizer(path: str):
    """Return the HF tokenizer stored in a model directory or a checkpoint's hf_assets."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_sft_example(tokenizer, example: Example, seq_length: int) -> dict[str, torch.Tensor]:
    """Return tokens / labels / loss_mask [seq_length] for one example; loss only on the response."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(example.response(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = prompt_ids + response_ids
    if len(ids) - 1 > seq_length:
        raise ValueError(f"example of {len(ids)} tokens does not fit --seq-length {seq_length}")
    tokens = torch.full((seq_length,), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((seq_length,), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(seq_length)
    n = len(ids) - 1
    tokens[:n] = torch.tensor(ids[:-1])
    labels[:n] = torch.tensor(ids[1:])
    mask[len(prompt_ids) - 1: n] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": mask}


def micro_batches(encoded: list[dict], indices: list[int], micro_batch_size: int) -> list[dict]:
    """Return the micro-batches (stacked dicts with position ids) for a list of example indices."""
    out = []
    for start in range(0, len(indices), micro_batch_size):
        rows = [encoded[i] for i in indices[start:start + micro_batch_size]]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        seq = batch["tokens"].shape[1]
        batch["position_ids"] = torch.arange(seq).unsqueeze(0).expand(len(rows), seq).contiguous()
        out.append(platform.to_device(batch))
    return out


def run_sft(args) -> dict:
    """Train with megatron-core on the task's reference responses; return the summary (also written on the
    logging rank)."""
    from megatron.core import parallel_state as ps

    from megatron_ais.arguments import validate_args
    from megatron_ais.checkpointing import CheckpointRanks, checkpoint_metadata, save_checkpoint
    from megatron_ais.data.tasks import build_task
    from megatron_ais.initialize import initialize_megatron
    from megatron_ais.logging import RunLogger
    from megatron_ais.mapping.distributed import save_hf_checkpoint
    from megatron_ais.training import lm_forward_step, reduce_lm_loss, setup_model_and_optimizer, train_step

    hf_config = validate_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    examples = build_task(args).train  # bad task flags or prompt files fail before anything heavy starts
    initialize_megatron(args)
    tp_rank = ps.get_tensor_model_parallel_rank()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    is_logger = ps.is_pipeline_last_stage() and tp_rank == 0 and dp_rank == 0
    log = RunLogger(args.output_dir, args.tensorboard_dir, is_logger)

    setup = setup_model_and_optimizer(args, hf_config)
    build, chunks, ddp_chunks, optimizer, assets = (setup.build, setup.chunks, setup.ddp_chunks, setup.optimizer,
                                                    setup.assets_dir)
    tokenizer = load_tokenizer(assets)

    encoded = [encode_sft_example(tokenizer, e, args.seq_length) for e in examples]
    global_batch = args.global_batch_size or args.micro_batch_size * dp_size
    per_rank = global_batch // dp_size
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(args.seed)).tolist()
    log.info(f"SFT: {build.shape.model_type} {build.shape.num_layers} layers, TP{build.tensor_model_parallel_size} "
             f"PP{pp_size} DP{dp_size}, {args.precision}, global batch {global_batch}, {args.train_iters} steps")
    history = []
    start = time.time()
    for step in range(1, args.train_iters + 1):
        t0 = time.time()
        first = ((step - 1) * global_batch) % len(order)
        window = [order[(first + i) % len(order)] for i in range(global_batch)]
        mine = window[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        batches = micro_batches(encoded, mine, args.micro_batch_size)
        result = train_step(ddp_chunks, optimizer, lm_forward_step, iter(batches), len(batches), args.seq_length,
                            args.micro_batch_size)
        if not result.update_successful:
            raise RuntimeError(f"step {step}: optimizer skipped the update (non-finite gradients)")
        loss = reduce_lm_loss(result.losses, ps.get_data_parallel_group()) if ps.is_pipeline_last_stage() else None
        seconds = time.time() - t0
        tokens = sum(int(b["loss_mask"].sum()) for b in batches) * dp_size
        if loss is not None:
            history.append(loss)
        if step % args.log_interval == 0 or step == args.train_iters:
            log.step(step, {"sft/loss": loss, "sft/grad_norm": result.grad_norm, "sft/step_seconds": seconds},
                     f"step {step:5d}/{args.train_iters} | loss {loss if loss is None else f'{loss:.4f}'} | "
                     f"grad norm {result.grad_norm:.3f} | {tokens / seconds:8.0f} tok/s | {seconds:.2f}s")
    if args.save:
        save_checkpoint(
            args.save, args.train_iters, chunks,
            checkpoint_metadata(args, build, hf_config, args.train_iters),
            assets, CheckpointRanks.from_parallel_state(), optimizer=optimizer,
            run_state={"kind": "sft", "step": args.train_iters}, dp_group=ps.get_data_parallel_group(),
            keep=args.keep_checkpoints)
    if args.export_hf_dir:
        save_hf_checkpoint(chunks, build, hf_config, args.export_hf_dir, ps.get_tensor_model_parallel_group(),
                           ps.get_pipeline_model_parallel_group(), is_stage_writer=tp_rank == 0 and dp_rank == 0,
                           dtype=torch.bfloat16 if hf_config.get("dtype") == "bfloat16" else None, assets_from=assets)
    summary = {"loss_first": history[0] if history else None, "loss_last": history[-1] if history else None,
               "losses": history, "steps": args.train_iters, "wall_s": time.time() - start}
    log.summary(summary)
    log.close()
    return summary
