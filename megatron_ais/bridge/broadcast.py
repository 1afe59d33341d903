"""Feeding a verified sync to engine processes over a process group of their own: the engine's rank (root) and
each vLLM worker join a group of 1 + engine-TP members (gloo on CPU, NCCL on GPU), built from a TCP store, apart
from both the trainer's and vLLM's own torch.distributed worlds. It is how weights reach engine workers that do not
share memory with the trainer (other GPUs, other nodes); each worker verifies every tensor before it applies any."""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=300)


def free_port() -> int:
    """Return a TCP port that is free on this host now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """This host's address as other hosts reach it (loopback when it has no other)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def device_uuid() -> str | None:
    """The physical GPU this process computes on (None without CUDA): device indices differ between processes
    with different CUDA_VISIBLE_DEVICES, UUIDs do not."""
    if not torch.cuda.is_available():
        return None
    from megatron_ais.bridge.arena import gpu_uuid

    return gpu_uuid(torch.cuda.current_device())


def feed_backend(root_device: str | None, member_devices: list[str | None]) -> str:
    """NCCL when the root and every member compute on GPUs of their own; gloo (host memory) otherwise: on CPU, and
    when a member shares the root's GPU (an engine worker on the trainer rank's GPU), which NCCL refuses ("duplicate
    GPU") — such a worker would better be fed by `shm` (CUDA IPC)."""
    devices = [root_device, *member_devices]
    return "nccl" if None not in devices and len(set(devices)) == len(devices) else "gloo"


def join_weight_group(host: str, port: int, rank: int, world: int, backend: str):
    """Join the feed group as `rank` (0 = the engine's rank, which hosts the store)."""
    store = dist.TCPStore(host, port, world, rank == 0, timeout=TIMEOUT)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, world, TIMEOUT)


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def feed_device(backend: str) -> str:
    """Where the feed group's bytes travel from and to: device memory for NCCL, host memory for gloo."""
    return "cuda" if backend == "nccl" else "cpu"


def broadcast_bytes(group, data: torch.Tensor, chunk_bytes: int, device: str = "cpu") -> None:
    """Root: send `data` (uint8, anywhere) in chunks of at most `chunk_bytes`, each moved to `device` first (one
    chunk there at a time)."""
    for start in range(0, data.numel(), chunk_bytes):
        _broadcast(group, data[start: start + chunk_bytes].to(device))


def receive_bytes(group, out: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """Member: receive the root's bytes into `out` (uint8, on the group's device) chunk by chunk."""
    for start in range(0, out.numel(), chunk_bytes):
        _broadcast(group, out[start: start + chunk_bytes])
    return out
