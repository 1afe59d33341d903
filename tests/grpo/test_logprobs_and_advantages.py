"""Vocab-parallel log-probs/entropy at TP2 equal a full-vocabulary log_softmax (values and gradients);
group advantages against closed forms."""
import re

import pytest
import torch

from distributed import spawn
from megatron_ais.errors import NonFiniteInputError
from megatron_ais.grpo.advantages import group_advantages
from megatron_ais.forward import vocab_parallel_logprobs

VOCAB, PADDED = 300, 384  # 84 padded columns, all on the second TP rank


def _inputs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, PADDED, generator=g, dtype=torch.float64).float() * 3
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    return logits, labels


def _reference(logits, labels):
    full = logits[..., :VOCAB].double().requires_grad_(True)
    logp = torch.log_softmax(full, -1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return lp.detach(), ent.detach(), full.grad


def _worker():
    import torch.distributed as dist

    from megatron_ais.platform import apply_cpu_compat
    from megatron_ais.distributed import initialize_distributed

    apply_cpu_compat()
    initialize_distributed()
    rank, size = dist.get_rank(), dist.get_world_size()
    logits, labels = _inputs()
    local = logits.chunk(size, dim=-1)[rank].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(local, labels, dist.group.WORLD, VOCAB, with_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return lp.detach(), ent.detach(), local.grad


@pytest.mark.slow
def test_tp2_logprobs_entropy_and_gradients_match_full_softmax():
    logits, labels = _inputs()
    ref_lp, ref_ent, ref_grad = _reference(logits, labels)
    results = spawn(2, _worker)
    for lp, ent, _ in results:
        assert torch.allclose(lp.double(), ref_lp, atol=1e-5, rtol=0)
        assert torch.allclose(ent.double(), ref_ent, atol=1e-5, rtol=0)
    grad = torch.cat([g for _, _, g in results], dim=-1)
    assert torch.allclose(grad[..., :VOCAB].double(), ref_grad, atol=1e-6, rtol=0)
    assert torch.count_nonzero(grad[..., VOCAB:]) == 0, "padded vocabulary must get no gradient"


def test_single_rank_without_group():
    logits, labels = _inputs()
    lp, ent = vocab_parallel_logprobs(logits, labels, None, VOCAB, with_entropy=True)
    ref_lp, ref_ent, _ = _reference(logits, labels)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))
    centred = group_advantages(rewards, 4, normalize_std=False)
    assert torch.allclose(centred[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    loo = group_advantages(rewards, 4, normalize_std=False, estimator="rloo")
    assert torch.allclose(loo[:4], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_group_advantages_leave_excluded_responses_out(leave_one_out):
    """A response excluded from training (NaN rollout log-prob) leaves its group's statistics: the others get the
    advantages of the group without it (closed form), it gets 0; a group left with one member gets 0 (RLOO)."""
    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0, 3.0, 7.0, 7.0, 7.0])  # an excluded reward may be anything
    valid = torch.tensor([True, True, False, True, True, False, False, False])
    adv = group_advantages(rewards, 4, estimator="rloo" if leave_one_out else "grpo", valid=valid)
    kept = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    if leave_one_out:
        baseline = (kept.sum() - kept) / 2
    else:
        baseline = kept.mean()
    expected = (kept - baseline) / (kept.std(unbiased=False) + 1e-6)
    assert torch.allclose(adv[[0, 1, 3]], expected.float(), atol=1e-6)
    assert adv[2] == 0 and torch.equal(adv[4:], torch.zeros(4))
    counted = torch.where(valid, rewards, 5.0)  # the same rewards with the excluded ones counted
    assert not torch.allclose(group_advantages(counted, 4, estimator="rloo" if leave_one_out else "grpo")[[0, 1, 3]],
                              adv[[0, 1, 3]])
    with pytest.raises(NonFiniteInputError, match=re.escape("rewards are NaN/Inf for 1 valid responses (groups [0])")):
        group_advantages(rewards, 4, estimator="rloo" if leave_one_out else "grpo")
