"""A separate engine's feed over a process group of its own: the engine's rank (root) and each vLLM worker join a
group of 1 + engine-TP members (gloo on CPU, NCCL on GPU), built from a TCP store, apart from both the trainer's
and vLLM's own torch.distributed worlds. It is how weights reach engine workers that do not share memory with the
trainer (other GPUs, other nodes); each worker verifies every tensor before it applies any. Tensors that live in
no arena go through shared memory, as `SharedMemoryFeed` sends them."""
from __future__ import annotations

import concurrent.futures
import datetime

import torch
import torch.distributed as dist

from megatron_ais.bridge.arena import ArenaWeights, buffer_data, gpu_uuid
from megatron_ais.distributed import CHUNK_BYTES, broadcast_bytes, free_port, host_address
from megatron_ais.engine.feeds.base import EngineWeights
from megatron_ais.engine.feeds.shared_memory import SharedMemoryFeed, entries_json

TIMEOUT = datetime.timedelta(seconds=300)


def device_uuid() -> str | None:
    """The physical GPU this process computes on (None without CUDA): device indices differ between processes
    with different CUDA_VISIBLE_DEVICES, UUIDs do not."""
    if not torch.cuda.is_available():
        return None
    return gpu_uuid(torch.cuda.current_device())


def feed_backend(root_device: str | None, member_devices: list[str | None]) -> str:
    """NCCL when the root and every member compute on GPUs of their own; gloo (host memory) otherwise: on CPU, and
    when a member shares the root's GPU (an engine worker on the trainer rank's GPU), which NCCL refuses ("duplicate
    GPU") — such a worker would better be fed by `shm` (CUDA IPC)."""
    devices = [root_device, *member_devices]
    return "nccl" if None not in devices and len(set(devices)) == len(devices) else "gloo"


def feed_device(backend: str) -> str:
    """Where the feed group's bytes travel from and to: this process's GPU for NCCL, host memory for gloo."""
    return f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"


def on_device(device: str, function, *args):
    """`function(*args)` with `device` current: the feed's collectives run in a thread of their own, and a new
    thread's current CUDA device is GPU 0, not the one this rank computes on."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    return function(*args)


def join_weight_group(host: str, port: int, rank: int, world: int, backend: str):
    """Join the feed group as `rank` (0 = the engine's rank, which hosts the store)."""
    store = dist.TCPStore(host, port, world, rank == 0, timeout=TIMEOUT)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, world, TIMEOUT)


class BroadcastFeed(SharedMemoryFeed):
    """Forms the feed group with the engine's workers at its first sync (once per engine start)."""

    def __init__(self, tensor_parallel_size: int):
        self.members = tensor_parallel_size
        self.group = None
        self.device = "cpu"

    def apply(self, llm, weights: EngineWeights) -> None:
        if not isinstance(weights, ArenaWeights):
            return super().apply(llm, weights)
        if self.group is None:
            self._join(llm)
        nbytes = max(e.offset + e.nbytes for e in weights.entries)
        data = buffer_data(weights.ref)[:nbytes]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sending = pool.submit(on_device, self.device, broadcast_bytes, self.group, data, CHUNK_BYTES, self.device)
            llm.collective_rpc("megatron_ais_receive_broadcast", args=(entries_json(weights.entries), nbytes,
                                                                       CHUNK_BYTES))
            sending.result()

    def _join(self, llm) -> None:
        host, port = host_address(), free_port()
        backend = feed_backend(device_uuid(), llm.collective_rpc("megatron_ais_device_uuid"))
        device = feed_device(backend)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            root = pool.submit(on_device, device, join_weight_group, host, port, 0, 1 + self.members, backend)
            llm.collective_rpc("megatron_ais_join_weight_group", args=(host, port, 1 + self.members, backend))
            self.group, self.device = root.result(), device

    def close(self) -> None:
        self.group = None  # its members are gone with the engine
