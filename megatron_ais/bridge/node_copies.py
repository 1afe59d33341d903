"""The staging arena's copies on the other nodes with engines. The bridge writes and verifies one arena, on the
arena rank's node; every other node whose ranks drive engines gets one copy of it per sync, received by that node's
first engine host over a process group of the arena rank and those hosts, so what crosses nodes crosses once per
node, not once per engine. The copies live where the arena does (`--bridge-arena`): a GPU arena is broadcast from
GPU memory into a GPU copy on each leader, so the group's NCCL backend carries it (a ring, no host copies); a host
arena into shared host memory, by gloo. The backend follows the tensors' device. Each copy is verified against the
sync's manifest (every tensor's layout and checksum) before any engine applies anything: a copy that differs
refuses the sync on every rank, and every engine keeps the weights it had.

Where the arena is double-buffered (η ≥ 1: syncs are written while the engines generate), so is each node's copy: a
forward writes the copy the last committed one (applied by every engine) did not, so an engine of that node that
dies and is restarted meanwhile (its host's generation goes on during a `--partial-rollouts` sync) reloads intact
weights, the last ones it applied; a refused forward leaves them as they were too.

With `--bridge-delta on` a node whose copy holds the sync's weights the arena rank last sent into it receives only the
elements that changed since (`bridge.delta`), applied to that copy in place and verified the same way.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from megatron_ais.bridge import delta
from megatron_ais.bridge.arena import ArenaWeights, CudaBuffer, SharedBuffer, buffer_data, entry_views, staging_buffer
from megatron_ais.bridge.buckets import verify_tensors
from megatron_ais.distributed import CHUNK_BYTES, broadcast_bytes, receive_bytes


def node_leaders(engine_hosts: tuple[int, ...], node_of: list[str], arena_rank: int) -> tuple[int, ...]:
    """The first engine host of every node but the arena rank's: the ranks that hold a copy."""
    leaders, seen = [], {node_of[arena_rank]}
    for host in engine_hosts:
        if node_of[host] not in seen:
            seen.add(node_of[host])
            leaders.append(host)
    return tuple(leaders)


