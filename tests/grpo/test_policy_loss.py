"""The policy loss's terms against closed forms worked by hand: the PPO-clip term on ratios beyond 1 ± ε for both
advantage signs (value, clipped indicator, gradient), the k1 and k3 KL estimates, and each loss aggregation."""
import math

import pytest
import torch

from megatron_ais.grpo.loss import (PolicyLossConfig, aggregate, kl_penalty, local_normalizer, ppo_clip_term,
                                    token_losses)

# clip band [1 - 0.2, 1 + 0.28] (the defaults)
RATIOS = [0.5, 0.9, 1.0, 1.1, 1.5]
# (advantage, −min(r·A, clip(r)·A) per ratio, clipped per ratio), worked by hand
CASES = [
    (1.0, [-0.5, -0.9, -1.0, -1.1, -1.28], [0, 0, 0, 0, 1]),  # A > 0: only a ratio above 1.28 is cut back
    (-2.0, [1.6, 1.8, 2.0, 2.2, 3.0], [1, 0, 0, 0, 0]),  # A < 0: only a ratio below 0.8 is held at 0.8
]


@pytest.mark.parametrize("advantage,expected,clipped", CASES)
def test_ppo_clip_term_on_both_sides_of_the_band(advantage, expected, clipped):
    old = torch.full((1, len(RATIOS)), -1.3, dtype=torch.float64)
    logprobs = (old + torch.tensor([RATIOS], dtype=torch.float64).log()).requires_grad_(True)
    advantages = torch.full_like(old, advantage)
    loss, indicator = ppo_clip_term(logprobs, old, advantages, torch.ones_like(old), PolicyLossConfig())
    assert torch.allclose(loss, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=1e-12)
    assert indicator.tolist() == [clipped]
    loss.sum().backward()
    # d(−r·A)/d log π = −r·A where the ratio is used as is; a clipped token has no gradient
    grad = [0.0 if c else -r * advantage for r, c in zip(RATIOS, clipped)]
    assert torch.allclose(logprobs.grad, torch.tensor([grad], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("rho", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_kl_estimates_against_their_closed_forms(rho):
    """With ρ = π_ref / π: k1 = −log ρ and k3 = ρ − log ρ − 1 (never negative, 0 only at ρ = 1)."""
    logprobs = torch.tensor([[-1.7]], dtype=torch.float64)
    ref = logprobs + math.log(rho)
    k1, k3 = kl_penalty(logprobs, ref, "k1").item(), kl_penalty(logprobs, ref, "k3").item()
    assert k1 == pytest.approx(-math.log(rho), abs=1e-12)
    assert k3 == pytest.approx(rho - math.log(rho) - 1.0, abs=1e-12)
    assert k3 > 0.0 if rho != 1.0 else k3 == 0.0


def test_token_losses_add_the_configured_kl_and_entropy_terms():
    old = torch.log(torch.tensor([[0.5, 0.2]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.4]], dtype=torch.float64))  # ρ = 0.5 and 2
    entropy = torch.tensor([[0.3, 0.7]], dtype=torch.float64)
    coefficient = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    config = PolicyLossConfig(kl_coef=0.1, kl_type="k3", entropy_coef=0.01)
    loss, parts = token_losses(old, old, torch.tensor([[1.0, -1.0]], dtype=torch.float64), coefficient, config,
                               ref_logprobs=ref, entropy=entropy)
    k3 = [0.5 - math.log(0.5) - 1.0, 2.0 - math.log(2.0) - 1.0]
    expected = [0.5 * -1.0 + 0.1 * k3[0] - 0.01 * 0.3, 2.0 * 1.0 + 0.1 * k3[1] - 0.01 * 0.7]
    assert torch.allclose(loss, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(parts["kl"], torch.tensor([k3], dtype=torch.float64), rtol=0, atol=1e-12)


def test_each_aggregation_against_its_closed_form():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0], [100.0] * 4])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0] * 4])  # 5 tokens in 2 sequences
    assert local_normalizer(mask, "token-mean").item() == 5.0
    assert local_normalizer(mask, "seq-mean-token-sum").item() == 2.0
    assert local_normalizer(mask, "seq-mean-token-mean").item() == 2.0
    # the normaliser is the whole data-parallel batch's count (here as if other ranks held 5 tokens, 2 sequences)
    assert aggregate(per_token, mask, "token-mean", 10.0).item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 10)
    assert aggregate(per_token, mask, "seq-mean-token-sum", 4.0).item() == pytest.approx((6 + 9) / 4)
    assert aggregate(per_token, mask, "seq-mean-token-mean", 4.0).item() == pytest.approx((6 / 3 + 9 / 2) / 4)
    assert aggregate(per_token, mask * 0, "token-mean", 0.0).item() == 0.0  # nothing valid anywhere: a zero loss


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_placeholders_off_the_mask_change_neither_the_loss_nor_its_gradient(policy_loss, kl_type):
    """A row scored (old, reference) in a shorter micro-batch than the one it trains in holds 0 beyond its length,
    and its padding's own log-prob may be -95 there: e^(0 + 95) overflowed to inf in k3 (and in the ratio the other
    way round), and 0 · inf made the loss and the gradient NaN. Off the mask nothing may count: the same loss and
    gradient as with the policy's own log-probs there."""
    agg = "seq-mean-token-mean" if policy_loss == "gspo" else "token-mean"
    config = PolicyLossConfig(policy_loss=policy_loss, loss_agg=agg, kl_coef=0.01, kl_type=kl_type)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    advantages = torch.tensor([[0.5, 0.5, 0.5, 0.5]])

    def loss_and_grad(pad_logprob, old_pad, ref_pad):
        logprobs = torch.tensor([[-1.0, -2.0, pad_logprob, 0.0]], requires_grad=True)
        old = torch.tensor([[-1.1, -1.9, old_pad, -120.0]])
        ref = torch.tensor([[-0.9, -2.2, ref_pad, ref_pad]])
        per_token, _ = token_losses(logprobs, old, advantages, torch.ones_like(mask), config, ref, mask=mask)
        loss = aggregate(per_token, mask, agg, local_normalizer(mask, agg))
        loss.backward()
        return loss.detach(), logprobs.grad

    placeholder = loss_and_grad(-95.0, 0.0, 0.0)
    assert torch.isfinite(placeholder[0]) and torch.isfinite(placeholder[1]).all(), placeholder
    benign = loss_and_grad(-1.0, -1.0, -1.0)
    assert torch.equal(placeholder[0], benign[0]) and torch.equal(placeholder[1][:, :2], benign[1][:, :2])
    assert torch.equal(placeholder[1][:, 2:], torch.zeros(1, 2))
