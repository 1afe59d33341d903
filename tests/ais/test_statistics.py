"""AIS statistics, λ, correction weights and baselines against closed forms and hand-computed examples."""
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ais.ais import (AISConfig, AISState, ais_coefficient, apply_correction, correction_weights,
                              exclude_invalid_sequences, mismatch_statistics)
from megatron_ais.ais.coefficient import lambda_of_tokens, lambda_per_token, results_per_lag, statistics_per_lag
from megatron_ais.ais.statistics import INDEX
from megatron_ais.grpo.loss import PolicyLossConfig, aggregate, token_losses


def _batch(seed=0, b=4, s=6, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(b, s, generator=g) * 3
    rollout = trainer + scale * torch.randn(b, s, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, s).clone()
    mask = (torch.rand(b, s, generator=g) > 0.2).float()
    return trainer, rollout, adv, mask


def reference_lambda(trainer, rollout, adv, mask, c=2.0, tau=0.05, reliability="band_ess",
                     variance="advantage_weighted", exponents=(1.0, 1.0, 1.0), low=0.0, high=1.0):
    """λ of docs/ais-method.md §2.4 computed token by token in plain python (independent of the module), with the
    ablations' diagnostics: reliability raw_ess (ESS of the raw weights) or none (1), variance cv (1 + CV² of the
    truncated weights, at least 1) or none (1), exponents (a_s, a_r, a_v) and the clip [low, high]."""
    d = [max(min(float(t - r), 20.0), -20.0) for t, r, m in zip(trainer.flatten(), rollout.flatten(), mask.flatten()) if m > 0]
    a = [float(x) for x, m in zip(adv.flatten(), mask.flatten()) if m > 0]
    n = len(d)
    w = [math.exp(x) for x in d]
    band = [min(max(x, 1 / c), c) for x in w]
    truncated = [min(x, c) for x in w]
    rho = {"band_ess": sum(band) ** 2 / (n * sum(x * x for x in band)),
           "raw_ess": sum(w) ** 2 / (n * sum(x * x for x in w)), "none": 1.0}[reliability]
    s_d = 1 - math.exp(-(sum(abs(x) for x in d) / n) / tau)
    qa = sum(x * x for x in a)
    qw = sum(x ** 2 * y * y for x, y in zip(truncated, a))
    gamma = {"advantage_weighted": max(1.0, qw / qa) if qa > 0 else 1.0,
             "cv": max(1.0, n * sum(x * x for x in truncated) / sum(truncated) ** 2), "none": 1.0}[variance]
    a_s, a_r, a_v = exponents
    return min(max(s_d ** a_s * rho ** a_r / gamma ** a_v, low), high)


def test_lambda_matches_closed_form():
    trainer, rollout, adv, mask = _batch()
    cfg = AISConfig()
    result = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, cfg), cfg)
    assert result.lam == pytest.approx(reference_lambda(trainer, rollout, adv, mask), rel=1e-12)
    assert 0 < result.lam < 1


@pytest.mark.parametrize("reliability,variance,exponents,low,high", [
    ("raw_ess", "cv", (1.0, 1.0, 1.0), 0.0, 1.0),
    ("none", "none", (1.0, 1.0, 1.0), 0.0, 1.0),
    ("band_ess", "cv", (0.5, 2.0, 0.0), 0.0, 1.0),
    ("raw_ess", "advantage_weighted", (1.0, 0.0, 3.0), 0.3, 0.9),
    ("band_ess", "advantage_weighted", (2.0, 1.0, 1.0), 0.5, 1.0),
])
def test_lambda_of_the_ablations_matches_closed_form(reliability, variance, exponents, low, high):
    trainer, rollout, adv, mask = _batch(scale=0.3)  # heavy enough that raw and band ESS differ, Γ > 1
    cfg = AISConfig(reliability=reliability, variance=variance, exponents=exponents, lambda_min=low, lambda_max=high)
    result = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, cfg), cfg)
    expected = reference_lambda(trainer, rollout, adv, mask, reliability=reliability, variance=variance,
                                exponents=exponents, low=low, high=high)
    assert result.lam == pytest.approx(expected, rel=1e-12)
    default = reference_lambda(trainer, rollout, adv, mask)
    assert expected != pytest.approx(default, rel=1e-3)  # each ablation changes λ on this batch


