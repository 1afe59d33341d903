"""The AIS registries, keyed by flag value: the diagnostics, the combiner and the λ rules (`diagnostics.py`) and the
corrections (`corrections.py`) register into them, and `AISConfig` checks its names against them. It imports nothing else
from `ais/`, so every module of the package can import it. Each is titled by the flag that selects from it."""
from __future__ import annotations

from megatron_ais.registry import Registry

SEVERITY = Registry("--ais-severity")
RELIABILITY = Registry("--ais-reliability")
VARIANCE = Registry("--ais-variance")
COMBINERS = Registry("--ais-combiner")
LAMBDA_RULES = Registry("--ais-lambda")
CORRECTIONS = Registry("--is-correction")