class NodeCopies:
    """Forwards each committed sync from the arena rank to the node leaders and verifies it there. Built by every
    rank together (it creates a process group).

    `delta` ('off' or 'on', `--bridge-delta`): whether a forward may send only the elements that changed since the
    copy every leader verified last in the slot it writes; a full copy goes whenever a member lacks that copy (the
    first forwards, a refused one, a new layout) and after `full_sync_interval` deltas. `on_gpu`: the arena is in GPU
    memory (`BridgeConfig.arena_on_gpu`, the same on every rank), and so are the bytes broadcast and the copies.
    `slots`: copies per node, the arena's buffers (`GRPOLoopConfig.staging_slots`)."""

    def __init__(self, arena_rank: int, leaders: tuple[int, ...], rank: int, delta_mode: str = "off",
                 full_sync_interval: int = 32, on_gpu: bool = False, slots: int = 1):
        self.arena_rank, self.leaders, self.rank = arena_rank, leaders, rank
        self.group = dist.new_group(sorted({arena_rank, *leaders})) if leaders else None
        self.on_gpu = on_gpu
        self.copies: list[SharedBuffer | CudaBuffer | None] = [None] * slots
        self.delta_mode, self.full_sync_interval = delta_mode, full_sync_interval
        self.forwards = 0  # forwards this member took part in (the same count on every member)
        self.committed = 0  # forwards every node verified: the next one writes slot `committed % slots`
        # per slot: (forward, layout) of the copy this member shares; the arena rank: the tensors of that copy
        self.versions: list[tuple[int, int | None] | None] = [None] * slots
        self.bases: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self.deltas_since_full = 0
        self.sent_bytes = 0  # what the arena rank's last forward broadcast

    def forward(self, weights: ArenaWeights) -> tuple[ArenaWeights | None, str | None]:
        """Collective on every rank. The arena rank sends the sync's bytes (or their delta); each leader receives
        them into its node's copy and verifies every tensor: it returns (the copy as ArenaWeights, None) or (None,
        why it differs); other ranks return (None, None)."""
        if self.group is None or (self.rank != self.arena_rank and self.rank not in self.leaders):
            return None, None
        self.forwards += 1
        slot, entries = self.committed % len(self.copies), list(weights.entries)
        nbytes = max(e.offset + e.nbytes for e in entries)
        # what a delta needs, worked out only with delta syncs (a full forward does not look at it)
        with_delta = self.delta_mode == "on"
        layout = zlib.crc32(repr(delta.layout_key(entries)).encode()) if with_delta else None
        plan = delta.DeltaPlan.of(entries) if with_delta else None
        if self.rank == self.arena_rank:
            self._send(buffer_data(weights.ref)[:nbytes], plan, self._may_send_delta(slot, layout), slot)
            self.versions[slot] = (self.forwards, layout)
            return None, None
        self._may_send_delta(slot, layout)  # its collective: every member takes part
        header = [None]
        if with_delta:
            dist.broadcast_object_list(header, src=self.arena_rank, group=self.group)
        self.versions[slot] = None
        try:
            self._receive(nbytes, plan, header[0], slot)
            views = entry_views(self.copies[slot].data, entries)
            verify_tensors([(entry, view) for entry, (_, view) in zip(entries, views)])
        except ValueError as err:
            return None, f"the copy of sync's arena on this node differs: {err}"
        self.versions[slot] = (self.forwards, layout)
        return ArenaWeights(self.copies[slot].ref, weights.entries), None

    def commit(self) -> None:
        """Every rank, once every node verified the last forward (its engines apply it): the next forward writes
        the other copy, so this one stays intact while a restarted engine may reload it."""
        self.committed += 1

    def _may_send_delta(self, slot: int, layout: int | None) -> bool:
        """With delta syncs (collective over the group): whether every member holds the same copy in `slot`, in
        this layout, and fewer than the interval's deltas came in a row."""
        if self.delta_mode != "on":
            return False
        versions = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(versions, self.versions[slot], group=self.group)
        return (self.deltas_since_full < self.full_sync_interval and versions[0] is not None
                and versions[0][1] == layout and len(set(versions)) == 1)

    def _send(self, data: torch.Tensor, plan: delta.DeltaPlan | None, send_delta: bool, slot: int) -> None:
        """The arena rank: with delta syncs broadcast the header (None: a full copy follows); then the bytes (a
        delta: against what `slot` holds)."""
        if send_delta:
            header, payload = delta.encode(data, plan, self.bases[slot])
            self.deltas_since_full += 1
        else:
            header, payload = None, data
            self.bases[slot] = delta.snapshot(data, plan) if self.delta_mode == "on" else {}
            self.deltas_since_full = 0
        if self.delta_mode == "on":
            dist.broadcast_object_list([header], src=self.arena_rank, group=self.group)
        broadcast_bytes(self.group, payload, CHUNK_BYTES, self.device)
        self.sent_bytes = payload.numel()

    @property
    def device(self) -> torch.device:
        """Where the bytes cross: this rank's GPU for a GPU arena (NCCL), host memory otherwise (gloo)."""
        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")

    def _receive(self, nbytes: int, plan: delta.DeltaPlan | None, header: delta.DeltaHeader | None,
                 slot: int) -> None:
        """A leader: the full copy into its node's copy in `slot`, or a delta applied to it (which holds the
        version the delta was encoded against: every member said so before it was sent)."""
        if header is None:
            if self.copies[slot] is None or self.copies[slot].nbytes < nbytes:
                if self.copies[slot] is not None:
                    self.copies[slot].close()
                self.copies[slot] = staging_buffer(f"node-arena-{slot}", nbytes, self.on_gpu)
            receive_bytes(self.group, self.copies[slot].data[:nbytes], CHUNK_BYTES)
            return
        payload = receive_bytes(self.group, torch.empty(header.payload_bytes(plan), dtype=torch.uint8,
                                                        device=self.device), CHUNK_BYTES)
        delta.apply(self.copies[slot].data, plan, header, payload)

    def close(self) -> None:
        for copy in self.copies:
            if copy is not None:
                copy.close()
        self.copies = [None] * len(self.copies)
