"""Weights & Biases with Megatron-LM's flags: the logging rank's run holds the flags as its config and every step's
scalars, written offline here (WANDB_MODE=offline) and read back from the run's file; without the optional package the
flag is refused by name."""
import importlib.util

import pytest

from megatron_ais.errors import ArgumentValidationError
from megatron_ais.logging import LoggingConfig, RunLogger
from wandb_records import offline_runs, read_offline_run


def test_scalars_and_flags_reach_an_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = LoggingConfig(output_dir=str(tmp_path / "out"), wandb_project="megatron-ais-test", wandb_exp_name="t",
                           wandb_save_dir=str(tmp_path / "wb"))
    logger = RunLogger(config, True, run_config={"lr": 3e-4, "task": "digit_sort"}, total_steps=3)
    for step in (1, 2, 3):
        logger.step(step, {"ais/lambda": 0.01 * step, "rollout/reward": step / 4, "eval/accuracy": None}, f"step {step}")
    logger.summary({"accuracy_after": 0.5, "history": []})
    logger.close()
    assert RunLogger(LoggingConfig(output_dir=str(tmp_path / "quiet")), False).wandb is None  # other ranks: none
    (run,) = offline_runs(str(tmp_path / "wb"))
    flags, history = read_offline_run(run)
    assert flags["lr"] == 3e-4 and flags["task"] == "digit_sort"
    assert history == {s: {"ais/lambda": pytest.approx(0.01 * s), "rollout/reward": s / 4} for s in (1, 2, 3)}


def test_the_flag_without_the_package_is_refused_by_name(monkeypatch):
    original = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else original(name, *a))
    with pytest.raises(ArgumentValidationError, match="--wandb-project needs the wandb package, which is optional"):
        LoggingConfig(wandb_project="p")
    LoggingConfig()  # without the flag nothing is needed
