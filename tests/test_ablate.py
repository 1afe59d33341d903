"""The mismatch study's bookkeeping: which flags each arm runs with in each regime, and its table row over seeds
(mean ± sample standard deviation) against a hand computation."""
import itertools
import os

import pytest

import ablate


def _summary(after, k3, seq_ess, lam, rewards=(0.1, 0.3)):
    history = [{"step": 1, "rollout/reward": rewards[0], "ais/k3_kl": k3, "ais/ess_ratio_raw": 0.99, "ais/sequence_ess": seq_ess,
                "ais/frac_truncated": 0.01, "guard/rejected_fraction": 0.0, "rollout/repetitive_fraction": 0.25,
                "ais/lambda": lam,
                "ais/lag2/k3_kl": 10 * k3, "ais/lag2/sequence_ess": seq_ess / 2},
               {"step": 2, "rollout/reward": rewards[1], "ais/k3_kl": 3 * k3, "ais/ess_ratio_raw": 0.97, "ais/sequence_ess": seq_ess,
                "ais/frac_truncated": 0.03, "guard/rejected_fraction": 0.0, "rollout/repetitive_fraction": 0.0,
                "ais/lambda": 2 * lam,
                "ais/lag2/k3_kl": 10 * k3, "ais/lag2/sequence_ess": seq_ess / 2, "eval/accuracy": after}]
    return {"accuracy_before": 0.25, "accuracy_after": after, "wall_s": 100.0, "history": history}


def test_the_regime_and_the_low_precision_change_only_the_low_precision_arms():
    arms = {name: flags for name, _, flags in ablate.ARMS}
    assert len(arms) == 20
    for regime in ablate.REGIMES:
        for low in ablate.LOW_PRECISIONS:
            assert ablate.arm_flags("bf16", arms["bf16"], regime, low_precision=low) == [
                "--rollout-precision", "bf16", "--is-correction", "none"]
    w8a8 = ablate.arm_flags("fp8-ais-seq", arms["fp8-ais-seq"], "w8a8")
    assert w8a8[:2] == ["--rollout-precision", "fp8"]
    assert w8a8[-4:] == ["--rollout-fp8-activations", "emulate", "--rollout-kv-cache-dtype", "fp8"]
    assert "--is-level" in w8a8
    assert ablate.arm_flags("fp8", arms["fp8"], "w8a16") == ["--rollout-precision", "fp8", "--is-correction", "none"]
    assert ablate.arm_flags("fp8", arms["fp8"], "gpu")[-2:] == ["--rollout-kv-cache-dtype", "fp8"]  # W8A8 natively
    # a 4-bit engine is W4A16 in every regime: the regime keeps only its KV cache
    assert ablate.arm_flags("fp8-tis", arms["fp8-tis"], "w8a8", low_precision="mxfp4") == [
        "--rollout-precision", "mxfp4", "--is-correction", "tis", "--rollout-kv-cache-dtype", "fp8"]
    assert ablate.arm_flags("fp8-qarl", arms["fp8-qarl"], "w8a16", low_precision="nvfp4")[:2] == [
        "--rollout-precision", "nvfp4"]
    assert ablate.cell("fp8-ais-bias", 2, "mxfp4") == "mxfp4-ais-bias-eta2" and ablate.cell("bf16", 0, "nvfp4") == "bf16"
    assert ablate.arm_label("FP8 + QaRL + TBPO", "mxfp4") == "MXFP4 (W4A16) + QaRL + TBPO"
    stale = ablate.arm_flags("fp8-ais-lag", arms["fp8-ais-lag"], "w8a16", eta=2)
    assert stale[-4:] == ["--max-off-policy-steps", "2", "--rollout-placement", "separate"]
    assert "--ais-lambda-per-lag" in stale


