"""`--overlong {keep,mask,soft-penalty}`: what becomes of responses that run to --max-new-tokens (DAPO, Yu et al.
2025): kept as they are, masked out of the loss when cut (overlong filtering), or given DAPO's soft length penalty
over a buffer before the limit (overlong reward shaping). Applied on the engine's host, before the group advantages."""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais.batch import RolloutBatch
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag

OVERLONG_MODES = ("keep", "mask", "soft-penalty")


@dataclasses.dataclass(frozen=True)
class OverlongConfig(FlagConfig):
    """DAPO's treatment of long responses."""

    mode: str = flag("keep", "Responses that reach --max-new-tokens: keep them; mask: a response the limit cut leaves "
                             "the loss (its reward still counts in its group's advantages); soft-penalty: add DAPO's "
                             "length penalty -(len - (max - buffer)) / buffer x --overlong-penalty to the reward of a "
                             "response longer than --max-new-tokens minus --overlong-buffer-tokens.",
                     name="--overlong", choices=OVERLONG_MODES)
    buffer_tokens: int = flag(0, "Soft-penalty buffer: the last this many tokens before --max-new-tokens (DAPO: "
                                 "overlong_buffer.len).", name="--overlong-buffer-tokens")
    penalty: float = flag(1.0, "Soft-penalty factor: the penalty at --max-new-tokens (DAPO: "
                               "overlong_buffer.penalty_factor).", name="--overlong-penalty", at_least=0)

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in OVERLONG_MODES:
            raise ArgumentValidationError(f"--overlong {self.mode!r} must be one of {OVERLONG_MODES}")
        if self.mode == "soft-penalty" and self.buffer_tokens < 1:
            raise ArgumentValidationError("--overlong soft-penalty needs --overlong-buffer-tokens of at least 1 (the "
                                          "tokens before --max-new-tokens over which the penalty grows)")


def soft_overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int,
                          penalty: float) -> torch.Tensor:
    """DAPO's reward shaping [n]: 0 up to max_new_tokens − buffer_tokens tokens, then falling linearly to −penalty
    at max_new_tokens."""
    exceed = lengths.double() - (max_new_tokens - buffer_tokens)
    return (-exceed / buffer_tokens * penalty).clamp(max=0.0)


def shape_overlong(batch: RolloutBatch, lengths: list[int], truncated: list[bool], config: OverlongConfig,
                   max_new_tokens: int) -> RolloutBatch:
    """The batch with --overlong applied: `lengths` are its responses' token counts, `truncated` whether the limit
    cut each; the batch counts the cut ones either way."""
    batch = dataclasses.replace(batch, truncated=sum(truncated))
    if config.mode == "mask":
        kept = torch.tensor([not cut for cut in truncated], dtype=batch.mask.dtype)
        return dataclasses.replace(batch, mask=batch.mask * kept.unsqueeze(-1))
    if config.mode == "soft-penalty":
        penalty = soft_overlong_penalty(torch.tensor(lengths), max_new_tokens, config.buffer_tokens, config.penalty)
        return dataclasses.replace(batch, rewards=(batch.rewards.double() + penalty).float())
    return batch
