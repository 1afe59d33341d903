"""The AIS ablation: one SFT checkpoint, one seed and task, five GRPO runs that differ only in the rollout
precision and the mismatch correction; a markdown table and one figure with the five curves.

    .venv/bin/python tools/ablate.py --load runs/default/sft/checkpoint --output-dir runs/ablation \\
        -- --seq-length 64 --grpo-steps 40 --prompts-per-step 32 --group-size 8 --lr 5e-4

Flags after `--` go to every pretrain_grpo_ais.py run unchanged (the defaults of `make run` are a good start).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARMS = (
    ("bf16", "BF16 rollouts", ["--rollout-precision", "bf16", "--is-correction", "none"]),
    ("fp8", "FP8, uncorrected", ["--rollout-precision", "fp8", "--is-correction", "none"]),
    ("fp8-tis", "FP8 + TIS", ["--rollout-precision", "fp8", "--is-correction", "tis"]),
    ("fp8-mis", "FP8 + MIS", ["--rollout-precision", "fp8", "--is-correction", "mis"]),
    ("fp8-ais", "FP8 + AIS", ["--rollout-precision", "fp8", "--is-correction", "ais"]),
)


def run_arm(name: str, flags: list[str], args, extra: list[str]) -> dict:
    """Run one arm with torchrun; return its summary (raises with the tail of its log on failure)."""
    out = os.path.join(args.output_dir, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc_per_node), os.path.join(ROOT, "pretrain_grpo_ais.py"), "--load", args.load,
           "--seed", str(args.seed), "--output-dir", out, *extra, *flags]
    os.makedirs(out, exist_ok=True)
    start = time.time()
    with open(os.path.join(out, "log.txt"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        tail = open(os.path.join(out, "log.txt")).read()[-3000:]
        raise RuntimeError(f"arm {name} failed (exit {proc.returncode}):\n{tail}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    summary["launcher_wall_s"] = time.time() - start
    return summary


def _values(history: list[dict], key: str) -> list[float]:
    return [h[key] for h in history if key in h]


def table_row(label: str, summary: dict) -> str:
    """One markdown row: accuracy before/after, best, mean mismatch, λ range, wall time."""
    history = summary["history"]
    k3 = _values(history, "ais/k3_kl")
    delta = _values(history, "ais/mean_abs_logratio")
    lam = _values(history, "ais/lambda")
    evals = _values(history, "eval/accuracy")
    lam_range = f"{min(lam):.3f}–{max(lam):.3f}" if lam and "AIS" in label else "–"
    return (f"| {label} | {summary['accuracy_before']:.3f} | {summary['accuracy_after']:.3f} | {max(evals):.3f} | "
            f"{sum(k3) / len(k3):.2e} | {sum(delta) / len(delta):.4f} | {lam_range} | {summary['wall_s']:.0f} |")


TABLE_HEADER = ("| run | held-out acc. before | after | best | mean k3 KL (trainer‖engine) | mean abs log-ratio | "
                "λ range | wall s |\n|---|---|---|---|---|---|---|---|")


def plot(summaries: dict[str, dict], labels: dict[str, str], path: str) -> str:
    """One figure: held-out accuracy and train reward per step for every arm, and the mismatch."""
    from megatron_ais.logging import save_step_figure, step_figure

    plt, fig, axes = step_figure(3)
    for name, summary in summaries.items():
        history = summary["history"]
        evals = [(0, summary["accuracy_before"])] + [(h["step"], h["eval/accuracy"]) for h in history
                                                     if "eval/accuracy" in h]
        axes[0].plot(*zip(*evals), "o-", label=labels[name])
        axes[1].plot([h["step"] for h in history], [h["rollout/reward"] for h in history], label=labels[name],
                     alpha=0.8)
        axes[2].plot([h["step"] for h in history], [h.get("ais/k3_kl", float("nan")) for h in history],
                     label=labels[name], alpha=0.8)
    axes[0].set_title("held-out accuracy (avg@k, sampled)")
    axes[1].set_title("train reward")
    axes[2].set_title("mismatch: k3 KL trainer ‖ engine")
    axes[2].set_yscale("log")
    return save_step_figure(plt, fig, axes, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Flags after `--` go to every pretrain_grpo_ais.py run unchanged.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--load", required=True, help="SFT (or any) Megatron checkpoint every arm starts from.")
    parser.add_argument("--output-dir", default="runs/ablation", help="One sub-directory per arm, table, figure.")
    parser.add_argument("--seed", type=int, default=1234, help="The seed shared by every arm.")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="Trainer ranks per arm.")
    parser.add_argument("--arms", nargs="*", default=[a[0] for a in ARMS], choices=[a[0] for a in ARMS],
                        help="Arms to run.")
    args = parser.parse_args(own)
    os.makedirs(args.output_dir, exist_ok=True)
    labels = {name: label for name, label, _ in ARMS}
    summaries = {}
    for name, label, flags in ARMS:
        if name in args.arms:
            print(f"[ablate] {label} ...", flush=True)
            summaries[name] = run_arm(name, flags, args, extra)
            print(f"[ablate] {table_row(label, summaries[name])}", flush=True)
    figure = plot(summaries, labels, os.path.join(args.output_dir, "ablation.png"))
    command = " ".join(["tools/ablate.py", *own, "--", *extra])
    table = "\n".join([TABLE_HEADER] + [table_row(labels[n], s) for n, s in summaries.items()])
    with open(os.path.join(args.output_dir, "ablation.md"), "w") as f:
        f.write(f"Command: `{command}`\n\n{table}\n\n![ablation]({os.path.basename(figure)})\n")
    print(table)
    print(f"wrote {os.path.join(args.output_dir, 'ablation.md')} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
