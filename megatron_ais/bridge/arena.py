"""Byte buffers in shared memory (/dev/shm) that several local processes map: the engine's staging arena,
which trainer ranks on the engine's node write into directly, and a stage's bucket buffer for senders that
ship buckets over torch.distributed. A file's name carries its creator's pid so that files left by a killed
run are recognised and removed."""
from __future__ import annotations

import os
import re
import tempfile

import torch

_NAME = re.compile(r"megatron-ais-(\d+)-[\w.-]+")


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

    @classmethod
    def create(cls, tag: str, nbytes: int) -> "SharedBuffer":
        """Create a new buffer named after this process and `tag`."""
        return cls(os.path.join(shared_directory(), f"megatron-ais-{os.getpid()}-{tag}.bin"), nbytes, create=True)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Return the tensor of `dtype` and `shape` stored at byte `offset`."""
        numel = 1
        for d in shape:
            numel *= d
        return self.data[offset: offset + numel * dtype.itemsize].view(dtype).view(shape)

    def close(self) -> None:
        self.data = None
        if self.owner and os.path.exists(self.path):
            os.remove(self.path)


def map_file(path: str) -> torch.Tensor:
    """Map a whole file copy-on-write (reads share the pages, nothing is copied) as a uint8 tensor."""
    return torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)


def entry_views(data: torch.Tensor, entries: list) -> list[tuple[str, torch.Tensor]]:
    """Return (name, tensor view) of manifest entries whose offsets index the bytes `data`."""
    if any(e.offset + e.nbytes > data.numel() for e in entries):
        raise ValueError(f"{data.numel()} bytes are fewer than the manifest's entries need")
    return [(e.name, data[e.offset: e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape))
            for e in entries]


def arena_views(path: str, entries: list) -> list[tuple[str, torch.Tensor]]:
    """Map a staging arena and return (name, tensor view) for manifest entries whose offsets are absolute."""
    return entry_views(map_file(path), entries)