def test_ema_lambda_is_beta_times_the_previous_plus_the_rest_times_the_new():
    cfg = AISConfig(ema=0.75)
    state, lambdas, expected = AISState(), [], None
    for seed, scale in ((0, 0.05), (1, 0.3), (2, 0.1)):
        trainer, rollout, adv, mask = _batch(seed=seed, scale=scale)
        new = reference_lambda(trainer, rollout, adv, mask)
        expected = new if expected is None else 0.75 * expected + 0.25 * new
        result = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, cfg), cfg, state)
        assert result.lam == pytest.approx(expected, rel=1e-12) and result.lam_raw == pytest.approx(new, rel=1e-12)
        lambdas.append(result.lam)
    assert len(set(lambdas)) == 3 and state.lam_ema == lambdas[-1]


def test_zero_mismatch_gives_lambda_zero_and_uncorrected_loss():
    trainer, _, adv, mask = _batch()
    cfg = AISConfig()
    result = ais_coefficient(mismatch_statistics(trainer, trainer, adv, mask, cfg), cfg)
    assert (result.lam, result.reliability, result.variance_amplification, result.mean_abs_logratio) == (0, 1, 1, 0)
    coef = apply_correction(trainer, trainer, mask, cfg, result).coefficient
    new_lp = trainer + 0.05
    loss_cfg = PolicyLossConfig()
    ais_loss = aggregate(token_losses(new_lp, trainer, adv, coef, loss_cfg)[0], mask, "token-mean", 10.0)
    plain = aggregate(token_losses(new_lp, trainer, adv, torch.ones_like(coef), loss_cfg)[0], mask, "token-mean", 10.0)
    assert torch.equal(ais_loss, plain)


def test_zero_advantages_give_no_nan():
    trainer, rollout, _, mask = _batch()
    cfg = AISConfig()
    result = ais_coefficient(mismatch_statistics(trainer, rollout, torch.zeros_like(trainer), mask, cfg), cfg)
    assert result.variance_amplification == 1.0 and math.isfinite(result.lam)
    empty = ais_coefficient(mismatch_statistics(trainer, rollout, torch.zeros_like(trainer), mask * 0, cfg), cfg)
    assert empty.lam == 0.0


def test_masked_positions_never_matter_even_when_nan():
    trainer, rollout, adv, mask = _batch()
    cfg = AISConfig()
    garbage = rollout.clone()
    garbage[mask == 0] = float("nan")
    assert torch.equal(mismatch_statistics(trainer, rollout, adv, mask, cfg),
                       mismatch_statistics(trainer, garbage, adv, mask, cfg))


def test_ais_gradient_interpolates_uncorrected_and_tis():
    trainer, rollout, adv, mask = _batch(scale=0.3)
    cfg = AISConfig()
    result = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, cfg), cfg)
    lam = result.lam
    loss_cfg = PolicyLossConfig()

    def grad(coef):
        lp = (trainer + 0.1 * torch.randn(trainer.shape, generator=torch.Generator().manual_seed(1))).double()
        lp.requires_grad_(True)
        loss = aggregate(token_losses(lp, trainer.double(), adv.double(), coef.double(), loss_cfg)[0], mask,
                         "token-mean", float(mask.sum()))
        loss.backward()
        return lp.grad

    g_ais = grad(correction_weights(trainer, rollout, result, cfg))
    g_none = grad(torch.ones_like(trainer))
    g_tis = grad(apply_correction(trainer, rollout, mask, AISConfig(correction="tis"), result).coefficient)
    # exact up to the fp32 rounding of the coefficients
    assert torch.allclose(g_ais, (1 - lam) * g_none + lam * g_tis, atol=1e-9, rtol=1e-6)
    assert not torch.allclose(g_ais, g_none, atol=1e-4)


