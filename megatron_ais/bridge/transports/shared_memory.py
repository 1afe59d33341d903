"""`shm`: the stage's ranks run on the engine's node and write their pieces straight into the staging arena."""
from __future__ import annotations

from megatron_ais.bridge.arena import open_staging_buffer
from megatron_ais.bridge.buckets import ManifestEntry
from megatron_ais.bridge.plan import Bucket
from megatron_ais.bridge.transports import StageTransport, send_manifest


class SharedMemoryTransport(StageTransport):
    """`arena_refs`/`arena_bytes`: the arena's buffers to map, one per slot (the receiver's own on the engine's
    rank); `stage_offset` and `scratch_offset`: where stage `stage`'s layout and its scratch region start in each."""

    name = "shm"
    lags = True  # every bucket has its own bytes of the arena

    def __init__(self, engine_rank: int, receiver, stage: int, arena_refs: tuple, arena_bytes: int,
                 stage_offset: int, scratch_offset: int):
        super().__init__(engine_rank, receiver)
        self.buffers = list(receiver.arenas) if receiver is not None else [
            open_staging_buffer(ref, arena_bytes) for ref in arena_refs]
        self.buffer = self.buffers[0]
        self.stage, self.offsets = stage, (stage_offset, scratch_offset)

    def placement(self, bucket: Bucket) -> tuple[int, int]:
        return self.offsets

    def deliver(self, sync_id: int, bucket: Bucket, manifest: list[ManifestEntry]) -> int:
        if self.receiver is not None:
            self.receiver.receive(sync_id, self.stage, manifest)
            return 0
        return send_manifest(self.engine_rank, sync_id, manifest, None)
