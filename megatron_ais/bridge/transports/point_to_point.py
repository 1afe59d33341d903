"""`distributed`: the stage's writers assemble each bucket in a buffer of their own (shared by the stage's ranks of
one node) and the stage's sender ships its bytes point-to-point into the engine's arena — with `--bridge-delta on`,
once the arena's slot holds what it shipped there last, only the elements that changed (`bridge.delta`)."""
from __future__ import annotations

import torch.distributed as dist

from megatron_ais.bridge.arena import open_staging_buffer, staging_buffer
from megatron_ais.bridge.buckets import ManifestEntry
from megatron_ais.bridge.delta import DeltaSender, relative
from megatron_ais.bridge.plan import Bucket, StagePlan
from megatron_ais.bridge.transports import StageTransport, send_manifest


class PointToPointTransport(StageTransport):
    """Collective over the stage's writers (`group`) at construction: the sender creates the bucket buffer (the
    largest bucket and the scratch region), the others map it; it serves every slot of the arena."""

    name = "distributed"

    def __init__(self, engine_rank: int, plan: StagePlan, group, sender: int, is_sender: bool, pp_rank: int,
                 on_gpu: bool, delta_mode: str = "off", full_sync_interval: int = 32):
        super().__init__(engine_rank)
        self.group = group
        # only a sender with delta syncs keeps what it shipped; without, a bucket goes whole at no extra cost
        self.delta = DeltaSender(full_sync_interval) if is_sender and delta_mode == "on" else None
        self.max_bucket = max((b.nbytes for b in plan.buckets), default=0)
        nbytes = self.max_bucket + plan.scratch_bytes
        shared = [None]
        if is_sender:
            self.buffer = staging_buffer(f"bridge-stage{pp_rank}", nbytes, on_gpu)
            shared = [self.buffer.ref]
        if dist.get_world_size(group) > 1:
            dist.broadcast_object_list(shared, src=sender, group=group)
        if not is_sender:
            self.buffer = open_staging_buffer(shared[0], nbytes)
        self.buffers = [self.buffer]

    def slot_buffer(self, slot: int):
        return self.buffer  # every slot's buckets: the receiver places the shipped bytes in its slot

    def use_slot(self, sync_id: int, slot: int, held: int | None = None) -> None:
        super().use_slot(sync_id, slot, held)
        if self.delta is not None:
            self.delta.begin(sync_id, slot, held)

    def placement(self, bucket: Bucket) -> tuple[int, int]:
        return -bucket.start, self.max_bucket

    def before_bucket(self, index: int) -> None:
        if index and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)  # the sender has shipped the last bucket out of the shared buffer

    def deliver(self, sync_id: int, bucket: Bucket, manifest: list[ManifestEntry]) -> int:
        window = self.buffer.data[: bucket.nbytes]
        if self.delta is None:
            return send_manifest(self.engine_rank, sync_id, manifest, window)
        header, payload = self.delta.bucket(window, relative(manifest, bucket.start))
        return send_manifest(self.engine_rank, sync_id, manifest, window, payload, header)