def test_baselines_on_a_hand_computed_example():
    trainer = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.9]]))  # w = 1, 5, 1.25, 0.5556
    mask = torch.ones(1, 4)
    result = ais_coefficient(torch.zeros(12, dtype=torch.float64), AISConfig())
    w = torch.tensor([[1.0, 5.0, 1.25, 0.5 / 0.9]])

    def run(**kw):
        out = apply_correction(trainer, rollout, mask, AISConfig(**kw), result)
        return out.coefficient, out.keep

    coef, keep = run(correction="tis")
    assert torch.allclose(coef, torch.tensor([[1.0, 2.0, 1.25, 0.5 / 0.9]])) and torch.equal(keep, mask)
    coef, keep = run(correction="mis")  # band [0.5, 2]: token 2 rejected from loss and normaliser
    assert torch.equal(keep, torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    assert torch.allclose(coef, w * keep)
    coef, keep = run(correction="icepop", icepop_low=0.6, icepop_high=4.0)  # 5 and 0.556 out of band, kept in Z
    assert torch.allclose(coef, torch.tensor([[1.0, 0.0, 1.25, 0.0]])) and torch.equal(keep, mask)
    coef, _ = run(correction="tis", level="sequence")  # product 3.47 -> capped at 2 for every token
    assert torch.allclose(coef, torch.full((1, 4), 2.0))
    coef, _ = run(correction="tis", level="geometric")  # geometric mean of w
    assert torch.allclose(coef, torch.full((1, 4), float(w.log().mean().exp())))
    coef, _ = run(correction="none")
    assert torch.equal(coef, torch.ones(1, 4))


def test_sequence_level_statistics_count_sequences():
    trainer, rollout, adv, mask = _batch()
    cfg = AISConfig(level="sequence")
    stats = mismatch_statistics(trainer, rollout, adv, mask, cfg)
    assert stats[INDEX["n"]].item() == float((mask.sum(-1) > 0).sum())
    # severity: Σ over sequences of |mean δ| (§2.6), not |Σδ|, which would grow with the response length
    expected = (((trainer - rollout) * mask).sum(-1) / mask.sum(-1).clamp(min=1)).abs().sum().item()
    assert stats[INDEX["sum_abs_logratio"]].item() == pytest.approx(expected, rel=1e-6)
    # while the weights stay the sequence's product: Σw = Σ exp(Σδ)
    expected_w = (((trainer - rollout) * mask).sum(-1).double().exp() * (mask.sum(-1) > 0)).sum().item()
    assert stats[INDEX["sum_weight"]].item() == pytest.approx(expected_w, rel=1e-6)


def test_k3_at_sequence_level_reads_the_mean_log_ratio_like_the_severity():
    """k3 (logged, and `--ais-severity k3`) of a sequence-level weight is that of the sequence's mean δ: the product's
    Σδ grows with the response length and read every long response as maximal mismatch."""
    c, length = 0.05, 400
    trainer, mask = torch.full((3, length), -1.0), torch.ones(3, length)
    rollout, adv = trainer - c, torch.randn(3, 1).expand(3, length).clone()
    per_token = math.exp(c) - 1.0 - c
    for level in ("sequence", "geometric"):
        stats = mismatch_statistics(trainer, rollout, adv, mask, AISConfig(level=level))
        assert stats[INDEX["sum_k3"]].item() == pytest.approx(3 * per_token, rel=1e-4), level
    config = AISConfig(level="sequence", severity="k3")
    result = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, config), config, AISState())
    assert result.severity == pytest.approx(1.0 - math.exp(-2.0 * math.sqrt(per_token / math.pi) / config.tau),
                                            rel=1e-3)


