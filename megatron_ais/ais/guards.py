"""Rollout log-probs that are NaN, ±Inf or −inf for a sampled token make a sequence unusable."""
from __future__ import annotations

import torch


def invalid_sequences(rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Return [B] bool: the sequences holding a non-finite rollout log-prob on a valid token."""
    return (~torch.isfinite(rollout_logprobs) & (mask > 0)).any(dim=-1)


def exclude_invalid_sequences(rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Return (mask with every sequence holding a non-finite rollout log-prob zeroed, number excluded)."""
    bad_sequence = invalid_sequences(rollout_logprobs, mask)
    cleaned = mask * (~bad_sequence).unsqueeze(-1).to(mask.dtype)
    return cleaned, int(bad_sequence.sum())


def check_trainer_logprobs(trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise when the trainer's own log-probs are non-finite on valid tokens: the weights are corrupt."""
    bad = ~torch.isfinite(trainer_logprobs) & (mask > 0)
    if bad.any():
        rows = bad.any(dim=-1).nonzero().flatten().tolist()
        raise FloatingPointError(f"trainer log-probs are NaN/Inf on {int(bad.sum())} valid tokens (sequences "
                                 f"{rows[:8]}); the model weights or activations are corrupt, refusing to train")
