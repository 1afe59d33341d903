"""The GRPO options of DAPO-style recipes, each against a closed form or a peer's published function ported here as
reference code (its source named): GSPO's loss and gradient (verl), TBPO's clips (closed form), Dr. GRPO's constant
normaliser, DAPO's soft overlong penalty (verl's DAPO reward manager) and overlong masking; the registries refuse a name twice; the defaults
compute what they did before the options existed, bit for bit."""
import math

import pytest
import torch

from dapo_reference import dapo_overlong_reward

from megatron_ais.batch import RolloutBatch
from megatron_ais.grpo.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, group_advantages, with_advantages
from megatron_ais.grpo.loss import (POLICY_LOSSES, PolicyLossConfig, aggregate, global_normalizer, gspo_term,
                                   token_losses)
from megatron_ais.registry import register
from megatron_ais.rollout.overlong import OverlongConfig, shape_overlong, soft_overlong_penalty


def verl_compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low,
                                  clip_ratio_high):
    """Reference: verl, verl/trainer/ppo/core_algos.py, compute_policy_loss_gspo (policy_loss.loss_mode=gspo) with
    its aggregation agg_loss(..., "seq-mean-token-mean"); ported without the metrics and without its clamp of the
    log-ratio at 10 (not reached here)."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    # agg_loss, seq-mean-token-mean
    seq_mask = torch.sum(response_mask, dim=-1)
    seq_losses = torch.sum(pg_losses * response_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    return (seq_losses * seq_mask).sum() / seq_mask.sum().clamp(min=1.0)


def _policy_inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 7, generator=generator, dtype=torch.float64) * 2
    # some sequences drift far enough that their sequence ratio leaves [1 - 0.2, 1 + 0.28]
    drift = torch.tensor([[0.02], [0.5], [-0.6], [0.1]], dtype=torch.float64)
    new = old + drift + 0.05 * torch.randn(4, 7, generator=generator, dtype=torch.float64)
    mask = torch.ones(4, 7, dtype=torch.float64)
    mask[0, 5:] = 0
    mask[2, 2:] = 0
    mask[3, 0] = 0
    advantages = torch.tensor([[1.0], [1.5], [-0.7], [-0.3]], dtype=torch.float64).expand(4, 7) * mask
    return new, old, advantages, mask


def test_gspo_loss_and_gradient_match_verl():
    new, old, advantages, mask = _policy_inputs()
    config = PolicyLossConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean")
    ours_lp = new.clone().requires_grad_(True)
    term, clipped = gspo_term(ours_lp, old, advantages, mask, config)
    ours = aggregate(term, mask, config.loss_agg, global_normalizer(mask, config.loss_agg, None))
    ours.backward()
    verl_lp = new.clone().requires_grad_(True)
    reference = verl_compute_policy_loss_gspo(old, verl_lp, advantages, mask, config.clip_low, config.clip_high)
    reference.backward()
    # verl divides each sequence's sum by (tokens + 1e-8): a relative difference of about 1e-9 at most
    assert ours.item() == pytest.approx(reference.item(), rel=1e-8)
    assert torch.allclose(ours_lp.grad, verl_lp.grad, rtol=1e-8, atol=1e-14)
    # the clip is per sequence: a sequence is clipped on all of its tokens or on none
    assert ((clipped * mask).sum(dim=-1) % mask.sum(dim=-1)).eq(0).all() and clipped[1:3].sum() > 0
    # and it is not PPO's: the token ratios differ within each sequence
    ppo, _ = POLICY_LOSSES["ppo"](new, old, advantages, mask, config)
    assert not torch.allclose(ppo * mask, term.detach() * mask)


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_score():
    """Closed form of GSPO's gradient of one unclipped sequence: −A · s · (1/|y|) Σ_t ∇log π_t, with
    s = exp(mean_t(log π_t − log π_old,t)); w.r.t. log π_t that is −A · s / |y| on each token."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    new = (old + torch.tensor([[0.05, -0.02, 0.03]], dtype=torch.float64)).requires_grad_(True)
    mask, advantage = torch.ones_like(old), 0.8
    config = PolicyLossConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean")
    term, clipped = gspo_term(new, old, torch.full_like(old, advantage), mask, config)
    aggregate(term, mask, config.loss_agg, 1.0).backward()
    s = torch.exp((new.detach() - old).mean())
    assert clipped.sum() == 0
    assert torch.allclose(new.grad, torch.full_like(old, -advantage * s.item() / 3), rtol=1e-12)


