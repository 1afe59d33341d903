"""Trainer side of a weight sync: TP gather per pipeline stage -> HF names -> engine precision -> buckets ->
transport. Only one stream of tensors is alive at a time, so a sender holds about one bucket plus the largest
tensor, never a model copy."""
from __future__ import annotations

import argparse
import dataclasses
import time


from megatron_ais.bridge.buckets import bucketize
from megatron_ais.bridge.quantization import QuantizationPolicy, quantize_for_engine
from megatron_ais.bridge.transport import SyncReceiver, manifest_for
from megatron_ais.mapping.distributed import export_hf_weights


@dataclasses.dataclass(frozen=True)
class BridgeConfig:
    """Bucket size and the engine-precision policy."""

    bucket_size_mb: float = 512.0
    policy: QuantizationPolicy = QuantizationPolicy()

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * (1 << 20))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BridgeConfig":
        return cls(bucket_size_mb=args.bridge_bucket_size_mb,
                   policy=QuantizationPolicy(precision=args.rollout_precision,
                                             exclude=tuple(args.bridge_fp8_exclude or ())))


def add_bridge_args(parser: argparse.ArgumentParser) -> None:
    """Resharding-bridge flags."""
    g = parser.add_argument_group("bridge")
    g.add_argument("--bridge-bucket-size-mb", type=float, default=512.0,
                   help="Bytes per bucket streamed to the engine; bounds the sender's extra memory.")
    g.add_argument("--bridge-fp8-exclude", nargs="*", default=None, metavar="REGEX",
                   help="HF tensor-name patterns to keep in BF16 under FP8 rollouts (q/k/v and gate/up together).")


@dataclasses.dataclass
class SyncStats:
    """What one sync moved and how long it took on this sender."""

    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    max_bucket_bytes: int = 0
    seconds: float = 0.0


def send_stage_weights(chunks: list, build, config: BridgeConfig, tp_group, sync_id: int,
                       transport=None) -> SyncStats:
    """Stream this pipeline stage's weights; every TP rank of the stage calls it, only the sender passes a
    transport (the others take part in the TP gathers and drop the result)."""
    start = time.perf_counter()
    stats = SyncStats()
    stream = export_hf_weights(chunks, build, tp_group, to_first_rank=True)
    if transport is None:
        for _ in stream:
            pass
        return stats
    transport.begin(sync_id)
    for bucket in bucketize(quantize_for_engine(stream, config.policy), config.bucket_bytes):
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        transport.send(sync_id, bucket, manifest_for(bucket))
        stats.tensors += len(bucket)
        stats.buckets += 1
        stats.bytes += nbytes
        stats.max_bucket_bytes = max(stats.max_bucket_bytes, nbytes)
    transport.finish(sync_id, stats.buckets)
    stats.seconds = time.perf_counter() - start
    return stats


@dataclasses.dataclass(frozen=True)
class BridgeLayout:
    """Who sends and who receives, from megatron's parallel state (taken at the call site).

    The engine lives on global rank `engine_rank`; each pipeline stage's sender is its TP-rank-0, DP-rank-0
    (CP-rank-0) rank. `stage_senders[s]` is the global rank of stage s's sender.
    """

    engine_rank: int
    stage_senders: tuple[int, ...]
    is_sender: bool
    rank: int

    @classmethod
    def from_parallel_state(cls, engine_rank: int = 0) -> "BridgeLayout":
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        rank = dist.get_rank()
        is_sender = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                     and ps.get_context_parallel_rank() == 0)
        marks = [None] * dist.get_world_size()
        dist.all_gather_object(marks, (ps.get_pipeline_model_parallel_rank() if is_sender else None, rank))
        senders = tuple(r for _, r in sorted((s, r) for s, r in marks if s is not None))
        return cls(engine_rank=engine_rank, stage_senders=senders, is_sender=is_sender, rank=rank)


def sync_weights_to_engine(chunks: list, build, config: BridgeConfig, tp_group, layout: BridgeLayout,
                           sync_id: int, receiver: SyncReceiver | None) -> SyncStats:
    """One sync into an engine hosted on `layout.engine_rank` (which passes its SyncReceiver).

    The engine rank's own stage goes in-process; other stages' senders send point-to-point and the engine
    rank receives them in stage order. The receiver applies only when every stage has arrived intact.
    """
    from megatron_ais.bridge.transport import DistributedSender, InProcessTransport, receive_from

    transport = None
    if layout.is_sender:
        if layout.rank == layout.engine_rank:
            transport = InProcessTransport(receiver, sender=layout.stage_senders.index(layout.rank))
        else:
            transport = DistributedSender(dst=layout.engine_rank)
    if layout.rank == layout.engine_rank:
        receiver.num_senders = len(layout.stage_senders)
        receiver.begin(sync_id)
    stats = send_stage_weights(chunks, build, config, tp_group, sync_id, transport)
    if layout.rank == layout.engine_rank:
        for sender_id, src in enumerate(layout.stage_senders):
            if src != layout.engine_rank:
                receive_from(src, receiver, sender_id)
    return stats
