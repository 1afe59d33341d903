"""A resumed run lists the flags that differ from the saved run (ignoring those that may change on resume, saying
which ones the saved run's values override), draws its task with the saved run's data seed (read from the
checkpoint's metadata before anything is built), and its logs continue from the checkpoint: what the earlier run
logged for later steps before it died is dropped from metrics.jsonl and tensorboard."""
import argparse
import json

import pytest
import torch

from megatron_ais.checkpointing import store
from megatron_ais.checkpointing.config import CheckpointConfig
from megatron_ais.checkpointing.formats import torch as torch_format
from megatron_ais.errors import CheckpointError
from megatron_ais.flags import plain_flag_values
from megatron_ais.grpo.state import DATA_SEED_KEY, GRPOState, changed_flags, check_data_seed, resumed_data_seed
from megatron_ais.logging import LoggingConfig, RunLogger


def test_changed_flags_lists_only_what_changes_the_computation():
    saved = {"lr": 3e-4, "grpo_steps": 50, "load": "sft", "task": "digit_sort", "group_size": 8}
    now = dict(lr=1e-3, grpo_steps=80, load="runs/default/checkpoint", task="digit_sort", group_size=8)
    # the optimizer's hyper-parameters come back with its state
    assert changed_flags(saved, now) == ["--lr 0.0003 -> 0.001"]  # the optimizer takes it (test_weight_decay_groups)
    now["group_size"] = 4
    assert changed_flags(saved, now)[0] == "--group-size 8 -> 4"
    assert changed_flags({}, now) == []


def test_flags_unset_in_the_saved_run_and_kept_values_are_reported():
    saved = plain_flag_values(argparse.Namespace(rollout_seed=None, lr=1e-3, exclude=("a",), train_iters=10,
                                                 ais_exponents=[1.0, 1.0, 1.0], parser=argparse.ArgumentParser()))
    # list flags (--ais-exponents, --bridge-fp8-exclude) are recorded as lists; objects are not
    assert saved == {"rollout_seed": None, "lr": 1e-3, "exclude": ["a"], "train_iters": 10,
                     "ais_exponents": [1.0, 1.0, 1.0]}
    assert changed_flags(saved, dict(ais_exponents=[1.0, 0.5, 1.0])) == ["--ais-exponents [1.0, 1.0, 1.0] -> "
                                                                       "[1.0, 0.5, 1.0]"]
    now = dict(rollout_seed=7, lr=1e-3)
    # train_iters belongs to another entry point (an SFT checkpoint's flags): not a change
    assert changed_flags(saved, now) == ["--rollout-seed None -> 7 (ignored: the saved run's value is kept)"]


def _checkpoint(root, **metadata) -> str:
    stage = store.prepare_staging(str(root), 3)
    store.write_metadata(stage, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                 "hf_config": {}, **metadata}, None)
    torch_format.write_rank_state(stage, 0, 0, 1, {"model": {"w": torch.ones(2)}})
    store.write_checksums(stage)
    store.commit_checkpoint(str(root), 3)
    return str(root)


def test_a_resumed_run_draws_its_data_with_the_saved_seed_read_before_anything_is_built(tmp_path):
    grpo = _checkpoint(tmp_path / "grpo", **{DATA_SEED_KEY: 11})
    sft = _checkpoint(tmp_path / "sft")
    assert resumed_data_seed(CheckpointConfig(load=grpo), seed=5) == 11  # --seed 5 on resume: the saved 11 is kept
    assert resumed_data_seed(CheckpointConfig(load=grpo, finetune=True), seed=5) == 5  # weights only: a new run
    assert resumed_data_seed(CheckpointConfig(load=sft), seed=5) == 5  # an SFT checkpoint has no GRPO data seed
    assert resumed_data_seed(CheckpointConfig(), seed=5) == 5
    # a GRPO checkpoint whose metadata lacks the seed (an older version's) and a changed --seed: refused, with the fix
    state = GRPOState.begin({"kind": "grpo", "step": 3, "data_seed": 11}, 5, None, {"hf_dir": "m"})
    with pytest.raises(CheckpointError, match="drew its data with seed 11, .*resume with --seed 11"):
        check_data_seed(state, resumed_data_seed(CheckpointConfig(load=sft), seed=5), sft)
    check_data_seed(state, 11, grpo)


def _scalars(tensorboard_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tensorboard_dir)
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_resumed_logs_continue_from_the_checkpoint(tmp_path):
    out = str(tmp_path)
    first = RunLogger(LoggingConfig(output_dir=out), True)
    for step in (1, 2, 3, 4):
        first.step(step, {"rollout/reward": float(step)}, None)
    first.close()  # the run died after logging step 4; its last checkpoint is step 2
    resumed = RunLogger(LoggingConfig(output_dir=out), True, resume_step=2)
    for step in (3, 4):
        resumed.step(step, {"rollout/reward": 10.0 * step}, f"step {step}")
    resumed.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["rollout/reward"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert _scalars(str(tmp_path / "tensorboard"), "rollout/reward") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_record_cut_short_is_dropped_and_a_fresh_run_keeps_the_earlier_log_aside(tmp_path):
    # a run killed while writing a record left half a line, on which every resume failed (JSONDecodeError)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    RunLogger(LoggingConfig(output_dir=str(tmp_path)), True, resume_step=2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n'
    # a fresh run into the same --output-dir appended to it, repeating step numbers
    fresh = RunLogger(LoggingConfig(output_dir=str(tmp_path)), True)
    fresh.step(1, {"a": 5.0}, None)
    fresh.close()
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [{"step": 1, "a": 5.0}]
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n'
