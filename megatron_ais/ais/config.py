"""Configuration of the mismatch correction (`--is-correction` and the AIS options)."""
from __future__ import annotations

import dataclasses
import functools

from megatron_ais.ais import registry
from megatron_ais.flags import FlagConfig, flag

LEVELS = ("token", "sequence", "geometric")


@dataclasses.dataclass(frozen=True)
class AISConfig(FlagConfig):
    """AIS-R defaults (docs/ais-method.md §2.4) plus the baselines' thresholds.

    cap: the TIS truncation C, also the reliability band [1/C, C]; tau: severity scale τ_D (nats);
    exponents: (a_s, a_r, a_v) of severity, reliability and variance amplification; ema: β of the optional
    smoothing of λ across rollout batches; logratio_clamp: safety clamp on δ.
    """

    correction: str = flag(
        "ais", "none: plain GRPO; tis: truncated IS weights min(w, C); mis: reject tokens/sequences whose ratio leaves "
               "[low, high] (dropped from the loss and its normaliser), IS weight otherwise; icepop: weight w inside "
               "[low, high], zero outside (kept in the normaliser); ais: adaptive interpolation (1 - lambda) + lambda "
               "* min(w, C) with one lambda per rollout batch.", name="--is-correction",
        choices=functools.partial(tuple, registry.CORRECTIONS))
    level: str = flag("token", "Ratio per token, per sequence (product of token ratios) or geometric (per-token "
                               "mean).", name="--is-level", choices=LEVELS)
    cap: float = flag(2.0, "Truncation C of TIS and AIS (reliability band [1/C, C]).", name="--is-cap",
                      above=1, bound_note="the band [1/C, C] must be non-empty")
    mis_low: float | None = flag(None, "MIS lower acceptance bound on w = pi_trainer / pi_rollout (default 1/high). "
                                       "verl's token rejection compares pi_rollout / pi_old with its band, the "
                                       "inverse: its asymmetric 'L_U' band is ours at --is-mask-low 1/U "
                                       "--is-mask-high 1/L (symmetric bands agree).", name="--is-mask-low",
                                 type=float)
    mis_high: float = flag(2.0, "MIS upper acceptance bound on w = pi_trainer / pi_rollout.", name="--is-mask-high")
    icepop_low: float = flag(0.5, "IcePop lower band edge alpha.")
    icepop_high: float = flag(5.0, "IcePop upper band edge beta.")
    tau: float = flag(0.05, "AIS severity scale tau_D in nats.", name="--ais-tau", above=0)
    exponents: tuple[float, float, float] = flag(
        (1.0, 1.0, 1.0), "Exponents of severity, reliability and variance amplification (0 ablates one).",
        name="--ais-exponents", metavar=("A_S", "A_R", "A_V"))
    lambda_min: float = flag(0.0, "Lower clip of lambda.", name="--ais-lambda-min", at_least=0, at_most=1)
    lambda_max: float = flag(1.0, "Upper clip of lambda.", name="--ais-lambda-max", at_least=0, at_most=1)
    ema: float = flag(0.0, "EMA factor beta for lambda across batches (0 = off).", name="--ais-ema",
                      at_least=0, below=1)
    severity: str = flag("mean_abs_logratio", "Divergence-severity diagnostic (anchored: relative to the first "
                                              "--ais-anchor-steps batches).", name="--ais-severity",
                         choices=functools.partial(sorted, registry.SEVERITY))
    reliability: str = flag("band_ess", "Weight-reliability diagnostic.", name="--ais-reliability",
                            choices=functools.partial(sorted, registry.RELIABILITY))
    variance: str = flag("advantage_weighted", "Variance-amplification diagnostic.", name="--ais-variance",
                         choices=functools.partial(sorted, registry.VARIANCE))
    combiner: str = flag("product", "How the three diagnostics become lambda.", name="--ais-combiner",
                         choices=functools.partial(sorted, registry.COMBINERS))
    lambda_rule: str = flag(
        "diagnostics", "How λ is set: diagnostics (AIS-R: the three diagnostics through --ais-combiner); bias-test "
                       "(sign-aware: each sequence's share of the TIS gradient minus the uncorrected one, "
                       "u = Â·Σ_t (min(w, C) − 1), tested over the batch: λ = clip(1 − 1/z², 0, 1) when its mean "
                       "b̂ > 0, --ais-explore-lambda otherwise; docs/ais-method.md §2.8).", name="--ais-lambda",
        choices=functools.partial(sorted, registry.LAMBDA_RULES))
    explore_lambda: float = flag(0.0, "With --ais-lambda bias-test: λ when the mismatch does not correlate "
                                      "positively with the advantage (b̂ ≤ 0: the paper's exploration bonus, left "
                                      "uncorrected at 0).", name="--ais-explore-lambda", at_least=0, at_most=1)
    anchor_steps: int = flag(10, "Batches that define the anchored severity D0.", name="--ais-anchor-steps")
    anchor_kappa: float = flag(1.0, "Anchored severity scale kappa.", name="--ais-anchor-kappa")
    lambda_per_lag: bool = flag(
        False, "With --max-off-policy-steps > 0: one λ for the tokens of each policy-version lag, each from that lag's "
               "DP-global statistics (and state), instead of one λ for the batch. Batches mix lags with "
               "--partial-rollouts; otherwise every batch has one lag and the two agree.",
        name="--ais-lambda-per-lag")
    stale_lambda_floor: float = flag(
        0.0, "With --max-off-policy-steps > 0: the least λ of the tokens a stale policy version sampled (lag >= 1). "
             "1 corrects them fully (truncated IS) while λ still adapts to the precision mismatch of the current "
             "version's tokens; 0: off. docs/results.md: at η = 4, TIS recovered the accuracy staleness cost and "
             "AIS-R's one λ did not.", name="--ais-stale-lambda-floor", at_least=0, at_most=1)
    logratio_clamp: float = 20.0

    def __post_init__(self):
        super().__post_init__()
        # looked up now, not frozen at import: the implementations register when `megatron_ais.ais` loads
        for value, table in ((self.correction, registry.CORRECTIONS), (self.severity, registry.SEVERITY),
                             (self.reliability, registry.RELIABILITY), (self.variance, registry.VARIANCE),
                             (self.combiner, registry.COMBINERS), (self.lambda_rule, registry.LAMBDA_RULES)):
            if value not in table:
                raise ValueError(f"{table.title} {value!r} must be one of {tuple(table)}")  # title: the flag
        if self.level not in LEVELS:
            raise ValueError(f"--is-level {self.level!r} must be one of {LEVELS}")
        if self.lambda_min > self.lambda_max:
            raise ValueError(f"--ais-lambda-min {self.lambda_min} must be at most --ais-lambda-max {self.lambda_max}")
        if not 0 < self.mis_band[0] < self.mis_band[1]:
            raise ValueError(f"--is-mask-low/--is-mask-high give an empty band {self.mis_band}")
        if self.lambda_per_lag and self.correction != "ais":
            raise ValueError(f"--ais-lambda-per-lag with --is-correction {self.correction}: only AIS has a λ; use "
                             "--is-correction ais or drop the flag")
        if self.stale_lambda_floor and self.correction != "ais":
            raise ValueError(f"--ais-stale-lambda-floor with --is-correction {self.correction}: only AIS has a λ; "
                             "use --is-correction ais or drop the flag")
        if not 0 <= self.icepop_low < self.icepop_high:
            raise ValueError(f"--icepop-low {self.icepop_low} must be below --icepop-high {self.icepop_high}")

    @property
    def severity_exponent(self) -> float:
        return self.exponents[0]

    @property
    def reliability_exponent(self) -> float:
        return self.exponents[1]

    @property
    def variance_exponent(self) -> float:
        return self.exponents[2]

    @property
    def mis_band(self) -> tuple[float, float]:
        """Return the MIS acceptance band; the lower bound defaults to 1 / upper."""
        return (self.mis_low if self.mis_low is not None else 1.0 / self.mis_high, self.mis_high)
