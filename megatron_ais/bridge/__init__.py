"""Resharding bridge: Megatron shards -> HF names -> blockwise FP8 -> buckets -> rollout engine."""
