"""Trainer side of a weight sync: every TP rank of the sending data-parallel replica writes its own pieces of
each HF tensor (quantized to blockwise FP8 where the policy says so) into the engine's staging arena or into its
stage's bucket buffer; the stage's sender checksums each bucket and delivers its manifest (and bytes, when
shipped); the engine's rank verifies and commits. No rank gathers a full tensor, let alone the model."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import socket
import time
from typing import Callable

import torch
import torch.distributed as dist

from kernels import fp8_blockwise
from kernels.cpu_bridge import (Position, checksum_sums, checksum_sums_device, copy_check_finite,
                                copy_check_finite_deferred, fold_checksum, fp8_quantize_into, read_back,
                                supports_quantize, unsigned_sums)
from kernels.fp8_blockwise import (all_finite, blockwise_fp8_quantize, blockwise_fp8_quantize_deferred,
                                   blockwise_fp8_quantize_reference_deferred, refuse_non_finite)
from megatron_ais.bridge.arena import (ARENA_PLACES, CudaBuffer, SharedBuffer, arena_on_gpu, open_staging_buffer,
                                       staging_buffer)
from megatron_ais.bridge.buckets import ManifestEntry
from megatron_ais.bridge.plan import HFTarget, StagePlan, WriterRole, hf_targets, plan_stage
from megatron_ais.bridge.quantization import SCALE_SUFFIX, QuantizationPolicy
from megatron_ais.bridge.transport import TRANSPORTS, SyncError, SyncReceiver, receive_stage, send_end, send_manifest
from megatron_ais.mapping.distributed import expert_tensor_parallel_rank, shard_context


@dataclasses.dataclass(frozen=True)
class BridgeConfig:
    """Bucket size, transport and the engine-precision policy."""

    bucket_size_mb: float = 512.0
    policy: QuantizationPolicy = QuantizationPolicy()
    transport: str = "auto"
    arena: str = "auto"

    def __post_init__(self):
        arena_on_gpu(self.arena)  # refuses an unknown place, or gpu without CUDA

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * (1 << 20))

    @property
    def arena_on_gpu(self) -> bool:
        return arena_on_gpu(self.arena)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BridgeConfig":
        return cls(bucket_size_mb=args.bridge_bucket_size_mb, transport=args.bridge_transport,
                   arena=args.bridge_arena, policy=QuantizationPolicy(precision=args.rollout_precision,
                                                                      exclude=tuple(args.bridge_fp8_exclude or ())))


def add_bridge_args(parser: argparse.ArgumentParser) -> None:
    """Resharding-bridge flags."""
    g = parser.add_argument_group("bridge")
    g.add_argument("--bridge-bucket-size-mb", type=float, default=512.0,
                   help="Bytes per bucket: the unit that is checksummed, delivered and verified, and the size of "
                        "a stage's send buffer when buckets are shipped over torch.distributed.")
    g.add_argument("--bridge-transport", choices=TRANSPORTS, default="auto",
                   help="How trainer ranks deliver weights to the engine's staging arena (/dev/shm on CPU, GPU memory "
                        "shared by CUDA IPC on CUDA nodes): 'shm' = ranks on the engine's node write their shards into "
                        "it directly; 'distributed' = each "
                        "pipeline stage's sender ships buckets point-to-point (gloo/NCCL); 'auto' = shm for "
                        "stages on the engine's node, distributed for the others.")
    g.add_argument("--bridge-arena", choices=ARENA_PLACES, default="auto",
                   help="Where the engine's staging arena (one engine-format copy of the weights, the price of atomic "
                        "syncs) and shipped stages' bucket buffers live: gpu = GPU memory of the engine's rank, "
                        "shared by CUDA IPC (device-to-device writes); host = shared host memory (/dev/shm: no GPU "
                        "memory, PCIe copies both ways; for models whose arena does not fit beside the trainer and "
                        "the engine); auto = gpu on CUDA nodes, host otherwise.")
    g.add_argument("--bridge-fp8-exclude", nargs="*", default=None, metavar="REGEX",
                   help="HF tensor-name patterns to keep in BF16 under FP8 rollouts (q/k/v and gate/up together).")


@dataclasses.dataclass
class SyncStats:
    """What one sync moved and how long it took on this rank."""

    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0
    written_bytes: int = 0  # what this rank wrote itself (its pieces; FP8 ones as codes)
    seconds: float = 0.0
    transport: str = ""


@dataclasses.dataclass(frozen=True)
class BridgeLayout:
    """Who writes, who sends and who receives, from megatron's parallel state (taken at the call site).

    The engine lives on global rank `engine_rank`. Dense tensors are shared out among the data-parallel replicas
    on the writers' node(s) (`dense_writer_replicas`), routed experts are written by the ranks of
    expert-data-parallel replica 0 (context-parallel rank 0 both); each pipeline stage's sender is replica 0's TP
    rank 0, and `stage_senders[s]` is stage s's. `stage_writers[s]` are all the ranks that write for stage s.
    """

    engine_rank: int
    stage_senders: tuple[int, ...]
    is_sender: bool
    rank: int
    writes: bool = True
    pp_rank: int = 0
    tp_rank: int = 0
    hosts: tuple[tuple[str, ...], ...] = ()  # hosts[s]: hosts of stage s's writing ranks
    stage_writers: tuple[tuple[int, ...], ...] = ()
    role: WriterRole = WriterRole()

    @classmethod
    def from_parallel_state(cls, engine_rank: int = 0) -> "BridgeLayout":
        from megatron.core import parallel_state as ps

        rank = dist.get_rank()
        cp0 = ps.get_context_parallel_rank() == 0
        dp_rank = ps.get_data_parallel_rank()
        experts = cp0 and ps.get_expert_data_parallel_rank() == 0
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        marks = [None] * dist.get_world_size()
        dist.all_gather_object(marks, (rank, pp_rank, dp_rank, cp0, experts, tp_rank, socket.gethostname()))
        stages = sorted({m[1] for m in marks})
        dense = {p: dense_writer_replicas([m for m in marks if m[1] == p]) for p in stages}
        writer_marks = [m for m in marks if m[3] and (m[4] or m[2] in dense[m[1]])]
        senders = tuple(next(m[0] for m in marks if m[1] == p and m[2] == 0 and m[3] and m[5] == 0) for p in stages)
        hosts = tuple(tuple(sorted({m[6] for m in writer_marks if m[1] == p})) for p in stages)
        writers = tuple(tuple(m[0] for m in writer_marks if m[1] == p) for p in stages)
        replicas = dense[pp_rank]
        role = WriterRole(dense_replica=replicas.index(dp_rank) if cp0 and dp_rank in replicas else None,
                          dense_replicas=len(replicas), experts=experts, ep_rank=ps.get_expert_model_parallel_rank(),
                          ep_size=ps.get_expert_model_parallel_world_size())
        return cls(engine_rank=engine_rank, stage_senders=senders, is_sender=rank in senders, rank=rank,
                   writes=role.dense or experts, pp_rank=pp_rank, tp_rank=tp_rank, hosts=hosts,
                   stage_writers=writers, role=role)


def dense_writer_replicas(stage_marks: list[tuple]) -> list[int]:
    """The data-parallel replicas that share a stage's dense tensors: replica 0 and every other replica whose ranks
    all run on the hosts where the stage's writers run anyway (replica 0's and the expert writers'), so sharing
    the work never adds a node, and a stage on the engine's node keeps writing into shared memory.
    `stage_marks`: (rank, pp, dp, cp0, writes experts, tp, host) of the stage's ranks."""
    ranks = [m for m in stage_marks if m[3]]
    hosts = {m[6] for m in ranks if m[2] == 0 or m[4]}
    return [d for d in sorted({m[2] for m in ranks}) if all(m[6] in hosts for m in ranks if m[2] == d)]


