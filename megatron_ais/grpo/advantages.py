"""Group-relative advantages: one scalar per response, normalised within its prompt's group."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                     leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Return advantages [n] for rewards [n] laid out as consecutive groups of `group_size` responses.

    Default (GRPO): (r - mean_group) / (std_group + eps). leave_one_out: baseline = mean of the other responses
    (RLOO). normalize_std=False: Dr. GRPO style, centred only. Groups with identical rewards give zeros.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    if leave_one_out:
        if group_size < 2:
            raise ValueError("leave-one-out advantages need a group size of at least 2")
        baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    else:
        baseline = r.mean(dim=1, keepdim=True)
    adv = r - baseline
    if normalize_std:
        std = r.std(dim=1, keepdim=True, unbiased=False) if group_size > 1 else torch.zeros_like(baseline)
        adv = adv / (std + eps)
    return adv.flatten().float()
