"""Verifiable tasks: prompts with exact answers and a reward that checks the model's `<answer>...</answer>`.

Tasks are registered by name (`--task`, `TASKS`) and built from the task flags (`TaskConfig`):

- `digit_sort` (default): sort a list of digits; algorithmic, so a tiny model generalises to unseen lists.
- `arithmetic`: `a + b` / `a - b` with operands up to `--max-operand`.
- `countdown`: combine `--countdown-numbers` numbers with + - * to reach a target; exact checker.
- `running_sum`: add `--sum-terms` digits writing every partial sum: long responses (a few hundred tokens).
- `jsonl`: prompts from `--prompt-file` (GSM8K-style math scored with math-verify, see `docs/data.md`).

Every task splits by problem: held-out prompts never appear in the training split (SFT or RL).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import random
import re
import sys
import threading
from typing import Callable

from megatron_ais.errors import PromptFileError, TaskError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.registry import Registry

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem: the user prompt, its answer (what the checker compares against) and the reference response
    used by the supervised warm-up."""

    prompt: str
    answer: str
    solution: str | None = None
    working: str | None = None  # worked steps written before the answer (long-response tasks)

    def response(self) -> str:
        """Return the reference response in the task's answer format."""
        answer = f"<answer>{self.solution if self.solution is not None else self.answer}</answer>"
        return answer if self.working is None else f"{self.working}\n{answer}"


def answer_text(response: str) -> str | None:
    """Return the text inside the first <answer>...</answer> (stripped), or None."""
    match = ANSWER.search(response)
    return match.group(1).strip() if match else None


def extract_answer(response: str) -> int | None:
    """Return the integer inside the first <answer>...</answer>, or None."""
    text = answer_text(response)
    return int(text) if text is not None and re.fullmatch(r"-?\d+", text) else None


def exact_answer_reward(response: str, answer) -> float:
    """1.0 when the response's <answer> equals the answer (integers compared as numbers, text with whitespace
    collapsed), else 0.0."""
    text = answer_text(response)
    if text is None:
        return 0.0
    if isinstance(answer, int) or re.fullmatch(r"-?\d+", str(answer)):
        return 1.0 if extract_answer(response) == int(answer) else 0.0
    return 1.0 if " ".join(text.split()) == " ".join(str(answer).split()) else 0.0


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _countdown_value(node, used: list[int]) -> int:
    if isinstance(node, ast.Expression):
        return _countdown_value(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_countdown_value(node.left, used), _countdown_value(node.right, used))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return node.value
    raise ValueError("only integers, + - * and parentheses are allowed")


def countdown_reward(response: str, answer: str) -> float:
    """1.0 when <answer> holds an expression of + - * and parentheses that uses exactly the given numbers
    (each once) and equals the target; `answer` is "target:n1,n2,...". Never evaluates anything but arithmetic."""
    text = answer_text(response)
    target, numbers = answer.split(":")
    if text is None or len(text) > 200:
        return 0.0
    used: list[int] = []
    try:
        value = _countdown_value(ast.parse(text, mode="eval"), used)
    except (SyntaxError, ValueError, RecursionError):
        return 0.0
    return 1.0 if value == int(target) and sorted(used) == sorted(int(n) for n in numbers.split(",")) else 0.0


MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own default for each parse and comparison


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when math-verify finds the <answer> (or, without one, the response) equal to the gold answer."""
    from math_verify import parse, verify  # only the math task scores with it

    # math-verify times itself out with signal.alarm, which only the main thread may set, and raises on any other:
    # a batch generated ahead is scored on a background thread, where it runs untimed (--reward-workers bounds it)
    timeout_s = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    text = answer_text(response)
    gold = parse(f"${answer}$", parsing_timeout=timeout_s)
    guess = parse(f"${text}$" if text is not None else response, parsing_timeout=timeout_s)
    try:
        return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=timeout_s) else 0.0
    except Exception:  # math-verify raises on unparsable input; that is a wrong answer, not a crash
        return 0.0


@dataclasses.dataclass(frozen=True)
class Task:
    """A train/eval split of examples and its reward."""

    train: list[Example]
    eval: list[Example]
    reward: Callable[[str, str], float]
    skipped: int = 0


def split_by_problem(examples: list[Example], seed: int, eval_size: int, train_size: int | None, flag: str
                     ) -> tuple:
    """Deduplicate by prompt, hold out `eval_size` problems, and cycle the rest to `train_size` examples (None:
    each of the rest once)."""
    unique = list({e.prompt: e for e in examples}.values())
    random.Random(seed).shuffle(unique)
    if len(unique) < 2 * eval_size:
        raise TaskError(f"{flag} gives {len(unique)} distinct problems, too few for {eval_size} held-out prompts; "
                         f"make the task larger or lower --eval-prompts")
    held_out, train_problems = unique[:eval_size], unique[eval_size:]
    train_size = len(train_problems) if train_size is None else train_size
    return [train_problems[i % len(train_problems)] for i in range(train_size)], held_out


ARITHMETIC_MAX_DRAWS = 200_000


def arithmetic_task(seed: int, max_operand: int, train_size: int = 4096, eval_size: int = 64) -> Task:
    """`a op b` with operands in [0, max_operand]."""
    rng = random.Random(seed)
    pool = []
    # about twice the distinct problems, so most of them are drawn; a bounded pool for a large --max-operand
    for _ in range(max(train_size, min(4 * (max_operand + 1) ** 2, ARITHMETIC_MAX_DRAWS))):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice("+-")
        pool.append(Example(f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)))
    train, held_out = split_by_problem(pool, seed, eval_size, train_size, f"--max-operand {max_operand}")
    return Task(train=train, eval=held_out, reward=exact_answer_reward)


def digit_sort_task(seed: int, length: int, train_size: int = 4096, eval_size: int = 64) -> Task:
    """Sort `length` random digits ascending; the answer is the digits separated by spaces."""
    rng = random.Random(seed)
    pool = []
    for _ in range(max(train_size, 2 * eval_size + 1024)):
        digits = [rng.randint(0, 9) for _ in range(length)]
        pool.append(Example(f"Sort the digits: {' '.join(map(str, digits))}", " ".join(map(str, sorted(digits)))))
    train, held_out = split_by_problem(pool, seed, eval_size, train_size, f"--sort-length {length}")
    return Task(train=train, eval=held_out, reward=exact_answer_reward)


def running_sum_task(seed: int, terms: int, train_size: int = 4096, eval_size: int = 64) -> Task:
    """Add `terms` digits (1-9) step by step: the reference response writes every partial sum ("12 + 7 = 19"), one
    line per term, then the total as the answer — responses of a few hundred tokens whose every step a small model
    can learn, so that the whole sequence's probability (and its sequence-level importance weight) compounds the
    per-token mismatch over many tokens."""
    rng = random.Random(seed)
    pool = []
    for _ in range(max(train_size, 2 * eval_size + 1024)):
        digits = [rng.randint(1, 9) for _ in range(terms)]
        steps, total = [], digits[0]
        for digit in digits[1:]:
            steps.append(f"{total} + {digit} = {total + digit}")
            total += digit
        pool.append(Example(f"Add step by step: {' + '.join(map(str, digits))}", str(total),
                            working="\n".join(steps)))
    train, held_out = split_by_problem(pool, seed, eval_size, train_size, f"--sum-terms {terms}")
    return Task(train=train, eval=held_out, reward=exact_answer_reward)


def _countdown_problem(rng: random.Random, count: int, max_number: int) -> Example:
    numbers = [rng.randint(1, max_number) for _ in range(count)]
    expr, value = str(numbers[0]), numbers[0]
    for n in numbers[1:]:
        op = rng.choice("+-*")
        expr, value = f"({expr}) {op} {n}" if op == "*" and " " in expr else f"{expr} {op} {n}", \
            {"+": value + n, "-": value - n, "*": value * n}[op]
    shown = sorted(numbers)
    return Example(f"Use {', '.join(map(str, shown))} once each with + - * to make {value}.",
                   f"{value}:{','.join(map(str, shown))}", solution=expr)


def countdown_task(seed: int, count: int, max_number: int, train_size: int = 4096, eval_size: int = 64) -> Task:
    """Countdown: reach the target with every given number once; any correct expression scores 1."""
    rng = random.Random(seed)
    pool = [_countdown_problem(rng, count, max_number) for _ in range(max(train_size, 2 * eval_size + 1024))]
    train, held_out = split_by_problem(pool, seed, eval_size, train_size,
                                       f"--countdown-numbers {count} --countdown-max {max_number}")
    return Task(train=train, eval=held_out, reward=countdown_reward)


def parse_prompt_line(line: str) -> Example:
    """Parse one JSONL record: {"prompt", "answer"} (optional "solution"), or GSM8K's {"question", "answer"}
    whose answer ends with "#### <final answer>"."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError("a record must be a JSON object")
    prompt = record.get("prompt", record.get("question"))
    answer = record.get("answer")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError('missing "prompt" (or "question") string')
    if answer is None or isinstance(answer, (dict, list, bool)):
        raise ValueError('missing "answer" (a string or a number)')
    if isinstance(answer, float) and not math.isfinite(answer):  # json reads NaN and Infinity
        raise ValueError(f'"answer" {answer} is not a finite number')
    answer, solution = str(answer).strip(), record.get("solution")
    if "####" in answer:  # GSM8K: reasoning, then the final answer after ####
        answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError('"answer" is empty')
    if solution is not None and (not isinstance(solution, str) or not solution.strip()):
        raise ValueError('"solution" must be a non-empty string (the SFT target inside <answer>)')
    return Example(prompt, answer, solution)


