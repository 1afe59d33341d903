"""A separate engine's feed on the trainer's node: its workers map the bridge's verified staging arena in place
(a shared-memory file, or GPU memory by CUDA IPC). Tensors that live in no arena are written to a safetensors
file in shared memory, which the workers check against a manifest before applying."""
from __future__ import annotations

import dataclasses
import json
import os

from safetensors.torch import save_file

from megatron_ais.bridge.arena import ArenaWeights, encode_ref, shared_directory
from megatron_ais.bridge.buckets import manifest_entry
from megatron_ais.engine.feeds.base import EngineWeights, WeightFeed


def entries_json(entries) -> str:
    """Manifest entries as the JSON text workers receive through collective_rpc."""
    return json.dumps([dataclasses.asdict(e) for e in entries])


class SharedMemoryFeed(WeightFeed):
    def apply(self, llm, weights: EngineWeights) -> None:
        if isinstance(weights, ArenaWeights):
            llm.collective_rpc("megatron_ais_apply_shared",
                               args=(encode_ref(weights.ref), entries_json(weights.entries)))
        else:
            self._apply_through_file(llm, weights)

    @staticmethod
    def _apply_through_file(llm, named_tensors) -> None:
        path = os.path.join(shared_directory(), f"megatron-ais-{os.getpid()}-sync.safetensors")
        manifest = entries_json([manifest_entry(n, t) for n, t in named_tensors])
        try:
            save_file({n: t.contiguous() for n, t in named_tensors}, path + ".tmp", metadata={"format": "pt"})
            os.replace(path + ".tmp", path)
            llm.collective_rpc("megatron_ais_apply_weights", args=(path, manifest))
        finally:
            for p in (path, path + ".tmp"):
                if os.path.exists(p):
                    os.remove(p)
