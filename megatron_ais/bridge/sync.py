"""Trainer side of a weight sync: every TP rank of the sending data-parallel replica writes its own pieces of
each HF tensor (quantized to blockwise FP8 where the policy says so) into the engine's staging arena or into its
stage's bucket buffer; the stage's sender checksums each bucket and delivers its manifest (and bytes, when
shipped) through the stage's transport; the engine's rank verifies and commits. No rank gathers a full tensor,
let alone the model."""
from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from megatron_ais.bridge.buckets import ManifestEntry, StageWriters
from megatron_ais.bridge.config import BridgeConfig
from megatron_ais.bridge.layout import BridgeLayout, stage_transports
from megatron_ais.bridge.pieces import (BucketSums, OnePassWrites, PieceWrites, bucket_pieces, bucket_writes,
                                        scratch_pieces, scratch_share, wait_for_device_writes)
from megatron_ais.bridge.plan import Bucket, EngineTensor, StagePlan, hf_targets, plan_stage
from megatron_ais.bridge.receiver import SyncReceiver
from megatron_ais.bridge.transports import StageTransport, receive_stage
from megatron_ais.bridge.transports.point_to_point import PointToPointTransport
from megatron_ais.bridge.transports.shared_memory import SharedMemoryTransport
from megatron_ais.distributed import node_name, share
from megatron_ais.errors import as_sync_error
from megatron_ais.mapping.distributed import expert_tensor_parallel_rank, shard_context


@dataclasses.dataclass
class SyncStats:
    """What one sync moved and how long it took on this rank."""

    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0
    written_bytes: int = 0  # what this rank wrote itself (its pieces; FP8 ones as codes)
    shipped_bytes: int = 0  # what this stage's sender shipped point-to-point (full buckets or their FP8 deltas)
    seconds: float = 0.0
    transport: str = ""
    committed: object = None  # what the receiver's `apply` returned, on every rank (small: it is pickled)


@dataclasses.dataclass(frozen=True)
class WrittenBucket:
    """A bucket this rank has written (or failed to write: `error`), its figures on their way back (`sums`);
    `read_back_waits`: reading them back also waits for its writes; `scratch`: this writer's share of what is
    quantized once every writer's pieces are in the scratch region (None: nothing)."""

    bucket: Bucket
    sums: BucketSums
    read_back_waits: bool
    error: str | None
    scratch: PieceWrites | OnePassWrites | None


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """What each rank tells the others when the bridge connects: its stage, and if it is the stage's sender, the
    stage's engine tensors and sizes."""

    pp_rank: int
    is_sender: bool
    tensors: list[EngineTensor] | None
    nbytes: int
    scratch_bytes: int
    host: str


@dataclasses.dataclass(frozen=True)
class ArenaPlacement:
    """The staging arena as the engine's rank shares it: its buffers' refs (one per slot: two when double-buffered)
    and size, and where each stage's layout and scratch region start in each of them."""

    refs: tuple
    nbytes: int
    stage_offsets: tuple[int, ...]
    scratch_offsets: tuple[int, ...]