def read_prompt_file(path: str, skip_bad_samples: bool) -> tuple[list[Example], int]:
    """Read a prompt JSONL file; return (examples, skipped lines). Malformed lines raise a PromptFileError naming
    every bad line, unless `skip_bad_samples`, which counts them (and reports them on stderr)."""
    examples, bad = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                examples.append(parse_prompt_line(line))
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                bad.append(f"{path}:{number}: {err}")
    if bad and not skip_bad_samples:
        raise PromptFileError(f"{len(bad)} malformed line(s) in --prompt-file (fix them or pass --skip-bad-samples):"
                              "\n  " + "\n  ".join(bad[:20]))
    for message in bad[:20]:
        print(f"skipping {message}", file=sys.stderr)
    return examples, len(bad)


def jsonl_task(path: str, seed: int, skip_bad_samples: bool, eval_size: int, train_size: int | None = None) -> Task:
    """Prompts from a JSONL file, scored with math-verify (GSM8K-style answers); every problem not held out is a
    training example (cycled to `train_size` when given)."""
    examples, skipped = read_prompt_file(path, skip_bad_samples)
    train, held_out = split_by_problem(examples, seed, eval_size, train_size, f"--prompt-file {path}")
    return Task(train=train, eval=held_out, reward=math_verify_reward, skipped=skipped)


def _jsonl(config: "TaskConfig", seed: int) -> Task:
    if not config.prompt_file or not os.path.isfile(config.prompt_file):
        raise TaskError(f"--task jsonl needs --prompt-file FILE (an existing JSONL file; got {config.prompt_file!r})")
    return jsonl_task(config.prompt_file, seed, config.skip_bad_samples, config.eval_prompts, config.num_examples)


GENERATED_EXAMPLES = 4096  # a generated task's training examples unless --num-examples says otherwise
# --task name -> builder from the task flags and a seed
TASKS: Registry = Registry("--task", {
    "digit_sort": lambda c, seed: digit_sort_task(seed, c.sort_length, c.generated_examples(), c.eval_prompts),
    "arithmetic": lambda c, seed: arithmetic_task(seed, c.max_operand, c.generated_examples(), c.eval_prompts),
    "countdown": lambda c, seed: countdown_task(seed, c.countdown_numbers, c.countdown_max, c.generated_examples(),
                                                c.eval_prompts),
    "running_sum": lambda c, seed: running_sum_task(seed, c.sum_terms, c.generated_examples(), c.eval_prompts),
    "jsonl": _jsonl,
})


@dataclasses.dataclass(frozen=True)
class TaskConfig(FlagConfig):
    """Which task, its size and its data; shared by the supervised warm-up and the GRPO loop."""

    task: str = flag("digit_sort", "Verifiable task (see megatron_ais/data).",
                     choices=tuple(TASKS))
    sort_length: int = flag(5, "digit_sort: digits per list.", at_least=1)
    max_operand: int = flag(20, "arithmetic: largest operand.", at_least=0)
    countdown_numbers: int = flag(3, "countdown: numbers per problem.", at_least=1)
    countdown_max: int = flag(9, "countdown: largest number.", at_least=1)
    sum_terms: int = flag(32, "running_sum: digits to add; the worked response has one line per term (about 7 "
                              "tokens each with the tiny model's tokenizer).", at_least=2)
    prompt_file: str | None = flag(None, 'jsonl: one JSON object per line, {"prompt": ..., "answer": ...} or '
                                         'GSM8K\'s {"question": ..., "answer": "... #### 42"} (docs/data.md).',
                                   type=str)
    skip_bad_samples: bool = flag(False, "jsonl: skip and count malformed lines instead of stopping with their line "
                                         "numbers.")
    num_examples: int | None = flag(None, f"Training examples drawn from the task (default: {GENERATED_EXAMPLES} "
                                          "for the generated tasks, every problem of --prompt-file not held out for "
                                          "jsonl, which this cycles or cuts to its number).", at_least=1, type=int)
    eval_prompts: int = flag(64, "Held-out prompts (never trained on).", at_least=1)

    def generated_examples(self) -> int:
        """How many training examples a generated task draws."""
        return self.num_examples or GENERATED_EXAMPLES


def build_task(config: TaskConfig, seed: int) -> Task:
    """Return the task named by the task flags, its data drawn with `seed`."""
    return TASKS[config.task](config, seed)
