"""Adaptive Importance Sampling (AIS-R, docs/ais-method.md §2) and the TIS / MIS / IcePop baselines."""
from megatron_ais.ais.coefficient import AISResult, AISState, ais_coefficient, correction_weights, metrics_per_lag
from megatron_ais.ais.config import AISConfig
from megatron_ais.ais.corrections import Correction, apply_correction
from megatron_ais.ais.guards import exclude_invalid_sequences, invalid_sequences
from megatron_ais.ais.statistics import STAT_NAMES, max_abs_logratio, mismatch_statistics, reduce_statistics

__all__ = ["AISConfig", "AISResult", "AISState", "Correction", "STAT_NAMES", "ais_coefficient",
           "apply_correction", "correction_weights", "exclude_invalid_sequences",
           "invalid_sequences", "max_abs_logratio", "metrics_per_lag", "mismatch_statistics", "reduce_statistics"]