def test_every_arm_is_a_run_the_flags_accept_in_every_regime():
    from megatron_ais.arguments import GRPORunConfig
    from pretrain_grpo_ais import build_grpo_parser

    for name, _, flags in ablate.ARMS:
        for regime, low in itertools.product(ablate.REGIMES, ablate.LOW_PRECISIONS):
            eta = 2 if name in ablate.PER_LAG_ARMS else 0
            argv = ["--hf-dir", "/m", *ablate.arm_flags(name, flags, regime, eta, low)]
            config = GRPORunConfig.from_args(build_grpo_parser().parse_args(argv), 1)
            assert config.engine.precision == ("bf16" if name == "bf16" else low), (name, low)
            assert config.aligned.rollout_aligned_forward == ("qarl" in name), name
            assert (config.loss.policy_loss == "tbpo") == name.endswith("tbpo"), name


def test_a_row_gives_mean_and_sample_std_over_seeds():
    runs = {1: _summary(0.5, 1e-3, 0.8, 0.1, (0.0, 0.2)), 2: _summary(0.6, 3e-3, 0.6, 0.3, (0.9, 0.3)),
            3: _summary(0.7, 2e-3, 0.7, 0.2, (0.5, 0.4))}
    baseline = {3: _summary(0.5, 1e-3, 0.8, 0.1), 1: _summary(0.4, 1e-3, 0.8, 0.1), 2: _summary(0.6, 1e-3, 0.8, 0.1)}
    row = ablate.table_row("fp8-ais", "FP8 + AIS", runs, baseline, eta=2).split(" | ")
    assert row[1:5] == ["2", "3", "0.250", "0.600 ± 0.100"]
    assert row[5] == "0.100 ± 0.100"  # paired with the baseline seed by seed: 0.1, 0.0, 0.2
    assert row[6] == "0.600 ± 0.100"  # best step
    assert row[7] == "0.300 ± 0.100"  # the second half of the steps' training reward (step 2 here)
    assert row[8] == "4.00e-03"  # per-step mean 2·k3, averaged over seeds
    assert row[9:13] == ["0.9800", "0.700", "0.020", "0.000"] and row[14] == "0.100–0.600"
    assert row[13] == "0.125"  # responses that repeat an n-gram, per-step mean
    assert row[15:17] == ["2.00e-02", "0.350"]  # the tokens at lag η = 2
    assert ablate.table_row("fp8", "FP8", runs).split(" | ")[14] == "–"  # λ only for AIS arms
    assert ablate.table_row("fp8", "FP8", runs).split(" | ")[5] == "–"  # no baseline
    del baseline[2]  # pairs only over the seeds both have: 0.1, 0.2
    assert ablate.table_row("fp8-ais", "FP8 + AIS", runs, baseline).split(" | ")[5] == "0.150 ± 0.071 (2 pairs)"


def test_report_only_tables_the_summaries_already_written(tmp_path):
    import json

    for arm, after in (("fp8", 0.5), ("fp8-ais", 0.7)):
        for seed in (1, 2):
            (tmp_path / arm / f"seed{seed}").mkdir(parents=True)
            (tmp_path / arm / f"seed{seed}" / "summary.json").write_text(json.dumps(_summary(after, 1e-3, 0.8, 0.1)))
    assert ablate.main(["--load", "unused", "--output-dir", str(tmp_path), "--arms", "fp8", "fp8-ais", "--seeds", "1",
                        "2", "--report-only"]) == 0
    table = (tmp_path / "ablation.md").read_text()
    assert "| FP8, uncorrected | 0 | 2 | 0.250 | 0.500 ± 0.000 | – |" in table
    assert "| FP8 + AIS | 0 | 2 | 0.250 | 0.700 ± 0.000 | 0.200 ± 0.000 |" in table
    assert (tmp_path / "ablation.png").stat().st_size > 10_000


