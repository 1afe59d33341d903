"""The run's console, tensorboard scalars, Weights & Biases and the run summary; only the designated logging rank
writes. The console: one line per step under one progress bar for the run (steps done, ETA; on a terminal), our
messages on stderr, and the summary line last."""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import sys
import warnings
from typing import Any

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from megatron_ais import platform
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag


@dataclasses.dataclass(frozen=True)
class LoggingConfig(FlagConfig):
    """Where a run writes its logs and how often it prints; Weights & Biases with Megatron-LM's flags."""

    output_dir: str = flag("runs/default", "Run directory: tensorboard events, summary.json, figures.")
    log_interval: int = flag(1, "Print one console line every this many steps.", at_least=1)
    tensorboard_dir: str | None = flag(None, "Tensorboard event directory (default: <output-dir>/tensorboard).",
                                       type=str)
    wandb_project: str | None = flag(None, "Log the same scalars as tensorboard, and the run's flags, to this Weights "
                                           "& Biases project (needs the optional wandb package; WANDB_MODE=offline "
                                           "keeps them on disk).", type=str)
    wandb_exp_name: str | None = flag(None, "The Weights & Biases run's name (default: W&B's own).", type=str)
    wandb_save_dir: str | None = flag(None, "Where Weights & Biases keeps its files (default: --output-dir).", type=str)

    def __post_init__(self):
        super().__post_init__()
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ArgumentValidationError("--wandb-project needs the wandb package, which is optional: pip install "
                                          "wandb (or drop the flag)")

    def prints(self, step: int, last_step: int) -> bool:
        """Whether `step`'s console line is printed: every --log-interval steps and the last."""
        return step % self.log_interval == 0 or step == last_step


# the libraries whose Python warnings a run shows once (rank 0), not once per rank
LIBRARIES = r"(megatron|torch|transformers|vllm|tensorboard|triton|numba)(\.|$)"


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message} ({os.path.basename(filename)}:{lineno})\n"


def _once_per_subject(show):
    """`warnings.showwarning` that shows one warning per subject (its first sentence): megatron says "Transformer
    Engine and Apex are not installed" from four modules, each with its own fallback."""
    seen = set()

    def showwarning(message, category, filename, lineno, file=None, line=None):
        subject = str(message).split(". ")[0]
        if subject not in seen:
            seen.add(subject)
            show(message, category, filename, lineno, file, line)

    return showwarning


def quiet_libraries(rank: int) -> None:
    """The console stays ours: the libraries' Python warnings are shown by rank 0 only, once per subject, on one line;
    the other ranks drop them; without CUDA megatron's expected fallback notices are dropped (an entry point calls
    this before megatron is imported, which warns at import). Megatron's rerun state machine announces its default
    mode (disabled) at warning level; that announcement is dropped."""
    if not platform.is_cuda():
        platform.drop_expected_cpu_warnings()
    warnings.formatwarning = _one_line
    warnings.showwarning = _once_per_subject(warnings.showwarning)
    if rank != 0:
        warnings.filterwarnings("ignore", module=LIBRARIES)
    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.ERROR)


def apply_vllm_log_level() -> None:
    """Hold vLLM's loggers to VLLM_LOGGING_LEVEL from the start: vLLM configures its logging lazily, and until then
    what it logs while being imported reaches Python's last-resort handler, which knows nothing of that level. An
    entry point calls this at import, so that the engine processes vLLM spawns (which import the entry point's
    module before unpickling anything of vLLM's) apply it too."""
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    if level:
        logging.getLogger("vllm").setLevel(level.upper())


def start_wandb(config: LoggingConfig, run_config: dict[str, Any]):
    """A Weights & Biases run for the logging rank, with the run's flags as its config (quiet: the console stays
    ours)."""
    import wandb  # optional: only a run with --wandb-project needs it

    return wandb.init(project=config.wandb_project, name=config.wandb_exp_name,
                      dir=config.wandb_save_dir or config.output_dir, config=run_config,
                      settings=wandb.Settings(console="off", silent=True))


