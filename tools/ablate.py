"""The mismatch study: one SFT checkpoint, GRPO runs that differ only in the rollout numerics and the mismatch
correction, each over several seeds; a markdown table of mean ± std across seeds and one figure of the
trajectories.

    .venv/bin/python tools/ablate.py --load runs/study/sft/checkpoint --output-dir runs/study --regime w8a8 \\
        --seeds 1 2 3 -- --task running_sum --seq-length 320 --max-new-tokens 256 --grpo-steps 12 ...

Regimes: `w8a16` (the CPU engine: e4m3 weights, BF16 activations, BF16 KV cache), `w8a8` (H100's numerics on a
CPU: `--rollout-fp8-activations emulate` and an FP8 KV cache) and `gpu` (a GPU engine, W8A8 natively, with an FP8 KV
cache). `--off-policy-steps 0 2 4` sweeps the staleness bound η (`--max-off-policy-steps`, separate engines when
η > 0; add `--partial-rollouts` after `--` for mixed-lag batches). Each arm's after-accuracy is also compared seed by
seed with the uncorrected FP8 arm at the same η (paired differences). Flags after `--` go to every
pretrain_grpo_ais.py run unchanged. The command resumes: a run finished with the same flags is read, not rerun, so a
grid grows a seed or an arm at a time under one --output-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# QaRL: the trainer's forward on the engine's weights; + TBPO (docs/ais-method.md §5.2: GSPO-scale clips, the trust
# band for negative sequences, the sequence mismatch weight as geometric TIS capped at 2)
QARL = ["--rollout-aligned-forward", "--is-correction", "none"]
QARL_TBPO = ["--rollout-aligned-forward", "--policy-loss", "tbpo", "--loss-agg", "seq-mean-token-mean", "--clip-low",
             "3e-4", "--clip-high", "4e-4", "--is-correction", "tis", "--is-level", "geometric", "--is-cap", "2"]
# (name, label, correction flags): the bf16 arm samples from a BF16 engine, every `fp8*` arm from the low-precision
# engine (--low-precision: FP8 in the regime's numerics, or a W4A16 engine), its name and label then saying which
ARMS = (
    ("bf16", "BF16 rollouts", ["--is-correction", "none"]),
    ("fp8", "FP8, uncorrected", ["--is-correction", "none"]),
    ("fp8-tis", "FP8 + TIS", ["--is-correction", "tis"]),
    ("fp8-mis", "FP8 + MIS", ["--is-correction", "mis"]),
    ("fp8-icepop", "FP8 + IcePop", ["--is-correction", "icepop"]),
    ("fp8-seq-tis", "FP8 + sequence TIS", ["--is-correction", "tis", "--is-level", "sequence"]),
    ("fp8-geo-tis", "FP8 + geometric TIS", ["--is-correction", "tis", "--is-level", "geometric"]),
    ("fp8-ais", "FP8 + AIS", ["--is-correction", "ais"]),
    ("fp8-ais-seq", "FP8 + AIS, sequence level", ["--is-correction", "ais", "--is-level", "sequence"]),
    ("fp8-ais-cv", "FP8 + AIS, CV variance", ["--is-correction", "ais", "--ais-variance", "cv"]),
    ("fp8-ais-lag", "FP8 + AIS, one λ per lag", ["--is-correction", "ais", "--ais-lambda-per-lag"]),
    ("fp8-ais-floor", "FP8 + AIS, stale λ ≥ 1", ["--is-correction", "ais", "--ais-stale-lambda-floor", "1"]),
    ("fp8-ais-bias", "FP8 + AIS, sign-aware bias test", ["--is-correction", "ais", "--ais-lambda", "bias-test"]),
    ("fp8-ais-seq-ess", "FP8 + AIS, sequence mixing by ESS",
     ["--is-correction", "ais", "--is-level", "sequence", "--ais-reliability", "raw_ess", "--ais-exponents", "0", "1",
      "0"]),
    ("fp8-ais-k3", "FP8 + AIS, k3 severity", ["--is-correction", "ais", "--ais-severity", "k3"]),
    ("fp8-ais-tau", "FP8 + AIS, τ = 0.01", ["--is-correction", "ais", "--ais-tau", "0.01"]),
    ("fp8-ais-severity", "FP8 + AIS, severity alone", ["--is-correction", "ais", "--ais-exponents", "1", "0", "0"]),
    ("fp8-qarl", "FP8 + QaRL aligned forward", QARL),
    ("fp8-qarl-tbpo", "FP8 + QaRL + TBPO", QARL_TBPO),
    ("fp8-qarl-ais", "FP8 + QaRL + AIS", ["--rollout-aligned-forward", "--is-correction", "ais"]),
)
PER_LAG_ARMS = ("fp8-ais-lag", "fp8-ais-floor")  # need η > 0
# the low-precision engine: FP8 in a regime's numerics (the CPU kernel's W8A16; H100's W8A8 emulated on a CPU; on a
# GPU vLLM's own W8A8 path), or 4-bit weights (W4A16), which keep only the regime's KV cache
LOW_PRECISIONS = {"fp8": "FP8", "nvfp4": "NVFP4 (W4A16)", "mxfp4": "MXFP4 (W4A16)"}
REGIMES = {"w8a16": (False, False), "w8a8": (True, True), "gpu": (False, True)}  # (FP8 activations emulated, KV)


def regime_flags(regime: str, low_precision: str) -> list[str]:
    emulated, fp8_kv_cache = REGIMES[regime]
    return ((["--rollout-fp8-activations", "emulate"] if emulated and low_precision == "fp8" else [])
            + (["--rollout-kv-cache-dtype", "fp8"] if fp8_kv_cache else []))


def arm_flags(name: str, flags: list[str], regime: str, eta: int = 0, low_precision: str = "fp8") -> list[str]:
    """An arm's flags in a regime at staleness bound η: the bf16 arm's engine is BF16, the others' the low precision
    in the regime's numerics; η > 0 runs separate engines that many steps ahead."""
    stale = ["--max-off-policy-steps", str(eta), "--rollout-placement", "separate"] if eta else []
    if name == "bf16":
        return ["--rollout-precision", "bf16", *flags, *stale]
    return ["--rollout-precision", low_precision, *flags, *regime_flags(regime, low_precision), *stale]