def test_report_only_at_a_4bit_low_precision_names_and_pairs_its_arms(tmp_path):
    import json

    for arm, after in (("bf16", 0.6), ("mxfp4", 0.4), ("mxfp4-tis", 0.5)):
        (tmp_path / arm / "seed1").mkdir(parents=True)
        (tmp_path / arm / "seed1" / "summary.json").write_text(json.dumps(_summary(after, 1e-3, 0.8, 0.1)))
    assert ablate.main(["--load", "unused", "--output-dir", str(tmp_path), "--low-precision", "mxfp4", "--arms",
                        "bf16", "fp8", "fp8-tis", "--seeds", "1", "--report-only"]) == 0
    table = (tmp_path / "ablation.md").read_text()
    assert "after − MXFP4 (W4A16) uncorrected, paired" in table
    assert "| MXFP4 (W4A16), uncorrected | 0 | 1 | 0.250 | 0.400 ± 0.000 | – |" in table
    assert "| MXFP4 (W4A16) + TIS | 0 | 1 | 0.250 | 0.500 ± 0.000 | 0.100 ± 0.000 |" in table
    assert "| BF16 rollouts | 0 | 1 | 0.250 | 0.600 ± 0.000 | 0.200 ± 0.000 |" in table
    assert "2 paired comparisons (2 seed pairs; arm − uncorrected MXFP4 (W4A16), same seed and η)" in table


def test_report_only_sweeps_eta_with_a_figure_of_accuracy_against_it(tmp_path):
    import json

    for arm, eta, after in (("fp8", 0, 0.5), ("fp8-ais", 0, 0.6), ("fp8-eta2", 2, 0.3), ("fp8-ais-eta2", 2, 0.55),
                            ("fp8-ais-lag-eta2", 2, 0.58)):
        for seed in (1, 2):
            (tmp_path / arm / f"seed{seed}").mkdir(parents=True)
            (tmp_path / arm / f"seed{seed}" / "summary.json").write_text(
                json.dumps(_summary(after + 0.01 * seed, 1e-3, 0.8, 0.1)))
    assert ablate.main(["--load", "unused", "--output-dir", str(tmp_path), "--arms", "fp8", "fp8-ais", "fp8-ais-lag",
                        "--seeds", "1", "2", "--off-policy-steps", "0", "2", "--report-only"]) == 0
    table = (tmp_path / "ablation.md").read_text()
    assert "| FP8 + AIS | 2 | 2 | 0.250 | 0.565 ± 0.007 | 0.250 ± 0.000 |" in table
    # three cells compared with the uncorrected one at their η, on two seeds each
    assert "3 paired comparisons (6 seed pairs; arm − uncorrected FP8, same seed and η)" in table
    assert "| arm | η | step 2 |" in table and "| FP8 + AIS | 2 | 0.565 ± 0.007 |" in table  # per evaluation step
    assert "| FP8 + AIS, one λ per lag | 2 |" in table and "| FP8 + AIS, one λ per lag | 0 |" not in table
    assert (tmp_path / "accuracy_by_eta.png").stat().st_size > 10_000