class RunLogger:
    """One console line per step under a progress bar, tensorboard scalars, metrics.jsonl, W&B and summary.json."""

    def __init__(self, config: LoggingConfig, enabled: bool, resume_step: int | None = None,
                 run_config: dict[str, Any] | None = None, total_steps: int | None = None):
        """`resume_step`: a run resumed from that step's checkpoint; what an earlier run logged for later steps
        (before it died) is dropped from metrics.jsonl and, by tensorboard's purge, from the event files. A fresh
        run moves an earlier run's metrics.jsonl aside (metrics.1.jsonl, ...).
        `total_steps`: show a progress bar for the run (its steps done and ETA)."""
        self.enabled, self.output_dir = enabled, config.output_dir
        self.writer = self.wandb = self.progress = None
        if not enabled:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        metrics = os.path.join(self.output_dir, "metrics.jsonl")
        if resume_step is not None:
            drop_logged_steps_after(metrics, resume_step)
        elif os.path.isfile(metrics):  # an earlier run's records, kept beside this run's rather than mixed in
            os.replace(metrics, _unused_name(metrics))
        self.writer = SummaryWriter(config.tensorboard_dir or os.path.join(self.output_dir, "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)
        if config.wandb_project:
            self.wandb = start_wandb(config, run_config or {})
        if total_steps:
            # on a terminal only (disable=None): in a log file a redrawn bar is noise between the step lines
            self.progress = tqdm(total=total_steps, initial=resume_step or 0, desc="steps", unit="step",
                                 file=sys.stderr, dynamic_ncols=True, disable=None)

    def _print(self, line: str, file) -> None:
        if self.progress is not None:
            self.progress.write(line, file=file)
        else:
            print(line, file=file, flush=True)

    def step(self, step: int, scalars: dict[str, float], line: str | None) -> None:
        """Write the step's scalars to tensorboard, metrics.jsonl and W&B, and print its console line (if any)."""
        if not self.enabled:
            return
        logged = {k: v for k, v in scalars.items() if v is not None}
        for name, value in logged.items():
            self.writer.add_scalar(name, value, step)
        with open(os.path.join(self.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **logged}) + "\n")
        if self.wandb is not None:
            self.wandb.log(logged, step=step)
        if line is not None:
            self._print(line, sys.stdout)
        if self.progress is not None:
            self.progress.update(1)

    def info(self, message: str) -> None:
        """Print a message from the logging rank."""
        if self.enabled:
            self._print(message, sys.stderr)

    def summary(self, data: dict[str, Any]) -> None:
        """Write summary.json (and the W&B summary's scalars), flush tensorboard."""
        if not self.enabled:
            return
        with open(os.path.join(self.output_dir, "summary.json"), "w") as f:
            json.dump(data, f, indent=2)
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in data.items() if isinstance(v, (int, float))})
        self.writer.flush()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _logged_step(line: str) -> int | None:
    """A metrics.jsonl record's step; None for a line cut short (a run killed while writing it) or blank."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def _unused_name(path: str) -> str:
    """`metrics.jsonl` -> the first of `metrics.1.jsonl`, `metrics.2.jsonl`, ... that does not exist."""
    stem, extension = os.path.splitext(path)
    return next(f"{stem}.{n}{extension}" for n in itertools.count(1) if not os.path.exists(f"{stem}.{n}{extension}"))


def drop_logged_steps_after(path: str, step: int) -> int:
    """Rewrite a metrics.jsonl without the records of steps after `step` (atomically); return how many went."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if (logged := _logged_step(line)) is not None and logged <= step]
    if len(kept) < len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return len(lines) - len(kept)


def grpo_console_line(step: int, metrics: dict[str, float]) -> str:
    """Return the one-line GRPO summary: λ and its diagnostics, mismatch and guard counters, loss. A field the step
    did not measure (a skipped update's λ and loss, a dense model's routes) is left out, not printed as a blank."""
    def fields(*specs) -> str:
        return " ".join(f"{label} {format(metrics[name], fmt)}" for label, name, fmt in specs if name in metrics)

    parts = [f"step {step:5d}"]
    if "ais/lambda" in metrics:
        parts.append(f"λ {metrics['ais/lambda']:.4f} (" + fields(
            ("sev", "ais/severity", ".3f"), ("rel", "ais/reliability", ".3f"), ("var", "ais/var_amp", ".3f")) + ")")
    parts.append(fields(("|δ| mean", "ais/mean_abs_logratio", ".4f"), ("max", "ais/max_abs_logratio", ".3f")))
    parts.append(fields(("k3", "ais/k3_kl", ".2e"), ("χ²", "ais/chi2", ".2e"), ("ess", "ais/ess_ratio_raw", ".3f"),
                        ("seq", "ais/sequence_ess", ".3f"), ("trunc", "ais/frac_truncated", ".3f")))
    parts.append(fields(("excluded", "guard/excluded_sequences", ".0f")))
    parts.append(fields(("loss", "train/policy_loss", ".4f"), ("grad", "train/grad_norm", ".3f")))
    # MoE: the probe's share of routes the trainer would choose otherwise (what routing replay removes)
    parts.append(fields(("routes differ", "rollout/routing_mismatch", ".3f")))
    return " | ".join(part for part in parts if part)


def step_figure(columns: int):
    """Return (pyplot, figure, axes) for `columns` per-step panels (headless backend)."""
    import matplotlib  # only the logging rank draws, at the end of a run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): headless

    fig, axes = plt.subplots(1, columns, figsize=(5.3 * columns, 4.2))
    return plt, fig, axes


def save_step_figure(plt, fig, axes, path: str, xlabel: str = "GRPO step") -> str:
    """Label the step axes (or whatever `xlabel` names), add legends and write the figure as a PNG."""
    for ax in axes:
        ax.set_xlabel(xlabel)
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
