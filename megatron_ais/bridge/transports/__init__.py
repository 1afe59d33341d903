"""How a pipeline stage's buckets reach the engine's staging arena: one class per transport, one interface,
chosen per stage when the bridge connects (`layout.stage_transports`).

    shm          the stage's ranks run on the engine's node: they write their pieces straight into the arena
                 and the stage's sender only sends the bucket's manifest (in process when it is the engine's
                 own rank, point-to-point otherwise)                                   `SharedMemoryTransport`
    distributed  the stage's ranks assemble each bucket in a local shared buffer and its sender ships the bytes
                 with torch.distributed point-to-point (gloo on CPU, NCCL on GPU) into the arena
                                                                                      `PointToPointTransport`

Senders and the engine's rank talk in `BucketMessage`s and one `StageEnd` per sync (`receive_stage`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_ais.bridge.buckets import ManifestEntry
from megatron_ais.bridge.plan import Bucket

TRANSPORTS = ("auto", "shm", "distributed")


@dataclasses.dataclass(frozen=True)
class BucketMessage:
    """One delivered bucket: its manifest, and where its shipped bytes go in the stage's layout (`span`: start and
    byte count; None when the bytes are in the arena already)."""

    sync_id: int
    manifest: list[ManifestEntry]
    span: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class StageEnd:
    """A stage is done with a sync (or failed with `error`)."""

    sync_id: int
    error: str | None = None


def send_manifest(dst: int, sync_id: int, manifest: list[ManifestEntry], window: torch.Tensor | None) -> None:
    """Point-to-point delivery of one bucket's manifest, followed by its bytes when `window` is given."""
    span = None if window is None else (manifest[0].offset if manifest else 0, window.numel())
    dist.send_object_list([BucketMessage(sync_id, manifest, span)], dst=dst)
    if window is not None:
        dist.send(window, dst=dst)
        if window.is_cuda:
            # NCCL's wait only orders this GPU's stream: the stage's other writers refill the buffer with the next
            # bucket as soon as they pass the next barrier, so the bytes must be gone before this returns
            torch.cuda.current_stream(window.device).synchronize()


def receive_stage(src: int, stage: int, receiver, stage_bytes: int) -> None:
    """On the engine's rank: take one stage sender's messages until it ends; shipped bytes go straight into the
    stage's part of the arena (or, when their place is out of the stage's bounds, nowhere, and the sync fails)."""
    while True:
        message = [None]
        dist.recv_object_list(message, src=src)
        message = message[0]
        if isinstance(message, StageEnd):
            if message.error is not None:
                receiver.abort(f"sync {message.sync_id} refused, engine keeps its weights: {message.error}")
            return
        if message.span is not None:
            start, nbytes = message.span
            if 0 <= start and start + nbytes <= stage_bytes:
                dist.recv(receiver.window(stage, start, start + nbytes), src=src)
            else:
                dist.recv(torch.empty(nbytes, dtype=torch.uint8, device=receiver.arena.data.device), src=src)
                receiver.abort(f"sync {message.sync_id} refused: stage {stage} sent bytes [{start}, {start + nbytes}) "
                               f"outside its {stage_bytes} bytes")
        receiver.receive(message.sync_id, stage, message.manifest)


class StageTransport:
    """A stage's writers' side of one transport: the buffer they write into (`buffer`, the current sync's slot's,
    `use_slot`), where a bucket's bytes sit in it, and how the stage's sender delivers each bucket and ends a sync.
    `receiver` is set on the engine's rank only."""

    name = ""

    def __init__(self, engine_rank: int, receiver=None):
        self.engine_rank, self.receiver = engine_rank, receiver
        self.buffers = []  # what the writers write into, one per slot of the arena
        self.buffer = None

    def slot_buffer(self, slot: int):
        """The buffer a sync into the arena's slot `slot` writes."""
        return self.buffers[slot]

    def use_slot(self, slot: int) -> None:
        """The next sync goes into the arena's slot `slot`."""
        self.buffer = self.slot_buffer(slot)

    def placement(self, bucket: Bucket) -> tuple[int, int]:
        """(byte offset of the stage layout's 0 in `buffer`, byte offset of the scratch region)."""
        raise NotImplementedError

    def before_bucket(self, index: int) -> None:
        """Called on every writer before it writes bucket `index`."""

    def deliver(self, sync_id: int, bucket: Bucket, manifest: list[ManifestEntry]) -> None:
        """The stage's sender: hand one written, checksummed bucket to the engine's rank."""
        raise NotImplementedError

    def finish(self, sync_id: int, error: str | None) -> None:
        """The stage's sender: tell the engine's rank that the stage is done with this sync (or failed)."""
        if self.receiver is not None:
            if error is not None:
                self.receiver.abort(f"sync {sync_id} refused, engine keeps its weights: {error}")
        else:
            dist.send_object_list([StageEnd(sync_id, error)], dst=self.engine_rank)

    def close(self) -> None:
        for buffer in self.buffers:
            if all(buffer is not arena for arena in getattr(self.receiver, "arenas", ())):
                buffer.close()
        self.buffers, self.buffer = [], None