def arm_name(name: str, low_precision: str) -> str:
    """What an arm is called at a low precision: `fp8-tis` is `mxfp4-tis` under --low-precision mxfp4."""
    return low_precision + name[len("fp8"):] if name.startswith("fp8") else name


def arm_label(label: str, low_precision: str) -> str:
    return label.replace("FP8", LOW_PRECISIONS[low_precision], 1)


def cell(name: str, eta: int, low_precision: str = "fp8") -> str:
    """An arm's directory name at η and a low precision (η = 0 keeps the arm's name: earlier studies' directories)."""
    name = arm_name(name, low_precision)
    return name if eta == 0 else f"{name}-eta{eta}"


def run_flags(name: str, flags: list[str], seed: int, args, extra: list[str], eta: int = 0) -> list[str]:
    """The pretrain_grpo_ais.py flags of one arm at one seed and η."""
    return ["--load", args.load, "--seed", str(seed), "--output-dir",
            run_dir(args.output_dir, name, seed, eta, args.low_precision), *extra,
            *arm_flags(name, flags, args.regime, eta, args.low_precision)]


def owned_flags(args) -> set[str]:
    """The pretrain_grpo_ais.py flags ablate sets itself for some run of this command (a repeat after `--` would
    win, argparse keeping the last: every seed the same run, or every arm the same arm)."""
    return {"--load", "--seed", "--output-dir", "--max-off-policy-steps"} | {
        flag for name, _, flags in ARMS for eta in args.off_policy_steps
        for flag in arm_flags(name, flags, args.regime, eta, args.low_precision) if flag.startswith("--")}


def run_dir(output_dir: str, name: str, seed: int, eta: int = 0, low_precision: str = "fp8") -> str:
    return os.path.join(output_dir, cell(name, eta, low_precision), f"seed{seed}")


