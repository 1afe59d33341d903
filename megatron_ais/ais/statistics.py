"""Per-batch sufficient statistics of the rollout/trainer mismatch (docs/ais-method.md §2.2).

Everything here is a sum over valid units (tokens, or sequences at sequence / geometric level), so one
all-reduce (SUM) over the data-parallel (x context-parallel) group gives statistics of the whole batch that do
not depend on how it was split over ranks or micro-batches.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_ais.ais.config import AISConfig
from megatron_ais.ais.guards import check_finite

STAT_NAMES = (
    "n",                          # N: valid units
    "sum_abs_logratio",           # Σ|δ| (per sequence: |mean δ|) divergence severity
    "sum_band_weight",            # Σw̃, w̃ = clip(w, 1/C, C)   reliability
    "sum_band_weight_sq",         # Σw̃²
    "sum_adv_sq",                 # ΣÂ²                       variance amplification
    "sum_trunc_weight_sq_adv_sq",  # Σw̄²Â², w̄ = min(w, C)
    "sum_weight",                 # Σw     (logging only from here on)
    "sum_weight_sq",              # Σw²
    "sum_trunc_weight",           # Σw̄
    "sum_trunc_weight_sq",        # Σw̄²
    "sum_k3",                     # Σ(e^δ - 1 - δ), δ as the severity reads it (per sequence: its mean δ)
    "n_truncated",                # #{w > C}
    "n_sequences",                # sequences with a valid token   sequence-level ESS (logging), at every level:
    "sum_seq_weight",             # Σ W, W = exp(Σ_t δ_t) per sequence (Σ δ clamped like δ)
    "sum_seq_weight_sq",          # Σ W²
    "sum_bias",                   # Σ u, u = Â Σ_t (min(w_t, C) − 1) per sequence   the bias test
    "sum_bias_sq",                # Σ u²
)
INDEX = {name: i for i, name in enumerate(STAT_NAMES)}


def unit_log_ratios(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                    config: AISConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (δ per unit, unit mask): per token [b, s], or per sequence [b] (sum or mean of token δ).

    Masked positions never contribute, even when they hold NaN or garbage; valid ones must be finite.
    """
    check_finite(trainer_logprobs, mask, "trainer log-probs")
    check_finite(rollout_logprobs, mask, "rollout log-probs")
    valid = mask > 0
    delta = torch.where(valid, trainer_logprobs.float() - rollout_logprobs.float(), torch.zeros((), dtype=torch.float32))
    if config.level == "token":
        return delta.clamp(-config.logratio_clamp, config.logratio_clamp), valid.float()
    per_seq = delta.sum(dim=-1)
    counts = valid.float().sum(dim=-1)
    if config.level == "geometric":
        per_seq = per_seq / counts.clamp(min=1.0)
    return per_seq.clamp(-config.logratio_clamp, config.logratio_clamp), (counts > 0).float()


def severity_log_ratios(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                        config: AISConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """δ per unit as the divergence severity measures it: the unit's δ, except that a sequence-level (product)
    weight's Σδ is replaced by the sequence's mean δ (§2.6: Σ|mean δ|) — a sum grows with the response length and
    would saturate the severity on every long response."""
    if config.level == "sequence":
        config = dataclasses.replace(config, level="geometric")
    return unit_log_ratios(trainer_logprobs, rollout_logprobs, mask, config)


def unit_advantages(advantages: torch.Tensor, mask: torch.Tensor, config: AISConfig) -> torch.Tensor:
    """Return Â per unit: per token, or the sequence's advantage (its masked token mean) per sequence."""
    check_finite(advantages, mask, "advantages")
    valid = mask > 0
    adv = torch.where(valid, advantages.float(), torch.zeros((), dtype=torch.float32))
    if config.level == "token":
        return adv
    return adv.sum(dim=-1) / valid.float().sum(dim=-1).clamp(min=1.0)


def mismatch_statistics(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, config: AISConfig) -> torch.Tensor:
    """Return the fp64 vector of sums in STAT_NAMES order for tensors of shape [batch, seq]."""
    delta, m = unit_log_ratios(trainer_logprobs.detach(), rollout_logprobs.detach(), mask, config)
    severity = severity_log_ratios(trainer_logprobs.detach(), rollout_logprobs.detach(), mask, config)[0].double()
    adv_sq = unit_advantages(advantages.detach(), mask, config).double().pow(2)
    delta, m = delta.double(), m.double()
    w = delta.exp()
    cap = config.cap
    trunc = w.clamp(max=cap)
    band = w.clamp(1.0 / cap, cap)
    terms = (m, severity.abs(), band, band * band, adv_sq, trunc * trunc * adv_sq, w, w * w, trunc, trunc * trunc,
             severity.exp() - 1.0 - severity, (w > cap).double())
    seq_delta, seq_m = unit_log_ratios(trainer_logprobs.detach(), rollout_logprobs.detach(), mask,
                                       dataclasses.replace(config, level="sequence"))
    seq_w, seq_m = seq_delta.double().exp(), seq_m.double()
    bias = bias_shares(trainer_logprobs.detach(), rollout_logprobs.detach(), advantages.detach(), mask, config)
    return torch.stack([(m * t).sum() for t in terms] + [(seq_m * t).sum() for t in (seq_m, seq_w, seq_w * seq_w,
                                                                                     bias, bias * bias)])


def bias_shares(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, config: AISConfig) -> torch.Tensor:
    """u per sequence [b] (fp64): Â · Σ_t (min(w_t, C) − 1) over its response, the sequence's share of the TIS
    gradient's weight minus the uncorrected one's (token weights, whatever the level)."""
    delta, m = unit_log_ratios(trainer_logprobs, rollout_logprobs, mask, dataclasses.replace(config, level="token"))
    excess = ((delta.double().exp().clamp(max=config.cap) - 1.0) * m.double()).sum(dim=-1)
    return unit_advantages(advantages, mask, dataclasses.replace(config, level="sequence")).double() * excess


def reduce_statistics(stats: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (SUM) the statistics over `group` (DP x CP; never TP or PP) in place and return them."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    return stats


def max_abs_logratio(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                     config: AISConfig, group=None) -> float:
    """Return max |δ| over valid units of the whole batch, δ as the severity measures it (all-reduce MAX; logging
    only, never enters λ)."""
    delta, m = severity_log_ratios(trainer_logprobs.detach(), rollout_logprobs.detach(), mask, config)
    value = torch.where(m > 0, delta.abs(), torch.zeros((), dtype=delta.dtype)).max().double().reshape(1) \
        if delta.numel() else torch.zeros(1, dtype=torch.float64, device=delta.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item()
