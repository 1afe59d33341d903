"""Checkpoint save and load time of both formats (torch, torch_dist) on 2 gloo ranks (DP2, distributed optimizer,
fp32, after one training step, so the optimizer state is saved too), for the tiny model and a larger random one,
and the training time a save costs with and without --async-save.

    .venv/bin/python tools/bench_checkpoint.py [--big-hidden-size 1024] [--big-layers 8] [--root DIR]

A synchronous save blocks training for its whole length (the first of a process is timed apart). A background save
blocks it for `begin_save` (the format's collectives and the copy of the state); training then goes on, one step
after another with the poll every rank makes at a step boundary, until the save is committed: the time lost is the
blocking part plus how much slower those steps ran than steps without a save (the writer shares the cores). Prints
a table and, as its last line, `async_save_blocking_fraction=<x> torch_dist_over_torch_save_s=<y>` for the larger
model: the blocking part of a background save over a synchronous save's time (the worse of the two formats; target
<= 0.2), and torch_dist's synchronous save time over torch's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SEQ = 32


def _trainer(hf_dir: str):
    """(model setup, a training step on fixed tokens, the checkpoint metadata) on this rank's world."""
    from megatron.core import parallel_state as ps

    from megatron_ais.arguments import TrainerConfig, build_parser
    from megatron_ais.checkpointing.config import checkpoint_metadata
    from megatron_ais.forward import split_micro_batches
    from megatron_ais.training import initialize_trainer, lm_forward_step, setup_model_and_optimizer, train_step

    args = build_parser("bench").parse_args(["--hf-dir", hf_dir, "--seq-length", str(SEQ), "--fp32",
                                             "--micro-batch-size", "2", "--use-distributed-optimizer"])
    trainer = TrainerConfig.from_args(args, int(os.environ["WORLD_SIZE"]))
    hf_config, build = initialize_trainer(trainer)
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training, run_kind="bench")
    tokens = torch.randint(0, build.shape.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(0))
    rows = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(4, SEQ)}

    def step():
        batches = split_micro_batches(rows, 2)
        train_step(setup.ddp_chunks, setup.optimizer, lm_forward_step, iter(batches), len(batches), SEQ, 2)

    metadata = checkpoint_metadata(build, hf_config, 1, ps.get_data_parallel_world_size(), True)
    return setup, step, metadata


def _timed(fn) -> float:
    """Seconds `fn` takes on this rank, started together on every rank."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _checkpoint_bytes(directory: str) -> int:
    with open(os.path.join(directory, "checksums.json")) as f:
        return sum(entry["size"] for entry in json.load(f).values())


def _background_save(begin, step, step_s: float) -> dict:
    """Start a background save, then train until it is committed (polled at every step boundary, as a run does);
    the seconds it blocked, the steps trained meanwhile and the time lost beside them."""
    from megatron_ais.checkpointing.background import BackgroundSaver

    saver = BackgroundSaver()
    blocking = _timed(lambda: saver.start(begin()))
    during = []
    while saver.outstanding is not None:
        start = time.perf_counter()
        step()
        saver.poll()
        during.append(time.perf_counter() - start)
    return {"blocking_s": blocking, "steps_during": len(during),
            "lost_s": blocking + sum(during) - len(during) * step_s}


def _format_figures(fmt, root: str, setup, step, step_s: float, metadata: dict) -> dict:
    """One format's synchronous save, load (model, optimizer, RNG) and background save."""
    from megatron.core import parallel_state as ps

    from megatron_ais.checkpointing import store
    from megatron_ais.checkpointing.ranks import CheckpointRanks

    ranks = CheckpointRanks.from_parallel_state()
    sync_root, async_root = os.path.join(root, fmt.NAME, "sync"), os.path.join(root, fmt.NAME, "async")
    common = dict(chunks=setup.chunks, metadata=metadata, hf_assets_from=None, ranks=ranks, optimizer=setup.optimizer,
                  run_state={"kind": "bench"}, dp_group=ps.get_data_parallel_group(), fmt=fmt, keep=1)
    # the first save of a process also pays for what is set up once (megatron-core's strategies, caches): timed
    # apart, the second is what every later save costs
    first_save_s = _timed(lambda: store.save_checkpoint(sync_root, 1, **common))
    save_s = _timed(lambda: store.save_checkpoint(sync_root, 2, **common))

    def load():
        loaded = store.load_checkpoint(sync_root, ranks, distributed_optimizer=True)
        fmt.load_model(setup.chunks, loaded)
        fmt.restore_training_state(loaded, setup.chunks, setup.optimizer, ps.get_data_parallel_rank(),
                                   ps.get_data_parallel_world_size())

    load_s = _timed(load)
    background = _background_save(lambda: store.begin_save(async_root, 3, snapshot=True, **common), step, step_s)
    return {"first_save_s": first_save_s, "save_s": save_s, "load_s": load_s, **background,
            "bytes": _checkpoint_bytes(store.iteration_dir(sync_root, 2))}


