"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the full vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary; three all-reduces over the TP group (max,
Σexp, target logit; plus Σp·logit for the entropy) give exact full-vocabulary values. Padded vocabulary
columns are excluded from the softmax, so log-probs are those of the real vocabulary.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum over TP ranks; forward all-reduce, backward identity (every TP rank computes the same loss)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(tensor, group)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, group, vocab_size: int,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (log p(label) [..], entropy [..] or None) for local logits [.., V_local] of TP rank's vocab slice.

    Computed in fp32; differentiable in `logits`.
    """
    tp_rank = dist.get_rank(group) if group is not None else 0
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    x = logits.float()
    real = torch.arange(start, start + local_vocab, device=x.device) < vocab_size
    # padded columns are excluded by multiplying their exp by 0; keeping them finite keeps every gradient finite
    max_logit = x.detach().masked_fill(~real, float("-inf")).max(dim=-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
    shifted = x - max_logit.unsqueeze(-1)
    exp = shifted.exp() * real
    sum_exp = _tp_sum(exp.sum(dim=-1), group)
    log_z = sum_exp.log()
    in_slice = (labels >= start) & (labels < start + local_vocab)
    local_label = (labels - start).clamp(0, local_vocab - 1)
    target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1)
    target = _tp_sum(torch.where(in_slice, target, torch.zeros_like(target)), group)
    logprobs = target - log_z
    if not with_entropy:
        return logprobs, None
    # H = log Z - Σ e^s·s / Z: each summed partial must depend on local logits only, because the all-reduce's
    # backward is the identity (Σ p·s summed per rank would miss p's dependence on other ranks through Z)
    entropy = log_z - _tp_sum((exp * shifted).sum(dim=-1), group) / sum_exp
    return logprobs, entropy
