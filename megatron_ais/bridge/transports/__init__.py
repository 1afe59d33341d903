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

from megatron_ais.bridge import delta
from megatron_ais.bridge.buckets import ManifestEntry
from megatron_ais.bridge.plan import Bucket

TRANSPORTS = ("auto", "shm", "distributed")


@dataclasses.dataclass(frozen=True)
class BucketMessage:
    """One delivered bucket: its manifest, and where its shipped bytes go in the stage's layout (`span`: start and
    byte count; None when the bytes are in the arena already); `delta`: the bytes that follow are the bucket's
    delta (`bridge.delta`) against what the arena's slot holds, not the bucket itself."""

    sync_id: int
    manifest: list[ManifestEntry]
    span: tuple[int, int] | None = None
    delta: delta.DeltaHeader | None = None


@dataclasses.dataclass(frozen=True)
class StageEnd:
    """A stage is done with a sync (or failed with `error`)."""

    sync_id: int
    error: str | None = None


def send_manifest(dst: int, sync_id: int, manifest: list[ManifestEntry], window: torch.Tensor | None,
                  payload: torch.Tensor | None = None, header: delta.DeltaHeader | None = None) -> int:
    """Point-to-point delivery of one bucket's manifest, followed, when the bucket's bytes `window` are given, by
    them or by `payload`, their delta of `header`; return the bytes shipped."""
    span = None if window is None else (manifest[0].offset if manifest else 0, window.numel())
    dist.send_object_list([BucketMessage(sync_id, manifest, span, header)], dst=dst)
    if window is None:
        return 0
    shipped = window if header is None else payload
    dist.send(shipped, dst=dst)
    if shipped.is_cuda:
        # NCCL's wait only orders this GPU's stream: the stage's other writers refill the buffer with the next
        # bucket as soon as they pass the next barrier, so the bytes must be gone before this returns
        torch.cuda.current_stream(shipped.device).synchronize()
    return shipped.numel()


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
            _receive_bytes(src, stage, receiver, stage_bytes, message)
        receiver.receive(message.sync_id, stage, message.manifest)


def _receive_bytes(src: int, stage: int, receiver, stage_bytes: int, message: BucketMessage) -> None:
    """A shipped bucket's bytes into its place in the arena's slot, or its delta applied there (the slot holds what
    the delta was encoded against: the sender checked); bytes out of the stage's bounds go nowhere and fail the
    sync."""
    start, nbytes = message.span
    inside = 0 <= start and start + nbytes <= stage_bytes
    device = receiver.arena.data.device
    if message.delta is None:
        dist.recv(receiver.window(stage, start, start + nbytes) if inside else
                  torch.empty(nbytes, dtype=torch.uint8, device=device), src=src)
    else:
        plan = delta.DeltaPlan.of(delta.relative(message.manifest, start))
        payload = torch.empty(message.delta.payload_bytes(plan), dtype=torch.uint8, device=device)
        dist.recv(payload, src=src)
        if inside:
            try:
                delta.apply(receiver.window(stage, start, start + nbytes), plan, message.delta, payload)
            except ValueError as err:
                receiver.abort(f"sync {message.sync_id} refused, engine keeps its weights: stage {stage}: {err}")
    if device.type == "cuda":
        # NCCL's wait (and the delta's scatter) only order this GPU's current stream; the receiver checksums the
        # bytes on a stream of its own, which must not read them before they have landed
        torch.cuda.current_stream(device).synchronize()
    if not inside:
        receiver.abort(f"sync {message.sync_id} refused: stage {stage} sent bytes [{start}, {start + nbytes}) "
                       f"outside its {stage_bytes} bytes")


class StageTransport:
    """A stage's writers' side of one transport: the buffer they write into (`buffer`, the current sync's slot's,
    `use_slot`), where a bucket's bytes sit in it, and how the stage's sender delivers each bucket and ends a sync.
    `receiver` is set on the engine's rank only."""

    name = ""
    lags = False  # whether a bucket may be written before the one before it is delivered (no bytes shared)

    def __init__(self, engine_rank: int, receiver=None):
        self.engine_rank, self.receiver = engine_rank, receiver
        self.buffers = []  # what the writers write into, one per slot of the arena
        self.buffer = None

    def slot_buffer(self, slot: int):
        """The buffer a sync into the arena's slot `slot` writes."""
        return self.buffers[slot]

    def use_slot(self, sync_id: int, slot: int, held: int | None = None) -> None:
        """Sync `sync_id` goes into the arena's slot `slot`, which holds committed sync `held` (None: none, or
        not asked: without delta syncs)."""
        self.buffer = self.slot_buffer(slot)

    def placement(self, bucket: Bucket) -> tuple[int, int]:
        """(byte offset of the stage layout's 0 in `buffer`, byte offset of the scratch region)."""
        raise NotImplementedError

    def before_bucket(self, index: int) -> None:
        """Called on every writer before it writes bucket `index`."""

    def deliver(self, sync_id: int, bucket: Bucket, manifest: list[ManifestEntry]) -> int:
        """The stage's sender: hand one written, checksummed bucket to the engine's rank; return the bytes it
        shipped (0: they are in the arena already)."""
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