class WeightBridge:
    """Syncs a model's weights into a rollout engine, every call a complete, verified, atomic update.

    Every rank calls `sync` together; the engine's rank passes the receiver. The first sync exchanges the stages'
    layouts once, maps the shared buffers and builds each rank's pieces (views that do not move, one set per slot of
    a double-buffered arena); later syncs only move bytes and manifests. Usable as a context manager (`close` on
    exit).
    """

    def __init__(self, chunks: list, build, config: BridgeConfig, layout: BridgeLayout,
                 receiver: SyncReceiver | None = None):
        self.chunks, self.build, self.config, self.layout = chunks, build, config, layout
        self.receiver = receiver
        self.writers: StageWriters | None = None  # the ranks that write for this rank's stage
        self.plan: StagePlan | None = None
        self.transport: StageTransport | None = None
        self.stage_bytes: list[int] = []
        self.pieces: list[list[PieceWrites | OnePassWrites]] = []  # per slot, per bucket
        # this writer's share of the scratch quantization, per slot, per bucket
        self.scratch_writes: list[list[PieceWrites | OnePassWrites | None]] = []
        self.connected = False
        self.slots = 1  # buffers of the arena (the receiver's, learnt when the bridge connects)
        self.completed = 0  # committed syncs: the next one writes slot `completed % slots`

    def __enter__(self) -> "WeightBridge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _connect(self) -> None:
        lay = self.layout
        if lay.writes:
            ctx = shard_context(self.build, lay.tp_rank)
            expert_ctx = shard_context(self.build, expert_tensor_parallel_rank(self.build), expert=True)
            self.plan = plan_stage(hf_targets(self.chunks, self.build, ctx, self.config.policy, expert_ctx, lay.role),
                                   self.config.policy, self.config.bucket_bytes)
        # one group per stage of the ranks that write for it (TP ranks, and EP x expert-TP ranks of MoE layers):
        # every rank creates every group, in the same order
        for stage, writers in enumerate(lay.stage_writers):
            group = dist.new_group(list(writers))
            if lay.writes and stage == lay.pp_rank:
                self.writers = StageWriters(group, lay.is_sender)
        infos = [None] * dist.get_world_size()
        dist.all_gather_object(infos, StageInfo(lay.pp_rank, lay.is_sender, list(self.plan.tensors) if lay.is_sender
                                                else None, self.plan.nbytes if self.plan else 0,
                                                self.plan.scratch_bytes if self.plan else 0, node_name()))
        stages = sorted((i for i in infos if i.is_sender), key=lambda i: i.pp_rank)
        self.stage_bytes = [i.nbytes for i in stages]
        engine = infos[lay.engine_rank]
        modes = stage_transports(lay.hosts, self.config.transport, engine.host, engine.pp_rank)
        arena = self._share_arena(stages, modes)
        self.slots = len(arena.refs)
        if lay.writes:
            self.transport = self._stage_transport(modes[lay.pp_rank], arena)
            self.pieces = [self._pieces(slot) for slot in range(self.slots)]
            self.scratch_writes = [self._scratch_writes(slot) for slot in range(self.slots)]

    def _share_arena(self, stages: list[StageInfo], modes: list[str]) -> ArenaPlacement:
        """The engine's rank sizes the arena for every stage (and the scratch regions of stages that write into it);
        every rank learns where it is."""
        def prepare():
            self.receiver.arena_on_gpu = self.config.arena_on_gpu
            refs, offsets, scratch = self.receiver.prepare([i.tensors for i in stages], self.stage_bytes,
                                                          [i.scratch_bytes if m == "shm" else 0
                                                           for i, m in zip(stages, modes)])
            return ArenaPlacement(refs, self.receiver.arena.nbytes, offsets, scratch)

        return share(prepare, src=self.layout.engine_rank)

    def _stage_transport(self, mode: str, arena: ArenaPlacement) -> StageTransport:
        lay = self.layout
        if mode == "shm":
            return SharedMemoryTransport(lay.engine_rank, self.receiver if lay.is_engine_rank else None, lay.pp_rank,
                                         arena.refs, arena.nbytes, arena.stage_offsets[lay.pp_rank],
                                         arena.scratch_offsets[lay.pp_rank])
        return PointToPointTransport(lay.engine_rank, self.plan, self.writers.group, lay.stage_senders[lay.pp_rank],
                                     lay.is_sender, lay.pp_rank, self.config.arena_on_gpu, self.config.delta,
                                     self.config.full_sync_interval)

    def _pieces(self, slot: int) -> list[PieceWrites | OnePassWrites]:
        """This rank's pieces of every bucket as ready-made views into slot `slot`'s buffer (and, on a GPU, the
        bucket's one-pass tables), built once per bridge (the buffers and the parameters' storage do not move)."""
        buffer, policy = self.transport.slot_buffer(slot), self.config.policy
        return [bucket_writes(bucket_pieces(self.plan, self.plan.bucket_targets(b), b, buffer,
                                            *self.transport.placement(b), policy.block_size), policy)
                for b in self.plan.buckets]

    def _scratch_writes(self, slot: int) -> list[PieceWrites | OnePassWrites | None]:
        """This writer's share (`scratch_share`) of each bucket's scratch-assembled tensors, quantized into slot
        `slot`; built once."""
        buffer, policy = self.transport.slot_buffer(slot), self.config.policy
        writer, writers = dist.get_rank(self.writers.group), dist.get_world_size(self.writers.group)
        shares = [scratch_share(scratch_pieces(self.plan, b, buffer, *self.transport.placement(b), policy), writer,
                                writers, self.layout.is_sender) if b.scratch else [] for b in self.plan.buckets]
        return [bucket_writes(share, policy) if share else None for share in shares]

    def _start_bucket(self, index: int, bucket: Bucket, stats: SyncStats, slot: int) -> WrittenBucket:
        """Write this rank's pieces of bucket `index` into slot `slot` (FP8 pieces quantized on the way) and start
        reading their figures back without waiting."""
        sums, writes, error = BucketSums(), self.pieces[slot][index], None
        try:
            stats.written_bytes += writes.write(sums, self.config.policy)
            sums.start()
        except ValueError as err:
            error = str(err)
        return WrittenBucket(bucket, sums, writes.read_back_waits and error is None, error,
                             self.scratch_writes[slot][index])

    def _finish_bucket(self, written: WrittenBucket) -> tuple[list[ManifestEntry] | None, str | None]:
        """Read a written bucket's figures (refusing NaN/Inf by name), quantize this writer's share of the stage's
        scratch-assembled tensors, and agree on the manifest; return it (sender) and the first error."""
        bucket, sums, error = written.bucket, written.sums, written.error
        if error is None:
            try:
                sums.resolve()
            except ValueError as err:
                error = str(err)
        if not written.read_back_waits:
            wait_for_device_writes(self.transport.buffer)
        if bucket.scratch:
            error = self.writers.agree(error)  # every piece is in the scratch area before any writer quantizes it
            if error is None and written.scratch is not None:
                try:
                    written.scratch.write(sums, self.config.policy)
                    sums.resolve()
                except ValueError as err:
                    error = str(err)
                if not written.scratch.read_back_waits:
                    wait_for_device_writes(self.transport.buffer)
        return self.writers.manifest(self.plan.tensors[bucket.first: bucket.last], sums.totals, error)

    def _deliver(self, sync_id: int, written: WrittenBucket, stats: SyncStats) -> str | None:
        """Finish a written bucket and, on the sender, deliver it; return the first writer's error."""
        manifest, error = self._finish_bucket(written)
        if error is None and self.layout.is_sender:
            bucket = written.bucket
            stats.shipped_bytes += self.transport.deliver(sync_id, bucket, manifest)
            stats.buckets += 1
            stats.tensors += bucket.last - bucket.first
            stats.bytes += bucket.nbytes
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, bucket.nbytes)
        return error

    def _send_stage(self, sync_id: int, stats: SyncStats, slot: int, held: int | None) -> None:
        """Write and deliver every bucket in order. A bucket whose figures come back with its writes (one pass on
        a GPU) into a transport whose buckets do not share bytes is finished one bucket later, after the next one is
        queued: the host reads, agrees and delivers while the device writes. Every writer finishes the buckets in
        order, so the writers' collectives match whichever buckets each one lags."""
        error, pending = None, None
        self.transport.use_slot(sync_id, slot, held)
        for index, bucket in enumerate(self.plan.buckets):
            self.transport.before_bucket(index)
            written = self._start_bucket(index, bucket, stats, slot)
            if pending is not None:
                error, pending = self._deliver(sync_id, pending, stats), None
                if error is not None:
                    break
            if self.transport.lags and written.read_back_waits and not bucket.scratch:
                pending = written
                continue
            error = self._deliver(sync_id, written, stats)
            if error is not None:
                break
        if pending is not None and error is None:
            error = self._deliver(sync_id, pending, stats)
        if self.layout.is_sender:
            self.transport.finish(sync_id, error)

    def _receive_and_commit(self, sync_id: int):
        """The engine's rank: take the other stages' deliveries, then verify and apply the sync; return what the
        receiver's `apply` returned."""
        for stage, src in enumerate(self.layout.stage_senders):
            if src != self.layout.engine_rank:
                receive_stage(src, stage, self.receiver, self.stage_bytes[stage])
        with as_sync_error():
            return self.receiver.commit(sync_id)

    def sync(self, sync_id: int) -> SyncStats:
        """One complete sync; raises SyncError on every rank when the engine refused it."""
        start = time.perf_counter()
        if not self.connected:
            self._connect()
            self.connected = True
        stats = SyncStats(transport=self.transport.name if self.transport else "")
        slot = self.completed % self.slots
        # with delta syncs the senders ship deltas only against the sync the slot holds
        held = share(lambda: self.receiver.slot_syncs[slot], src=self.layout.engine_rank) \
            if self.config.delta == "on" else None
        if self.layout.is_engine_rank:
            self.receiver.begin(sync_id, slot)
        if self.layout.writes:
            self._send_stage(sync_id, stats, slot, held)
        stats.committed = share(lambda: self._receive_and_commit(sync_id), src=self.layout.engine_rank)
        stats.seconds = time.perf_counter() - start
        self.completed += 1
        return stats

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport = None
        self.pieces = []  # their views map the buffer
