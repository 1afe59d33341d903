"""The AIS variants against closed forms (docs/ais-method.md §2.8): the sign-aware bias test gives λ = 0 where the
mismatch is orthogonal to the advantage, λ → 1 where it leans with it and --ais-explore-lambda where it leans
against it; the k3 severity reads Gaussian mismatch like the mean |δ| and concentrated mismatch at its size. (DP2 =
one rank holding the batch: tests/ais/test_distributed.py.)"""
import math

import pytest
import torch

from megatron_ais.ais import AISConfig, ais_coefficient, mismatch_statistics
from megatron_ais.ais.diagnostics import bias_test
from megatron_ais.ais.statistics import STAT_NAMES


def _batch(advantages: torch.Tensor, delta: torch.Tensor, tokens: int = 12):
    """Sequences of `tokens` response tokens with these per-sequence advantages and per-token δ = log π − log μ."""
    rollout = -torch.rand(len(advantages), tokens, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.ones_like(rollout)
    return rollout + delta, rollout, advantages[:, None].expand_as(rollout).clone(), mask


def _lambda(batch, **flags):
    config = AISConfig(lambda_rule="bias-test", **flags)
    result = ais_coefficient(mismatch_statistics(*batch, config), config)
    return result.lam, result


def test_mismatch_orthogonal_to_the_advantage_gives_lambda_zero():
    """Pairs of sequences with the same token weights and opposite advantages: Σu = 0 exactly, whatever the weights."""
    g = torch.Generator().manual_seed(1)
    delta = 0.3 * torch.randn(16, 12, generator=g, dtype=torch.float64)
    advantages = torch.randn(16, generator=g, dtype=torch.float64)
    lam, result = _lambda(_batch(torch.cat([advantages, -advantages]), torch.cat([delta, delta])))
    assert abs(result.bias) < 1e-6 and lam == 0.0  # δ is computed in fp32: Σu is 0 up to its rounding


@pytest.mark.parametrize("c", [0.5, -0.5])
def test_weights_that_grow_with_the_advantage_give_lambda_one_and_against_it_the_explore_lambda(c):
    """w = exp(c·Â) on every token: u = Â · 12 · (min(e^(cÂ), C) − 1) has the sign of c for every sequence."""
    advantages = torch.linspace(-1.5, 1.5, 64, dtype=torch.float64)
    advantages = advantages[advantages != 0]
    batch = _batch(advantages, c * advantages[:, None].expand(-1, 12))
    lam, result = _lambda(batch, explore_lambda=0.3)
    u = advantages * 12 * ((c * advantages).exp().clamp(max=2.0) - 1)
    assert result.bias == pytest.approx(u.mean().item(), rel=1e-6)  # δ in fp32
    z = u.mean() / (u.std() / math.sqrt(len(u)))
    assert result.bias_z == pytest.approx(z.item(), rel=1e-6)
    if c > 0:
        assert lam == pytest.approx(1 - 1 / result.bias_z ** 2, rel=1e-12) and lam > 0.98  # z ≈ 8 at 62 sequences
    else:
        assert lam == 0.3


def test_bias_test_is_z_of_the_shares_and_zero_below_two_sequences():
    s = dict.fromkeys(STAT_NAMES, 0.0)
    s.update(n_sequences=4.0, sum_bias=2.0, sum_bias_sq=3.0)  # u = (a, b, c, d) with mean 0.5, Σu² = 3
    mean, z = bias_test(s)
    variance = (3.0 - 4 * 0.25) / 3
    assert mean == 0.5 and z == pytest.approx(0.5 / math.sqrt(variance / 4), rel=1e-15)
    assert bias_test({**s, "n_sequences": 1.0}) == (0.0, 0.0)


def test_k3_severity_reads_gaussian_mismatch_as_the_mean_and_concentrated_mismatch_at_its_size():
    g = torch.Generator().manual_seed(2)
    gaussian = _batch(torch.ones(64), 0.02 * torch.randn(64, 200, generator=g, dtype=torch.float64), tokens=200)
    mean_abs, k3 = (ais_coefficient(mismatch_statistics(*gaussian, config), config).severity
                    for config in (AISConfig(), AISConfig(severity="k3")))
    assert k3 == pytest.approx(mean_abs, rel=0.03)
    sparse = torch.zeros(64, 200, dtype=torch.float64)
    sparse[:, ::20] = 0.5 * torch.sign(torch.randn(64, 10, generator=g, dtype=torch.float64))  # 5 % of tokens
    concentrated = _batch(torch.ones(64), sparse, tokens=200)
    results = [ais_coefficient(mismatch_statistics(*concentrated, config), config)
               for config in (AISConfig(), AISConfig(severity="k3"))]
    d_mean = results[0].mean_abs_logratio
    d_k3 = 2 * math.sqrt(results[1].k3_kl / math.pi)
    assert d_mean == pytest.approx(0.025, rel=1e-6) and d_k3 > 3 * d_mean
    assert results[1].severity == pytest.approx(1 - math.exp(-d_k3 / 0.05), rel=1e-12)
    assert results[1].severity > 2 * results[0].severity
