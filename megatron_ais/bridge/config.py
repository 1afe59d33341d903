"""The bridge's flags: bucket size, transport, where the staging arena lives, and the engine-precision policy."""
from __future__ import annotations

import dataclasses

from megatron_ais.bridge.arena import ARENA_PLACES, arena_on_gpu
from megatron_ais.bridge.delta import DELTA_MODES
from megatron_ais.bridge.quantization import QuantizationPolicy
from megatron_ais.bridge.transports import TRANSPORTS
from megatron_ais.flags import FlagConfig, flag


@dataclasses.dataclass(frozen=True)
class BridgeConfig(FlagConfig):
    """Bucket size, transport, arena place and the quantization policy (whose precision is the engine's)."""

    bucket_size_mb: float = flag(512.0, "Bytes per bucket: the unit that is checksummed, delivered and verified, and "
                                        "the size of a stage's send buffer when buckets are shipped over "
                                        "torch.distributed.", name="--bridge-bucket-size-mb")
    transport: str = flag(
        "auto", "How trainer ranks deliver weights to the engine's staging arena (/dev/shm on CPU, GPU memory shared "
                "by CUDA IPC on CUDA nodes): 'shm' = ranks on the engine's node write their shards into it directly; "
                "'distributed' = each pipeline stage's sender ships buckets point-to-point (gloo/NCCL); 'auto' = shm "
                "for stages on the engine's node, distributed for the others.", name="--bridge-transport",
        choices=TRANSPORTS)
    arena: str = flag(
        "auto", "Where the engine's staging arena (one engine-format copy of the weights, the price of atomic syncs) "
                "and shipped stages' bucket buffers live: gpu = GPU memory of the engine's rank, shared by CUDA IPC "
                "(device-to-device writes); host = shared host memory (/dev/shm: no GPU memory, PCIe copies both "
                "ways; for models whose arena does not fit beside the trainer and the engine); auto = gpu on CUDA "
                "nodes, host otherwise.", name="--bridge-arena", choices=ARENA_PLACES)
    delta: str = flag(
        "off", "on: where weights cross nodes (a pipeline stage's buckets shipped to the arena, the arena forwarded "
               "to other nodes' copies), once the receiving copy holds what was sent there last, send of every tensor "
               "only the elements that changed (position + bytes: FP8 or 4-bit codes, scales, BF16 tensors), a tensor "
               "in full where that is smaller, verified against the full tensors' checksums; a full sync after a "
               "refused one, a layout change and every --bridge-full-sync-interval syncs. Costs each sender one "
               "copy of the tensors it sends (per arena buffer).", name="--bridge-delta", choices=DELTA_MODES)
    full_sync_interval: int = flag(32, "With --bridge-delta on: the most delta syncs in a row before a full one.",
                                   name="--bridge-full-sync-interval",
                                   at_least=1, bound_note="delta syncs between full ones")
    policy: QuantizationPolicy = QuantizationPolicy()

    def __post_init__(self):
        super().__post_init__()
        arena_on_gpu(self.arena)  # refuses an unknown place, or gpu without CUDA

    @classmethod
    def from_args(cls, args, precision: str = "fp8", **fields) -> "BridgeConfig":
        """The bridge flags, with the policy for engine weights of `precision` (--rollout-precision)."""
        return super().from_args(args, policy=QuantizationPolicy.from_args(args, precision=precision), **fields)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_size_mb * (1 << 20))

    @property
    def arena_on_gpu(self) -> bool:
        return arena_on_gpu(self.arena)
