"""A synthetic, locally generated arithmetic task: deterministic by seed, exact answers."""
from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class ArithmeticExample:
    """One problem: the user prompt and its exact integer answer."""

    prompt: str
    answer: int

    def response(self) -> str:
        """Return the reference response in the task's answer format."""
        return f"<answer>{self.answer}</answer>"


def arithmetic_examples(count: int, seed: int, max_operand: int = 99, ops: str = "+-") -> list[ArithmeticExample]:
    """Return `count` problems `a op b` with operands in [0, max_operand], the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(ArithmeticExample(prompt=f"What is {a} {op} {b}?", answer=value))
    return out
