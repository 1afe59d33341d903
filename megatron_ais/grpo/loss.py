"""The policy loss: a registered policy-gradient term (token-level PPO-clip, or GSPO's sequence-level ratio and
clip) times the correction coefficients, KL and entropy terms, and aggregation whose normaliser is counted over the
whole data-parallel batch (so the gradient does not depend on the split)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_ais.flags import FlagConfig, flag
from megatron_ais.registry import Registry, register

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# policy-gradient terms by --policy-loss: (log π, log π_old, advantages, mask, config) -> (per-token term, clipped)
POLICY_LOSSES = Registry("--policy-loss")
# the policy losses whose ratio and clip are per sequence
SEQUENCE_LOSSES = ("gspo", "tbpo")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(FlagConfig):
    """PPO-clip bounds (asymmetric, DAPO-style defaults), KL and entropy coefficients, aggregation."""

    clip_low: float = flag(0.2, "PPO ratio clip below: 1 - clip_low. There is no dual clip (verl's clip_ratio_c = 3 "
                                "bounds the loss of a negative-advantage token whose ratio exceeds 3); the "
                                "correction's weights are truncated (TIS, AIS) or masked (MIS, IcePop) instead.",
                                at_least=0, below=1)
    clip_high: float = flag(0.28, "PPO ratio clip above: 1 + clip_high (DAPO).", at_least=0)
    kl_coef: float = flag(0.0, "Weight of the KL penalty to the reference policy.")
    kl_type: str = flag("k3", "KL estimator (Schulman's k1 or k3).", choices=("k1", "k3"))
    entropy_coef: float = flag(0.0, "Weight of the entropy bonus.")
    loss_agg: str = flag("token-mean", "token-mean: Σ over tokens / tokens in the global batch; seq-mean-token-sum: "
                                       "per-sequence sums / sequences; seq-mean-token-mean: per-sequence means / "
                                       "sequences; seq-mean-token-sum-norm (Dr. GRPO): per-sequence sums / "
                                       "(sequences x --max-new-tokens), a constant per-sequence normaliser.",
                         choices=LOSS_AGGREGATIONS)
    policy_loss: str = flag("ppo", "ppo: token-level ratio and clip; gspo: GSPO's sequence ratio (geometric mean of "
                                   "the token ratios) clipped per sequence, with --loss-agg seq-mean-token-mean (use "
                                   "GSPO-scale --clip-low/--clip-high, e.g. 3e-4/4e-4); tbpo: QaRL's TBPO as "
                                   "reconstructed in docs/ais-method.md §5.2 — GSPO's ratio and clip for positive "
                                   "advantages, for negative ones the ratio held in the trust band "
                                   "[1 - --tbpo-neg-clip-low, 1 + --tbpo-neg-clip-high] (no gradient outside it); its "
                                   "sequence mismatch weight is --is-correction tis --is-level geometric --is-cap 2.",
                            choices=lambda: tuple(POLICY_LOSSES))
    tbpo_neg_clip_low: float = flag(3e-4, "TBPO: the trust band's lower edge for negative-advantage sequences, "
                                          "1 - this.", at_least=0, below=1)
    tbpo_neg_clip_high: float = flag(7e-4, "TBPO: the trust band's upper edge for negative-advantage sequences, "
                                           "1 + this (PPO lets their ratio grow unbounded).", at_least=0)
    # the longest response (--max-new-tokens): Dr. GRPO's constant normaliser of a sequence's token sum
    max_response_tokens: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"--loss-agg {self.loss_agg!r} must be one of {LOSS_AGGREGATIONS}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"--policy-loss {self.policy_loss!r} must be one of {tuple(POLICY_LOSSES)}")
        if self.policy_loss in SEQUENCE_LOSSES and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(f"--policy-loss {self.policy_loss} with --loss-agg {self.loss_agg}: its objective is the "
                             "mean over sequences of each sequence's clipped term; use --loss-agg seq-mean-token-mean")
        if self.kl_type not in ("k1", "k3"):
            raise ValueError(f"--kl-type {self.kl_type!r} must be k1 or k3")


    @property
    def normalizer_scale(self) -> int:
        """What each unit of the aggregation's normaliser counts for: Dr. GRPO's constant token count, else 1."""
        return self.max_response_tokens if self.loss_agg == "seq-mean-token-sum-norm" else 1


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), clipped indicator), elementwise."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


@register(POLICY_LOSSES, "ppo")
def ppo_clip_term(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  config: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: the token ratio r_t = π/π_old, clipped per token."""
    return clipped_objective((logprobs - old_logprobs).exp(), advantages, config)


