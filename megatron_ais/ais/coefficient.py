"""λ from the global statistics, its running state, the per-token correction weights, and the diagnostics per
policy-version lag."""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais.ais import diagnostics, registry
from megatron_ais.ais.config import AISConfig
from megatron_ais.ais.guards import check_finite_statistics
from megatron_ais.ais.statistics import (STAT_NAMES, max_abs_logratio, mismatch_statistics, reduce_statistics,
                                         unit_log_ratios)


@dataclasses.dataclass
class AISState:
    """State carried across rollout batches (EMA of λ, anchored severity); checkpointed with the run."""

    batches: int = 0
    anchor_sum: float = 0.0
    anchor_count: int = 0
    lam_ema: float | None = None
    per_lag: dict[int, "AISState"] = dataclasses.field(default_factory=dict)  # --ais-lambda-per-lag: each lag's

    def anchor_mean(self) -> float | None:
        """Return D0, the mean severity D over the anchoring batches seen so far (None before the first)."""
        return self.anchor_sum / self.anchor_count if self.anchor_count else None

    def of_lag(self, lag: int) -> "AISState":
        """The state of the λ of the tokens of policy-version lag `lag` (--ais-lambda-per-lag)."""
        return self.per_lag.setdefault(lag, AISState())

    def state_dict(self) -> dict:
        state = dataclasses.asdict(self)
        state["per_lag"] = {str(lag): lag_state for lag, lag_state in state["per_lag"].items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if key == "per_lag":
                value = {int(lag): AISState(**lag_state) for lag, lag_state in value.items()}
            setattr(self, key, value)


@dataclasses.dataclass(frozen=True)
class AISResult:
    """λ for one rollout batch, the three diagnostics and the logging-only mismatch metrics."""

    lam: float
    lam_raw: float
    reliability: float
    severity: float
    variance_amplification: float
    mean_abs_logratio: float
    ess_ratio_raw: float
    cv2_applied: float
    chi2: float
    k3_kl: float
    truncated_fraction: float
    num_units: float
    sequence_ess: float = 1.0  # (Σ W)² / (N Σ W²) of the sequences' raw weights W = Π_t w_t, whatever the level
    bias: float = 0.0  # the bias test's b̂ and z (diagnostics.bias_test), whatever the λ rule
    bias_z: float = 0.0
    # --ais-lambda-per-lag: each token's λ, that of its lag (`lambda_per_token`); the correction uses it, not `lam`
    token_lambda: torch.Tensor | None = None

    def metrics(self, prefix: str = "ais/") -> dict[str, float]:
        """Return the scalars to log, named as in docs/ais-method.md §2.5."""
        return {prefix + "lambda": self.lam, prefix + "lambda_raw": self.lam_raw,
                prefix + "reliability": self.reliability, prefix + "severity": self.severity,
                prefix + "var_amp": self.variance_amplification, prefix + "mean_abs_logratio": self.mean_abs_logratio,
                prefix + "ess_ratio_raw": self.ess_ratio_raw, prefix + "cv2_applied": self.cv2_applied,
                prefix + "chi2": self.chi2, prefix + "k3_kl": self.k3_kl,
                prefix + "frac_truncated": self.truncated_fraction, prefix + "num_units": self.num_units,
                prefix + "sequence_ess": self.sequence_ess, prefix + "bias": self.bias, prefix + "bias_z": self.bias_z}


EMPTY_RESULT = AISResult(lam=0.0, lam_raw=0.0, reliability=1.0, severity=0.0, variance_amplification=1.0,
                         mean_abs_logratio=0.0, ess_ratio_raw=1.0, cv2_applied=0.0, chi2=0.0, k3_kl=0.0,
                         truncated_fraction=0.0, num_units=0.0)


def chi_square(s: dict) -> float:
    """χ²(π‖μ) estimated self-normalised from the raw weights, N·Σw² / (Σw)² − 1 (= 1/ESS ratio − 1): never negative
    (Cauchy-Schwarz), unlike Σw²/N − 1, whose sampling error goes below zero when the policies nearly agree."""
    return max(s["n"] * s["sum_weight_sq"] / s["sum_weight"] ** 2 - 1.0, 0.0)


def sequence_ess(s: dict) -> float:
    """ESS ratio of the sequence-level raw weights, (Σ W)² / (N Σ W²) (1 when no sequence has a valid token)."""
    if s["n_sequences"] <= 0:
        return 1.0
    return s["sum_seq_weight"] ** 2 / (s["n_sequences"] * s["sum_seq_weight_sq"])


def ais_coefficient(stats: torch.Tensor, config: AISConfig, state: AISState | None = None) -> AISResult:
    """Return λ and the diagnostics for globally reduced statistics; advances `state` when given.

    A pure function of (stats, config, state): identical inputs on every rank give a bit-identical λ.
    """
    s = dict(zip(STAT_NAMES, stats.double().tolist()))
    check_finite_statistics(s)
    if s["n"] <= 0:
        return EMPTY_RESULT
    state = state if state is not None else AISState()
    d = diagnostics.mean_abs_logratio(s)
    if config.severity == "anchored" and state.anchor_count < config.anchor_steps:
        state.anchor_sum += d
        state.anchor_count += 1
    severity = registry.SEVERITY[config.severity](s, config, state)
    reliability = registry.RELIABILITY[config.reliability](s, config, state)
    variance = registry.VARIANCE[config.variance](s, config, state)
    lam_raw = registry.LAMBDA_RULES[config.lambda_rule](s, severity, reliability, variance, config)
    lam = min(max(lam_raw, config.lambda_min), config.lambda_max)
    if config.ema > 0:
        lam = lam if state.lam_ema is None else config.ema * state.lam_ema + (1.0 - config.ema) * lam
        state.lam_ema = lam
    state.batches += 1
    n = s["n"]
    bias, bias_z = diagnostics.bias_test(s)
    return AISResult(
        lam=lam, lam_raw=lam_raw, reliability=reliability, severity=severity, variance_amplification=variance,
        mean_abs_logratio=d, ess_ratio_raw=s["sum_weight"] ** 2 / (n * s["sum_weight_sq"]),
        cv2_applied=n * s["sum_trunc_weight_sq"] / s["sum_trunc_weight"] ** 2 - 1.0,
        chi2=chi_square(s), k3_kl=s["sum_k3"] / n, truncated_fraction=s["n_truncated"] / n,
        num_units=n, sequence_ess=sequence_ess(s), bias=bias, bias_z=bias_z)


def unit_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                 config: AISConfig) -> torch.Tensor:
    """Return the raw IS weight w = exp(δ) per token [b, s] (a sequence's weight broadcast to its tokens)."""
    delta, _ = unit_log_ratios(trainer_logprobs.detach(), rollout_logprobs.detach(), mask, config)
    w = delta.exp()
    return w if config.level == "token" else w.unsqueeze(-1).expand_as(mask)