def test_anchored_severity_and_ema_state_round_trip():
    """s_D = clip((D − D0) / (κ D0), 0, 1) with D0 the mean D of the first --ais-anchor-steps batches: two anchor
    batches of different D, κ = 2, and later batches whose severity lies strictly inside (0, 1)."""
    trainer, rollout, adv, mask = _batch(scale=0.05)
    cfg = AISConfig(severity="anchored", anchor_steps=2, anchor_kappa=2.0, ema=0.5)

    def scaled(k):
        """The batch with its log-ratios k times the base ones, and their mean |δ| (D) in plain python."""
        shifted = trainer + k * (rollout - trainer)
        d = [abs(float(t - r)) for t, r, m in zip(trainer.flatten(), shifted.flatten(), mask.flatten()) if m > 0]
        return mismatch_statistics(trainer, shifted, adv, mask, cfg), sum(d) / len(d)

    (first, d1), (second, d2), (later, d3) = scaled(1.0), scaled(2.0), scaled(4.0)
    d0 = (d1 + d2) / 2  # the mean over both anchor batches, neither one alone
    state = AISState()
    assert ais_coefficient(first, cfg, state).severity == 0.0  # D0 = D1 so far
    assert ais_coefficient(second, cfg, state).severity == pytest.approx((d2 - d0) / (2 * d0), rel=1e-5)
    assert state.anchor_count == 2 and state.anchor_mean() == pytest.approx(d0, rel=1e-5)
    saved = state.state_dict()
    result = ais_coefficient(later, cfg, state)
    expected = (d3 - d0) / (2 * d0)  # (4 − 1.5) / (2 · 1.5) = 5/6 with D1 = 1: inside (0, 1), not clipped
    assert 0.5 < expected < 0.9 and result.severity == pytest.approx(expected, rel=1e-5)
    # the anchor stays fixed after its batches: a batch with D1 again scores below D0 (clipped to 0)
    assert ais_coefficient(first, cfg, state).severity == 0.0 and state.anchor_mean() == pytest.approx(d0, rel=1e-5)
    restored = AISState()
    restored.load_state_dict(saved)
    assert ais_coefficient(later, cfg, restored) == result


def test_nan_rollout_sequences_are_excluded_and_counted():
    _, rollout, _, mask = _batch()
    mask = torch.ones_like(mask)
    rollout[1, 2] = float("nan")
    rollout[3, 0] = float("-inf")
    cleaned, excluded = exclude_invalid_sequences(rollout, mask)
    assert excluded == 2 and cleaned[1].sum() == 0 and cleaned[3].sum() == 0 and cleaned[0].sum() == mask.shape[1]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), cut=st.integers(1, 7), level=st.sampled_from(["token", "sequence", "geometric"]))
def test_statistics_are_invariant_to_permutation_and_splitting(seed, cut, level):
    trainer, rollout, adv, mask = _batch(seed=seed, b=8, s=5, scale=0.3)
    cfg = AISConfig(level=level)
    whole = mismatch_statistics(trainer, rollout, adv, mask, cfg)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
    permuted = mismatch_statistics(trainer[perm], rollout[perm], adv[perm], mask[perm], cfg)
    split = mismatch_statistics(trainer[:cut], rollout[:cut], adv[:cut], mask[:cut], cfg) + \
        mismatch_statistics(trainer[cut:], rollout[cut:], adv[cut:], mask[cut:], cfg)
    assert torch.allclose(whole, permuted, rtol=1e-12, atol=1e-12)
    assert torch.allclose(whole, split, rtol=1e-12, atol=1e-12)


