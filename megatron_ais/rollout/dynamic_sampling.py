"""`--dynamic-sampling` (DAPO, Yu et al. 2025): a group whose rewards are all equal has zero advantages under
group-relative baselines and gives no policy gradient; such groups are dropped and further prompts sampled, round
after round, until --prompts-per-step informative groups are collected or --max-sampling-rounds is reached. Groups
are judged on the rewards the advantages use: with --overlong soft-penalty, the shaped ones, so a group all correct
but of lengths the penalty tells apart keeps its gradient and stays (DAPO's recipe judges accuracy and drops it).

Round r's prompts and sampling seed depend only on the seeds, the step and r (round 0 is the stream a run without
dynamic sampling draws), so a resumed run samples what the uninterrupted run did. A step short of informative
groups after the last round trains on those it has: the batch keeps its shape (DP shares, mini-batches and
micro-batches are checked once, before the run), filled with the first zero-variance groups, whose response masks
are zeroed so they leave the loss and its normaliser."""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from megatron_ais.flags import FlagConfig, flag


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig(FlagConfig):
    """Whether steps keep only groups with reward variance, and how many rounds of prompts a step may sample."""

    enabled: bool = flag(False, "Drop groups whose rewards are all equal (no advantage, no gradient) and sample "
                                "further prompts until --prompts-per-step informative groups are collected or "
                                "--max-sampling-rounds rounds were sampled (DAPO; verl's algorithm.filter_groups).",
                         name="--dynamic-sampling")
    max_rounds: int = flag(4, "With --dynamic-sampling: rounds of --prompts-per-step prompts a step samples at most; "
                              "a step still short then trains on the informative groups it has (the rest of its "
                              "batch is masked out of the loss) and says so.", name="--max-sampling-rounds", at_least=1)

    @property
    def rounds(self) -> int:
        """Rounds a step samples at most (1 without dynamic sampling)."""
        return self.max_rounds if self.enabled else 1


def stream_seed(seed: int, step: int, round_index: int) -> int:
    """The seed of round `round_index` of a step's prompts (or samples): round 0's is the seed a run without dynamic
    sampling uses; later rounds' come from (seed, step, round) alone."""
    if round_index == 0:
        return seed * 100003 + step
    return random.Random(f"{seed}/{step}/{round_index}").getrandbits(31)


def informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ (a zero-variance group has zero advantages)."""
    return max(rewards) > min(rewards)


@dataclasses.dataclass(frozen=True)
class GroupSelection:
    """The groups a step trains on, by stream position (round × prompts per round + prompt), in stream order;
    `blank`: the zero-variance ones that fill a short batch, masked out of the loss."""

    picked: tuple[int, ...]
    blank: frozenset[int]
    sampled: int  # groups sampled
    zero_variance: int  # of them, groups whose rewards are all equal
    rounds: int

    @property
    def informative(self) -> int:
        return len(self.picked) - len(self.blank)

    def metrics(self, group_size: int) -> dict[str, float]:
        return {"sampling/filtered_fraction": self.zero_variance / max(self.sampled, 1),
                "sampling/rounds": self.rounds, "sampling/prompts_sampled": self.sampled,
                "sampling/informative_groups": self.informative,
                "sampling/responses_sampled": self.sampled * group_size}


def select_groups(group_rewards: Sequence[Sequence[float]], target: int, rounds: int) -> GroupSelection:
    """The first `target` informative groups of the stream (each group's rewards, in stream order); short of them,
    the first zero-variance groups fill the batch as blanks."""
    varied = [i for i, rewards in enumerate(group_rewards) if informative(rewards)]
    zero_variance = [i for i, rewards in enumerate(group_rewards) if not informative(rewards)]
    chosen = varied[:target]
    blank = zero_variance[:target - len(chosen)]
    return GroupSelection(tuple(sorted(chosen + blank)), frozenset(blank), len(group_rewards), len(zero_variance),
                          rounds)
