"""Byte buffers that several processes of a node map: the engine's staging arena, which trainer ranks on the
engine's node write into directly, and a stage's bucket buffer for senders that ship buckets over
torch.distributed.

On CPU they live in shared memory (/dev/shm; a file's name carries its creator's pid so that files left by a killed
run are recognised and removed); on CUDA nodes in GPU memory shared through CUDA IPC handles, so trainer GPUs write
into the arena device to device and the engine's workers read it in place. Either way a buffer is referred to by
its `ref` (a path, or a CUDA IPC handle), which other processes pass to `open_staging_buffer`.
"""
from __future__ import annotations

import base64
import dataclasses
import os
import pickle
import re
import tempfile

import torch
from torch.multiprocessing.reductions import reduce_tensor

_NAME = re.compile(r"megatron-ais-(\d+)-[\w.-]+")
# the bytes of the buffers this process created, by encoded ref: a CUDA IPC handle cannot be opened by the process
# that made it, so its own readers (a colocated engine, the broadcast feed's root) take the tensor itself
_CREATED_HERE: dict[str, torch.Tensor] = {}


def shared_directory() -> str:
    """Return where shared buffers live: /dev/shm (RAM) when the system has it, the temp directory otherwise."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_stale_shared_files(directory: str | None = None) -> list[str]:
    """Delete megatron-ais shared files whose creating process is gone; return their names."""
    directory = directory or shared_directory()
    removed = []
    if not os.path.isdir("/proc"):
        return removed
    for name in os.listdir(directory):
        match = _NAME.fullmatch(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            try:
                os.remove(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


class SharedBuffer:
    """`nbytes` bytes in a shared file, exposed as a uint8 tensor; the creator removes the file on close."""

    def __init__(self, path: str, nbytes: int, create: bool):
        self.path, self.nbytes, self.owner = path, max(int(nbytes), 1), create
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, self.nbytes)
            finally:
                os.close(fd)
        elif os.path.getsize(path) < self.nbytes:
            raise ValueError(f"shared buffer {path} holds {os.path.getsize(path)} bytes, {self.nbytes} expected")
        self.data = torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)
        if create:
            _CREATED_HERE[path] = self.data

    @classmethod
    def create(cls, tag: str, nbytes: int) -> "SharedBuffer":
        """Create a new buffer named after this process and `tag`."""
        return cls(os.path.join(shared_directory(), f"megatron-ais-{os.getpid()}-{tag}.bin"), nbytes, create=True)

    @property
    def ref(self) -> str:
        return self.path

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Return the tensor of `dtype` and `shape` stored at byte `offset`."""
        return byte_view(self.data, offset, dtype, shape)

    def close(self) -> None:
        self.data = None
        if self.owner:
            _CREATED_HERE.pop(self.path, None)
            if os.path.exists(self.path):
                os.remove(self.path)


class CudaBuffer:
    """`nbytes` bytes of GPU memory that other processes of the node map through a CUDA IPC handle (torch's own,
    `reduce_tensor`: the creator keeps the memory alive, openers get a tensor on the creator's GPU). The ref names
    that GPU by UUID, since device indices differ between processes that see different CUDA_VISIBLE_DEVICES."""

    # position of the device index among `reduce_tensor`'s arguments for `rebuild_cuda_tensor`
    _DEVICE_ARG = 6

    def __init__(self, data: torch.Tensor, ref: tuple, owner: bool):
        self.data, self.ref, self.owner, self.nbytes = data, ref, owner, data.numel()

    @classmethod
    def create(cls, nbytes: int) -> "CudaBuffer":
        data = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=torch.cuda.current_device())
        rebuild, args = reduce_tensor(data)
        buffer = cls(data, (rebuild, args, gpu_uuid(data.device.index)), owner=True)
        _CREATED_HERE[encode_ref(buffer.ref)] = data
        return buffer

    @classmethod
    def open(cls, ref: tuple, nbytes: int) -> "CudaBuffer":
        data = _CREATED_HERE.get(encode_ref(ref))
        if data is None:
            rebuild, args, uuid = ref
            args = list(args)
            args[cls._DEVICE_ARG] = local_gpu_index(uuid)
            data = rebuild(*args)
        if data.numel() < nbytes:
            raise ValueError(f"CUDA IPC buffer holds {data.numel()} bytes, {nbytes} expected")
        return cls(data, ref, owner=False)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return byte_view(self.data, offset, dtype, shape)

    def close(self) -> None:
        if self.owner:
            _CREATED_HERE.pop(encode_ref(self.ref), None)
        self.data = None


def gpu_uuid(index: int) -> str:
    """The UUID of this process's GPU `index`."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_gpu_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; a clear error when this process does not see it."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    raise ValueError(f"a CUDA IPC buffer lives on GPU {uuid}, which this process does not see (its "
                     f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); trainer and engine "
                     "processes of a node must see the GPU that holds the bridge's staging arena")


def byte_view(data: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` stored at byte `offset` of the uint8 tensor `data`."""
    numel = 1
    for d in shape:
        numel *= d
    return data[offset: offset + numel * dtype.itemsize].view(dtype).view(shape)


