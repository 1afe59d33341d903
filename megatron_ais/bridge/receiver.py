"""The receiver on the engine's rank: it owns the staging arena that holds one complete set of engine tensors, takes
each stage's buckets as its transport delivers them (`bridge.transports`), verifies them and commits a sync.

The receiver verifies every tensor of every bucket against its manifest (name, dtype, shape, place, bytes,
checksum) and the layout it expects (the layout at once, the bytes' checksums on threads of their own —
`HOST_VERIFIERS`, each a run of a bucket's tensors — so that reading bucket k overlaps the writing of bucket k + 1:
every bucket has its own place in the arena; a GPU arena's checksums — one pass per bucket where Triton is
(`kernels.bucket_pass`) — run on a stream of their own and their figures stay on the GPU until the commit reads
every bucket's back at once), and applies the arena's tensors to the engine in one call only when every stage has
delivered everything intact; a refused sync leaves the engine's weights untouched (the arena is a staging copy, not
the engine's weights). The engine gets the arena itself (`arena.ArenaWeights`: a separate engine maps it, a
colocated one takes views). On CUDA nodes the arena is GPU memory shared by CUDA IPC instead of /dev/shm unless
`--bridge-arena host` keeps it in host memory (`arena.staging_buffer`).

Double-buffered (`slots=2`, the asynchronous loop's): the arena is two buffers, and a sync writes the one the last
committed sync did not, so that a sync's writes, made while the engines generate, never touch the weights an engine
restarted meanwhile reloads (the last committed ones). The writers pick the same slot: the count of committed syncs
modulo the slots, which every rank knows (`WeightBridge.completed`).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from typing import Callable

import torch

from megatron_ais.bridge.arena import (ArenaWeights, CudaBuffer, SharedBuffer, arena_on_gpu, gpu_arena_shortfall,
                                       remove_stale_shared_files, staging_buffer)
from megatron_ais.bridge.buckets import ManifestEntry, start_checksums, verify_checksums
from megatron_ais.bridge.plan import EngineTensor
from megatron_ais.errors import ArgumentValidationError, SyncError

# a host arena's buckets are checksummed by this many threads, each a run of about equal bytes: one core reads
# memory slower than the writers, each on its own core, fill the arena (tools/bench_bridge.py, docs/benchmarks.md)
HOST_VERIFIERS = 2


@dataclasses.dataclass
class SyncReceiver:
    """Verifies delivered buckets in the staging arena and commits a complete sync atomically: `commit` returns the
    verified arena (`arena.ArenaWeights`: its ref, a file path or CUDA IPC handle, and the verified entries at
    absolute offsets), which a separate engine maps and a colocated one takes views of (`feeds.named_tensors`); the
    run's fleet applies it (`RolloutFleet.apply`).

    `on_commit` is for tests and benchmarks without a fleet: given each committed arena (e.g. one engine's
    `update_weights`), and `commit` returns what it returns. A run leaves it None.
    """

    on_commit: Callable[[object], object] | None = None
    slots: int = 1  # staging buffers: 2 double-buffers the arena
    arenas: list = dataclasses.field(default_factory=list)  # one SharedBuffer or CudaBuffer per slot
    slot: int = 0  # the buffer the current (or last) sync writes
    stage_offsets: tuple[int, ...] = ()
    expected: tuple[tuple[EngineTensor, ...], ...] = ()
    sync_id: int | None = None
    received: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    pending: list = dataclasses.field(default_factory=list)  # delivered buckets' checksums, started
    views: dict = dataclasses.field(default_factory=dict)  # (slot, stage, name) -> the tensor's view of the arena
    verifier: concurrent.futures.ThreadPoolExecutor | None = None
    arena_on_gpu: bool | None = None  # None: GPU memory where CUDA is available (`arena.staging_buffer`)
    ipc_consumers: int = 0  # engine processes on other GPUs of the node that map a GPU arena (a CUDA context each)
    slot_syncs: list = dataclasses.field(default_factory=list)  # per slot: the committed sync it holds, or None
    sums_passes: dict = dataclasses.field(default_factory=dict)  # a GPU arena's buckets' checksum passes, built once
    verify_stream: object = None  # a GPU arena's verification stream (`_verification_stream`)

    @property
    def arena(self) -> SharedBuffer | CudaBuffer | None:
        """The buffer of the current (or last) sync."""
        return self.arenas[self.slot] if self.arenas else None

    def prepare(self, stages: list[list[EngineTensor]], stage_bytes: list[int], scratch_bytes: list[int]
                ) -> tuple[tuple, tuple[int, ...], tuple[int, ...]]:
        """Size the arena's buffers for `stages` (reusing them when the layout is unchanged); return (their refs,
        paths or CUDA IPC handles, one per slot; stage offsets; scratch offsets), the same in every slot."""
        offsets, total = [], 0
        for nbytes in stage_bytes:
            offsets.append(total)
            total += nbytes
        scratch = []
        for nbytes in scratch_bytes:
            scratch.append(total)
            total += nbytes
        expected = tuple(tuple(s) for s in stages)
        if len(self.arenas) != self.slots or self.arena.nbytes < total or expected != self.expected:
            self._release_arenas()
            remove_stale_shared_files()
            self._check_gpu_room(total)
            self.arenas = [staging_buffer(f"bridge-arena{slot}", total, self.arena_on_gpu)
                           for slot in range(self.slots)]
            self.slot_syncs = [None] * self.slots
        self.stage_offsets, self.expected, self.views, self.sums_passes = tuple(offsets), expected, {}, {}
        return tuple(a.ref for a in self.arenas), self.stage_offsets, tuple(scratch)

    def _check_gpu_room(self, nbytes: int) -> None:
        """Before a GPU arena's buffers are allocated: refuse, in one line naming the flags, an arena that does not
        fit beside the trainer (the allocator's cached free blocks count as free)."""
        if not (arena_on_gpu("auto") if self.arena_on_gpu is None else self.arena_on_gpu):
            return
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        shortfall = gpu_arena_shortfall(nbytes, self.slots, self.ipc_consumers, free)
        if shortfall is not None:
            raise ArgumentValidationError(shortfall)

    def begin(self, sync_id: int, slot: int = 0) -> None:
        """Take sync `sync_id`'s deliveries into buffer `slot`."""
        concurrent.futures.wait(self.pending)  # a sync that failed before its commit may have left some
        self.sync_id, self.received, self.error, self.pending, self.slot = sync_id, {}, None, [], slot
        self.slot_syncs[slot] = None  # from now on the slot holds no committed sync until this one commits

    def window(self, stage: int, start: int, end: int) -> torch.Tensor:
        """Return the current slot's arena bytes [start, end) of a stage's layout."""
        base = self.stage_offsets[stage]
        return self.arena.data[base + start: base + end]

    def receive(self, sync_id: int, stage: int, manifest: list[ManifestEntry]) -> None:
        """Take one delivered bucket (already in the arena): its layout is checked now, its bytes on the verifier
        thread; any mismatch refuses the whole sync."""
        if self.error is not None:
            return
        try:
            if sync_id != self.sync_id:
                raise SyncError(f"bucket of sync {sync_id} arrived during sync {self.sync_id}")
            expected = {t.name: t for t in self.expected[stage]}
            checks = []
            for entry in manifest:
                want = expected.get(entry.name)
                if want is None or (want.dtype, want.shape, want.offset, want.nbytes) != (
                        entry.dtype, entry.shape, entry.offset, entry.nbytes):
                    raise ValueError(f"{entry.name}: manifest says {entry.dtype}{list(entry.shape)} at byte "
                                     f"{entry.offset}, the engine expects "
                                     + (f"{want.dtype}{list(want.shape)} at byte {want.offset}" if want else
                                        "no such tensor"))
                checks.append((entry, self._tensor(stage, want)))
                self.received.setdefault(stage, {})[entry.name] = entry.checksum
        except (ValueError, SyncError) as err:
            self.abort(f"sync {sync_id} refused, engine keeps its weights: {err}")
            return
        if self.verifier is None:
            self.verifier = concurrent.futures.ThreadPoolExecutor(HOST_VERIFIERS,
                                                                  thread_name_prefix="megatron-ais-verify")
        stream = self._verification_stream()
        for part in split_by_bytes(checks, 1 if stream is not None else HOST_VERIFIERS):
            self.pending.append(self.verifier.submit(_start_checksums, part, self.sums_passes, stream))

    def _wait_for_verification(self) -> None:
        """Finish every delivered bucket's checksums (a GPU arena's figures read back at once); the first mismatch
        refuses the sync."""
        pending, self.pending = self.pending, []
        started = [future.result() for future in pending]
        error = next((s for s in started if isinstance(s, str)), None)
        if error is None and started:
            checks = [check for checks, _ in started for check in checks]
            with _on_stream(self._verification_stream()):  # the figures are read back behind their passes
                error = _verify_checksums(checks, [f for _, figures in started for f in figures])
        if error is not None:
            self.abort(f"sync {self.sync_id} refused, engine keeps its weights: {error}")

    def _verification_stream(self):
        """A GPU arena's checksums run on a stream of their own, so that they overlap the writers' next buckets
        instead of queueing behind them; no event orders them after the bytes they read: every writer waited for a
        bucket's writes before it was delivered (its figures' read-back or `wait_for_device_writes`; the engine's rank,
        for what it received, `transports._receive_bytes`)."""
        data = self.arena.data
        if not data.is_cuda:
            return None
        if self.verify_stream is None or self.verify_stream.device != data.device:
            self.verify_stream = torch.cuda.Stream(device=data.device)
        return self.verify_stream

    def _tensor(self, stage: int, t: EngineTensor) -> torch.Tensor:
        view = self.views.get((self.slot, stage, t.name))
        if view is None:
            view = self.views[self.slot, stage, t.name] = self.arena.view(self.stage_offsets[stage] + t.offset,
                                                                         t.torch_dtype, t.shape)
        return view

    def abort(self, reason: str) -> None:
        if self.error is None:
            self.error = reason

    def commit(self, sync_id: int):
        """The verified arena when every stage delivered every tensor intact (or what `on_commit` returns of it);
        raise SyncError otherwise."""
        self._wait_for_verification()
        if self.error is None:
            for stage, tensors in enumerate(self.expected):
                missing = [t.name for t in tensors if t.name not in self.received.get(stage, ())]
                if missing:
                    self.abort(f"sync {sync_id}: stage {stage} did not deliver {len(missing)} tensors "
                               f"({missing[:3]}...); engine keeps its weights")
                    break
        self.sync_id = None
        if self.error is not None:
            raise SyncError(self.error)
        self.slot_syncs[self.slot] = sync_id
        weights = ArenaWeights(self.arena.ref, tuple(
            ManifestEntry(t.name, t.dtype, t.shape, self.stage_offsets[s] + t.offset, t.nbytes,
                          self.received[s][t.name])
            for s, tensors in enumerate(self.expected) for t in tensors))
        return weights if self.on_commit is None else self.on_commit(weights)

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.shutdown(wait=True)
            self.verifier = None
        self.views = {}
        self._release_arenas()

    def _release_arenas(self) -> None:
        for arena in self.arenas:
            arena.close()
        self.arenas = []


def split_by_bytes(checks: list[tuple[ManifestEntry, torch.Tensor]], parts: int
                   ) -> list[list[tuple[ManifestEntry, torch.Tensor]]]:
    """`checks` in order, cut into at most `parts` runs of about equal bytes (a run holds whole tensors)."""
    total, runs, run, done = sum(e.nbytes for e, _ in checks), [], [], 0
    for check in checks:
        run.append(check)
        done += check[0].nbytes
        if done * parts >= total * (len(runs) + 1) and len(runs) < parts - 1:
            runs.append(run)
            run = []
    return runs + [run] if run else runs


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _start_checksums(checks: list[tuple[ManifestEntry, torch.Tensor]], passes: dict, stream
                     ) -> tuple[list, list] | str:
    """A bucket's layouts checked and checksums started on `stream` (None: the host's or the current one;
    `buckets.start_checksums`, its one-pass tables kept in `passes`): (checks, figures), or the first mismatch."""
    try:
        with _on_stream(stream):
            return checks, start_checksums(checks, passes)
    except ValueError as err:
        return str(err)


def _verify_checksums(checks: list[tuple[ManifestEntry, torch.Tensor]], figures: list) -> str | None:
    """The first tensor whose checksum is not its entry's, None when all match."""
    try:
        verify_checksums(checks, figures)
    except ValueError as err:
        return str(err)
    return None