def _on_host(*tensors: torch.Tensor) -> bool:
    """Whether a piece is written by the host kernels, its figures known at once; otherwise torch ops write it
    where its source lives and its figures come back at the bucket's end (`BucketSums`)."""
    return all(t.device.type == "cpu" for t in tensors)


def _refuse_copy(name: str, bad: int) -> None:
    raise ValueError(f"{name}: {bad} NaN/Inf values; refusing to send a corrupt weight to the engine")


class BucketSums:
    """The checksum sums of the tensors this rank writes in one bucket. The host kernels' figures are added as they
    come; figures that torch ops compute on a GPU stay there until `resolve` reads them all back at once — one host
    synchronisation per bucket instead of one per piece — and refuses the first corrupt piece by name."""

    def __init__(self):
        self.totals: dict[str, list[int]] = {}
        self._deferred: list[tuple[torch.Tensor, tuple[str | None, ...], Callable[[int], None]]] = []

    def add(self, name: str, piece: tuple[int, int]) -> None:
        total = self.totals.setdefault(name, [0, 0])
        total[0] = (total[0] + piece[0]) & 0xFFFFFFFFFFFFFFFF
        total[1] = (total[1] + piece[1]) & 0xFFFFFFFFFFFFFFFF

    def defer(self, figures: torch.Tensor, names: tuple[str | None, ...], refuse: Callable[[int], None]) -> None:
        """`figures`: int64 [1 + 2 len(names)] where they were computed — the piece's corrupt count, then the
        (A, B) sums of each named tensor (None: not counted); `refuse(count)` raises for a corrupt piece."""
        self._deferred.append((figures, names, refuse))

    def resolve(self) -> dict[str, list[int]]:
        """Read the deferred figures back, refuse the first corrupt piece, and return every tensor's sums."""
        deferred, self._deferred = self._deferred, []
        for (_, names, refuse), values in zip(deferred, read_back([f for f, _, _ in deferred])):
            if values[0]:
                refuse(values[0])
            for k, name in enumerate(names):
                if name is not None:
                    self.add(name, unsigned_sums(values[1 + 2 * k], values[2 + 2 * k]))
        return self.totals