def correction_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, result: AISResult,
                       config: AISConfig, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Return the detached per-token coefficient (1 - λ) + λ · min(w, C), shape [b, s].

    `mask` (default: all tokens) limits which tokens enter a sequence-level ratio.
    """
    if mask is None:
        mask = torch.ones_like(trainer_logprobs, dtype=torch.float32)
    truncated = unit_weights(trainer_logprobs, rollout_logprobs, mask, config).clamp(max=config.cap)
    lam = result.lam if result.token_lambda is None else result.token_lambda
    return ((1.0 - lam) + lam * truncated).detach()


def lags_of_units(lags: torch.Tensor, mask: torch.Tensor, config: AISConfig) -> torch.Tensor:
    """Each token's policy-version lag as the correction counts it: its own at --is-level token; at geometric or
    sequence level one coefficient weighs a whole sequence, so every token takes its sequence's largest lag (over
    the tokens in `mask`): a response sampled partly by a stale version (--partial-rollouts) is as stale as its
    oldest token, for its λ and for the lag whose statistics it enters."""
    if config.level == "token":
        return lags
    return torch.where(mask > 0, lags, 0).amax(dim=-1, keepdim=True).expand_as(lags)


def statistics_per_lag(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, lags: torch.Tensor, max_lag: int, config: AISConfig, group=None
                       ) -> dict[int, tuple[torch.Tensor, float]]:
    """For each policy-version lag 0 .. `max_lag` that has tokens: the statistics of its tokens alone over the
    DP-global batch, and their max |δ|. Collective over `group`: every rank computes every lag."""
    per_lag = {}
    for lag in range(max_lag + 1):
        lag_mask = mask * (lags == lag).to(mask.dtype)
        stats = reduce_statistics(mismatch_statistics(trainer_logprobs, rollout_logprobs, advantages, lag_mask,
                                                      config), group)
        largest = max_abs_logratio(trainer_logprobs, rollout_logprobs, lag_mask, config, group)
        if stats[STAT_NAMES.index("n")] > 0:
            per_lag[lag] = (stats, largest)
    return per_lag


def lag_metrics(results: dict[int, AISResult], largest: dict[int, float], with_lambda: bool = False
                ) -> dict[str, float]:
    """Each lag's diagnostics as `ais/lag{k}/<name>` (and its λ, `with_lambda`)."""
    metrics = {}
    for lag, result in results.items():
        names = [("num_units", result.num_units), ("mean_abs_logratio", result.mean_abs_logratio),
                 ("max_abs_logratio", largest[lag]), ("k3_kl", result.k3_kl), ("chi2", result.chi2),
                 ("ess_ratio_raw", result.ess_ratio_raw), ("sequence_ess", result.sequence_ess)]
        if with_lambda:
            names.append(("lambda", result.lam))
        metrics.update({f"ais/lag{lag}/{name}": value for name, value in names})
    return metrics


