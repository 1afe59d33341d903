"""Configuration of the mismatch correction (`--is-correction` and the AIS options)."""
from __future__ import annotations

import argparse
import dataclasses

LEVELS = ("token", "sequence", "geometric")


@dataclasses.dataclass(frozen=True)
class AISConfig:
    """AIS-R defaults (docs/ais-method.md §2.4) plus the baselines' thresholds.

    cap: the TIS truncation C, also the reliability band [1/C, C]; tau: severity scale τ_D (nats);
    exponents: (a_s, a_r, a_v) of severity, reliability and variance amplification; ema: β of the optional
    smoothing of λ across rollout batches; logratio_clamp: safety clamp on δ.
    """

    correction: str = "ais"
    level: str = "token"
    cap: float = 2.0
    tau: float = 0.05
    severity_exponent: float = 1.0
    reliability_exponent: float = 1.0
    variance_exponent: float = 1.0
    lambda_min: float = 0.0
    lambda_max: float = 1.0
    ema: float = 0.0
    logratio_clamp: float = 20.0
    severity: str = "mean_abs_logratio"
    reliability: str = "band_ess"
    variance: str = "advantage_weighted"
    combiner: str = "product"
    anchor_steps: int = 10
    anchor_kappa: float = 1.0
    mis_low: float | None = None
    mis_high: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"--is-level {self.level!r} must be one of {LEVELS}")
        if self.cap <= 1.0:
            raise ValueError(f"--is-cap {self.cap} must be > 1 (the band [1/C, C] must be non-empty)")
        if self.tau <= 0:
            raise ValueError(f"--ais-tau {self.tau} must be positive")
        if not 0.0 <= self.lambda_min <= self.lambda_max <= 1.0:
            raise ValueError(f"need 0 <= --ais-lambda-min {self.lambda_min} <= --ais-lambda-max {self.lambda_max} <= 1")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"--ais-ema {self.ema} must be in [0, 1)")
        if not 0 < self.mis_band[0] < self.mis_band[1]:
            raise ValueError(f"--is-mask-low/--is-mask-high give an empty band {self.mis_band}")
        if not 0 <= self.icepop_low < self.icepop_high:
            raise ValueError(f"--icepop-low {self.icepop_low} must be below --icepop-high {self.icepop_high}")

    @property
    def mis_band(self) -> tuple[float, float]:
        """Return the MIS acceptance band; the lower bound defaults to 1 / upper."""
        return (self.mis_low if self.mis_low is not None else 1.0 / self.mis_high, self.mis_high)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AISConfig":
        """Return the config named by the correction flags."""
        a_s, a_r, a_v = args.ais_exponents
        return cls(correction=args.is_correction, level=args.is_level, cap=args.is_cap, tau=args.ais_tau,
                   severity_exponent=a_s, reliability_exponent=a_r, variance_exponent=a_v,
                   lambda_min=args.ais_lambda_min, lambda_max=args.ais_lambda_max, ema=args.ais_ema,
                   severity=args.ais_severity, reliability=args.ais_reliability, variance=args.ais_variance,
                   combiner=args.ais_combiner, anchor_steps=args.ais_anchor_steps,
                   anchor_kappa=args.ais_anchor_kappa, mis_low=args.is_mask_low, mis_high=args.is_mask_high,
                   icepop_low=args.icepop_low, icepop_high=args.icepop_high)


def add_correction_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the rollout/trainer mismatch correction."""
    from megatron_ais.ais import diagnostics

    g = parser.add_argument_group("importance-sampling correction")
    g.add_argument("--is-correction", choices=("none", "tis", "mis", "icepop", "ais"), default="ais",
                   help="none: plain GRPO; tis: truncated IS weights min(w, C); mis: reject tokens/sequences whose "
                        "ratio leaves [low, high] (dropped from the loss and its normaliser), IS weight otherwise; "
                        "icepop: weight w inside [low, high], zero outside (kept in the normaliser); ais: adaptive "
                        "interpolation (1 - lambda) + lambda * min(w, C) with one lambda per rollout batch.")
    g.add_argument("--is-level", choices=LEVELS, default="token",
                   help="Ratio per token, per sequence (product of token ratios) or geometric (per-token mean).")
    g.add_argument("--is-cap", type=float, default=2.0, help="Truncation C of TIS and AIS (reliability band [1/C, C]).")
    g.add_argument("--is-mask-low", type=float, default=None, help="MIS lower acceptance bound (default 1/high).")
    g.add_argument("--is-mask-high", type=float, default=2.0, help="MIS upper acceptance bound.")
    g.add_argument("--icepop-low", type=float, default=0.5, help="IcePop lower band edge alpha.")
    g.add_argument("--icepop-high", type=float, default=5.0, help="IcePop upper band edge beta.")
    g.add_argument("--ais-tau", type=float, default=0.05, help="AIS severity scale tau_D in nats.")
    g.add_argument("--ais-exponents", type=float, nargs=3, default=(1.0, 1.0, 1.0), metavar=("A_S", "A_R", "A_V"),
                   help="Exponents of severity, reliability and variance amplification (0 ablates one).")
    g.add_argument("--ais-lambda-min", type=float, default=0.0, help="Lower clip of lambda.")
    g.add_argument("--ais-lambda-max", type=float, default=1.0, help="Upper clip of lambda.")
    g.add_argument("--ais-ema", type=float, default=0.0, help="EMA factor beta for lambda across batches (0 = off).")
    g.add_argument("--ais-severity", choices=sorted(diagnostics.SEVERITY), default="mean_abs_logratio",
                   help="Divergence-severity diagnostic (anchored: relative to the first --ais-anchor-steps batches).")
    g.add_argument("--ais-reliability", choices=sorted(diagnostics.RELIABILITY), default="band_ess",
                   help="Weight-reliability diagnostic.")
    g.add_argument("--ais-variance", choices=sorted(diagnostics.VARIANCE), default="advantage_weighted",
                   help="Variance-amplification diagnostic.")
    g.add_argument("--ais-combiner", choices=sorted(diagnostics.COMBINERS), default="product",
                   help="How the three diagnostics become lambda.")
    g.add_argument("--ais-anchor-steps", type=int, default=10, help="Batches that define the anchored severity D0.")
    g.add_argument("--ais-anchor-kappa", type=float, default=1.0, help="Anchored severity scale kappa.")