def run_arm(name: str, flags: list[str], seed: int, args, extra: list[str], eta: int = 0) -> dict:
    """Run one arm at one seed with torchrun and return its summary; a run already finished with the same flags is
    read, not rerun (so the grid's command resumes), and one finished with other flags stops the grid."""
    out = run_dir(args.output_dir, name, seed, eta, args.low_precision)
    own = run_flags(name, flags, seed, args, extra, eta)
    if os.path.exists(os.path.join(out, "summary.json")):
        if not os.path.exists(os.path.join(out, "flags.json")) or not ran_with(out, own):
            raise SystemExit(f"ablate: {out} holds a finished run with other flags; pass another --output-dir or "
                             "remove that directory")
        return read_summary(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc_per_node), os.path.join(ROOT, "pretrain_grpo_ais.py"), *own]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "flags.json"), "w") as f:  # before the run: an interrupted one is rerun, not refused
        json.dump(own, f)
    start = time.time()
    with open(os.path.join(out, "log.txt"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        tail = open(os.path.join(out, "log.txt")).read()[-3000:]
        raise RuntimeError(f"arm {name} seed {seed} failed (exit {proc.returncode}):\n{tail}")
    summary = read_summary(out)
    summary["launcher_wall_s"] = time.time() - start
    return summary


def ran_with(out: str, flags: list[str]) -> bool:
    """Whether the run in `out` was made with `flags` (a run without flags.json, from before it was recorded, is
    taken as made with them)."""
    recorded = os.path.join(out, "flags.json")
    return not os.path.exists(recorded) or json.load(open(recorded)) == flags


def read_summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def _values(history: list[dict], key: str) -> list[float]:
    return [h[key] for h in history if key in h]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def seed_figures(summary: dict, eta: int = 0) -> dict[str, float]:
    """One run's figures: final and best held-out accuracy, and the per-step means of the mismatch metrics, overall
    and of the tokens at lag η (the steady state of a run at η; at η = 0 every token)."""
    history = summary["history"]
    lag = f"ais/lag{eta}/" if eta else "ais/"
    evals = _values(history, "eval/accuracy")
    rewards = _values(history, "rollout/reward")
    return {"after": summary["accuracy_after"], "best": max(evals) if evals else summary["accuracy_after"],
            "late_reward": _mean(rewards[len(rewards) // 2:]),
            "k3": _mean(_values(history, "ais/k3_kl")), "token_ess": _mean(_values(history, "ais/ess_ratio_raw")),
            "sequence_ess": _mean(_values(history, "ais/sequence_ess")),
            "k3_at_lag": _mean(_values(history, lag + "k3_kl")),
            "sequence_ess_at_lag": _mean(_values(history, lag + "sequence_ess")),
            "truncated": _mean(_values(history, "ais/frac_truncated")),
            "rejected": _mean(_values(history, "guard/rejected_fraction")),
            "repetitive": _mean(_values(history, "rollout/repetitive_fraction")),
            "lambda_min": min(_values(history, "ais/lambda"), default=float("nan")),
            "lambda_max": max(_values(history, "ais/lambda"), default=float("nan")), "wall_s": summary["wall_s"]}


def spread(values: list[float], digits: int = 3) -> str:
    """mean ± sample standard deviation (± 0 for one seed)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{_mean(values):.{digits}f} ± {std:.{digits}f}"


def paired_difference(runs: dict[int, dict], baseline: dict[int, dict] | None) -> str:
    """after − the baseline's after at the same seed, over the seeds both have, as mean ± std (with the number of
    pairs when the baseline lacks some of the arm's seeds); "–" without a baseline."""
    seeds = sorted(set(runs) & set(baseline or {}))
    if not seeds or runs is baseline:
        return "–"
    pairs = "" if len(seeds) == len(runs) else f" ({len(seeds)} pairs)"
    return spread([runs[seed]["accuracy_after"] - baseline[seed]["accuracy_after"] for seed in seeds]) + pairs


def table_row(name: str, label: str, runs: dict[int, dict], baseline: dict[int, dict] | None = None,
              eta: int = 0) -> str:
    """One markdown row over an arm's runs by seed (at η; `baseline`: the uncorrected low-precision arm's runs by
    seed)."""
    summaries = list(runs.values())
    figures = [seed_figures(s, eta) for s in summaries]

    def column(key):
        return [f[key] for f in figures]

    lam = f"{min(column('lambda_min')):.3f}–{max(column('lambda_max')):.3f}" if "ais" in name else "–"
    before = _mean([s["accuracy_before"] for s in summaries])
    return (f"| {label} | {eta} | {len(figures)} | {before:.3f} | {spread(column('after'))} | "
            f"{paired_difference(runs, baseline)} | "
            f"{spread(column('best'))} | {spread(column('late_reward'))} | {_mean(column('k3')):.2e} | {_mean(column('token_ess')):.4f} | "
            f"{_mean(column('sequence_ess')):.3f} | "
            f"{_mean(column('truncated')):.3f} | "
            f"{_mean(column('rejected')):.3f} | {_mean(column('repetitive')):.3f} | {lam} | {_mean(column('k3_at_lag')):.2e} | "
            f"{_mean(column('sequence_ess_at_lag')):.3f} | {_mean(column('wall_s')):.0f} |")


def table_header(precision: str) -> str:
    return (f"| arm | η | seeds | held-out acc. before (mean) | after (mean ± std) | after − {precision} uncorrected, "
            "paired (mean ± std) | best step (mean ± std) | training reward, second half (mean ± std) | mean k3 KL "
            "(trainer‖engine) | token ESS | sequence ESS | units with w > C | rejected tokens | repetitive responses | "
            "λ range | k3 at lag η | sequence ESS at lag η | wall s per run |\n" + "|---" * 18 + "|")


def accuracy_by_step(runs: dict[str, dict[int, dict]], cells: list[tuple[str, str, int]]) -> str:
    """A markdown table of each cell's held-out accuracy at every evaluation step (mean ± std over its seeds)."""
    steps = sorted({h["step"] for by_seed in runs.values() for s in by_seed.values() for h in s["history"]
                    if "eval/accuracy" in h})
    lines = ["| arm | η | " + " | ".join(f"step {step}" for step in steps) + " |", "|---|---|" + "---|" * len(steps)]
    for name, label, eta in cells:
        summaries = list(runs[cell(name, eta)].values())
        values = [[h["eval/accuracy"] for s in summaries for h in s["history"] if h["step"] == step
                   and "eval/accuracy" in h] for step in steps]
        lines.append(f"| {label} | {eta} | " + " | ".join(spread(v) if v else "–" for v in values) + " |")
    return "\n".join(lines)


SETTLED_AFTER = 5  # steps: the AIS diagnostics' table reads λ after the first syncs, where lags and anchors settle


def _range(values: list[float], digits: int = 3) -> str:
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}" if values else "–"


def diagnostics_table(runs: dict[str, dict[int, dict]], cells: list[tuple[str, str, int]]) -> str:
    """A markdown table of each AIS cell's λ and the diagnostics it is made of, over every seed's steps after the
    first SETTLED_AFTER: λ (mean, range), the severity s_D (mean), λ / s_D (range: 1 where the reliability ρ and the
    variance term Γ take nothing off, as the product rule makes λ = s_D · ρ / Γ), ρ's and Γ's ranges, and the mean
    |δ| D the severity reads. Empty without an AIS cell."""
    lines = []
    for name, label, eta in cells:
        steps = [h for s in runs[cell(name, eta)].values() for h in s["history"]
                 if h["step"] > SETTLED_AFTER and "ais/severity" in h]
        if "ais" not in name or not steps:
            continue

        def values(key):
            return [h[key] for h in steps]

        ratio = [h["ais/lambda"] / h["ais/severity"] for h in steps if h["ais/severity"] > 0]
        lines.append(f"| {label} | {eta} | {_mean(values('ais/lambda')):.3f} ({_range(values('ais/lambda'))}) | "
                     f"{_mean(values('ais/severity')):.3f} | {_range(ratio)} | "
                     f"{_range(values('ais/reliability'), 4)} | {_range(values('ais/var_amp'), 4)} | "
                     f"{_mean(values('ais/mean_abs_logratio')):.4f} |")
    if not lines:
        return ""
    return "\n".join(["| arm | η | λ, mean (range) | severity s_D, mean | λ / s_D | reliability ρ | variance Γ | "
                      "mean \\|δ\\| D |", "|---" * 8 + "|"] + lines)


def plot(summaries: dict[str, list[dict]], labels: dict[str, str], path: str) -> str:
    """One figure of the trajectories, averaged over seeds: held-out accuracy, training reward, k3, token and
    sequence ESS, and for the AIS arms λ and the bias test's z (b̂ over its standard error, logged under every λ
    rule: does the mismatch come to correlate with the advantage?)."""
    from megatron_ais.logging import save_step_figure, step_figure

    panels = (("eval/accuracy", "held-out accuracy (avg@k, sampled)"), ("rollout/reward", "training reward"),
              ("ais/k3_kl", "k3 KL trainer ‖ engine"),
              ("ais/ess_ratio_raw", "token ESS (raw weights)"), ("ais/sequence_ess", "sequence ESS (raw weights)"),
              ("ais/lambda", "AIS λ"), ("ais/bias_z", "bias test z = b̂ / its standard error"))
    plt, fig, axes = step_figure(len(panels))
    for name, runs in summaries.items():
        for axis, (key, title) in zip(axes, panels):
            steps = sorted({h["step"] for s in runs for h in s["history"] if key in h})
            if key in ("ais/lambda", "ais/bias_z") and "ais" not in name or not steps:
                continue
            means = [_mean([h[key] for s in runs for h in s["history"] if h["step"] == step and key in h])
                     for step in steps]
            axis.plot(steps, means, "o-" if key == "eval/accuracy" else "-", label=labels[name], alpha=0.8)
            axis.set_title(title)
    axes[2].set_yscale("log")
    return save_step_figure(plt, fig, axes, path)


def plot_against_eta(summaries: dict[str, list[dict]], cells: list[tuple[str, str, int]], path: str) -> str:
    """Held-out accuracy after the run against η, one line per arm: mean over seeds, sample std as error bars."""
    from megatron_ais.logging import save_step_figure, step_figure

    plt, fig, axis = step_figure(1)
    for name, label in dict((name, label) for name, label, _ in cells).items():
        etas = sorted(eta for arm, _, eta in cells if arm == name)
        runs = [[s["accuracy_after"] for s in summaries[cell(name, eta)]] for eta in etas]
        axis.errorbar(etas, [_mean(r) for r in runs], yerr=[statistics.stdev(r) if len(r) > 1 else 0.0 for r in runs],
                      marker="o", capsize=3, label=label)
    axis.set_ylabel("held-out accuracy after (mean ± std over seeds)")
    return save_step_figure(plt, fig, [axis], path, xlabel="η (--max-off-policy-steps)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Flags after `--` go to every pretrain_grpo_ais.py run unchanged.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--load", required=True, help="SFT (or any) Megatron checkpoint every arm starts from.")
    parser.add_argument("--output-dir", default="runs/ablation", help="One sub-directory per arm and seed, table, "
                                                                        "figure.")
    parser.add_argument("--regime", choices=tuple(REGIMES), default="w8a16",
                        help="The low-precision engine's numerics: w8a16 (CPU), w8a8 (H100's, emulated on a CPU, FP8 "
                             "KV cache) or gpu (vLLM's native W8A8 on a GPU, FP8 KV cache); a 4-bit engine is W4A16 "
                             "and keeps only the regime's KV cache.")
    parser.add_argument("--low-precision", choices=tuple(LOW_PRECISIONS), default="fp8",
                        help="The weights of every arm's engine but bf16's; the fp8-* arms are named after it.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234], help="Seeds; every arm runs each.")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="Trainer ranks per run.")
    parser.add_argument("--arms", nargs="*", default=[a[0] for a in ARMS], choices=[a[0] for a in ARMS],
                        help="Arms to run.")
    parser.add_argument("--off-policy-steps", type=int, nargs="+", default=[0],
                        help="Staleness bounds η (--max-off-policy-steps) to sweep; every arm runs each.")
    parser.add_argument("--report-only", action="store_true",
                        help="Run nothing: table and figure from the summaries already in --output-dir (a cell "
                             "lists the seeds it has; a cell with none is left out).")
    args = parser.parse_args(own)
    overriding = [f.split("=")[0] for f in extra if f.split("=")[0] in owned_flags(args)]
    if overriding:
        parser.error(f"{overriding[0]} after `--` would override what ablate sets for each run (its seed, output "
                     "directory, or an arm's, regime's or η's flags): use ablate's own options")
    os.makedirs(args.output_dir, exist_ok=True)
    labels, runs, cells, other_flags = {}, {}, [], []
    for eta in args.off_policy_steps:
        for name, label, flags in ARMS:
            if name not in args.arms or (name in PER_LAG_ARMS and eta == 0):
                continue
            shown, label = arm_name(name, args.low_precision), arm_label(label, args.low_precision)
            key = cell(shown, eta)
            labels[key] = label if eta == 0 else f"{label}, η {eta}"
            for seed in args.seeds:
                if args.report_only:
                    out = run_dir(args.output_dir, shown, seed, eta)
                    if os.path.exists(os.path.join(out, "summary.json")):
                        runs.setdefault(key, {})[seed] = read_summary(out)
                        if not ran_with(out, run_flags(name, flags, seed, args, extra, eta)):
                            other_flags.append(os.path.relpath(out, args.output_dir))
                    continue
                print(f"[ablate] {labels[key]}, seed {seed} ...", flush=True)
                runs.setdefault(key, {})[seed] = run_arm(name, flags, seed, args, extra, eta)
            if key in runs:
                cells.append((shown, label, eta))
                print(f"[ablate] {table_row(shown, label, runs[key], eta=eta)}", flush=True)
    if not cells:
        raise SystemExit(f"ablate: no finished run of these arms, seeds and η under {args.output_dir}")
    summaries = {key: list(by_seed.values()) for key, by_seed in runs.items()}
    uncorrected = arm_name("fp8", args.low_precision)
    rows = [table_row(name, label, runs[cell(name, eta)], runs.get(cell(uncorrected, eta)), eta)
            for name, label, eta in cells]
    figure = plot(summaries, labels, os.path.join(args.output_dir, "ablation.png"))
    if len(args.off_policy_steps) > 1:
        by_eta = plot_against_eta(summaries, cells, os.path.join(args.output_dir, "accuracy_by_eta.png"))
    command = " ".join(["tools/ablate.py", *own, "--", *extra])
    seed_pairs = [len(set(runs[cell(name, eta)]) & set(runs.get(cell(uncorrected, eta), {})))
                  for name, _, eta in cells if name != uncorrected]
    compared = sum(1 for pairs in seed_pairs if pairs)
    precision = LOW_PRECISIONS[args.low_precision]
    table = "\n".join([table_header(precision)] + rows)
    if compared:
        table += (f"\n\n{compared} paired comparisons ({sum(seed_pairs)} seed pairs; arm − uncorrected {precision}, "
                  "same seed and η) over the table.")
    if other_flags:
        table += (f"\n\nRun with other flags than this command's (their flags.json): {', '.join(other_flags)}.")
    table += "\n\nHeld-out accuracy at each evaluation (mean ± std over seeds):\n\n" + accuracy_by_step(runs, cells)
    diagnostics = diagnostics_table(runs, cells)
    if diagnostics:
        table += (f"\n\nThe AIS arms' λ and its diagnostics, every seed's steps after step {SETTLED_AFTER}:\n\n"
                  + diagnostics)
    with open(os.path.join(args.output_dir, "ablation.md"), "w") as f:
        f.write(f"Command: `{command}`\n\n{table}\n\n![ablation]({os.path.basename(figure)})\n")
        if len(args.off_policy_steps) > 1:
            f.write(f"\n![accuracy by η]({os.path.basename(by_eta)})\n")
    print(table)
    print(f"wrote {os.path.join(args.output_dir, 'ablation.md')} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