def lambda_per_token(results: dict[int, AISResult], lags: torch.Tensor) -> torch.Tensor:
    """Each token's λ: that of its lag (0 where its lag has no tokens in the batch: off the response)."""
    lam = torch.zeros(lags.shape, dtype=torch.float32, device=lags.device)
    for lag, result in results.items():
        lam = torch.where(lags == lag, torch.tensor(result.lam, dtype=torch.float32, device=lags.device), lam)
    return lam


def lambda_of_tokens(result: AISResult, results: dict[int, AISResult], lags: torch.Tensor, config: AISConfig
                     ) -> torch.Tensor | None:
    """Each token's λ where it is not the batch's one: its lag's (--ais-lambda-per-lag, from `results`), and at
    least --ais-stale-lambda-floor for the tokens of a stale policy version (lag >= 1); None when neither applies."""
    if not config.lambda_per_lag and not config.stale_lambda_floor:
        return None
    lam = lambda_per_token(results, lags) if config.lambda_per_lag else \
        torch.full(lags.shape, result.lam, dtype=torch.float32, device=lags.device)
    if config.stale_lambda_floor:
        lam = torch.where(lags >= 1, lam.clamp(min=config.stale_lambda_floor), lam)
    return lam


def results_per_lag(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, lags: torch.Tensor, max_lag: int, config: AISConfig, group=None,
                    state: AISState | None = None) -> tuple[dict[int, AISResult], dict[int, float]]:
    """For each policy-version lag that has tokens: λ and the diagnostics of its tokens alone over the DP-global
    batch (`state`: each lag's λ advances its own, `AISState.of_lag`; None: a fresh one, the diagnostics alone), and
    their max |δ|. Collective over `group`."""
    per_lag = statistics_per_lag(trainer_logprobs, rollout_logprobs, advantages, mask, lags, max_lag, config, group)
    results = {lag: ais_coefficient(stats, config, None if state is None else state.of_lag(lag))
               for lag, (stats, _) in per_lag.items()}
    return results, {lag: largest for lag, (_, largest) in per_lag.items()}


def metrics_per_lag(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, lags: torch.Tensor, max_lag: int, config: AISConfig, group=None
                    ) -> dict[str, float]:
    """The mismatch diagnostics of the tokens of each policy-version lag 0 .. `max_lag` on their own (lag 0: the
    precision mismatch alone; lag k adds k steps of staleness), each over the DP-global batch, as
    `ais/lag{k}/<name>` for every lag that has tokens. Collective over `group`."""
    return lag_metrics(*results_per_lag(trainer_logprobs, rollout_logprobs, advantages, mask, lags, max_lag, config,
                                        group))
