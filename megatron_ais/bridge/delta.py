"""Delta syncs (`--bridge-delta on`) wherever bytes cross nodes — a stage's buckets shipped to the arena
(`DeltaSender`), the arena forwarded to other nodes' copies (`node_copies`): once a receiver holds a verified copy
of the engine's weights, a sync sends, of every tensor, only the elements that changed since that copy — each as its
position in its tensor and its new bytes — whatever the tensor holds: FP8 or packed 4-bit codes (a byte, two codes,
is an element), their scales, the tensors kept in BF16.

Element-sparse on purpose: an optimizer step changes a small fraction of the codes (0.24 % after one Megatron Adam
step at lr 1e-6, `tools/bench_bridge.py --delta`; 0.4 % on a Qwen3-0.6B-shaped layer, `tests/bridge/test_delta.py`)
but spread over nearly every 128 x 128 block, so whole-block deltas would save nothing; and it moves few BF16 values
by a representable step. A tensor whose changed elements would take more bytes as (position, bytes) pairs than in
full (e.g. block scales, most of which move with their block's amax) is sent in full.

Integrity stays end to end: the receiver verifies every tensor of its updated copy against the sync's manifest (the
sender's checksums of the full tensors), so a dropped, altered or misplaced element refuses the sync like a flipped
byte. Both ends keep the version of the copy they share; the sender sends a full copy whenever they differ (the
first sync, a refused one, a new layout) and every `--bridge-full-sync-interval` syncs. An engine restart needs no
full sync: the copies belong to the trainer ranks (the arena to its rank, a node's copy to its first engine host),
and a restarted engine reloads them.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais.bridge.arena import byte_view

DELTA_MODES = ("off", "on")
POSITION_BYTES = 4  # int32 positions: a tensor sent element-sparse has fewer than 2^31 elements (`DeltaPlan.of`)
FULL = -1  # in `DeltaHeader.changed`: the tensor is sent in full


def layout_key(entries) -> tuple:
    """What must be unchanged for a delta to apply: every tensor's name, dtype, shape and place."""
    return tuple((e.name, e.dtype, tuple(e.shape), e.offset) for e in entries)