def _bench_worker(hf_dir: str, root: str) -> dict:
    from megatron_ais.checkpointing.store import FORMATS

    setup, step, metadata = _trainer(hf_dir)
    step()  # the optimizer has state to save
    step_s = statistics.median(_timed(step) for _ in range(3))
    # DP2 at TP1 x PP1: each rank holds the whole model
    results = {"params": sum(p.numel() for chunk in setup.chunks for p in chunk.parameters()), "step_s": step_s}
    for fmt in FORMATS.values():
        results[fmt.NAME] = _format_figures(fmt, root, setup, step, step_s, metadata)
    return results


def _model(out: str, hidden: int, layers: int, heads: int, intermediate: int, vocab: int) -> str:
    import make_tiny_model

    return make_tiny_model.make_tiny_model(make_tiny_model.build_parser().parse_args(
        ["--arch", "qwen3", "--out", out, "--hidden-size", str(hidden), "--num-layers", str(layers),
         "--num-attention-heads", str(heads), "--num-key-value-heads", str(heads // 2), "--intermediate-size",
         str(intermediate), "--vocab-size", str(vocab), "--max-position-embeddings", str(4 * SEQ)]))


def _merged(results: list[dict]) -> dict:
    """Every figure as the slowest rank saw it (the byte count and parameters are rank 0's)."""
    merged = dict(results[0])
    for fmt in ("torch", "torch_dist"):
        merged[fmt] = {key: max(r[fmt][key] for r in results) if key != "bytes" else results[0][fmt][key]
                       for key in results[0][fmt]}
    return merged


def _print_rows(name: str, result: dict) -> None:
    params = f"{result['params'] / 1e6:.0f} M" if result["params"] < 1e9 else f"{result['params'] / 1e9:.2f} B"
    for fmt in ("torch", "torch_dist"):
        r = result[fmt]
        print(f"| {name} ({params}) | {fmt} | {r['bytes'] / 1e9:.2f} | {r['first_save_s']:.2f} | {r['save_s']:.2f} | "
              f"{r['load_s']:.2f} | "
              f"{r['blocking_s']:.2f} | {r['blocking_s'] / r['save_s']:.2f} | {r['steps_during']} x "
              f"{result['step_s']:.2f} s | {r['lost_s']:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-hidden-size", type=int, default=1024)
    # 8 layers: 103 M parameters; 20 (0.24 B) already exhausts a 24 GiB machine (docs/benchmarks.md)
    parser.add_argument("--big-layers", type=int, default=8)
    parser.add_argument("--root", default=None, help="Where the models and checkpoints go (default: a temporary "
                                                      "directory, removed afterwards).")
    args = parser.parse_args(argv)
    from megatron_ais.launch import spawn

    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        models = {"tiny": _model(os.path.join(tmp, "tiny"), 256, 4, 4, 512, 512),
                  "big": _model(os.path.join(tmp, "big"), args.big_hidden_size, args.big_layers, 16,
                                args.big_hidden_size * 11 // 4, 4096)}
        results = {name: _merged(spawn(2, _bench_worker, hf_dir, os.path.join(tmp, f"ckpt-{name}")))
                   for name, hf_dir in models.items()}
    print("| model (parameters) | format | checkpoint GB | first save s | save s | load s | --async-save blocking s | "
          "blocking / save | steps trained during the write | training time lost with --async-save, s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        _print_rows(name, result)
    big = results["big"]
    fraction = max(big[fmt]["blocking_s"] / big[fmt]["save_s"] for fmt in ("torch", "torch_dist"))
    print(f"async_save_blocking_fraction={fraction:.3f} "
          f"torch_dist_over_torch_save_s={big['torch_dist']['save_s'] / big['torch']['save_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
