"""The mismatch study's bookkeeping: which flags each arm runs with in each regime, and its table row over seeds
(mean ± sample standard deviation) against a hand computation."""
import ablate


def _summary(after, k3, seq_ess, lam, rewards=(0.1, 0.3)):
    history = [{"step": 1, "rollout/reward": rewards[0], "ais/k3_kl": k3, "ais/ess_ratio_raw": 0.99, "ais/sequence_ess": seq_ess,
                "ais/frac_truncated": 0.01, "guard/rejected_fraction": 0.0, "ais/lambda": lam},
               {"step": 2, "rollout/reward": rewards[1], "ais/k3_kl": 3 * k3, "ais/ess_ratio_raw": 0.97, "ais/sequence_ess": seq_ess,
                "ais/frac_truncated": 0.03, "guard/rejected_fraction": 0.0, "ais/lambda": 2 * lam,
                "eval/accuracy": after}]
    return {"accuracy_before": 0.25, "accuracy_after": after, "wall_s": 100.0, "history": history}


def test_the_regime_changes_only_the_fp8_arms():
    arms = {name: flags for name, _, flags in ablate.ARMS}
    assert ablate.arm_flags("bf16", arms["bf16"], "w8a8") == ["--rollout-precision", "bf16", "--is-correction", "none"]
    w8a8 = ablate.arm_flags("fp8-ais-seq", arms["fp8-ais-seq"], "w8a8")
    assert w8a8[-4:] == ["--rollout-fp8-activations", "emulate", "--rollout-kv-cache-dtype", "fp8"]
    assert "--is-level" in w8a8 and ablate.arm_flags("fp8", arms["fp8"], "w8a16") == arms["fp8"]
    assert ablate.arm_flags("fp8", arms["fp8"], "gpu")[-2:] == ["--rollout-kv-cache-dtype", "fp8"]  # W8A8 natively
    assert len(arms) == 10


def test_a_row_gives_mean_and_sample_std_over_seeds():
    runs = [_summary(0.5, 1e-3, 0.8, 0.1, (0.0, 0.2)), _summary(0.6, 3e-3, 0.6, 0.3, (0.9, 0.3)),
            _summary(0.7, 2e-3, 0.7, 0.2, (0.5, 0.4))]
    row = ablate.table_row("fp8-ais", "FP8 + AIS", runs).split(" | ")
    assert row[1:5] == ["3", "0.250", "0.600 ± 0.100", "0.600 ± 0.100"]
    assert row[5] == "0.300 ± 0.100"  # the second half of the steps' training reward (step 2 here)
    assert row[6] == "4.00e-03"  # per-step mean 2·k3, averaged over seeds
    assert row[7:11] == ["0.9800", "0.700", "0.020", "0.000"] and row[11] == "0.100–0.600"
    assert ablate.table_row("fp8", "FP8", runs).split(" | ")[11] == "–"  # λ only for AIS arms


def test_report_only_tables_the_summaries_already_written(tmp_path):
    import json

    for arm, after in (("fp8", 0.5), ("fp8-ais", 0.7)):
        for seed in (1, 2):
            (tmp_path / arm / f"seed{seed}").mkdir(parents=True)
            (tmp_path / arm / f"seed{seed}" / "summary.json").write_text(json.dumps(_summary(after, 1e-3, 0.8, 0.1)))
    assert ablate.main(["--load", "unused", "--output-dir", str(tmp_path), "--arms", "fp8", "fp8-ais", "--seeds", "1",
                        "2", "--report-only"]) == 0
    table = (tmp_path / "ablation.md").read_text()
    assert "| FP8, uncorrected | 2 | 0.250 | 0.500 ± 0.000 |" in table and "| FP8 + AIS | 2 | 0.250 | 0.700" in table
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
