"""A colocated engine's feed: its worker lives in this process and takes the tensors (views, no copy)."""
from __future__ import annotations

from megatron_ais.engine.feeds.base import EngineWeights, WeightFeed, named_tensors
from megatron_ais.engine.vllm_compat import colocated_worker, reload_weights


class InProcessFeed(WeightFeed):
    def apply(self, llm, weights: EngineWeights) -> None:
        reload_weights(colocated_worker(llm), named_tensors(weights))