@pytest.mark.parametrize("advantage,drift,moves,value", [
    (0.8, 1e-4, True, None),  # A > 0 inside GSPO's clip: GSPO's gradient
    (0.8, 2e-3, False, 1 + 4e-4),  # A > 0 above 1 + clip_high: clipped, no gradient
    (0.8, -2e-3, True, None),  # A > 0 below 1 - clip_low: PPO's min keeps s·A, the gradient flows
    (-0.8, 5e-4, True, None),  # A < 0 inside the trust band (above positive's 1 + clip_high: the band is its own)
    (-0.8, 2e-3, False, 1 + 7e-4),  # A < 0 above the band: dual clip, no gradient (GSPO's would flow, unbounded)
    (-0.8, -2e-3, False, 1 - 3e-4),  # A < 0 below the band: no gradient
])
def test_tbpo_clips_positive_sequences_like_gspo_and_holds_negative_ones_in_the_trust_band(advantage, drift, moves,
                                                                                          value):
    """Closed form of TBPO (docs/ais-method.md §5.2) on one sequence of three tokens whose log-probs all moved by
    `drift` (s = e^drift): the term is −A·s with gradient −A·s/3 per token where it moves, else −A·bound with none."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    new = (old + drift).requires_grad_(True)
    mask = torch.ones_like(old)
    config = PolicyLossConfig(policy_loss="tbpo", loss_agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4)
    term, clipped = POLICY_LOSSES["tbpo"](new, old, torch.full_like(old, advantage), mask, config)
    aggregate(term, mask, config.loss_agg, 1.0).backward()
    s = math.exp(drift)
    if moves:
        assert clipped.sum() == 0
        assert torch.allclose(term.detach(), torch.full_like(old, -advantage * s), rtol=1e-12)
        assert torch.allclose(new.grad, torch.full_like(old, -advantage * s / 3), rtol=1e-10)
    else:
        assert clipped.eq(1).all() and new.grad.abs().max() == 0
        assert torch.allclose(term.detach(), torch.full_like(old, -advantage * value), rtol=1e-12)
    gspo = new.detach().clone().requires_grad_(True)
    gspo_value, _ = gspo_term(gspo, old, torch.full_like(old, advantage), mask, config)
    aggregate(gspo_value, mask, config.loss_agg, 1.0).backward()
    # only where a negative sequence's ratio rises past the band does GSPO's gradient flow and TBPO's not
    differs = advantage < 0 and drift > 7e-4
    assert differs != torch.allclose(gspo.grad, new.grad, rtol=1e-12, atol=0), (gspo.grad, new.grad)


def test_dr_grpo_normaliser_is_sequences_times_the_longest_response():
    generator = torch.Generator().manual_seed(1)
    per_token = torch.randn(5, 9, generator=generator, dtype=torch.float64)
    mask = (torch.rand(5, 9, generator=generator) > 0.3).double()
    mask[4] = 0  # a sequence with no token in the loss is not counted (as in the other sequence means)
    config = PolicyLossConfig(loss_agg="seq-mean-token-sum-norm", max_response_tokens=16)
    normalizer = global_normalizer(mask, config.loss_agg, None, config.normalizer_scale)
    assert normalizer == 4 * 16
    loss = aggregate(per_token, mask, config.loss_agg, normalizer)
    closed_form = sum((per_token[i] * mask[i]).sum() / 16 for i in range(4)) / 4
    assert loss.item() == pytest.approx(closed_form.item(), rel=1e-12)
    # the other aggregations do not scale their units
    assert PolicyLossConfig(loss_agg="seq-mean-token-sum", max_response_tokens=16).normalizer_scale == 1


def test_soft_overlong_penalty_matches_dapo():
    lengths = torch.arange(0, 33)
    penalty = soft_overlong_penalty(lengths, max_new_tokens=32, buffer_tokens=8, penalty=0.7)
    expected = [dapo_overlong_reward(int(n), 32, 8, 0.7) for n in lengths]
    assert penalty.tolist() == pytest.approx(expected, abs=1e-12)
    assert penalty[24] == 0 and penalty[32] == pytest.approx(-0.7)


def _rollout_batch(rewards, lengths, seq_length=12):
    rows = len(rewards)
    mask = torch.zeros(rows, seq_length)
    for row, n in enumerate(lengths):
        mask[row, 2:2 + n] = 1.0
    tokens = torch.arange(rows * seq_length).view(rows, seq_length) % 50
    return RolloutBatch(tokens=tokens, labels=tokens.roll(-1, 1), mask=mask, rollout_logprobs=-0.5 * mask,
                        rewards=torch.tensor(rewards), group_size=2)


def test_overlong_modes_shape_rewards_or_masks():
    lengths, cut = [3, 8, 8, 5], [False, True, False, False]  # an 8-token response that stopped at EOS is not cut
    batch = _rollout_batch([1.0, 0.0, 1.0, 1.0], lengths)
    kept = shape_overlong(batch, lengths, cut, OverlongConfig(), 8)
    assert torch.equal(kept.mask, batch.mask) and torch.equal(kept.rewards, batch.rewards) and kept.truncated == 1
    masked = shape_overlong(batch, lengths, cut, OverlongConfig(mode="mask"), 8)
    assert masked.mask[1].sum() == 0 and torch.equal(masked.mask[[0, 2, 3]], batch.mask[[0, 2, 3]])
    assert torch.equal(masked.rewards, batch.rewards)
    penalised = shape_overlong(batch, lengths, cut, OverlongConfig(mode="soft-penalty", buffer_tokens=4,
                                                                    penalty=1.0), 8)
    assert penalised.rewards.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.75])
    # a masked response still counts in its group's advantages (its reward was observed)
    advantages = with_advantages(masked, AdvantageConfig()).advantages
    assert advantages[0] > 0 > advantages[1]


@pytest.mark.parametrize("registry,name", [(POLICY_LOSSES, "gspo"), (ADVANTAGE_ESTIMATORS, "rloo")])
def test_registries_refuse_a_second_registration(registry, name):
    with pytest.raises(ValueError, match="refusing a second registration"):
        register(registry, name)(lambda *args: None)
    assert {"ppo", "gspo"} <= set(POLICY_LOSSES) and {"grpo", "rloo"} <= set(ADVANTAGE_ESTIMATORS)


def _token_losses_before_the_options(logprobs, old, advantages, coefficient, config):
    """The default per-token loss as grpo/loss.py computed it before --policy-loss existed (PPO-clip × c)."""
    ratio = (logprobs - old).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    return coefficient.detach() * torch.maximum(unclipped, clipped)


def _advantages_before_the_registry(rewards, group_size, normalize_std, leave_one_out, eps=1e-6):
    """group_advantages as it was before its baselines were registered (all members valid)."""
    r = rewards.double().view(-1, group_size)
    count = torch.full((r.shape[0], 1), float(group_size), dtype=torch.float64)
    total = r.sum(dim=1, keepdim=True)
    mean = total / count
    baseline = torch.where(count > 1, (total - r) / (count - 1), r) if leave_one_out else mean
    adv = r - baseline
    if normalize_std:
        adv = adv / (((r - mean) ** 2).sum(dim=1, keepdim=True).div(count).sqrt() + eps)
    return adv.flatten().float()


def test_defaults_compute_what_they_did_before_bit_for_bit():
    new, old, advantages, mask = _policy_inputs(seed=3)
    new, old, advantages = new.float(), old.float(), advantages.float()
    coefficient = torch.rand(new.shape, generator=torch.Generator().manual_seed(4))
    config = PolicyLossConfig()
    loss, _ = token_losses(new, old, advantages, coefficient, config)
    assert torch.equal(loss, _token_losses_before_the_options(new, old, advantages, coefficient, config))
    assert global_normalizer(mask, "token-mean", None, config.normalizer_scale) == mask.sum().item()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.9, 0.1, 0.0, 0.0, 0.0, 1.0])
    for normalize_std in (True, False):
        for leave_one_out in (False, True):
            assert torch.equal(group_advantages(rewards, 4, normalize_std, "rloo" if leave_one_out else "grpo"),
                               _advantages_before_the_registry(rewards, 4, normalize_std, leave_one_out))
