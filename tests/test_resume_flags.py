"""A resumed run lists the flags that differ from the saved run, ignoring those that may change on resume."""
import argparse

from megatron_ais.recipe import changed_flags


def test_changed_flags_lists_only_what_changes_the_computation():
    saved = {"lr": 3e-4, "grpo_steps": 50, "load": "sft", "task": "digit_sort", "group_size": 8}
    now = argparse.Namespace(lr=1e-3, grpo_steps=80, load="runs/default/checkpoint", task="digit_sort", group_size=8)
    assert changed_flags(saved, now) == ["--lr 0.0003 -> 0.001"]
    assert changed_flags({}, now) == []
