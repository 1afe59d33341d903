"""The staging arena's copies on the other nodes with engines. The bridge writes and verifies one arena, on the
arena rank's node; every other node whose ranks drive engines gets one copy of it per sync, received by that node's
first engine host over a process group of the arena rank and those hosts (a broadcast: NCCL pipelines it as a ring
on GPUs), so what crosses nodes crosses once per node, not once per engine. Each copy is verified against the
sync's manifest (every tensor's layout and checksum) before any engine applies anything: a copy that differs
refuses the sync on every rank, and every engine keeps the weights it had.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_ais.bridge.arena import ArenaWeights, SharedBuffer, buffer_data, entry_views
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
    rank together (it creates a process group)."""

    def __init__(self, arena_rank: int, leaders: tuple[int, ...], rank: int):
        self.arena_rank, self.leaders, self.rank = arena_rank, leaders, rank
        self.group = dist.new_group(sorted({arena_rank, *leaders})) if leaders else None
        self.copy: SharedBuffer | None = None

    def forward(self, weights: ArenaWeights) -> tuple[ArenaWeights | None, str | None]:
        """Collective on every rank. The arena rank sends the sync's bytes; each leader receives them into its
        node's copy and verifies every tensor: it returns (the copy as ArenaWeights, None) or (None, why it differs);
        other ranks return (None, None)."""
        if self.group is None or (self.rank != self.arena_rank and self.rank not in self.leaders):
            return None, None
        nbytes = max(e.offset + e.nbytes for e in weights.entries)
        if self.rank == self.arena_rank:
            broadcast_bytes(self.group, buffer_data(weights.ref)[:nbytes], CHUNK_BYTES)
            return None, None
        if self.copy is None or self.copy.nbytes < nbytes:
            self.copy = SharedBuffer.create("node-arena", nbytes)
        receive_bytes(self.group, self.copy.data[:nbytes], CHUNK_BYTES)
        views = entry_views(self.copy.data, list(weights.entries))
        try:
            verify_tensors([(entry, view) for entry, (_, view) in zip(weights.entries, views)])
        except ValueError as err:
            return None, f"the copy of sync's arena on this node differs: {err}"
        return ArenaWeights(self.copy.ref, weights.entries), None

    def close(self) -> None:
        if self.copy is not None:
            self.copy.close()
            self.copy = None
