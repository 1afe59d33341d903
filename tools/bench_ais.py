"""Overhead of the AIS correction (statistics, DP all-reduce, λ, per-token weights) relative to one GRPO
training step of the tiny model at DP2 (gloo, CPU), both measured in the same processes.

    .venv/bin/python tools/bench_ais.py [--sequences 16] [--seq-length 128] [--repeats 5]

Prints a table and, as its last line, `ais_overhead_fraction=<x>` (target <= 0.01).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _bench_worker(hf_dir: str, sequences: int, seq_length: int, repeats: int) -> dict:
    import torch.distributed as dist

    from megatron_ais.ais import (AISConfig, AISState, ais_coefficient, apply_correction, max_abs_logratio,
                                  mismatch_statistics, reduce_statistics)
    from megatron_ais.arguments import TrainerConfig, build_parser
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.batch import RolloutBatch
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.grpo.step import GRPOConfig, grpo_train_step, rows_of_whole_batch
    from megatron_ais.training import initialize_trainer, setup_model_and_optimizer

    args = build_parser("bench").parse_args(["--hf-dir", hf_dir, "--bf16", "--seq-length", str(seq_length)])
    trainer = TrainerConfig.from_args(args, int(os.environ["WORLD_SIZE"]))
    _, build = initialize_trainer(trainer)
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    build, ddp, optimizer = setup.build, setup.ddp_chunks, setup.optimizer
    groups = ParallelGroups.from_parallel_state()
    g = torch.Generator().manual_seed(0)
    vocab = build.shape.vocab_size
    seq = torch.randint(0, vocab, (sequences, seq_length + 1), generator=g)
    mask = torch.zeros(sequences, seq_length)
    mask[:, seq_length // 4:] = 1.0
    rollout = (-torch.rand(sequences, seq_length, generator=g) * 5) * mask
    batch = RolloutBatch(seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), mask, rollout,
                         torch.randint(0, 2, (sequences,), generator=g).float(), 4)
    ais = AISConfig()
    config = GRPOConfig(loss=PolicyLossConfig(), correction=ais, vocab_size=vocab, micro_batch_size=4)
    state = AISState()
    local_rows = rows_of_whole_batch(batch, config, groups)
    step_times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        grpo_train_step(ddp, optimizer, local_rows, config, state, groups)
        if i:  # the first step warms up allocators and lazy initialisation
            step_times.append(time.perf_counter() - t0)
    per_rank = sequences // groups.data_parallel_size
    rows = slice(groups.data_parallel_rank * per_rank, (groups.data_parallel_rank + 1) * per_rank)
    trainer_lp = rollout[rows] + 0.05 * torch.randn(per_rank, seq_length, generator=g)
    adv = torch.randn(per_rank, 1, generator=g) * mask[rows]
    ais_times = []
    for _ in range(repeats * 20):
        dist.barrier()
        t0 = time.perf_counter()
        stats = reduce_statistics(mismatch_statistics(trainer_lp, rollout[rows], adv, mask[rows], ais),
                                  groups.data_parallel_group)
        result = ais_coefficient(stats, ais, AISState())
        max_abs_logratio(trainer_lp, rollout[rows], mask[rows], ais, groups.data_parallel_group)
        apply_correction(trainer_lp, rollout[rows], mask[rows], ais, result)
        ais_times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(step_times), "ais_s": statistics.median(ais_times),
            "tokens": int(mask.sum()), "lambda": result.lam, "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16, help="Rollout batch size (sequences, both ranks).")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hf-dir", default=None, help="Model (default: a fresh tools/make_tiny_model.py model).")
    args = parser.parse_args(argv)
    from megatron_ais.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.hf_dir
        if hf_dir is None:
            import make_tiny_model
            hf_dir = make_tiny_model.make_tiny_model(make_tiny_model.build_parser().parse_args(
                ["--arch", "qwen3", "--out", os.path.join(tmp, "tiny")]))
        results = spawn(2, _bench_worker, hf_dir, args.sequences, args.seq_length, args.repeats)
    step = max(r["step_s"] for r in results)
    overhead = max(r["ais_s"] for r in results)
    print(f"| what (DP2, gloo, {results[0]['threads']} thread/rank, tiny qwen3, {results[0]['tokens']} "
          "response tokens) | median seconds |")
    print("|---|---|")
    print(f"| GRPO step (old log-probs + update) | {step:.4f} |")
    print(f"| AIS statistics + all-reduce + lambda + weights | {overhead:.6f} |")
    print(f"ais_overhead_fraction={overhead / step:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
