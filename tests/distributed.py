"""Multi-rank test helper: real gloo processes through megatron_ais.launch.spawn."""
from megatron_ais.launch import spawn

__all__ = ["spawn"]
