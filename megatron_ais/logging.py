"""Console lines, tensorboard scalars and the run summary; only the designated logging rank writes."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag


@dataclasses.dataclass(frozen=True)
class LoggingConfig(FlagConfig):
    """Where a run writes its logs and how often it prints."""

    output_dir: str = flag("runs/default", "Run directory: tensorboard events, summary.json, figures.")
    log_interval: int = flag(1, "Print one console line every this many steps.")
    tensorboard_dir: str | None = flag(None, "Tensorboard event directory (default: <output-dir>/tensorboard).",
                                       type=str)

    def __post_init__(self):
        if self.log_interval < 1:
            raise ArgumentValidationError(f"--log-interval {self.log_interval} must be a positive integer")

    def prints(self, step: int, last_step: int) -> bool:
        """Whether `step`'s console line is printed: every --log-interval steps and the last."""
        return step % self.log_interval == 0 or step == last_step


class RunLogger:
    """One console line per step, tensorboard scalars and summary.json for a run directory."""

    def __init__(self, output_dir: str, tensorboard_dir: str | None, enabled: bool, resume_step: int | None = None):
        """`resume_step`: a run resumed from that step's checkpoint; what an earlier run logged for later steps
        (before it died) is dropped from metrics.jsonl and, by tensorboard's purge, from the event files."""
        self.enabled = enabled
        self.output_dir = output_dir
        self.writer = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            if resume_step is not None:
                drop_logged_steps_after(os.path.join(output_dir, "metrics.jsonl"), resume_step)
            self.writer = SummaryWriter(tensorboard_dir or os.path.join(output_dir, "tensorboard"),
                                        purge_step=None if resume_step is None else resume_step + 1)

    def step(self, step: int, scalars: dict[str, float], line: str | None) -> None:
        """Write the step's scalars to tensorboard and metrics.jsonl, and print its console line (if any)."""
        if not self.enabled:
            return
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(name, value, step)
        with open(os.path.join(self.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **{k: v for k, v in scalars.items() if v is not None}}) + "\n")
        if line is not None:
            print(line, flush=True)

    def info(self, message: str) -> None:
        """Print a message from the logging rank."""
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    def summary(self, data: dict[str, Any]) -> None:
        """Write summary.json and flush tensorboard."""
        if not self.enabled:
            return
        with open(os.path.join(self.output_dir, "summary.json"), "w") as f:
            json.dump(data, f, indent=2)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def drop_logged_steps_after(path: str, step: int) -> int:
    """Rewrite a metrics.jsonl without the records of steps after `step` (atomically); return how many went."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) < len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return len(lines) - len(kept)


def grpo_console_line(step: int, metrics: dict[str, float]) -> str:
    """Return the one-line GRPO summary: λ and its diagnostics, mismatch and guard counters, loss."""
    def get(name, fmt=".4f"):
        value = metrics.get(name)
        return "-" if value is None else format(value, fmt)

    return (f"step {step:5d} | λ {get('ais/lambda')} (sev {get('ais/severity', '.3f')} rel {get('ais/reliability', '.3f')} "
            f"var {get('ais/var_amp', '.3f')}) | |δ| mean {get('ais/mean_abs_logratio')} max "
            f"{get('ais/max_abs_logratio', '.3f')} | k3 {get('ais/k3_kl', '.2e')} χ² {get('ais/chi2', '.2e')} "
            f"ess {get('ais/ess_ratio_raw', '.3f')} trunc {get('ais/frac_truncated', '.3f')} | excluded "
            f"{get('guard/excluded_sequences', '.0f')} | loss {get('train/policy_loss')} "
            f"grad {get('train/grad_norm', '.3f')}")


def step_figure(columns: int):
    """Return (pyplot, figure, axes) for `columns` per-step panels (headless backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=(5.3 * columns, 4.2))
    return plt, fig, axes


def save_step_figure(plt, fig, axes, path: str) -> str:
    """Label the step axes, add legends and write the figure as a PNG."""
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(history: list[dict[str, float]], path: str, accuracy_before: float | None = None) -> str:
    """Write a PNG with reward and held-out accuracy (from `accuracy_before` at step 0), λ and the three
    diagnostics, and the mismatch k3 KL per step."""
    plt, fig, axes = step_figure(3)
    steps = [h.get("step", i + 1) for i, h in enumerate(history)]

    def series(name):
        return [h.get(name, float("nan")) for h in history]

    axes[0].plot(steps, series("rollout/reward"), label="train reward")
    evaluated = [(0, accuracy_before)] if accuracy_before is not None else []
    evaluated += [(s, h["eval/accuracy"]) for s, h in zip(steps, history) if "eval/accuracy" in h]
    if evaluated:
        axes[0].plot(*zip(*evaluated), "o-", label="held-out accuracy")
    axes[0].set_title("reward / accuracy")
    for name, label in (("ais/lambda", "λ"), ("ais/severity", "severity"), ("ais/reliability", "reliability"),
                        ("ais/var_amp", "variance amplification")):
        axes[1].plot(steps, series(name), label=label)
    axes[1].set_title("AIS λ and diagnostics")
    axes[2].plot(steps, series("ais/k3_kl"), label="k3 KL (trainer ‖ engine)")
    axes[2].plot(steps, series("ais/mean_abs_logratio"), label="mean |δ|")
    axes[2].set_yscale("log")
    axes[2].set_title("rollout/trainer mismatch")
    return save_step_figure(plt, fig, axes, path)
