"""The arithmetic task: exact rewards and a held-out split disjoint from training."""
import pytest

from megatron_ais.data.tasks import arithmetic_task, exact_answer_reward, extract_answer


def test_reward_and_answer_parsing():
    assert extract_answer("so <answer> -12 </answer> ok") == -12
    assert exact_answer_reward("<answer>7</answer>", 7) == 1.0
    assert exact_answer_reward("<answer>7</answer><answer>8</answer>", 8) == 0.0
    assert exact_answer_reward("7", 7) == 0.0


def test_held_out_split_is_disjoint_and_deterministic():
    task = arithmetic_task(seed=1, max_operand=9, eval_size=32)
    assert len(task.eval) == 32 and len(task.train) == 4096
    assert not {e.prompt for e in task.eval} & {e.prompt for e in task.train}
    again = arithmetic_task(seed=1, max_operand=9, eval_size=32)
    assert [e.prompt for e in again.eval] == [e.prompt for e in task.eval]
    assert all(e.answer == eval(e.prompt.removeprefix("What is ").rstrip("?")) for e in task.eval)
    with pytest.raises(ValueError, match="--max-operand 2"):
        arithmetic_task(seed=1, max_operand=2, eval_size=64)
