"""Tasks and rewards: exact checkers against hand-computed answers, held-out splits disjoint from training,
the prompt JSONL format with line-numbered errors, and math-verify scoring of GSM8K-style answers."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from megatron_ais.data.tasks import (arithmetic_task, countdown_reward, countdown_task, digit_sort_task,
                                     exact_answer_reward, extract_answer, jsonl_task, math_verify_reward,
                                     read_prompt_file, running_sum_task)
from megatron_ais.errors import PromptFileError, TaskError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_exact_reward_and_answer_parsing():
    assert extract_answer("so <answer> -12 </answer> ok") == -12
    assert exact_answer_reward("<answer>7</answer>", 7) == 1.0
    assert exact_answer_reward("<answer>07</answer>", "7") == 1.0
    assert exact_answer_reward("<answer>7</answer><answer>8</answer>", 8) == 0.0
    assert exact_answer_reward("7", 7) == 0.0
    assert exact_answer_reward("<answer>1  2 3</answer>", "1 2 3") == 1.0
    assert exact_answer_reward("<answer>1 3 2</answer>", "1 2 3") == 0.0


@pytest.mark.parametrize("build", [lambda: arithmetic_task(1, 9, eval_size=32), lambda: digit_sort_task(1, 5, eval_size=32),
                                   lambda: countdown_task(1, 3, 9, eval_size=32),
                                   lambda: running_sum_task(1, 32, eval_size=32)])
def test_held_out_split_is_disjoint_deterministic_and_solved_by_reference(build):
    task = build()
    assert len(task.eval) == 32 and len(task.train) == 4096
    assert not {e.prompt for e in task.eval} & {e.prompt for e in task.train}
    assert [e.prompt for e in build().eval] == [e.prompt for e in task.eval]
    # every reference response earns the full reward from the task's own checker
    assert all(task.reward(e.response(), e.answer) == 1.0 for e in task.eval + task.train[:200])


def test_answers_are_right():
    for e in arithmetic_task(1, 9, eval_size=32).eval:
        assert int(e.answer) == eval(e.prompt.removeprefix("What is ").rstrip("?"))
    for e in digit_sort_task(3, 6, eval_size=32).eval:
        digits = e.prompt.removeprefix("Sort the digits: ").split()
        assert e.answer.split() == sorted(digits) and len(digits) == 6


def test_running_sums_are_worked_out_line_by_line():
    for e in running_sum_task(2, 32, eval_size=32).eval:
        digits = [int(d) for d in e.prompt.removeprefix("Add step by step: ").split(" + ")]
        lines = e.response().splitlines()
        assert len(digits) == 32 and int(e.answer) == sum(digits) and len(lines) == 32
        for n, line in enumerate(lines[:-1], start=2):  # "partial + next = partial'"
            assert line == f"{sum(digits[:n - 1])} + {digits[n - 1]} = {sum(digits[:n])}"
        assert lines[-1] == f"<answer>{sum(digits)}</answer>"
    assert exact_answer_reward("12 + 3 = 15\n<answer>16</answer>", "15") == 0.0


def test_a_large_operand_range_draws_a_bounded_pool():
    # 4 (m + 1)^2 draws: 4e10 at --max-operand 1e5, which every rank built before its first step
    start = time.perf_counter()
    task = arithmetic_task(0, 10 ** 5, eval_size=32)
    assert time.perf_counter() - start < 10 and len(task.train) == 4096


def test_a_prompt_file_trains_on_every_problem(tmp_path):
    # --num-examples defaulted to 4096: a GSM8K-sized file lost 3000 of its problems silently
    path = _write(tmp_path / "big.jsonl", [json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1})
                                           for i in range(5000)])
    task = jsonl_task(path, seed=0, skip_bad_samples=False, eval_size=64)
    assert len(task.train) == len({e.prompt for e in task.train}) == 5000 - 64
    assert len(jsonl_task(path, 0, False, 64, train_size=100).train) == 100


def test_small_tasks_are_refused_with_the_flag():
    with pytest.raises(TaskError, match="--max-operand 2"):
        arithmetic_task(seed=1, max_operand=2, eval_size=64)


def test_countdown_checker():
    answer = "22:3,5,7"
    assert countdown_reward("<answer>3 * 5 + 7</answer>", answer) == 1.0
    assert countdown_reward("<answer>(7 - 5) * 3</answer>", answer) == 0.0  # 6, and not every number
    assert countdown_reward("<answer>5 * 5 - 3</answer>", answer) == 0.0  # 5 twice, 7 unused
    assert countdown_reward("<answer>3 * 5 + 7 + 0</answer>", answer) == 0.0  # extra number
    assert countdown_reward("<answer>__import__('os').getpid()</answer>", answer) == 0.0
    assert countdown_reward("<answer>22</answer>", answer) == 0.0
    assert countdown_reward("<answer>3*5+7.0</answer>", answer) == 0.0
    assert countdown_reward("no answer", answer) == 0.0


def test_math_verify_reward():
    assert math_verify_reward("<answer>18</answer>", "18") == 1.0
    assert math_verify_reward("<answer>\\frac{1}{2}</answer>", "0.5") == 1.0
    assert math_verify_reward("<answer>17</answer>", "18") == 0.0
    assert math_verify_reward("the total is 18", "18") == 1.0
    assert math_verify_reward("<answer>}{</answer>", "18") == 0.0


def test_math_verify_reward_off_the_main_thread():
    # a batch generated ahead (--max-off-policy-steps >= 1) is scored inline on a background thread, where
    # math-verify's signal.alarm timeout raises: every such response used to score 0
    scores = []
    worker = threading.Thread(target=lambda: scores.extend([math_verify_reward("<answer>18</answer>", "18"),
                                                             math_verify_reward("<answer>17</answer>", "18")]))
    worker.start()
    worker.join()
    assert scores == [1.0, 0.0]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


GSM8K = json.dumps({"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"})


def test_prompt_file_formats(tmp_path):
    path = _write(tmp_path / "p.jsonl", [GSM8K, json.dumps({"prompt": "What is 2^10?", "answer": 1024}), "",
                                         json.dumps({"prompt": "Half of 3?", "answer": "3/2", "solution": "1.5"})])
    examples, skipped = read_prompt_file(path, skip_bad_samples=False)
    assert skipped == 0 and [e.answer for e in examples] == ["7", "1024", "3/2"]
    assert examples[2].response() == "<answer>1.5</answer>"
    assert math_verify_reward(examples[2].response(), examples[2].answer) == 1.0


def test_malformed_lines_are_reported_with_numbers_or_skipped(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [GSM8K, "{not json", json.dumps({"prompt": "no answer"}), GSM8K,
                                           json.dumps(["a", "list"])])
    with pytest.raises(PromptFileError) as err:
        read_prompt_file(path, skip_bad_samples=False)
    message = str(err.value)
    assert f"{path}:2:" in message and f"{path}:3:" in message and f"{path}:5:" in message
    assert f"{path}:1:" not in message and "--skip-bad-samples" in message and 'missing "answer"' in message
    # a blank or non-finite answer scored every response 0; a solution that is no string became the SFT target
    for record, why in (({"prompt": "p", "answer": "   "}, '"answer" is empty'),
                        ({"prompt": "p", "answer": float("nan")}, '"answer" nan is not a finite number'),
                        ({"prompt": "p", "answer": 1, "solution": {"a": 1}}, '"solution" must be a non-empty string'),
                        ({"prompt": "p", "answer": 1, "solution": ""}, '"solution" must be a non-empty string')):
        with pytest.raises(PromptFileError, match=re.escape(why)):
            read_prompt_file(_write(tmp_path / "one.jsonl", [json.dumps(record)]), skip_bad_samples=False)
    examples, skipped = read_prompt_file(path, skip_bad_samples=True)
    assert len(examples) == 2 and skipped == 3


def test_cli_stops_on_a_bad_prompt_file_before_starting(tmp_path, model_root):
    from conftest import make_model_dir

    hf_dir = make_model_dir(model_root, "qwen3")
    bad = _write(tmp_path / "bad.jsonl", [GSM8K, "{oops"])
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}  # as torchrun starts it
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_sft.py"), "--hf-dir", hf_dir,
                           "--task", "jsonl", "--prompt-file", bad], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 2 and f"{bad}:2:" in proc.stderr and "--skip-bad-samples" in proc.stderr
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_sft.py"), "--hf-dir", hf_dir,
                           "--task", "jsonl"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "--prompt-file" in proc.stderr

