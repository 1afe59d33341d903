"""What every feed shares: the weights a feed applies (`EngineWeights`: HF-named tensors or the bridge's verified
staging arena) and the interface one class per feed implements."""
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
