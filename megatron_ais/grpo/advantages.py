"""Group-relative advantages: one scalar per response, its reward less a registered baseline of its prompt's group
(GRPO's group mean, RLOO's leave-one-out mean), optionally divided by the group's std."""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais.ais import invalid_sequences
from megatron_ais.batch import RolloutBatch
from megatron_ais.errors import NonFiniteInputError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.registry import Registry, register

# baselines by estimator: (rewards [groups, G], reward totals [groups, 1], valid members [groups, 1]) -> [groups, G]
ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


@register(ADVANTAGE_ESTIMATORS, "grpo")
def group_mean_baseline(rewards: torch.Tensor, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """GRPO: the mean reward of the group's valid members."""
    return (total / count.clamp(min=1)).expand_as(rewards)


@register(ADVANTAGE_ESTIMATORS, "rloo")
def leave_one_out_baseline(rewards: torch.Tensor, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """RLOO: the mean reward of the other valid members; a member alone in its group is its own baseline (0)."""
    return torch.where(count > 1, (total - rewards) / (count - 1).clamp(min=1), rewards)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(FlagConfig):
    """How a group's rewards become advantages: GRPO's normalised ones, centred only, or leave-one-out."""

    no_std: bool = flag(False, "Centre rewards per group without dividing by the group's standard deviation (by "
                               "default advantages are (r - mean) / (std + eps) with the population std, ddof 0; verl "
                               "and TRL use the sample std, which scales advantages by sqrt((G-1)/G)).",
                        name="--advantage-no-std")
    leave_one_out: bool = flag(False, "Baseline each response with the mean reward of the other responses of its "
                                      "group (RLOO). Still divided by the group's std unless --advantage-no-std: "
                                      "RLOO as published (and verl's rloo) is that baseline alone, i.e. both flags.",
                               name="--advantage-leave-one-out")

    @property
    def estimator(self) -> str:
        """The registered baseline these flags select."""
        return "rloo" if self.leave_one_out else "grpo"


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, estimator: str = "grpo",
                     eps: float = 1e-6, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Return advantages [n] for rewards [n] laid out as consecutive groups of `group_size` responses.

    Default (GRPO): (r - mean_group) / (std_group + eps). `estimator` names the baseline in ADVANTAGE_ESTIMATORS
    (rloo: the mean of the other responses). normalize_std=False: Dr. GRPO style, centred only. Groups with identical rewards give zeros.
    `valid` [n] (bool): responses left out of training (a NaN rollout log-prob) are left out of their group's
    statistics too and get advantage 0; a group's statistics are those of its valid members.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    if estimator == "rloo" and group_size < 2:
        raise ValueError("leave-one-out advantages need a group size of at least 2")
    r = rewards.double().view(-1, group_size)
    keep = torch.ones_like(r) if valid is None else valid.to(r.device).double().view(-1, group_size)
    bad = ~torch.isfinite(r) & (keep > 0)
    if bad.any():
        raise NonFiniteInputError(f"rewards are NaN/Inf for {int(bad.sum())} valid responses (groups "
                                  f"{bad.any(dim=1).nonzero().flatten().tolist()[:8]}); refusing to train on them")
    count = keep.sum(dim=1, keepdim=True)
    total = torch.where(keep > 0, r, 0.0).sum(dim=1, keepdim=True)  # an excluded member's reward may be anything
    adv = r - ADVANTAGE_ESTIMATORS[estimator](r, total, count)
    if normalize_std:
        mean = total / count.clamp(min=1)
        std = (torch.where(keep > 0, r - mean, 0.0) ** 2).sum(dim=1, keepdim=True).div(count.clamp(min=1)).sqrt()
        adv = adv / (std + eps)
    return torch.where(keep > 0, adv, 0.0).flatten().float()


def with_advantages(batch: RolloutBatch, config: AdvantageConfig) -> RolloutBatch:
    """The batch (whole groups) with each row's group advantage. A sequence left out for a NaN rollout log-prob is
    left out of its group's mean and std too."""
    return dataclasses.replace(batch, advantages=group_advantages(
        batch.rewards, batch.group_size, not config.no_std, config.estimator,
        valid=~invalid_sequences(batch.rollout_logprobs, batch.mask)))
