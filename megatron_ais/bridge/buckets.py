"""Group a stream of named tensors into buckets of bounded size, each with a manifest that the receiver
verifies before it applies anything (names, dtypes, shapes, byte counts, CRC32 checksums)."""
from __future__ import annotations

import dataclasses
import zlib
from typing import Iterable, Iterator

import torch


@dataclasses.dataclass(frozen=True)
class ManifestEntry:
    """What the receiver must find for one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: int


def tensor_bytes(tensor: torch.Tensor):
    """Return the tensor's raw bytes as a uint8 numpy view (no copy on CPU; any dtype, fp8 included)."""
    flat = tensor.detach().contiguous().view(-1)
    return flat.view(torch.uint8).cpu().numpy()


def manifest_entry(name: str, tensor: torch.Tensor) -> ManifestEntry:
    """Return the manifest entry of one tensor."""
    data = tensor_bytes(tensor)
    return ManifestEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), int(data.nbytes),
                         zlib.crc32(data))


def verify_bucket(bucket: list[tuple[str, torch.Tensor]], manifest: list[ManifestEntry]) -> None:
    """Raise ValueError naming the first tensor that does not match the manifest."""
    if [n for n, _ in bucket] != [e.name for e in manifest]:
        raise ValueError(f"bucket names {[n for n, _ in bucket][:4]}... differ from the manifest "
                         f"{[e.name for e in manifest][:4]}...")
    for (name, tensor), expected in zip(bucket, manifest):
        got = manifest_entry(name, tensor)
        if got != expected:
            raise ValueError(f"{name}: received {got} but the manifest says {expected}")


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
              ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield consecutive groups whose bytes stay within bucket_bytes (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