def _copy_checked(src: torch.Tensor, dst: torch.Tensor, position: Position, name: str, sums: BucketSums,
                  counted: bool = True) -> None:
    """Copy a piece into place, adding its checksum sums to `sums` (when `counted`); refuse NaN/Inf naming the
    tensor."""
    if _on_host(src, dst):
        if src.dtype == dst.dtype:
            bad, piece = copy_check_finite(src, dst, position)
        else:
            dst.copy_(src)
            bad = 0 if all_finite(dst) else int((~torch.isfinite(dst)).sum())
            piece = checksum_sums(dst, position)
        if bad:
            _refuse_copy(name, bad)
        if counted:
            sums.add(name, piece)
        return
    src = src.to(dst.dtype)  # converted where it lives, so that the checks run there too
    sums.defer(copy_check_finite_deferred(src, dst, position), (name if counted else None,),
               functools.partial(_refuse_copy, name))


def _quantize_into(src: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, q_position: Position,
                   s_position: Position, policy: QuantizationPolicy, name: str, scale_name: str,
                   sums: BucketSums) -> None:
    """Quantize a piece into place, adding the checksum sums of its codes and of its scales to `sums`."""
    if _on_host(src, q_out, s_out):
        if supports_quantize(src):
            sums.add(name, fp8_quantize_into(src, q_out, s_out, policy.block_size, policy.pow2_scale, name,
                                             q_position))
            sums.add(scale_name, checksum_sums(s_out, s_position))
            return
        q, s = blockwise_fp8_quantize(src, policy.block_size, policy.pow2_scale, name=name)
        sums.add(name, checksum_sums(q, q_position))
        sums.add(scale_name, checksum_sums(s, s_position))
        q_out.copy_(q)
        s_out.copy_(s)
        return
    quantize = blockwise_fp8_quantize_deferred if src.is_cuda and fp8_blockwise.triton is not None \
        else blockwise_fp8_quantize_reference_deferred
    q, s, corrupt = quantize(src, policy.block_size, policy.pow2_scale, name)
    # checksummed where the quantizer ran, as for copies
    sums.defer(torch.cat([corrupt, checksum_sums_device(q, q_position), checksum_sums_device(s, s_position)]),
               (name, scale_name), lambda _: refuse_non_finite(src, name))
    q_out.copy_(q)
    s_out.copy_(s)


def wait_for_device_writes(buffer) -> None:
    """Block until this process's copies into a GPU buffer are done: other processes read it next (the engine's
    verifier, the stage's sender) and CUDA orders nothing across processes."""
    if buffer is not None and buffer.data.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.synchronize(buffer.data.device)


