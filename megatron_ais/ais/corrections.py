"""`--is-correction {none,tis,mis,icepop,ais}`: per-token loss coefficients and acceptance masks.

Each correction returns a detached coefficient c (multiplies the token's PPO-clip term) and a keep mask
(tokens it rejects leave both the loss and its normaliser). Registered by name (`ais/registry.py`); adding one is
one entry.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais.ais.coefficient import AISResult, correction_weights, unit_weights
from megatron_ais.ais.config import AISConfig
from megatron_ais.ais.registry import CORRECTIONS
from megatron_ais.registry import register


@dataclasses.dataclass(frozen=True)
class Correction:
    """Per-token coefficient [b, s] (detached) and keep mask [b, s] (1 = token stays in the loss)."""

    coefficient: torch.Tensor
    keep: torch.Tensor


@register(CORRECTIONS, "none")
def no_correction(trainer_lp, rollout_lp, mask, config, result):
    """Plain GRPO: c = 1."""
    return Correction(torch.ones_like(mask, dtype=torch.float32), mask.float())


@register(CORRECTIONS, "tis")
def truncated_is(trainer_lp, rollout_lp, mask, config, result):
    """TIS: c = min(w, C) (token, sequence-product or geometric ratio)."""
    w = unit_weights(trainer_lp, rollout_lp, mask, config)
    return Correction(w.clamp(max=config.cap).detach(), mask.float())


@register(CORRECTIONS, "mis")
def masked_is(trainer_lp, rollout_lp, mask, config, result):
    """MIS: reject units whose ratio leaves [low, high] (dropped from loss and normaliser); c = w for the rest."""
    w = unit_weights(trainer_lp, rollout_lp, mask, config)
    low, high = config.mis_band
    accept = ((w >= low) & (w <= high)).float()
    return Correction((w * accept).detach(), mask.float() * accept)


@register(CORRECTIONS, "icepop")
def icepop(trainer_lp, rollout_lp, mask, config, result):
    """IcePop: c = w inside [α, β], 0 outside; masked tokens stay in the normaliser."""
    w = unit_weights(trainer_lp, rollout_lp, mask, config)
    inside = ((w >= config.icepop_low) & (w <= config.icepop_high)).float()
    return Correction((w * inside).detach(), mask.float())


@register(CORRECTIONS, "ais")
def adaptive_is(trainer_lp, rollout_lp, mask, config, result):
    """AIS: c = (1 - λ) + λ · min(w, C), one λ per rollout batch."""
    return Correction(correction_weights(trainer_lp, rollout_lp, result, config, mask), mask.float())


def apply_correction(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, config: AISConfig,
                     result: AISResult) -> Correction:
    """Return the configured correction's coefficients and keep mask."""
    return CORRECTIONS[config.correction](trainer_lp, rollout_lp, mask, config, result)
