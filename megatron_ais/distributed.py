"""Starting torch.distributed from torchrun's environment, and keeping ranks in step: what one rank computes (a
rollout batch, a refit verdict, the last pipeline stage's metrics) reaches every rank of a group through `share`,
and an error raised there is raised on every rank, so no rank is left waiting in a collective. Also the host and
port helpers of process groups built outside torchrun's world, and bytes broadcast over such a group in chunks
(weight feeds, node copies). Light on purpose (no megatron-core): every spawned rank and vLLM's workers import it."""
from __future__ import annotations

import datetime
import os
import random
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ais import platform
from megatron_ais.errors import SHARED_ERRORS
from megatron_ais.lifetime import exit_with_parent

CHUNK_BYTES = 64 << 20  # bytes broadcast at a time: one chunk in device memory at a time


def ranks_on_this_node(world_size: int) -> int:
    """How many ranks torchrun started on this node (LOCAL_WORLD_SIZE; without it, every rank of `world_size`)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def shared_failure(err: Exception) -> tuple[type, str]:
    """How every rank re-raises `err`: its type and message when one of errors.SHARED_ERRORS, else RuntimeError
    naming the type."""
    kind = type(err) if isinstance(err, SHARED_ERRORS) else RuntimeError
    return kind, f"{type(err).__name__}: {err}" if kind is RuntimeError else str(err)


def share(compute: Callable[[], Any] | None, src: int, group=None) -> Any:
    """Run `compute` on global rank `src` and return its value on every rank of `group` (the world by default);
    other ranks pass None or anything (it is not called there). If it raised, `src` re-raises its error and every
    other rank raises one of the same type (one of errors.SHARED_ERRORS, RuntimeError otherwise) with its message.
    A None value costs one small tensor broadcast; anything else is pickled."""
    value, failure, message = None, None, None
    if dist.get_rank() == src:
        try:
            value = compute()
        except Exception as err:  # every rank must learn of any failure, whatever raised it
            failure, message = err, shared_failure(err)
    status = torch.tensor([int(failure is not None), int(value is not None)])
    dist.broadcast(status, src=src, group=group)
    if int(status.sum()):
        payload = [message if failure is not None else value]
        dist.broadcast_object_list(payload, src=src, group=group)
        value = payload[0]
    if failure is not None:
        raise failure
    if int(status[0]):
        kind, text = value
        raise kind(text)
    return value


def gather_on(obj: Any, dst: int) -> list | None:
    """Every rank's `obj`, in rank order, on global rank `dst` (None elsewhere)."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, parts, dst=dst)
    return parts


def from_last_stage(obj: Any, pipeline_group) -> Any:
    """The last pipeline stage's `obj` on every stage of `pipeline_group` (log-probs, λ and losses exist only
    there; the logging rank is on the first stage). None: a pipeline of one stage."""
    if pipeline_group is None or dist.get_world_size(pipeline_group) == 1:
        return obj
    return share(lambda: obj, src=dist.get_process_group_ranks(pipeline_group)[-1], group=pipeline_group)


def node_name() -> str:
    """The name of this process's node: its hostname, or MEGATRON_AIS_NODE_NAME when set (containers that share a
    hostname; tests that run two nodes on one machine). Ranks with the same name share memory."""
    return os.environ.get("MEGATRON_AIS_NODE_NAME") or socket.gethostname()


EPHEMERAL_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PICKED_PORT = 10000
_port_picker = random.SystemRandom()  # not the seeded global generator: forked ranks would all pick the same port


def _ephemeral_port_floor() -> int | None:
    """The first port the kernel hands out to `bind(0)` and outgoing connections (Linux), or None if unknown."""
    try:
        with open(EPHEMERAL_PORTS_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(attempts: int = 64) -> int:
    """Return a TCP port that is free on this host now, for a server another process starts later. Picked below the
    kernel's ephemeral range where it is known: a port from `bind(0)` is one the kernel may give any outgoing
    connection (another world's store clients, an engine's sockets) before the server binds it (EADDRINUSE)."""
    floor = _ephemeral_port_floor()
    if floor is not None and floor > LOWEST_PICKED_PORT:
        for _ in range(attempts):
            port = _port_picker.randrange(LOWEST_PICKED_PORT, floor)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """This host's address as other hosts reach it (loopback when it has no other)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


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


def initialize_distributed(timeout_minutes: int = 30) -> None:
    """Start torch.distributed from the launcher's env (torchrun): gloo on CPU; NCCL and gloo (host tensors) on CUDA.
    The rank exits with its launcher (`lifetime.exit_with_parent`)."""
    if dist.is_initialized():
        return
    exit_with_parent()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"environment variable {var} is not set; launch with torchrun "
                               "(python -m torch.distributed.run --nproc-per-node N ...)")
    if platform.is_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=platform.distributed_backend(),
                            timeout=datetime.timedelta(minutes=timeout_minutes))