def element_bytes(entry) -> int:
    """Bytes per element of a manifest entry's dtype."""
    return getattr(torch, entry.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class DeltaHeader:
    """What a delta payload holds: per element-sparse tensor (in manifest order) how many changed elements it
    carries, or FULL."""

    changed: tuple[int, ...]

    def payload_bytes(self, plan: "DeltaPlan") -> int:
        sparse = sum(n for n in self.changed if n != FULL)
        return (plan.dense_bytes + sparse * POSITION_BYTES
                + sum(e.nbytes if n == FULL else n * element_bytes(e) for e, n in zip(plan.sparse, self.changed)))


@dataclasses.dataclass(frozen=True)
class DeltaPlan:
    """A manifest split into the tensors a delta sends element-sparse and those (of 2^31 elements or more) it sends
    in full."""

    sparse: tuple  # manifest entries
    dense: tuple  # every other entry

    @classmethod
    def of(cls, entries) -> "DeltaPlan":
        sparse = tuple(e for e in entries if e.nbytes // element_bytes(e) < 2 ** 31)
        return cls(sparse, tuple(e for e in entries if e not in sparse))

    @property
    def dense_bytes(self) -> int:
        return sum(e.nbytes for e in self.dense)


def changed_elements(new: torch.Tensor, base: torch.Tensor, size: int) -> torch.Tensor:
    """The int32 positions of the `size`-byte elements at which two tensors' bytes differ."""
    differs = new.reshape(-1, size) != base.reshape(-1, size)
    return torch.nonzero(differs.any(dim=1)).view(-1).to(torch.int32)


def _bytes_of(where: torch.Tensor, size: int) -> torch.Tensor:
    """The byte positions of the `size`-byte elements at `where` (int64)."""
    return (where.long().unsqueeze(1) * size + torch.arange(size, device=where.device)).reshape(-1)


def encode(data: torch.Tensor, plan: DeltaPlan, base: dict[str, torch.Tensor]) -> tuple[DeltaHeader, torch.Tensor]:
    """The delta of the arena bytes `data` against `base` (each element-sparse tensor's bytes in the receiver's copy,
    brought up to `data` on the way): one uint8 payload of every changed position (int32, first, so that they stay
    aligned), the dense tensors' bytes, then per element-sparse tensor its changed elements' bytes, or its bytes in
    full when that is smaller."""
    positions, values, changed = [], [], []
    for entry in plan.sparse:
        new, size = data[entry.offset: entry.offset + entry.nbytes], element_bytes(entry)
        where = changed_elements(new, base[entry.name], size)
        if where.numel() * (POSITION_BYTES + size) >= entry.nbytes:
            changed.append(FULL)
            values.append(new)
            base[entry.name].copy_(new)
            continue
        index = _bytes_of(where, size)
        changed.append(where.numel())
        positions.append(where.view(torch.uint8))
        values.append(new[index])
        base[entry.name][index] = values[-1]
    parts = positions + [data[e.offset: e.offset + e.nbytes] for e in plan.dense] + values
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=data.device)
    return DeltaHeader(tuple(changed)), payload


def apply(data: torch.Tensor, plan: DeltaPlan, header: DeltaHeader, payload: torch.Tensor) -> None:
    """Write a delta payload into the arena bytes `data`, which hold the version it was encoded against: the dense
    tensors' bytes in place, each element-sparse tensor's changed elements at their positions (or its bytes in full).
    A payload whose size its header does not describe, or a position outside its tensor, raises ValueError; whether
    the bytes are right is for the manifest's checksums to say."""
    if payload.numel() != header.payload_bytes(plan):
        raise ValueError(f"the delta payload holds {payload.numel()} bytes, its header describes "
                         f"{header.payload_bytes(plan)}")
    sparse = sum(n for n in header.changed if n != FULL)
    positions = byte_view(payload, 0, torch.int32, (sparse,)).long()
    start, first = sparse * POSITION_BYTES, 0
    for entry in plan.dense:
        data[entry.offset: entry.offset + entry.nbytes].copy_(payload[start: start + entry.nbytes])
        start += entry.nbytes
    for entry, count in zip(plan.sparse, header.changed):
        target, size = data[entry.offset: entry.offset + entry.nbytes], element_bytes(entry)
        if count == FULL:
            target.copy_(payload[start: start + entry.nbytes])
            start += entry.nbytes
            continue
        where = positions[first: first + count]
        first += count
        if count and not (0 <= int(where.min()) and int(where.max()) < entry.nbytes // size):
            raise ValueError(f"{entry.name}: a delta position lies outside its {entry.nbytes // size} elements")
        target[_bytes_of(where, size)] = payload[start: start + count * size]
        start += count * size


def snapshot(data: torch.Tensor, plan: DeltaPlan) -> dict[str, torch.Tensor]:
    """Each element-sparse tensor's bytes in `data`, copied: the base the next delta is encoded against."""
    return {e.name: data[e.offset: e.offset + e.nbytes].clone() for e in plan.sparse}


def relative(entries, start: int) -> list:
    """Manifest entries with offsets from byte `start` (a bucket's window) instead of the stage layout's 0."""
    return [dataclasses.replace(e, offset=e.offset - start) for e in entries]


class DeltaSender:
    """A stage sender's side of delta syncs into the arena's slots: the tensors it last shipped into each slot and
    the sync that shipped them. A sync ships deltas when the slot still holds that sync (the receiver says,
    `SyncReceiver.slot_syncs`) and fewer than `full_sync_interval` deltas came in a row; else full buckets. Costs one
    copy of the stage's tensors per slot, where the stage's buffer lives."""

    def __init__(self, full_sync_interval: int):
        self.full_sync_interval = full_sync_interval
        self.bases: dict[int, dict[str, torch.Tensor]] = {}  # slot -> tensor name -> its bytes, as shipped
        self.shipped: dict[int, int] = {}  # slot -> the sync whose tensors `bases` holds
        self.deltas_in_a_row = 0
        self.slot, self.active = 0, False

    def begin(self, sync_id: int, slot: int, held: int | None) -> None:
        """Sync `sync_id` goes into `slot`, which holds committed sync `held` (None: none, or not known)."""
        self.slot = slot
        self.active = (held is not None and self.shipped.get(slot) == held
                       and self.deltas_in_a_row < self.full_sync_interval)
        self.deltas_in_a_row = self.deltas_in_a_row + 1 if self.active else 0
        self.shipped[slot] = sync_id

    def bucket(self, window: torch.Tensor, entries) -> tuple[DeltaHeader | None, torch.Tensor]:
        """What to ship of one written bucket (`window`: its bytes; `entries`: its manifest, offsets relative to
        the window): (its delta's header, payload), or (None, the bytes) for a full bucket."""
        plan, base = DeltaPlan.of(entries), self.bases.setdefault(self.slot, {})
        if self.active:
            return encode(window, plan, base)
        base.update(snapshot(window, plan))
        return None, window
