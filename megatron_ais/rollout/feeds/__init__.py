"""How one complete, verified set of weights reaches an engine's workers: one class per feed, one interface,
chosen when the engine starts (`build_feed`).

    in_process      a colocated engine: its worker lives in this process and takes views of the tensors
    shared_memory   a separate engine on this node: its workers map the bridge's staging arena in place
    broadcast       a separate engine's workers are sent the arena over a process group of their own and verify it

What a feed applies (`EngineWeights`) is either HF-named tensors or the bridge's verified staging arena
(`bridge.arena.ArenaWeights`: its ref and the manifest entries of every tensor, at absolute offsets).
"""
from __future__ import annotations

from typing import Union

import torch

from megatron_ais.bridge.arena import ArenaWeights, arena_views

EngineWeights = Union[list[tuple[str, torch.Tensor]], ArenaWeights]


def named_tensors(weights: EngineWeights) -> list[tuple[str, torch.Tensor]]:
    """The weights as (HF name, tensor) pairs: views of the arena where they live in one."""
    return arena_views(weights.ref, list(weights.entries)) if isinstance(weights, ArenaWeights) else weights


class WeightFeed:
    """Applies a complete set of weights to a started vLLM engine (`llm`)."""

    def apply(self, llm, weights: EngineWeights) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the feed holds for one engine start (the engine stopped)."""


def build_feed(placement: str, weight_feed: str, tensor_parallel_size: int) -> WeightFeed:
    """The feed of an engine with this placement and --rollout-weight-feed."""
    from megatron_ais.rollout.feeds.broadcast import BroadcastFeed
    from megatron_ais.rollout.feeds.in_process import InProcessFeed
    from megatron_ais.rollout.feeds.shared_memory import SharedMemoryFeed

    if placement == "colocated":
        return InProcessFeed()
    if weight_feed == "broadcast":
        return BroadcastFeed(tensor_parallel_size)
    return SharedMemoryFeed()
