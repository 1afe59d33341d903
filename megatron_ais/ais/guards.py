"""Rollout log-probs that are NaN, ±Inf or −inf for a sampled token make a sequence unusable; every public entry
point of `megatron_ais.ais` refuses non-finite inputs rather than return NaN or clamp ±Inf silently."""
from __future__ import annotations

import math

import torch

from megatron_ais.errors import NonFiniteInputError


def invalid_sequences(rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return [B] bool: the sequences holding a non-finite rollout log-prob on a valid token."""
    return (~torch.isfinite(rollout_logprobs) & (mask > 0)).any(dim=-1)


def exclude_invalid_sequences(rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Return (mask with every sequence holding a non-finite rollout log-prob zeroed, number excluded)."""
    bad_sequence = invalid_sequences(rollout_logprobs, mask)
    cleaned = mask * (~bad_sequence).unsqueeze(-1).to(mask.dtype)
    return cleaned, int(bad_sequence.sum())


def check_finite(values: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    """Refuse `values` [b, s] that are NaN/Inf on valid tokens, naming them (`name`); masked positions may hold
    anything. The GRPO step excludes such sequences first (`exclude_invalid_sequences`); a library caller must too."""
    bad = ~torch.isfinite(values) & (mask > 0)
    if bad.any():
        rows = bad.any(dim=-1).nonzero().flatten().tolist() if bad.dim() > 1 else []
        raise NonFiniteInputError(f"{name} are NaN/Inf on {int(bad.sum())} valid tokens (sequences {rows[:8]}); "
                                  "exclude those sequences first (megatron_ais.ais.exclude_invalid_sequences)")


def check_finite_statistics(statistics: dict[str, float]) -> None:
    """Refuse mismatch statistics holding NaN/Inf, naming the first such statistic."""
    for name, value in statistics.items():
        if not math.isfinite(value):
            raise NonFiniteInputError(f"mismatch statistic {name} is {value}: the log-probs or advantages it sums "
                                      "were not finite (or the weights overflowed); refusing to compute λ from it")
