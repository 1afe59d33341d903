"""The three AIS diagnostics, the combiner and the λ rules, each registered by name (docs/ais-method.md §2.3-§2.4,
§2.8).

The paper's exact formulas are not public; replacing one of ours is registering a function here (into the
registries of `ais/registry.py`) and selecting it by flag (`--ais-severity`, `--ais-reliability`, `--ais-variance`,
`--ais-combiner`). A diagnostic maps the global statistics (a dict of STAT_NAMES -> float), the config and the
running state to a float.
"""
from __future__ import annotations

import math

from megatron_ais.ais.config import AISConfig
from megatron_ais.ais.registry import COMBINERS, LAMBDA_RULES, RELIABILITY, SEVERITY, VARIANCE
from megatron_ais.registry import register


def mean_abs_logratio(s: dict) -> float:
    """D = Σ|δ| / N (nats)."""
    return s["sum_abs_logratio"] / s["n"]


@register(SEVERITY, "mean_abs_logratio")
def severity_exponential(s, config, state):
    """s_D = 1 - exp(-D / τ)."""
    return 1.0 - math.exp(-mean_abs_logratio(s) / config.tau)


@register(SEVERITY, "k3")
def severity_k3(s, config, state):
    """s_D = 1 - exp(-D_k3 / τ), D_k3 = 2·sqrt(k3 / π): the mean |δ| that Gaussian δ of this k3 (≈ E[δ²] / 2) would
    have, so it reads like `mean_abs_logratio` on Gaussian mismatch; k3 weighs a large |δ| by about its square, so
    mismatch concentrated on few tokens is read at its size, not diluted by the token mean."""
    return 1.0 - math.exp(-2.0 * math.sqrt(max(s["sum_k3"], 0.0) / (math.pi * s["n"])) / config.tau)


@register(SEVERITY, "anchored")
def severity_anchored(s, config, state):
    """s_D = clip((D - D0) / (κ D0), 0, 1), D0 = mean D over the first anchor_steps batches (kept in state)."""
    d0 = state.anchor_mean()
    if d0 is None or d0 <= 0:
        return 0.0
    return min(max((mean_abs_logratio(s) - d0) / (config.anchor_kappa * d0), 0.0), 1.0)


@register(RELIABILITY, "band_ess")
def reliability_band_ess(s, config, state):
    """ρ = (Σw̃)² / (N Σw̃²): ESS ratio of the band-clipped weights, in [4/(C+1/C)², 1]."""
    return s["sum_band_weight"] ** 2 / (s["n"] * s["sum_band_weight_sq"])


@register(RELIABILITY, "raw_ess")
def reliability_raw_ess(s, config, state):
    """ESS ratio of the raw weights (collapses on heavy tails; kept as an ablation)."""
    return s["sum_weight"] ** 2 / (s["n"] * s["sum_weight_sq"])


@register(RELIABILITY, "none")
def reliability_none(s, config, state):
    return 1.0


@register(VARIANCE, "advantage_weighted")
def variance_advantage_weighted(s, config, state):
    """Γ = max(1, Σw̄²Â² / ΣÂ²); 1 when every advantage is zero."""
    if s["sum_adv_sq"] <= 0:
        return 1.0
    return max(1.0, s["sum_trunc_weight_sq_adv_sq"] / s["sum_adv_sq"])


@register(VARIANCE, "cv")
def variance_cv(s, config, state):
    """Γ' = max(1, N Σw̄² / (Σw̄)²) = 1 + CV²(w̄)."""
    return max(1.0, s["n"] * s["sum_trunc_weight_sq"] / s["sum_trunc_weight"] ** 2)


@register(VARIANCE, "none")
def variance_none(s, config, state):
    return 1.0


@register(COMBINERS, "product")
def combine_product(severity: float, reliability: float, variance: float, config: AISConfig) -> float:
    """λ_raw = s_D^a_s · ρ^a_r · Γ^(-a_v)."""
    return (severity ** config.severity_exponent) * (reliability ** config.reliability_exponent) \
        * (variance ** -config.variance_exponent)


def bias_test(s: dict) -> tuple[float, float]:
    """(b̂, z): the mean over the batch's sequences of u = Â · Σ_t (min(w_t, C) − 1), the share of the TIS gradient
    that the uncorrected one lacks, and its z statistic b̂ / (σ̂ / sqrt(n)) (σ̂: the sample standard deviation; ±inf
    when every u is equal and b̂ is not 0; both 0 below two sequences)."""
    n = s["n_sequences"]
    if n < 2:
        return 0.0, 0.0
    mean = s["sum_bias"] / n
    variance = max(s["sum_bias_sq"] - n * mean * mean, 0.0) / (n - 1)
    if variance <= 0:
        return mean, 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean, mean / math.sqrt(variance / n)


@register(LAMBDA_RULES, "diagnostics")
def lambda_from_diagnostics(s, severity, reliability, variance, config):
    """AIS-R: the three diagnostics through --ais-combiner."""
    return COMBINERS[config.combiner](severity, reliability, variance, config)


@register(LAMBDA_RULES, "bias-test")
def lambda_from_bias_test(s, severity, reliability, variance, config):
    """λ = clip(1 − 1/z², 0, 1) when b̂ > 0 (the mismatch leans the update toward tokens the advantage favours: a
    bias to correct, as far as the batch resolves it), --ais-explore-lambda otherwise."""
    bias, z = bias_test(s)
    if bias <= 0:
        return config.explore_lambda
    return min(max(1.0 - 1.0 / (z * z), 0.0), 1.0)
