"""A registry takes each name once: a second registration is refused, naming the registry and the name."""
import pytest

from megatron_ais.registry import Registry, register


def test_first_registration_works_and_a_second_is_refused():
    table = Registry("--test-choice")

    @register(table, "first")
    def first():
        return 1

    assert table == {"first": first} and first() == 1
    with pytest.raises(ValueError, match="the --test-choice registry already holds 'first'"):
        register(table, "first")(lambda: 2)
    assert table["first"] is first
    with pytest.raises(ValueError, match="already holds 'first'"):
        table["first"] = lambda: 3


def test_the_registries_of_tasks_and_architectures_refuse_a_second_entry():
    from megatron_ais.data.tasks import TASKS
    from megatron_ais.mapping.rules import ARCHITECTURES

    assert {"digit_sort", "jsonl"} <= set(TASKS) and {"llama", "qwen3_moe"} <= set(ARCHITECTURES)
    for table, name in ((TASKS, "digit_sort"), (ARCHITECTURES, "qwen3")):
        with pytest.raises(ValueError, match=f"already holds '{name}'"):
            register(table, name)(None)
