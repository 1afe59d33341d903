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
    """Arithmetic with a held-out split drawn from a different seed stream (no overlap with training prompts)."""
    train = arithmetic_examples(train_size, seed, max_operand)
    seen = {e.prompt for e in train}
    pool = arithmetic_examples(eval_size * 20, seed + 7919, max_operand)
    held_out = [e for e in pool if e.prompt not in seen][:eval_size]
    return Task(train=train, eval=held_out, reward=exact_answer_reward)


TASKS: dict[str, Callable[..., Task]] = {"arithmetic": arithmetic_task}
