"""Group-relative advantages: one scalar per response, normalised within its prompt's group."""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais.ais import invalid_sequences
from megatron_ais.batch import RolloutBatch
from megatron_ais.flags import FlagConfig, flag


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(FlagConfig):
    """How a group's rewards become advantages: GRPO's normalised ones, centred only, or leave-one-out."""

    no_std: bool = flag(False, "Centre rewards per group without dividing by the group's standard deviation (by "
                               "default advantages are (r - mean) / (std + eps) with the population std, ddof 0; verl "
                               "and TRL use the sample std, which scales advantages by sqrt((G-1)/G)).",
                        name="--advantage-no-std")
    leave_one_out: bool = flag(False, "Baseline each response with the mean reward of the other responses of its "
                                      "group (RLOO).", name="--advantage-leave-one-out")



def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                     leave_one_out: bool = False, eps: float = 1e-6, valid: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Return advantages [n] for rewards [n] laid out as consecutive groups of `group_size` responses.

    Default (GRPO): (r - mean_group) / (std_group + eps). leave_one_out: baseline = mean of the other responses
    (RLOO). normalize_std=False: Dr. GRPO style, centred only. Groups with identical rewards give zeros.
    `valid` [n] (bool): responses left out of training (a NaN rollout log-prob) are left out of their group's
    statistics too and get advantage 0; a group's statistics are those of its valid members.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    if leave_one_out and group_size < 2:
        raise ValueError("leave-one-out advantages need a group size of at least 2")
    r = rewards.double().view(-1, group_size)
    keep = torch.ones_like(r) if valid is None else valid.to(r.device).double().view(-1, group_size)
    count = keep.sum(dim=1, keepdim=True)
    total = torch.where(keep > 0, r, 0.0).sum(dim=1, keepdim=True)  # an excluded member's reward may be anything
    mean = total / count.clamp(min=1)
    if leave_one_out:  # a member alone in its group has no baseline: advantage 0
        baseline = torch.where(count > 1, (total - r) / (count - 1).clamp(min=1), r)
    else:
        baseline = mean
    adv = r - baseline
    if normalize_std:
        std = (torch.where(keep > 0, r - mean, 0.0) ** 2).sum(dim=1, keepdim=True).div(count.clamp(min=1)).sqrt()
        adv = adv / (std + eps)
    return torch.where(keep > 0, adv, 0.0).flatten().float()


def with_advantages(batch: RolloutBatch, config: AdvantageConfig) -> RolloutBatch:
    """The batch (whole groups) with each row's group advantage. A sequence left out for a NaN rollout log-prob is
    left out of its group's mean and std too."""
    return dataclasses.replace(batch, advantages=group_advantages(
        batch.rewards, batch.group_size, not config.no_std, config.leave_one_out,
        valid=~invalid_sequences(batch.rollout_logprobs, batch.mask)))
