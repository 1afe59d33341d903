"""How one complete, verified set of weights reaches an engine's workers: one class per feed, one interface,
chosen when the engine starts (`build_feed`).

    in_process      a colocated engine: its worker lives in this process and takes views of the tensors
    shared_memory   a separate engine on this node: its workers map the bridge's staging arena in place
    broadcast       a separate engine's workers are sent the arena over a process group of their own and verify it

What a feed applies (`base.EngineWeights`) is either HF-named tensors or the bridge's verified staging arena
(`bridge.arena.ArenaWeights`: its ref and the manifest entries of every tensor, at absolute offsets).
"""
from __future__ import annotations

from megatron_ais.engine.feeds.base import WeightFeed
from megatron_ais.engine.feeds.broadcast import BroadcastFeed
from megatron_ais.engine.feeds.in_process import InProcessFeed
from megatron_ais.engine.feeds.shared_memory import SharedMemoryFeed


def build_feed(placement: str, weight_feed: str, tensor_parallel_size: int) -> WeightFeed:
    """The feed of an engine with this placement and --rollout-weight-feed."""
    if placement == "colocated":
        return InProcessFeed()
    if weight_feed == "broadcast":
        return BroadcastFeed(tensor_parallel_size)
    return SharedMemoryFeed()
