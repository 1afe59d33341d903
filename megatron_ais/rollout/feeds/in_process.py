"""A colocated engine's feed: its worker lives in this process and takes the tensors (views, no copy)."""
from __future__ import annotations

from megatron_ais.rollout.feeds import EngineWeights, WeightFeed, named_tensors


def colocated_worker(llm):
    """The vLLM worker of an engine running in this process."""
    worker = llm.llm_engine.model_executor.driver_worker
    return getattr(worker, "worker", worker)


class InProcessFeed(WeightFeed):
    def apply(self, llm, weights: EngineWeights) -> None:
        from megatron_ais.rollout.worker_extension import apply_weights_in_worker

        apply_weights_in_worker(colocated_worker(llm), named_tensors(weights))
