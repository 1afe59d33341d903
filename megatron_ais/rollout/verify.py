"""Refit verification: after a sync, the engine scores a fixed probe sequence and its log-probs must agree with
the trainer's on the same weights, within a tolerance per engine precision.

Tolerances were calibrated on the tiny models (docs/rollout.md): fp32 engine vs fp32 trainer max |Δ| 1.7e-5;
bf16 engine mean |Δ| 0.015-0.02 on a random model, 0.073 after 150 SFT steps on digit sort (a trained model is
confident, and the random-token probe then has log-probs far in the tail, where bf16 rounding is largest), so
its bound is 0.25. The FP8 engine is compared with the BF16 trainer, so its check includes the
quantization mismatch itself: 0.05 on a random model, 0.12 after 300 SFT steps on the random-token probe; its
bound (0.5) catches wrong or badly stale weights (mean |Δ| of order 1), not small staleness.
"""
from __future__ import annotations

import dataclasses

import torch

# (statistic, bound): fp32 is checked on the max, the low-precision engines on the mean
TOLERANCES = {"fp32": ("max", 1e-4), "bf16": ("mean", 0.25), "fp8": ("mean", 0.5)}


class RefitVerificationError(RuntimeError):
    """The engine's log-probs disagree with the trainer's after a weight sync."""


@dataclasses.dataclass(frozen=True)
class RefitReport:
    mean_abs_diff: float
    max_abs_diff: float
    worst_position: int
    passed: bool


def probe_tokens(vocab_size: int, length: int = 48, seed: int = 1234) -> list[int]:
    """Return the fixed probe sequence (same for every sync of a run)."""
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def verify_refit(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, precision: str,
                 raise_on_failure: bool = True) -> RefitReport:
    """Compare the engine's and the trainer's probe log-probs; raise RefitVerificationError when out of tolerance."""
    diff = (engine_logprobs.double() - trainer_logprobs.double()).abs()
    if not bool(torch.isfinite(diff).all()):
        raise RefitVerificationError("refit verification: non-finite log-probs on the probe sequence")
    statistic, bound = TOLERANCES[precision]
    value = diff.mean().item() if statistic == "mean" else diff.max().item()
    report = RefitReport(diff.mean().item(), diff.max().item(), int(diff.argmax()), value <= bound)
    if not report.passed and raise_on_failure:
        raise RefitVerificationError(
            f"refit verification failed for the {precision} engine: {statistic} |engine - trainer| log-prob "
            f"{value:.3e} > {bound:.3g} (worst at probe position {report.worst_position}, |Δ| "
            f"{report.max_abs_diff:.3e}); the engine's weights are stale or corrupt, stopping")
    return report
