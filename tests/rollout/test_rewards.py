"""Rewards scored inline or in worker processes: a reward that raises, returns NaN or something outside [0, 1], or
hangs, scores 0 and is counted; a hung worker costs one timeout, not the step; the rest are scored as inline."""
import os
import time

import psutil
import pytest

from megatron_ais.errors import ArgumentValidationError
from megatron_ais.rollout.rewards import RewardConfig, RewardScorer


def unruly_reward(response: str, answer: str) -> float:
    """Module-level, so that a spawned worker can import it: the answer says how to misbehave."""
    if answer == "hang":
        with open(os.environ["HUNG_REWARD_PID_FILE"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    if answer == "raise":
        raise RuntimeError("the verifier crashed")
    if answer == "nan":
        return float("nan")
    if answer == "two":
        return 2.0
    return 1.0 if response == answer else 0.0


PAIRS = [("7", "7"), ("x", "raise"), ("8", "9"), ("x", "nan"), ("x", "two"), ("5", "5")]
EXPECTED = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_inline_scores_count_what_raises_or_is_not_a_reward():
    scores = RewardScorer(unruly_reward, RewardConfig()).score(PAIRS)
    assert scores.values == EXPECTED and scores.failed == 3 and scores.timed_out == 0


def test_worker_processes_score_as_inline_and_a_hung_reward_costs_one_timeout(tmp_path, monkeypatch):
    pid_file = tmp_path / "hung_reward.pid"
    monkeypatch.setenv("HUNG_REWARD_PID_FILE", str(pid_file))  # the pool's workers inherit it
    scorer = RewardScorer(unruly_reward, RewardConfig(workers=2, timeout_s=2.0))
    try:
        assert scorer.score(PAIRS).values == EXPECTED
        pairs = PAIRS[:2] + [("x", "hang")] + PAIRS[2:] + [("3", "3")] * 6
        start = time.monotonic()
        scores = scorer.score(pairs)
        elapsed = time.monotonic() - start
        assert scores.values == EXPECTED[:2] + [0.0] + EXPECTED[2:] + [1.0] * 6
        assert scores.failed == 3 and scores.timed_out == 1
        # the worker that hung was ended, not waited for (it would sleep 600 s): the scorer came back at once
        assert not psutil.pid_exists(int(pid_file.read_text()))
        assert elapsed < 120, elapsed  # a timeout of 2 s per turn and a pool restart, far below the 600 s
        assert scorer.score([("1", "1")]).values == [1.0]  # the restarted pool serves the next step
    finally:
        scorer.close()


def test_bad_reward_settings_are_refused_naming_the_flag():
    with pytest.raises(ArgumentValidationError, match="--reward-workers -1"):
        RewardConfig(workers=-1)
    with pytest.raises(ArgumentValidationError, match="--reward-timeout-s 0"):
        RewardConfig(workers=1, timeout_s=0)
    with pytest.raises(ArgumentValidationError, match="cannot be sent to a worker process"):
        RewardScorer(lambda response, answer: 1.0, RewardConfig(workers=1))
