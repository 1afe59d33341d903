"""Scoring responses where they are generated: the task's reward of each (response, answer), inline or in a pool of
worker processes with a per-sample timeout. Process workers, not threads: math-verify is slow, single-threaded and
breaks in threads (verl#3407). A reward that raises, returns a non-finite or out-of-range value, or runs past its
timeout scores 0 and is counted; a hung worker is killed and the pool restarted, and the step goes on."""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import pickle
import time
from typing import Callable

from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag


@dataclasses.dataclass(frozen=True)
class RewardConfig(FlagConfig):
    """How rewards are computed."""

    workers: int = flag(0, "Reward worker processes on the engine's host (spawned once per run); 0 scores inline "
                           "in the engine's rank, where a reward that hangs stalls the step (fine for the built-in "
                           "tasks; use a few workers for math-verify or any reward that may hang).",
                        name="--reward-workers", at_least=0, bound_note="0 scores inline")
    timeout_s: float = flag(10.0, "With --reward-workers: seconds one sample's reward may take; past it the sample "
                                  "scores 0, is counted in rollout/reward_timeouts, and its worker is replaced.",
                            name="--reward-timeout-s", above=0)


@dataclasses.dataclass(frozen=True)
class Scores:
    values: list[float]
    failed: int  # raised, or returned something that is not a finite number in [0, 1]
    timed_out: int


def _checked(value) -> float:
    value = float(value)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"reward {value} is not a finite number in [0, 1]")
    return value


def _call(reward: Callable[[str, str], float], response: str, answer: str) -> float:
    return _checked(reward(response, answer))


class RewardScorer:
    """Scores (response, answer) pairs with `reward` (a picklable module-level function when `workers` > 0)."""

    def __init__(self, reward: Callable[[str, str], float], config: RewardConfig):
        self.reward, self.config = reward, config
        if config.workers:
            try:
                pickle.dumps(reward)
            except Exception as err:
                raise ArgumentValidationError(f"--reward-workers {config.workers}: the task's reward {reward!r} cannot "
                                              f"be sent to a worker process ({err}); use --reward-workers 0") from err
        self.pool = self._new_pool() if config.workers else None

    def _new_pool(self):
        # spawn: the engine's rank runs threads (vLLM, gloo) that a forked child would inherit mid-flight
        return multiprocessing.get_context("spawn").Pool(self.config.workers)

    def score(self, pairs: list[tuple[str, str]]) -> Scores:
        if self.pool is None:
            return self._score_inline(pairs)
        values, failed, timed_out = [0.0] * len(pairs), 0, 0
        pending = list(range(len(pairs)))
        while pending:
            start = time.monotonic()
            results = {i: self.pool.apply_async(_call, (self.reward, *pairs[i])) for i in pending}
            hung = None
            for slot, i in enumerate(pending):
                # the pool hands samples out in order, `workers` at a time: this one starts by its slot's turn
                deadline = start + self.config.timeout_s * (1 + slot // self.config.workers)
                try:
                    values[i] = results[i].get(timeout=max(0.0, deadline - time.monotonic()))
                except multiprocessing.TimeoutError:
                    hung = i
                    break
                except Exception:  # the reward's own error, re-raised from the worker
                    failed += 1
            if hung is None:
                break
            timed_out += 1
            rest = pending[pending.index(hung) + 1:]
            pending = []
            for i in rest:  # what finished beside the hung sample is kept; the rest is scored again
                if results[i].ready():
                    try:
                        values[i] = results[i].get(timeout=0)
                    except Exception:
                        failed += 1
                else:
                    pending.append(i)
            self.pool.terminate()
            self.pool = self._new_pool()
        return Scores(values, failed, timed_out)

    def _score_inline(self, pairs: list[tuple[str, str]]) -> Scores:
        values, failed = [], 0
        for response, answer in pairs:
            try:
                values.append(_call(self.reward, response, answer))
            except Exception:
                values.append(0.0)
                failed += 1
        return Scores(values, failed, 0)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None