def test_chi_square_is_self_normalised_and_never_negative():
    """χ² = N·Σw²/(Σw)² − 1 from the raw weights, against plain python; weights that all shrink (mean w² < 1, where
    Σw²/N − 1 goes negative) give exactly 0, not a negative divergence."""
    trainer, rollout, adv, mask = _batch(seed=3, scale=0.3)
    w = [math.exp(float(t - r)) for t, r, m in zip(trainer.flatten(), rollout.flatten(), mask.flatten()) if m > 0]
    result = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, AISConfig()), AISConfig())
    assert result.chi2 == pytest.approx(len(w) * sum(x * x for x in w) / sum(w) ** 2 - 1, rel=1e-9)
    assert result.chi2 == pytest.approx(1 / result.ess_ratio_raw - 1, rel=1e-9)
    uniform = ais_coefficient(mismatch_statistics(rollout + math.log(0.9), rollout, adv, mask, AISConfig()),
                              AISConfig())
    assert uniform.chi2 == 0.0  # every w = 0.9: Σw²/N − 1 = −0.19


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which,name", [(1, "rollout log-probs"), (0, "trainer log-probs"), (2, "advantages")])
def test_every_entry_point_refuses_non_finite_inputs_on_valid_tokens(bad, which, name):
    from megatron_ais.ais import AISResult, max_abs_logratio
    from megatron_ais.errors import NonFiniteInputError

    inputs = list(_batch())
    inputs[3] = torch.ones_like(inputs[3])
    inputs[which][1, 2] = bad
    trainer, rollout, adv, mask = inputs
    cfg = AISConfig()
    with pytest.raises(NonFiniteInputError, match=f"{name} are NaN/Inf on 1 valid tokens \\(sequences \\[1\\]\\)"):
        mismatch_statistics(trainer, rollout, adv, mask, cfg)
    if which == 2:
        return
    result = AISResult(lam=0.5, lam_raw=0.5, reliability=1, severity=1, variance_amplification=1, mean_abs_logratio=0,
                       ess_ratio_raw=1, cv2_applied=0, chi2=0, k3_kl=0, truncated_fraction=0, num_units=1)
    for call in (lambda: correction_weights(trainer, rollout, result, cfg, mask),
                 lambda: apply_correction(trainer, rollout, mask, AISConfig(correction="tis"), result),
                 lambda: max_abs_logratio(trainer, rollout, mask, cfg)):
        with pytest.raises(NonFiniteInputError, match=name):
            call()


def test_lambda_is_refused_from_non_finite_statistics_naming_the_statistic():
    from megatron_ais.errors import NonFiniteInputError

    stats = mismatch_statistics(*_batch(), AISConfig())
    stats[INDEX["sum_weight_sq"]] = float("inf")
    with pytest.raises(NonFiniteInputError, match="mismatch statistic sum_weight_sq is inf"):
        ais_coefficient(stats, AISConfig())
    stats[INDEX["sum_weight_sq"]] = float("nan")
    with pytest.raises(NonFiniteInputError, match="mismatch statistic sum_weight_sq is nan"):
        ais_coefficient(stats, AISConfig())


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_sequence_ess_is_logged_at_every_level_from_whole_sequence_weights(level):
    trainer, rollout, adv, mask = _batch(b=6, s=10, scale=0.2)
    mask[2] = 0  # a sequence without a valid token is not a sequence here
    result = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, AISConfig(level=level)),
                             AISConfig(level=level))
    weights = [math.exp(sum(float(t - r) for t, r, m in zip(trainer[i], rollout[i], mask[i]) if m > 0))
               for i in range(6) if mask[i].sum() > 0]
    expected = sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))
    assert result.sequence_ess == pytest.approx(expected, rel=1e-6)  # δ in fp32
    assert result.metrics()["ais/sequence_ess"] == result.sequence_ess and expected < 0.99


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_per_lag_diagnostics_are_those_of_each_lags_rows_alone(level):
    """Rows sampled one and two policy versions back next to rows of the current one: each lag's diagnostics equal
    those the rows of that lag give on their own (k3 = E[w - 1 - log w], the ESS ratio and χ² by hand); a lag with
    no tokens is not logged."""
    from megatron_ais.ais import metrics_per_lag

    trainer, rollout, adv, mask = _batch(seed=3, b=6, s=5, scale=0.3)
    lags = torch.tensor([0, 1, 0, 2, 1, 0]).unsqueeze(-1).expand(6, 5)
    config = AISConfig(level=level)
    metrics = metrics_per_lag(trainer, rollout, adv, mask, lags, 3, config)
    assert not any(name.startswith("ais/lag3/") for name in metrics)
    for lag in range(3):
        rows = (lags[:, 0] == lag).nonzero().flatten()
        alone = ais_coefficient(mismatch_statistics(trainer[rows], rollout[rows], adv[rows], mask[rows], config),
                                config)
        assert metrics[f"ais/lag{lag}/k3_kl"] == pytest.approx(alone.k3_kl, rel=1e-12)
        assert metrics[f"ais/lag{lag}/ess_ratio_raw"] == pytest.approx(alone.ess_ratio_raw, rel=1e-12)
        assert metrics[f"ais/lag{lag}/num_units"] == alone.num_units
        if level == "token":  # by hand, from the rows' own tokens
            valid = mask[rows] > 0
            delta = (trainer[rows] - rollout[rows])[valid].double()
            w = delta.exp()
            assert metrics[f"ais/lag{lag}/k3_kl"] == pytest.approx(float((w - 1 - delta).mean()), rel=1e-9)
            assert metrics[f"ais/lag{lag}/chi2"] == pytest.approx(
                float(len(w) * (w * w).sum() / w.sum() ** 2 - 1), rel=1e-9)
            assert metrics[f"ais/lag{lag}/max_abs_logratio"] == pytest.approx(float(delta.abs().max()), rel=1e-6)