class WeightBridge:
    """Syncs a model's weights into a rollout engine, every call a complete, verified, atomic update.

    Every rank calls `sync` together; the engine's rank passes the receiver. The first sync exchanges the stages'
    layouts once and maps the shared buffers; later syncs only move bytes and manifests.
    """

    def __init__(self, chunks: list, build, config: BridgeConfig, layout: BridgeLayout,
                 receiver: SyncReceiver | None = None):
        self.chunks, self.build, self.config, self.layout = chunks, build, config, layout
        self.group = None  # the ranks that write for this rank's stage
        self.receiver = receiver
        self.plan: StagePlan | None = None
        self.buffer: SharedBuffer | CudaBuffer | None = None
        self.stage_bytes: list[int] = []
        self.mode = ""
        self.connected = False
        self.completed = 0

    @property
    def is_engine_rank(self) -> bool:
        return self.layout.rank == self.layout.engine_rank

    def _stage_modes(self, engine_host: str, engine_stage: int) -> list[str]:
        modes = []
        for stage, hosts in enumerate(self.layout.hosts):
            local = hosts == (engine_host,)
            if not local and (self.config.transport == "shm" or stage == engine_stage):
                raise ValueError(f"--bridge-transport {self.config.transport}: pipeline stage {stage} runs on "
                                 f"{list(hosts)}, not only on the engine's node {engine_host}; the engine's own stage "
                                 "must, and with 'shm' every stage must (use auto or distributed)")
            # the engine's own stage writes into the arena in process whatever the transport
            shipped = self.config.transport == "distributed" and stage != engine_stage
            if (shipped or not local) and len(hosts) > 1:
                raise ValueError(f"pipeline stage {stage}'s writers run on {list(hosts)}: a shipped stage assembles "
                                 "each bucket in one node's shared buffer, so the ranks that write for it (its TP "
                                 "ranks, and the EP x expert-TP ranks of MoE layers) must share a node; keep "
                                 "--tensor-model-parallel-size and --expert-model-parallel-size x expert-TP within a "
                                 "node")
            modes.append("distributed" if shipped or not local else "shm")
        return modes

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
                self.group = group
        mine = (lay.pp_rank, lay.is_sender, list(self.plan.tensors) if lay.is_sender else None,
                self.plan.nbytes if self.plan else 0, self.plan.scratch_bytes if self.plan else 0,
                socket.gethostname())
        infos = [None] * dist.get_world_size()
        dist.all_gather_object(infos, mine)
        stages = sorted((i for i in infos if i[1]), key=lambda i: i[0])
        self.stage_bytes = [i[3] for i in stages]
        modes = self._stage_modes(infos[lay.engine_rank][5], infos[lay.engine_rank][0])
        shared = [None]
        if self.is_engine_rank:
            self.receiver.arena_on_gpu = self.config.arena_on_gpu
            ref, offsets, scratch = self.receiver.prepare([i[2] for i in stages], self.stage_bytes,
                                                           [i[4] if m == "shm" else 0 for i, m in zip(stages, modes)])
            shared = [(ref, self.receiver.arena.nbytes, offsets, scratch)]
        dist.broadcast_object_list(shared, src=lay.engine_rank)
        ref, arena_bytes, self.stage_offsets, self.scratch_offsets = shared[0]
        if lay.writes:
            self.mode = modes[lay.pp_rank]
            if self.mode == "shm":
                self.buffer = self.receiver.arena if self.is_engine_rank else open_staging_buffer(ref, arena_bytes)
            else:
                self._map_stage_buffer()
            self._bucket_targets = self._targets_per_bucket()
            self._tensors = {t.name: t for t in self.plan.tensors}
            self._bucket_pieces = [self._pieces_of(b, ts) for b, ts in zip(self.plan.buckets, self._bucket_targets)]
        self.connected = True

    def _map_stage_buffer(self) -> None:
        """A shipped stage assembles each bucket in a buffer of its own that its writers share."""
        plan = self.plan
        self.max_bucket = max((b.nbytes for b in plan.buckets), default=0)
        shared = [None]
        if self.layout.is_sender:
            self.buffer = staging_buffer(f"bridge-stage{self.layout.pp_rank}", self.max_bucket + plan.scratch_bytes,
                                         self.config.arena_on_gpu)
            shared = [self.buffer.ref]
        if dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(shared, src=self.layout.stage_senders[self.layout.pp_rank], group=self.group)
        if not self.layout.is_sender:
            self.buffer = open_staging_buffer(shared[0], self.max_bucket + plan.scratch_bytes)

    def _targets_per_bucket(self) -> list[list[HFTarget]]:
        first_index = {t.name: i for i, t in enumerate(self.plan.tensors)}
        return [[t for t in self.plan.targets if b.first <= first_index[t.name] < b.last] for b in self.plan.buckets]

    def _placement(self, bucket) -> tuple[int, int]:
        """Return (byte offset of the stage layout's 0 in self.buffer, byte offset of the scratch region)."""
        if self.mode == "shm":
            return self.stage_offsets[self.layout.pp_rank], self.scratch_offsets[self.layout.pp_rank]
        return -bucket.start, self.max_bucket

    def _pieces_of(self, bucket, targets: list[HFTarget]) -> list[tuple]:
        """This rank's pieces of a bucket as ready-made views, built once per bridge (the buffers and the
        parameters' storage do not move): ("copy", src, dst, position, name, counted, nbytes) or ("quantize", src,
        q, s, q position, s position, name, scale name, nbytes). An FP8 piece that cuts through blocks is copied
        into the scratch area (not counted: the sender's quantization of the whole tensor is)."""
        base, scratch_base = self._placement(bucket)
        tensors, bs = self._tensors, self.config.policy.block_size
        scratch = dict(bucket.scratch)
        pieces = []
        for target in targets:
            main = tensors[target.name]
            if not target.quantized or not target.blockwise_local:
                if target.quantized:
                    dst = self.buffer.view(scratch_base + scratch[target.name], target.param.dtype, target.shape)
                else:
                    dst = self.buffer.view(base + main.offset, main.torch_dtype, main.shape)
                for p in target.pieces:
                    out = dst.narrow(p.dim, p.dst_start, p.length)
                    pieces.append(("copy", target.param.narrow(p.dim, p.src_start, p.length), out,
                                   Position.of_piece(target.shape, p.dim, p.dst_start), target.name,
                                   not target.quantized, out.numel() * out.element_size()))
                continue
            scale = tensors[target.name + SCALE_SUFFIX]
            q = self.buffer.view(base + main.offset, main.torch_dtype, main.shape)
            s = self.buffer.view(base + scale.offset, scale.torch_dtype, scale.shape)
            for p in target.pieces:
                pieces.append(("quantize", target.param.narrow(p.dim, p.src_start, p.length),
                               q.narrow(p.dim, p.dst_start, p.length),
                               s.narrow(p.dim, p.dst_start // bs, -(-p.length // bs)),
                               Position.of_piece(main.shape, p.dim, p.dst_start),
                               Position.of_piece(scale.shape, p.dim, p.dst_start // bs), target.name, scale.name,
                               p.length * q.numel() // q.shape[p.dim]))
        return pieces

    def _write(self, index: int, sums: BucketSums) -> int:
        """Write this rank's pieces of bucket `index` (FP8 pieces quantized on the way), adding each piece's
        checksum sums to `sums`; return the bytes written."""
        written = 0
        for piece in self._bucket_pieces[index]:
            if piece[0] == "copy":
                _, src, dst, position, name, counted, nbytes = piece
                _copy_checked(src, dst, position, name, sums, counted)
            else:
                _, src, q, s, q_position, s_position, name, scale_name, nbytes = piece
                _quantize_into(src, q, s, q_position, s_position, self.config.policy, name, scale_name, sums)
            written += nbytes
        return written

    def _quantize_scratch(self, bucket, targets: list[HFTarget], sums: BucketSums) -> None:
        """The stage's sender: quantize the FP8 tensors whose pieces were assembled in the scratch region."""
        base, scratch_base = self._placement(bucket)
        tensors = self._tensors
        for name, offset in bucket.scratch:
            target = next(t for t in targets if t.name == name)
            full = self.buffer.view(scratch_base + offset, target.param.dtype, target.shape)
            main, scale = tensors[name], tensors[name + SCALE_SUFFIX]
            q = self.buffer.view(base + main.offset, main.torch_dtype, main.shape)
            s = self.buffer.view(base + scale.offset, scale.torch_dtype, scale.shape)
            _quantize_into(full, q, s, Position.whole(q), Position.whole(s), self.config.policy, main.name,
                           scale.name, sums)

    def _first_error(self, error: str | None) -> str:
        """After the stage's writers learnt that one failed: every writer leaves with the first one's error."""
        errors = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        return next(e for e in errors if e is not None)

    def _agree(self, error: str | None) -> str | None:
        """Barrier of the stage's writers; every writer leaves with the first one's error, if any."""
        if dist.get_world_size(self.group) == 1:
            return error
        flag = torch.tensor([0 if error is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return self._first_error(error) if int(flag) else None

    def _manifest(self, bucket, sums: dict[str, list[int]], error: str | None
                  ) -> tuple[list[ManifestEntry] | None, str | None]:
        """The end of a bucket for the stage's writers: one all-reduce adds up the checksum sums each rank
        gathered while writing its pieces (in 32-bit halves, so that no int64 sum overflows) and whether any rank
        failed. Return (the manifest on the sender, the first rank's error if any)."""
        tensors = self.plan.tensors[bucket.first: bucket.last]
        values = [0 if error is None else 1, 0] + [half for t in tensors for v in sums.get(t.name, (0, 0))
                                                   for half in (v >> 32, v & 0xFFFFFFFF)]
        halves = torch.tensor(values, dtype=torch.int64).view(-1, 2)
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(halves, group=self.group)
            if int(halves[0, 0]):
                return None, self._first_error(error)
        if error is not None or not self.layout.is_sender:
            return None, error
        totals = [((hi << 32) + lo) & 0xFFFFFFFFFFFFFFFF for hi, lo in halves[1:].tolist()]
        return [ManifestEntry(t.name, t.dtype, t.shape, t.offset, t.nbytes,
                              fold_checksum(t.nbytes, (totals[2 * i], totals[2 * i + 1])))
                for i, t in enumerate(tensors)], None

    def _send_stage(self, sync_id: int, stats: SyncStats) -> None:
        plan, base_error = self.plan, None
        for index, (bucket, targets) in enumerate(zip(plan.buckets, self._bucket_targets)):
            if index and self.mode == "distributed" and dist.get_world_size(self.group) > 1:
                dist.barrier(group=self.group)  # the sender has shipped the last bucket out of the shared buffer
            error, sums = None, BucketSums()
            try:
                stats.written_bytes += self._write(index, sums)
                sums.resolve()
            except ValueError as err:
                error = str(err)
            wait_for_device_writes(self.buffer)
            if bucket.scratch:
                error = self._agree(error)  # every piece is in the scratch area before the sender quantizes it
                if error is None and self.layout.is_sender:
                    try:
                        self._quantize_scratch(bucket, targets, sums)
                        sums.resolve()
                    except ValueError as err:
                        error = str(err)
                    wait_for_device_writes(self.buffer)
            manifest, error = self._manifest(bucket, sums.totals, error)
            if error is not None:
                base_error = error
                break
            if not self.layout.is_sender:
                continue
            if self.is_engine_rank:
                self.receiver.receive(sync_id, self.layout.pp_rank, manifest)
            else:
                window = None
                if self.mode == "distributed":
                    window = self.buffer.data[: bucket.nbytes]
                send_manifest(self.layout.engine_rank, sync_id, manifest, window)
            stats.buckets += 1
            stats.tensors += bucket.last - bucket.first
            stats.bytes += bucket.nbytes
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, bucket.nbytes)
        if self.layout.is_sender:
            if self.is_engine_rank:
                if base_error is not None:
                    self.receiver.abort(f"sync {sync_id} refused, engine keeps its weights: {base_error}")
            else:
                send_end(self.layout.engine_rank, sync_id, base_error)

    def sync(self, sync_id: int) -> SyncStats:
        """One complete sync; raises SyncError on every rank when the engine refused it."""
        start = time.perf_counter()
        if not self.connected:
            self._connect()
        stats = SyncStats(transport=self.mode)
        if self.is_engine_rank:
            self.receiver.begin(sync_id)
        if self.layout.writes:
            self._send_stage(sync_id, stats)
        outcome, failure = [None], None
        if self.is_engine_rank:
            for stage, src in enumerate(self.layout.stage_senders):
                if src != self.layout.engine_rank:
                    receive_stage(src, stage, self.receiver, self.stage_bytes[stage])
            try:
                self.receiver.commit(sync_id)
            except Exception as err:  # every rank must learn that the sync failed, whatever the engine raised
                outcome, failure = [f"{type(err).__name__}: {err}" if not isinstance(err, SyncError) else str(err)], err
        failed = torch.tensor([int(outcome[0] is not None)])
        dist.broadcast(failed, src=self.layout.engine_rank)
        if int(failed):
            dist.broadcast_object_list(outcome, src=self.layout.engine_rank)
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise SyncError(outcome[0])
        stats.seconds = time.perf_counter() - start
        self.completed += 1
        return stats

    def close(self) -> None:
        if self.buffer is not None and self.buffer is not getattr(self.receiver, "arena", None):
            self.buffer.close()
        self.buffer = None
        self._bucket_pieces = []  # their views map the buffer


def sync_weights_to_engine(chunks: list, build, config: BridgeConfig, layout: BridgeLayout, sync_id: int,
                           receiver: SyncReceiver | None) -> SyncStats:
    """One sync through a bridge used once (a training loop keeps one WeightBridge for all its syncs)."""
    bridge = WeightBridge(chunks, build, config, layout, receiver)
    try:
        return bridge.sync(sync_id)
    finally:
        bridge.close()