def test_the_grid_resumes_finished_runs_and_refuses_one_with_other_flags(tmp_path, monkeypatch):
    import json
    import subprocess

    launched = []

    def run(cmd, cwd, **_):
        launched.append(cmd)
        out = cmd[cmd.index("--output-dir") + 1]
        with open(f"{out}/summary.json", "w") as f:
            json.dump(_summary(0.5, 1e-3, 0.8, 0.1), f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(ablate.subprocess, "run", run)
    grid = ["--load", "ckpt", "--output-dir", str(tmp_path), "--arms", "fp8", "--seeds", "1", "--", "--lr", "3e-4"]
    assert ablate.main(grid) == 0 and len(launched) == 1
    assert ablate.main(grid[:6] + ["--seeds", "1", "2"] + grid[8:]) == 0 and len(launched) == 2  # only seed 2 runs
    assert launched[1][launched[1].index("--seed") + 1] == "2"
    try:
        ablate.main(grid[:-1] + ["1e-3"])
    except SystemExit as exit:
        assert "holds a finished run with other flags" in str(exit) and len(launched) == 2
    else:
        raise AssertionError("a finished run with other flags was reused")


def test_flags_ablate_sets_are_refused_after_the_separator(tmp_path, capsys):
    # `-- --seed 7` made every seed the same run; `-- --is-correction tis` every arm TIS
    for extra in (["--seed", "7"], ["--output-dir", "x"], ["--is-correction=tis"], ["--max-off-policy-steps", "2"]):
        with pytest.raises(SystemExit) as exit_info:
            ablate.main(["--load", "ckpt", "--output-dir", str(tmp_path), "--", *extra])
        assert exit_info.value.code == 2 and f"{extra[0].split('=')[0]} after `--` would override" in \
            capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_report_only_names_the_runs_made_with_other_flags(tmp_path):
    import json

    for arm in ("fp8", "fp8-tis"):
        (tmp_path / arm / "seed1").mkdir(parents=True)
        (tmp_path / arm / "seed1" / "summary.json").write_text(json.dumps(_summary(0.5, 1e-3, 0.8, 0.1)))
    (tmp_path / "fp8-tis" / "seed1" / "flags.json").write_text(json.dumps(["--lr", "1"]))
    assert ablate.main(["--load", "unused", "--output-dir", str(tmp_path), "--arms", "fp8", "fp8-tis", "--seeds", "1",
                        "--report-only"]) == 0
    assert "Run with other flags than this command's (their flags.json): fp8-tis/seed1." in \
        (tmp_path / "ablation.md").read_text()


def test_report_only_tables_the_seeds_each_cell_has(tmp_path):
    import json

    for arm, seeds in (("fp8", (1, 2, 3)), ("fp8-tis", (1, 3))):
        for seed in seeds:
            (tmp_path / arm / f"seed{seed}").mkdir(parents=True)
            (tmp_path / arm / f"seed{seed}" / "summary.json").write_text(json.dumps(_summary(0.1 * seed, 1e-3, 0.8, 0.1)))
    assert ablate.main(["--load", "unused", "--output-dir", str(tmp_path), "--arms", "fp8", "fp8-tis", "fp8-ais",
                        "--seeds", "1", "2", "3", "--report-only"]) == 0
    table = (tmp_path / "ablation.md").read_text()
    assert "| FP8 + TIS | 0 | 2 | 0.250 | 0.200 ± 0.141 | 0.000 ± 0.000 |" in table and "FP8 + AIS" not in table


def test_the_diagnostics_table_reads_lambda_against_its_severity_after_the_first_steps():
    def run(lam, severity, reliability, variance):
        history = [{"step": step, "ais/lambda": lam * step, "ais/severity": severity * step,
                    "ais/reliability": reliability, "ais/var_amp": variance, "ais/mean_abs_logratio": 0.01 * step}
                   for step in (5, 6, 7)]  # step 5 is before the table's window
        return {"history": [{**history[0], "ais/lambda": 9.0}] + history[1:]}

    runs = {"fp8-ais-eta2": {1: run(0.09, 0.1, 0.99, 1.02), 2: run(0.08, 0.1, 0.98, 1.05)},
            "fp8-tis-eta2": {1: run(0.0, 0.0, 1.0, 1.0)}}
    cells = [("fp8-ais", "FP8 + AIS", 2), ("fp8-tis", "FP8 + TIS", 2)]
    table = ablate.diagnostics_table(runs, cells).splitlines()
    assert len(table) == 3  # the header, its rule and the one AIS cell
    row = table[2].split(" | ")
    # λ over steps 6-7 of both seeds: 0.54, 0.63, 0.48, 0.56; s_D 0.6, 0.7; λ / s_D 0.9 (seed 1), 0.8 (seed 2)
    assert row[2] == "0.552 (0.480–0.630)" and row[3] == "0.650" and row[4] == "0.800–0.900"
    assert row[5] == "0.9800–0.9900" and row[6] == "1.0200–1.0500" and row[7] == "0.0650 |"
    assert ablate.diagnostics_table({"fp8-eta2": {1: run(0.0, 0.0, 1.0, 1.0)}}, [("fp8", "FP8", 2)]) == ""
