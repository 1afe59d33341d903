"""One GRPO update (old log-probs + PPO-clip update) at DP2 on long-tailed response lengths whose mean is about a
quarter of --seq-length: micro-batches by token budget (--max-tokens-per-microbatch) against today's rows padded
to --seq-length, both measured in the same processes, same model, same batch.

    .venv/bin/python tools/bench_train.py [--sequences 64] [--seq-length 512] [--repeats 3]

Prints a table and, as its last line, `token_batching_speedup=<x> padded_tokens_fraction=<y>` (the speedup of
the token budget over padding, target >= 2.5 on the 2-core machine; the fraction of the positions the token-budget
path computes that are padding).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def long_tailed_lengths(count: int, seq_length: int, seed: int = 0) -> list[int]:
    """Sequence lengths (prompt of 16 + response) with a Pareto tail, capped at `seq_length`; mean near a quarter
    of it."""
    rng = random.Random(seed)
    return [min(16 + int(rng.paretovariate(1.5) * seq_length / 12), seq_length) for _ in range(count)]


def rollout_batch(lengths: list[int], seq_length: int, vocab: int, prompt_length: int = 16, group_size: int = 4):
    """A RolloutBatch of random tokens whose sequences have these lengths (a prompt of `prompt_length`, then the
    response), random rollout log-probs and rewards."""
    from megatron_ais.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    count = len(lengths)
    tokens = torch.randint(1, vocab, (count, seq_length), generator=g)
    labels = torch.randint(1, vocab, (count, seq_length), generator=g)
    mask = torch.zeros(count, seq_length)
    for row, length in enumerate(lengths):
        tokens[row, length:], labels[row, length:] = 0, 0
        mask[row, prompt_length - 1:length] = 1.0
    rollout = (-torch.rand(count, seq_length, generator=g) * 3) * mask
    return RolloutBatch(tokens, labels, mask, rollout, torch.randint(0, 2, (count,), generator=g).float(), group_size)


def _bench_worker(hf_dir: str, lengths: list[int], seq_length: int, repeats: int) -> dict:
    import torch.distributed as dist

    from megatron_ais.ais import AISConfig, AISState
    from megatron_ais.arguments import TrainerConfig, build_parser
    from megatron_ais.batch import balanced_partition
    from megatron_ais.forward import fixed_plan, token_budget_plan
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.forward import ParallelGroups
    from megatron_ais.grpo.step import GRPOConfig, grpo_train_step, rows_of_whole_batch
    from megatron_ais.training import initialize_trainer, setup_model_and_optimizer

    budget, micro_batch_size = 4 * seq_length, 4
    args = build_parser("bench").parse_args(["--hf-dir", hf_dir, "--bf16", "--seq-length", str(seq_length),
                                             "--max-tokens-per-microbatch", str(budget)])
    trainer = TrainerConfig.from_args(args, int(os.environ["WORLD_SIZE"]))
    _, build = initialize_trainer(trainer)
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    groups = ParallelGroups.from_parallel_state()
    batch = rollout_batch(lengths, seq_length, build.shape.vocab_size)
    padded = GRPOConfig(loss=PolicyLossConfig(), correction=AISConfig(), vocab_size=build.shape.vocab_size,
                        micro_batch_size=micro_batch_size)
    configs = {"padded": padded, "tokens": dataclasses.replace(padded, max_tokens_per_microbatch=budget)}
    seconds = {name: [] for name in configs}
    for i in range(repeats + 1):
        for name, config in configs.items():
            dist.barrier()
            t0 = time.perf_counter()
            grpo_train_step(setup.ddp_chunks, setup.optimizer, rows_of_whole_batch(batch, config, groups), config,
                            AISState(), groups)
            dist.barrier()
            if i:  # the first round warms up allocators and lazy initialisation
                seconds[name].append(time.perf_counter() - t0)
    mine = balanced_partition(lengths, groups.data_parallel_size)[groups.data_parallel_rank]
    per_rank = len(lengths) // groups.data_parallel_size
    return {"padded_s": statistics.median(seconds["padded"]), "tokens_s": statistics.median(seconds["tokens"]),
            "computed_padded": fixed_plan(per_rank, micro_batch_size, seq_length).padded_tokens(),
            "computed_tokens": token_budget_plan([lengths[i] for i in mine], budget).padded_tokens(),
            "real": sum(lengths[i] for i in mine), "threads": torch.get_num_threads(), "budget": budget}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=64, help="Rollout batch size (sequences, both ranks).")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-dir", default=None, help="Model (default: a fresh tools/make_tiny_model.py model).")
    args = parser.parse_args(argv)
    from megatron_ais.launch import spawn

    lengths = long_tailed_lengths(args.sequences, args.seq_length)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.hf_dir
        if hf_dir is None:
            import make_tiny_model
            hf_dir = make_tiny_model.make_tiny_model(make_tiny_model.build_parser().parse_args(
                ["--arch", "qwen3", "--out", os.path.join(tmp, "tiny"), "--max-position-embeddings",
                 str(args.seq_length)]))
        results = spawn(2, _bench_worker, hf_dir, lengths, args.seq_length, args.repeats)
    padded, tokens = max(r["padded_s"] for r in results), max(r["tokens_s"] for r in results)
    real = sum(r["real"] for r in results)
    computed = {k: sum(r[f"computed_{k}"] for r in results) for k in ("padded", "tokens")}
    print(f"| one GRPO update, DP2, {results[0]['threads']} thread/rank, tiny qwen3, {args.sequences} sequences, "
          f"mean length {sum(lengths) / len(lengths):.0f} of {args.seq_length} | positions computed | padding | "
          "median seconds |")
    print("|---|---|---|---|")
    print(f"| rows padded to --seq-length (4 per micro-batch) | {computed['padded']} | "
          f"{1 - real / computed['padded']:.2f} | {padded:.3f} |")
    print(f"| --max-tokens-per-microbatch {results[0]['budget']} | {computed['tokens']} | "
          f"{1 - real / computed['tokens']:.2f} | {tokens:.3f} |")
    print(f"token_batching_speedup={padded / tokens:.2f} padded_tokens_fraction={1 - real / computed['tokens']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
