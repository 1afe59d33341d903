"""Manifests: what the receiver must find for every tensor of a bucket (name, dtype, shape, place, byte count,
64-bit checksum), checked before anything is applied."""
from __future__ import annotations

import dataclasses
import torch

from kernels.cpu_bridge import checksum, checksums


@dataclasses.dataclass(frozen=True)
class ManifestEntry:
    """One tensor of a bucket; `offset` is its byte offset in the sender's stage layout."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int

    @classmethod
    def from_dict(cls, d: dict) -> "ManifestEntry":
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"], d["checksum"])


def manifest_entry(name: str, tensor: torch.Tensor, offset: int = 0) -> ManifestEntry:
    """Return the manifest entry of one tensor."""
    flat = tensor.detach().contiguous()  # checksummed where it lives (GPU arenas: no copy to the host)
    return ManifestEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset,
                         flat.numel() * flat.element_size(), checksum(flat))


def verify_tensors(checks: list[tuple[ManifestEntry, torch.Tensor]]) -> None:
    """Raise ValueError naming the first tensor that is not what its entry describes. Every layout is checked
    before any byte is read; the checksums of GPU tensors come back together (one synchronisation per call)."""
    layouts = [ManifestEntry(e.name, str(t.dtype).removeprefix("torch."), tuple(t.shape), e.offset,
                             t.numel() * t.element_size(), e.checksum) for e, t in checks]
    _first_difference(layouts, [e for e, _ in checks])
    sums = checksums([t.detach().contiguous() for _, t in checks])
    _first_difference([dataclasses.replace(e, checksum=c) for e, c in zip(layouts, sums)], [e for e, _ in checks])


def _first_difference(got: list[ManifestEntry], expected: list[ManifestEntry]) -> None:
    for g, entry in zip(got, expected):
        if g != entry:
            field = next(f.name for f in dataclasses.fields(entry) if getattr(g, f.name) != getattr(entry, f.name))
            raise ValueError(f"{entry.name}: {field} is {getattr(g, field)!r} but the manifest says "
                             f"{getattr(entry, field)!r}")


def verify_bucket(bucket: list[tuple[str, torch.Tensor]], manifest: list[ManifestEntry]) -> None:
    """Raise ValueError naming the first tensor that does not match the manifest."""
    if [n for n, _ in bucket] != [e.name for e in manifest]:
        raise ValueError(f"bucket names {[n for n, _ in bucket][:4]}... differ from the manifest "
                         f"{[e.name for e in manifest][:4]}...")
    verify_tensors([(expected, tensor) for (_, tensor), expected in zip(bucket, manifest)])
