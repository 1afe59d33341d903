"""Transports that carry buckets from trainer ranks to the rank that hosts the rollout engine, and the
receiver that verifies every bucket and commits a sync only when all of it has arrived intact.

    in-process   the engine lives in the sending process: tensors are handed over directly
    distributed  torch.distributed point-to-point (gloo on CPU, NCCL on GPU) from other trainer ranks, e.g.
                 pipeline stages that do not host the engine
Both deliver to a `SyncReceiver`, which stages verified buckets and applies them in one call at commit, so a
failed or tampered sync never leaves the engine with a mix of old and new weights.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from megatron_ais.bridge.buckets import ManifestEntry, manifest_entry, verify_bucket


class SyncError(RuntimeError):
    """A sync was refused; the engine keeps its previous weights."""


@dataclasses.dataclass
class SyncReceiver:
    """Verifies buckets against their manifests, stages them, and applies a complete sync atomically.

    `apply(named_tensors)` installs one complete set of weights (e.g. RolloutEngine.update_weights).
    """

    apply: Callable[[list[tuple[str, torch.Tensor]]], object]
    num_senders: int = 1
    sync_id: int | None = None
    staged: list = dataclasses.field(default_factory=list)
    finished_senders: dict = dataclasses.field(default_factory=dict)
    received_buckets: dict = dataclasses.field(default_factory=dict)
    staged_bytes: int = 0
    peak_staged_bytes: int = 0

    def begin(self, sync_id: int) -> None:
        self.sync_id, self.staged, self.finished_senders, self.received_buckets = sync_id, [], {}, {}
        self.staged_bytes = 0

    def receive(self, sync_id: int, sender: int, bucket: list[tuple[str, torch.Tensor]],
                manifest: list[ManifestEntry]) -> None:
        """Verify and stage one bucket; a mismatch aborts the whole sync."""
        if sync_id != self.sync_id:
            self.abort()
            raise SyncError(f"bucket of sync {sync_id} arrived during sync {self.sync_id}")
        try:
            verify_bucket(bucket, manifest)
        except ValueError as err:
            self.abort()
            raise SyncError(f"sync {sync_id} refused, engine keeps its weights: {err}") from err
        self.staged.extend(bucket)
        self.received_buckets[sender] = self.received_buckets.get(sender, 0) + 1
        self.staged_bytes += sum(e.nbytes for e in manifest)
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def finish(self, sync_id: int, sender: int, num_buckets: int) -> bool:
        """Record that `sender` sent `num_buckets`; apply once every sender has finished. Return True if applied."""
        if self.received_buckets.get(sender, 0) != num_buckets:
            self.abort()
            raise SyncError(f"sync {sync_id}: sender {sender} announced {num_buckets} buckets, "
                            f"{self.received_buckets.get(sender, 0)} arrived; engine keeps its weights")
        self.finished_senders[sender] = num_buckets
        if len(self.finished_senders) < self.num_senders:
            return False
        staged, self.staged, self.staged_bytes = self.staged, [], 0
        names = [n for n, _ in staged]
        if len(set(names)) != len(names):
            raise SyncError(f"sync {sync_id}: duplicate tensor names {sorted({n for n in names if names.count(n) > 1})[:4]}")
        self.apply(staged)
        self.sync_id = None
        return True

    def abort(self) -> None:
        self.staged, self.sync_id, self.staged_bytes = [], None, 0


class Transport(Protocol):
    """Sender side of one sync."""

    def begin(self, sync_id: int) -> None: ...
    def send(self, sync_id: int, bucket: list[tuple[str, torch.Tensor]], manifest: list[ManifestEntry]) -> None: ...
    def finish(self, sync_id: int, num_buckets: int) -> None: ...


@dataclasses.dataclass
class InProcessTransport:
    """The engine is in this process: buckets go straight to its receiver."""

    receiver: SyncReceiver
    sender: int = 0

    def begin(self, sync_id):
        if self.receiver.sync_id != sync_id:
            self.receiver.begin(sync_id)

    def send(self, sync_id, bucket, manifest):
        self.receiver.receive(sync_id, self.sender, bucket, manifest)

    def finish(self, sync_id, num_buckets):
        self.receiver.finish(sync_id, self.sender, num_buckets)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    # gloo has no float8 types: move raw bytes
    return tensor.contiguous().view(-1).view(torch.uint8)


@dataclasses.dataclass
class DistributedSender:
    """Sends buckets to the engine's rank with torch.distributed point-to-point (gloo / NCCL)."""

    dst: int
    group: object = None

    def begin(self, sync_id):
        pass

    def send(self, sync_id, bucket, manifest):
        dist.send_object_list([("bucket", sync_id, manifest)], dst=self.dst, group=self.group)
        for _, tensor in bucket:
            dist.send(_wire(tensor), dst=self.dst, group=self.group)

    def finish(self, sync_id, num_buckets):
        dist.send_object_list([("finish", sync_id, num_buckets)], dst=self.dst, group=self.group)


def receive_from(src: int, receiver: SyncReceiver, sender_id: int, group=None) -> None:
    """On the engine's rank: receive one sender's buckets for the current sync until it finishes."""
    while True:
        message = [None]
        dist.recv_object_list(message, src=src, group=group)
        kind, sync_id, payload = message[0]
        if kind == "finish":
            receiver.finish(sync_id, sender_id, payload)
            return
        bucket = []
        for entry in payload:
            raw = torch.empty(entry.nbytes, dtype=torch.uint8)
            dist.recv(raw, src=src, group=group)
            dtype = getattr(torch, entry.dtype)
            bucket.append((entry.name, raw.view(dtype).view(entry.shape) if entry.nbytes else
                           torch.empty(entry.shape, dtype=dtype)))
        receiver.receive(sync_id, sender_id, bucket, payload)


def manifest_for(bucket: list[tuple[str, torch.Tensor]]) -> list[ManifestEntry]:
    """Return the manifest of a bucket."""
    return [manifest_entry(n, t) for n, t in bucket]
