"""Steps per second of the GRPO loop with rollouts overlapping training (--max-off-policy-steps 1, without and with
--partial-rollouts) against the synchronous loop (0), in one invocation: the same run three times (same seeds), 1 trainer rank and 1 separate FP8 engine
whose worker is bound to a CPU core of its own (the trainer's one thread takes the other), sizes chosen so that
generation and training take about as long on a 2-core machine.

    .venv/bin/python tools/bench_async.py [--steps 8] [--prompts-per-step 16] [--group-size 4] [--max-new-tokens 32]
                                          [--max-num-seqs 16]

A step is timed as what the loop waited for its rollouts, trained and synced (the first step, which warms up both
sides, and the last, which evaluates and never overlaps, are left out). Prints a table and, as its last line,
`async_over_sync_steps_per_s=<x> partial_over_sync_steps_per_s=<y> rollout_s=<R> train_s=<T> sync_s=<S>` with R,
T, S the synchronous run's median
phase times: the ideal ratio is (R + T + S) / (max(R, T) + S).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


# (label, --max-off-policy-steps, further flags): the synchronous loop, one step off policy with the sync after the
# batch in flight, and with the sync as soon as the step has trained (partial rollouts)
MODES = (("0", 0, ()), ("1", 1, ()), ("1 --partial-rollouts", 1, ("--partial-rollouts",)))


def _tiny_model(out: str) -> str:
    import make_tiny_model

    return make_tiny_model.make_tiny_model(make_tiny_model.build_parser().parse_args(
        ["--arch", "qwen3", "--out", out, "--hidden-size", "256", "--num-layers", "4", "--num-attention-heads", "4",
         "--num-key-value-heads", "2", "--intermediate-size", "768", "--vocab-size", "512"]))


def _run(hf_dir: str, out: str, eta: int, args, extra: tuple[str, ...] = ()) -> list[dict]:
    """One GRPO run at --max-off-policy-steps `eta` (with `extra` flags); its history."""
    cores = sorted(os.sched_getaffinity(0))
    # the trainer on the first core, the engine's processes (started by it, then bound) on the last
    command = ["taskset", "-c", str(cores[0]), sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(ROOT, "pretrain_grpo_ais.py"), "--hf-dir", hf_dir, "--task", "digit_sort",
               "--seq-length", "64", "--grpo-steps", str(args.steps), "--eval-interval", str(args.steps),
               "--eval-prompts", "8", "--eval-samples", "1", "--prompts-per-step", str(args.prompts_per_step),
               "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
               "--micro-batch-size", "16", "--rollout-precision", "fp8", "--rollout-kv-cache-gb", "0.5",
               "--rollout-max-num-seqs", str(args.max_num_seqs),
               "--rollout-cpu-core", str(cores[-1]), "--verify-refit-interval", "0", "--max-off-policy-steps", str(eta),
               "--output-dir", out, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"--max-off-policy-steps {eta} run failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)["history"]


def _figures(history: list[dict]) -> dict:
    timed = history[1:-1]
    phases = {name: [h[f"time/{name}_s"] for h in timed] for name in ("rollout", "train", "sync")}
    step_s = [sum(values) for values in zip(*phases.values())]
    return {"steps_per_s": len(step_s) / sum(step_s), **{f"{k}_s": statistics.median(v) for k, v in phases.items()},
            "lag": max(h["rollout/version_lag"] for h in history), "reward": history[-1]["rollout/reward"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    # fewer sequences decoded at once make generation as long as training here (the trade the benchmark measures)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first and the last step are not timed)")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = _tiny_model(os.path.join(tmp, "model"))
        results = {label: _figures(_run(hf_dir, os.path.join(tmp, f"run{index}"), eta, args, extra))
                   for index, (label, eta, extra) in enumerate(MODES)}
    print("| --max-off-policy-steps | steps/s | rollout wait s (median) | train s | sync s | largest version lag |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['steps_per_s']:.3f} | {r['rollout_s']:.2f} | {r['train_s']:.2f} | {r['sync_s']:.2f} | "
              f"{r['lag']} |")
    sync = results["0"]
    ideal = (sync["rollout_s"] + sync["train_s"] + sync["sync_s"]) / (max(sync["rollout_s"], sync["train_s"])
                                                                       + sync["sync_s"])
    print(f"ideal ratio (R + T + S) / (max(R, T) + S) = {ideal:.2f}")
    print(f"async_over_sync_steps_per_s={results['1']['steps_per_s'] / sync['steps_per_s']:.3f} "
          f"partial_over_sync_steps_per_s={results['1 --partial-rollouts']['steps_per_s'] / sync['steps_per_s']:.3f} "
          f"rollout_s={sync['rollout_s']:.3f} train_s={sync['train_s']:.3f} sync_s={sync['sync_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
