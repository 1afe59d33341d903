"""Verifiable tasks: prompts with exact answers and a reward that checks the model's `<answer>...</answer>`.

Tasks are registered by name (`--task`); the default is the locally generated arithmetic task.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from megatron_ais.data.arithmetic import ArithmeticExample, arithmetic_examples

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def extract_answer(response: str) -> int | None:
    """Return the integer inside the first <answer>...</answer>, or None."""
    match = ANSWER.search(response)
    return int(match.group(1)) if match else None


def exact_answer_reward(response: str, answer: int) -> float:
    """1.0 when the response's <answer> equals the exact answer, else 0.0."""
    return 1.0 if extract_answer(response) == answer else 0.0


@dataclasses.dataclass(frozen=True)
class Task:
    """A train/eval split of examples and its reward."""

    train: list[ArithmeticExample]
    eval: list[ArithmeticExample]
    reward: Callable[[str, int], float]


def arithmetic_task(seed: int, max_operand: int, train_size: int = 4096, eval_size: int = 64) -> Task:
    """Arithmetic split by problem: the held-out problems never appear in the training split (SFT or RL)."""
    import random

    pool = arithmetic_examples(max(train_size, 4 * (max_operand + 1) ** 2), seed, max_operand)
    unique = list({e.prompt: e for e in pool}.values())
    random.Random(seed).shuffle(unique)
    if len(unique) < 2 * eval_size:
        raise ValueError(f"--max-operand {max_operand} gives {len(unique)} distinct problems, too few for "
                         f"{eval_size} held-out prompts; raise --max-operand or lower --eval-prompts")
    held_out, train_problems = unique[:eval_size], unique[eval_size:]
    train = [train_problems[i % len(train_problems)] for i in range(train_size)]
    return Task(train=train, eval=held_out, reward=exact_answer_reward)


TASKS: dict[str, Callable[..., Task]] = {"arithmetic": arithmetic_task}