def sequence_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence ratio s = exp(mean over the response of log π − log π_old) on each token as
    s_t = sg(s) · π_t / sg(π_t): its value is s, its gradient s·∇log π_t, so the per-sequence token mean
    (seq-mean-token-mean) of a term linear in it has the gradient s·mean_t ∇log π_t."""
    mask = mask.float()
    log_ratio = (logprobs - old_logprobs) * mask
    sequence = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return (logprobs - logprobs.detach() + sequence.detach()).exp()


@register(POLICY_LOSSES, "gspo")
def gspo_term(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              config: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): the sequence ratio (`sequence_ratio`), clipped per sequence."""
    return clipped_objective(sequence_ratio(logprobs, old_logprobs, mask), advantages, config)


@register(POLICY_LOSSES, "tbpo")
def tbpo_term(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              config: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """QaRL's TBPO as reconstructed in docs/ais-method.md §5.2: GSPO's sequence ratio s; a sequence with A ≥ 0 has
    GSPO's clipped term −min(s·A, clip(s, 1−ε_low, 1+ε_high)·A); one with A < 0 has −clip(s, 1−ε⁻_low, 1+ε⁻_high)·A:
    inside the trust band its gradient is GSPO's, outside it none on either side (PPO's clip stops only the side
    where s falls; dual clipping bounds the other, here to the band)."""
    ratio = sequence_ratio(logprobs, old_logprobs, mask)
    positive, clipped = clipped_objective(ratio, advantages, config)
    band = ratio.clamp(1.0 - config.tbpo_neg_clip_low, 1.0 + config.tbpo_neg_clip_high)
    negative = advantages < 0
    out_of_band = (band.detach() != ratio.detach()).float()
    return torch.where(negative, -advantages * band, positive), torch.where(negative, out_of_band, clipped)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Return the per-token KL(π‖π_ref) estimate: k1 = log π − log π_ref, k3 = e^(ref−lp) − (ref−lp) − 1."""
    if kl_type == "k1":
        return logprobs - ref_logprobs
    log_ratio = ref_logprobs - logprobs
    return log_ratio.exp() - log_ratio - 1.0


def token_losses(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 coefficient: torch.Tensor, config: PolicyLossConfig, ref_logprobs: torch.Tensor | None = None,
                 entropy: torch.Tensor | None = None, mask: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return the per-token loss [b, s] (correction coefficient × the policy loss's clipped term, plus KL and entropy
    terms); `mask` (default: every token) bounds GSPO's sequences: the tokens in the loss."""
    if mask is None:
        mask = torch.ones_like(logprobs)
    # off the loss's tokens the other policies' log-probs are placeholders (a row scored in a micro-batch of another
    # length holds 0 there, or a padding token's log-prob): taken as the policy's own, every term is finite there
    # (e^(0 − log π) overflows, and 0 · inf would make the loss and its gradient NaN)
    own = logprobs.detach()
    old_logprobs = torch.where(mask > 0, old_logprobs, own)
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask > 0, ref_logprobs, own)
    pg, clipped = POLICY_LOSSES[config.policy_loss](logprobs, old_logprobs, advantages, mask, config)
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


def local_normalizer(mask: torch.Tensor, loss_agg: str, scale: int = 1) -> torch.Tensor:
    """Return this rank's count of the aggregation's units (tokens, or sequences with a valid token), each counting
    for `scale` (Dr. GRPO: sequences × the longest response)."""
    if loss_agg == "token-mean":
        return mask.float().sum().double()
    return (mask.float().sum(dim=-1) > 0).double().sum() * scale


def global_normalizer(mask: torch.Tensor, loss_agg: str, group, scale: int = 1) -> float:
    """Return the aggregation's normaliser over the whole DP batch (one all-reduce SUM)."""
    count = local_normalizer(mask, loss_agg, scale).reshape(1)
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