ARENA_PLACES = ("auto", "gpu", "host")
# what a process pays on a GPU whose memory it maps by CUDA IPC without computing there: its CUDA context on that
# GPU. An estimate (a few hundred MiB with CUDA's lazy module loading); tools/device_checks.sh measures it
CUDA_CONTEXT_BYTES = 512 << 20


def gpu_arena_shortfall(buffer_bytes: int, slots: int, consumers: int, free_bytes: int) -> str | None:
    """Why `slots` GPU buffers of `buffer_bytes` and the CUDA contexts of `consumers` processes that map them do not
    fit in `free_bytes` (one line naming the flags to change), or None when they do."""
    need = buffer_bytes * slots + consumers * CUDA_CONTEXT_BYTES
    if need <= free_bytes:
        return None
    gib = 1 << 30
    return (f"the bridge's staging arena needs {need / gib:.1f} GiB of GPU memory ({slots} buffer(s) of "
            f"{buffer_bytes / gib:.1f} GiB and the CUDA contexts of {consumers} engine process(es) that map it) and "
            f"{free_bytes / gib:.1f} GiB are free beside the trainer: put it in host memory (--bridge-arena host), "
            "sync synchronously (--max-off-policy-steps 0: one buffer) or lower the trainer's memory (more model "
            "parallelism, --use-distributed-optimizer)")


def arena_on_gpu(place: str) -> bool:
    """Where `--bridge-arena` puts the staging buffers: GPU memory (auto on CUDA nodes) or host shared memory."""
    if place not in ARENA_PLACES:
        raise ValueError(f"--bridge-arena {place!r} must be one of {ARENA_PLACES}")
    if place == "gpu" and not torch.cuda.is_available():
        raise ValueError("--bridge-arena gpu needs CUDA; use auto or host")
    return place == "gpu" or (place == "auto" and torch.cuda.is_available())


def staging_buffer(tag: str, nbytes: int, on_gpu: bool | None = None) -> SharedBuffer | CudaBuffer:
    """A new buffer for the other processes of this node: GPU memory behind a CUDA IPC handle (`on_gpu`; default:
    where CUDA is available), shared host memory otherwise."""
    if arena_on_gpu("auto") if on_gpu is None else on_gpu:
        return CudaBuffer.create(nbytes)
    return SharedBuffer.create(tag, nbytes)


def open_staging_buffer(ref, nbytes: int) -> SharedBuffer | CudaBuffer:
    """Map a buffer another process of this node created, from its `ref`."""
    return SharedBuffer(ref, nbytes, False) if isinstance(ref, str) else CudaBuffer.open(ref, nbytes)


def encode_ref(ref) -> str:
    """A buffer's ref as text, for RPCs that take strings (a CUDA IPC handle holds bytes and a rebuild function)."""
    return ref if isinstance(ref, str) else "cuda-ipc:" + base64.b64encode(pickle.dumps(ref)).decode()


def decode_ref(text: str):
    """The inverse of `encode_ref` (only ever given what this program's own trainer encoded)."""
    if text.startswith("cuda-ipc:"):
        return pickle.loads(base64.b64decode(text.removeprefix("cuda-ipc:")))
    return text


def buffer_data(ref) -> torch.Tensor:
    """The bytes behind a ref: the buffer itself in the process that created it; elsewhere mapped, a shared-memory
    file copy-on-write, a CUDA IPC handle in place."""
    if not isinstance(ref, str):
        return CudaBuffer.open(ref, 0).data  # which takes its own buffer in the process that created it
    data = _CREATED_HERE.get(ref)
    return map_file(ref) if data is None else data


def map_file(path: str) -> torch.Tensor:
    """Map a whole file copy-on-write (reads share the pages, nothing is copied) as a uint8 tensor."""
    return torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)


def entry_views(data: torch.Tensor, entries: list) -> list[tuple[str, torch.Tensor]]:
    """Return (name, tensor view) of manifest entries whose offsets index the bytes `data`."""
    if any(e.offset + e.nbytes > data.numel() for e in entries):
        raise ValueError(f"{data.numel()} bytes are fewer than the manifest's entries need")
    return [(e.name, byte_view(data, e.offset, getattr(torch, e.dtype), e.shape)) for e in entries]


@dataclasses.dataclass(frozen=True)
class ArenaWeights:
    """A verified staging arena as an engine receives it: its ref (a shared-memory path or a CUDA IPC handle) and the
    manifest entries of every tensor, at absolute offsets."""

    ref: object
    entries: tuple


def arena_views(ref, entries: list) -> list[tuple[str, torch.Tensor]]:
    """Map a staging arena (by path or CUDA IPC handle) and return (name, tensor view) for manifest entries whose
    offsets are absolute."""
    return entry_views(buffer_data(ref), entries)