def test_lambda_per_lag_is_each_lags_own_lambda_on_its_tokens():
    """--ais-lambda-per-lag: rows one policy version stale (a larger mismatch) beside current ones; each lag's λ is
    the closed-form λ of its rows alone, and each token's coefficient is (1 − λ_k) + λ_k · min(w, C) with its lag's
    λ_k (by hand). With one lag in the batch, that lag's λ is the batch's λ."""
    trainer, rollout, adv, mask = _batch(seed=5, b=6, s=7, scale=0.05)
    stale = torch.tensor([False, True, False, True, True, False])
    rollout = torch.where(stale[:, None], rollout + 0.4 * torch.randn(6, 7, generator=torch.Generator().manual_seed(9)),
                          rollout)
    lags = stale.long()[:, None].expand(6, 7)
    config, state = AISConfig(lambda_per_lag=True), AISState()
    per_lag = statistics_per_lag(trainer, rollout, adv, mask, lags, 2, config)
    assert sorted(per_lag) == [0, 1]
    results = {lag: ais_coefficient(stats, config, state.of_lag(lag)) for lag, (stats, _) in per_lag.items()}
    expected = {lag: reference_lambda(trainer[stale == bool(lag)], rollout[stale == bool(lag)],
                                      adv[stale == bool(lag)], mask[stale == bool(lag)]) for lag in (0, 1)}
    for lag in (0, 1):
        assert results[lag].lam == pytest.approx(expected[lag], rel=1e-6)
    assert abs(expected[0] - expected[1]) > 0.1, expected
    batch = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, config), config)
    coefficient = correction_weights(trainer, rollout,
                                     dataclasses.replace(batch, token_lambda=lambda_per_token(results, lags)), config,
                                     mask)
    w = (trainer - rollout).exp().clamp(max=config.cap)
    lam = torch.where(stale[:, None], expected[1], expected[0]).expand(6, 7)
    valid = mask > 0
    assert torch.allclose(coefficient[valid], ((1 - lam) + lam * w)[valid].float(), atol=1e-6)
    assert state.batches == 0 and state.of_lag(0).batches == 1 and state.of_lag(1).batches == 1

    current = torch.zeros_like(lags)
    (stats, _), = statistics_per_lag(trainer, rollout, adv, mask, current, 2, config).values()
    assert ais_coefficient(stats, config).lam == pytest.approx(batch.lam, rel=1e-12)


@pytest.mark.parametrize("per_lag", [False, True])
def test_a_stale_lambda_floor_of_one_corrects_stale_tokens_as_tis(per_lag):
    """--ais-stale-lambda-floor 1: a stale token's coefficient is min(w, C) (truncated IS, by hand) at every lag
    >= 1 (lag 1 is all there is at --max-off-policy-steps 1) and a current token's keeps (1 − λ) + λ · min(w, C)
    with the batch's λ (or its lag's); a floor of 0.5 lifts only stale λ below it."""
    trainer, rollout, adv, mask = _batch(seed=7, b=8, s=7, scale=0.05)
    row_lags = torch.tensor([0, 1, 0, 2, 1, 3, 0, 0])
    lags = row_lags[:, None].expand(8, 7)
    stale = row_lags >= 1
    config = AISConfig(lambda_per_lag=per_lag, stale_lambda_floor=1.0)
    batch = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, config), config)
    results, _ = results_per_lag(trainer, rollout, adv, mask, lags, 3, config, state=AISState())
    assert sorted(results) == [0, 1, 2, 3]
    token_lambda = lambda_of_tokens(batch, results, lags, config)
    coefficient = correction_weights(trainer, rollout, dataclasses.replace(batch, token_lambda=token_lambda), config,
                                     mask)
    w = (trainer - rollout).exp().clamp(max=config.cap)
    current = results[0].lam if per_lag else batch.lam
    assert current < 0.9
    expected = torch.where(stale[:, None], w, (1 - current) + current * w)
    valid = mask > 0
    assert torch.allclose(coefficient[valid], expected[valid].float(), atol=1e-6)
    for lag in (1, 2, 3):
        rows = row_lags == lag
        assert torch.allclose(coefficient[rows][valid[rows]], w[rows][valid[rows]].float(), atol=1e-6), lag
    half = lambda_of_tokens(batch, results, lags, dataclasses.replace(config, stale_lambda_floor=0.5))
    for lag in (0, 1, 2, 3):
        own = (results[lag] if per_lag else batch).lam
        floor = 0.5 if lag >= 1 else 0.0
        assert torch.allclose(half[row_lags == lag], torch.tensor(max(own, floor))), lag
    assert lambda_of_tokens(batch, results, lags, AISConfig()) is None


