"""Token-level PPO-clip policy loss with correction coefficients, KL and entropy terms, and aggregation whose
normaliser is counted over the whole data-parallel batch (so the gradient does not depend on the split)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_ais.flags import FlagConfig, flag

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(FlagConfig):
    """PPO-clip bounds (asymmetric, DAPO-style defaults), KL and entropy coefficients, aggregation."""

    clip_low: float = flag(0.2, "PPO ratio clip below: 1 - clip_low. There is no dual clip (verl's clip_ratio_c = 3 "
                                "bounds the loss of a negative-advantage token whose ratio exceeds 3); the "
                                "correction's weights are truncated (TIS, AIS) or masked (MIS, IcePop) instead.")
    clip_high: float = flag(0.28, "PPO ratio clip above: 1 + clip_high (DAPO).")
    kl_coef: float = flag(0.0, "Weight of the KL penalty to the reference policy.")
    kl_type: str = flag("k3", "KL estimator (Schulman's k1 or k3).", choices=("k1", "k3"))
    entropy_coef: float = flag(0.0, "Weight of the entropy bonus.")
    loss_agg: str = flag("token-mean", "token-mean: Σ over tokens / tokens in the global batch; seq-mean-token-sum: "
                                       "per-sequence sums / sequences; seq-mean-token-mean: per-sequence means / "
                                       "sequences.", choices=LOSS_AGGREGATIONS)

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"--loss-agg {self.loss_agg!r} must be one of {LOSS_AGGREGATIONS}")
        if self.kl_type not in ("k1", "k3"):
            raise ValueError(f"--kl-type {self.kl_type!r} must be k1 or k3")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"--clip-low {self.clip_low} must be in [0, 1) and --clip-high {self.clip_high} >= 0")


def ppo_clip_term(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  config: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) per token, clipped indicator)."""
    ratio = (logprobs - old_logprobs).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Return the per-token KL(π‖π_ref) estimate: k1 = log π − log π_ref, k3 = e^(ref−lp) − (ref−lp) − 1."""
    if kl_type == "k1":
        return logprobs - ref_logprobs
    log_ratio = ref_logprobs - logprobs
    return log_ratio.exp() - log_ratio - 1.0


def token_losses(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 coefficient: torch.Tensor, config: PolicyLossConfig, ref_logprobs: torch.Tensor | None = None,
                 entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return the per-token loss [b, s] (correction coefficient × PPO-clip term, plus KL and entropy terms)."""
    pg, clipped = ppo_clip_term(logprobs, old_logprobs, advantages, config)
    loss = coefficient.detach() * pg
    parts = {"pg": pg.detach(), "clipped": clipped}
    if config.kl_coef and ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, config.kl_type)
        loss = loss + config.kl_coef * kl
        parts["kl"] = kl.detach()
    if config.entropy_coef and entropy is not None:
        loss = loss - config.entropy_coef * entropy
        parts["entropy"] = entropy.detach()
    return loss, parts


def local_normalizer(mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """Return this rank's count of the aggregation's units (tokens, or sequences with a valid token)."""
    if loss_agg == "token-mean":
        return mask.float().sum().double()
    return (mask.float().sum(dim=-1) > 0).double().sum()


def global_normalizer(mask: torch.Tensor, loss_agg: str, group) -> float:
    """Return the aggregation's unit count over the whole DP batch (one all-reduce SUM)."""
    count = local_normalizer(mask, loss_agg).reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count.item()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_agg: str, normalizer: float) -> torch.Tensor:
    """Return Σ(local contribution) / normalizer, where the normaliser counts the whole DP batch."""
    mask = mask.float()
    if normalizer <= 0:
        return (per_token * 0.0).sum()
    if loss_agg == "token-mean":
        return (per_token * mask).sum() / normalizer
    per_seq = (per_token * mask).sum(dim=-1)
    if loss_agg == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / normalizer


def megatron_loss_scale(num_microbatches: int, data_parallel_size: int) -> float:
    """Factor that undoes megatron's 1/num_microbatches (schedule) and 1/DP (DDP grad averaging).

    A loss of Σ_local / N_global scaled by this gives a gradient of exactly Σ_all / N_global.
    """
    return float(num_microbatches * data_parallel_size)
