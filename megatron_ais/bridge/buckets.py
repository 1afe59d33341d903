"""Manifests: what the receiver must find for every tensor of a bucket (name, dtype, shape, place, byte count,
64-bit checksum), checked before anything is applied."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from kernels.bucket_pass import BucketPass, flat_sums_pieces, supports_pass
from kernels.integrity import checksum, checksum_figures, finish_checksums, fold_checksum


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
    verify_checksums(checks, start_checksums(checks))


def start_checksums(checks: list[tuple[ManifestEntry, torch.Tensor]], passes: dict | None = None) -> list:
    """Check every tensor's layout against its entry (ValueError naming the first that differs) and start their
    checksums, which `verify_checksums` finishes: on one GPU with Triton one `sums` pass over the bucket (its
    tables built once and kept in `passes`, keyed by where the tensors are), else
    `kernels.integrity.checksum_figures`."""
    _first_difference([_layout(e, t) for e, t in checks], [e for e, _ in checks])
    tensors = [t for _, t in checks]
    if passes is None or not supports_pass(tensors, sums_only=True) or not all(t.is_contiguous() for t in tensors):
        return checksum_figures([t.detach().contiguous() for t in tensors])
    key = tuple((t.data_ptr(), t.numel(), t.element_size()) for t in tensors)  # no torch op per tensor
    if key not in passes:
        passes[key] = BucketPass([p for row, t in enumerate(tensors) for p in flat_sums_pieces(t, row)],
                                 len(tensors))
    return list(passes[key].run()[:, 1:].unbind(0))


def verify_checksums(checks: list[tuple[ManifestEntry, torch.Tensor]], figures: list) -> None:
    """Raise ValueError naming the first tensor whose checksum (from `start_checksums`' figures, the device ones
    read back at once) is not its entry's."""
    sums = finish_checksums([t for _, t in checks], figures)
    _first_difference([dataclasses.replace(_layout(e, t), checksum=c) for (e, t), c in zip(checks, sums)],
                      [e for e, _ in checks])


def _layout(entry: ManifestEntry, t: torch.Tensor) -> ManifestEntry:
    return ManifestEntry(entry.name, str(t.dtype).removeprefix("torch."), tuple(t.shape), entry.offset,
                         t.numel() * t.element_size(), entry.checksum)


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


class StageWriters:
    """The ranks that write one pipeline stage's buckets (its TP ranks, and the EP x expert-TP ranks of MoE layers):
    they agree on errors and add up their pieces' checksum sums into each bucket's manifest."""

    def __init__(self, group, is_sender: bool):
        self.group, self.is_sender = group, is_sender

    def first_error(self, error: str | None) -> str:
        """After the writers learnt that one failed: every writer leaves with the first one's error."""
        errors = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        return next(e for e in errors if e is not None)

    def agree(self, error: str | None) -> str | None:
        """Barrier of the writers; every writer leaves with the first one's error, if any."""
        if dist.get_world_size(self.group) == 1:
            return error
        flag = torch.tensor([0 if error is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return self.first_error(error) if int(flag) else None

    def manifest(self, tensors: list, sums: dict[str, list[int]], error: str | None
                 ) -> tuple[list[ManifestEntry] | None, str | None]:
        """The end of a bucket of `tensors` (its EngineTensors): one all-reduce adds up the checksum sums each writer
        gathered while writing its pieces (in 32-bit halves, so that no int64 sum overflows) and whether any failed.
        Return (the manifest on the sender, the first writer's error if any)."""
        values = [0 if error is None else 1, 0] + [half for t in tensors for v in sums.get(t.name, (0, 0))
                                                   for half in (v >> 32, v & 0xFFFFFFFF)]
        halves = torch.tensor(values, dtype=torch.int64).view(-1, 2)
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(halves, group=self.group)
            if int(halves[0, 0]):
                return None, self.first_error(error)
        if error is not None or not self.is_sender:
            return None, error
        totals = [((hi << 32) + lo) & 0xFFFFFFFFFFFFFFFF for hi, lo in halves[1:].tolist()]
        return [ManifestEntry(t.name, t.dtype, t.shape, t.offset, t.nbytes,
                              fold_checksum(t.nbytes, (totals[2 * i], totals[2 * i + 1])))
                for i, t in enumerate(tensors)], None