def test_per_lag_state_round_trips_through_json():
    import json

    config = AISConfig(ema=0.5, severity="anchored", lambda_per_lag=True)
    state = AISState()
    for seed in range(3):
        trainer, rollout, adv, mask = _batch(seed=seed)
        for lag in (0, 2):
            ais_coefficient(mismatch_statistics(trainer, rollout + 0.1 * lag, adv, mask, config), config,
                            state.of_lag(lag))
    restored = AISState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored == state and restored.of_lag(2).anchor_count == 3 and restored.of_lag(2).lam_ema is not None


@pytest.mark.parametrize("per_lag", [False, True])
def test_at_a_sequence_level_a_response_of_two_versions_is_as_stale_as_its_oldest_token(per_lag):
    """--partial-rollouts: a response's tokens may come from two policy versions. At --is-level geometric one
    coefficient weighs the sequence (GSPO's premise, docs/ais-method.md §2.6a): with --ais-stale-lambda-floor 1 a
    row with a stale token is corrected as TIS over the whole row, min(W_i, C), and the others with the current
    version's λ (its lag's, with --ais-lambda-per-lag: from the current rows alone), W_i the geometric mean of the
    row's ratios (by hand). A masked token's lag does not count. Before, the λ changed inside row 0."""
    from types import SimpleNamespace

    from megatron_ais.ais.coefficient import lags_of_units
    from megatron_ais.grpo.step import _per_lag

    trainer, rollout, adv, _ = _batch(seed=13, b=4, s=6, scale=0.05)
    mask = torch.ones(4, 6)
    mask[3, 5] = 0.0
    lags = torch.tensor([[0, 0, 0, 1, 1, 1], [0] * 6, [1] * 6, [0, 0, 0, 0, 0, 2]])
    config = AISConfig(level="geometric", lambda_per_lag=per_lag, stale_lambda_floor=1.0)
    batch = ais_coefficient(mismatch_statistics(trainer, rollout, adv, mask, config), config)
    result = _per_lag(trainer, rollout, adv, mask, lags, SimpleNamespace(correction=config, max_lag=2), AISState(),
                      SimpleNamespace(data_parallel_group=None), {}, batch)
    coefficient = apply_correction(trainer, rollout, mask, config, result).coefficient
    current_rows = torch.tensor([1, 3])
    current = ais_coefficient(mismatch_statistics(trainer[current_rows], rollout[current_rows], adv[current_rows],
                                                  mask[current_rows], config), config).lam if per_lag else batch.lam
    assert 0.0 < current < 0.9
    for row, stale in enumerate((True, False, True, False)):
        valid = mask[row] > 0
        w = min(math.exp(float(((trainer[row] - rollout[row])[valid]).double().mean())), config.cap)
        expected = w if stale else (1 - current) + current * w
        assert torch.allclose(coefficient[row][valid], torch.tensor(expected, dtype=torch.float32), atol=1e-6), row
    assert torch.equal(lags_of_units(lags, mask, dataclasses.replace(config, level="token")), lags)
