"""What the resharding bridge checks a tensor by, on the host (the C kernels of `kernels.cpu_library`) or where a
device tensor lives (torch ops): NaN/Inf, counted by a checked copy, and a position-weighted checksum.

The checksum of a tensor of E elements (each read as an unsigned integer of its byte width) is the fold of
A = sum v_i and B = sum (i + 1) v_i (mod 2^64, i the flat index): a changed element changes A, swapped or shifted
elements change B, and both are sums, so the TP ranks that write the pieces of a tensor each add up their own
pieces' sums while writing them (`Position` says where a piece sits) and one all-reduce gives the checksum.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kernels.cpu_library import DTYPE_CODES, library, rows_view, sums_array


def summed_where_it_lives(t: torch.Tensor) -> bool:
    """Whether a tensor's checks run as torch ops where it lives (a device tensor of a summable width) rather than
    in the host kernels."""
    return t.device.type != "cpu" and t.element_size() in _SIGNED_VIEWS


def all_finite(t: torch.Tensor) -> bool:
    """Return True when every element is finite (one min/max pass: both propagate NaN, Inf is an extreme)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a 2-D view sits in its tensor: its element (r, c) has flat index (row0 + r) * ncols + col0 + c."""

    row0: int
    ncols: int
    col0: int

    @classmethod
    def whole(cls, t: torch.Tensor) -> "Position":
        """The position of a tensor seen as a whole (1-D and scalars are one row)."""
        return cls(0, t.shape[-1] if t.dim() >= 1 else 1, 0)

    @classmethod
    def of_piece(cls, full_shape: tuple[int, ...], dim: int, start: int) -> "Position":
        """The position of `full.narrow(dim, start, n)` in a 1-D or 2-D tensor of `full_shape`."""
        if len(full_shape) == 1:
            return cls(0, full_shape[0], start)
        return cls(start, full_shape[1], 0) if dim == 0 else cls(0, full_shape[1], start)


def nonfinite(t: torch.Tensor) -> torch.Tensor:
    """Where a float tensor is NaN or Inf (FP8, which torch's isfinite does not take, widened exactly first)."""
    return ~torch.isfinite(t.float() if t.element_size() == 1 else t)


def copy_check_finite(src: torch.Tensor, dst: torch.Tensor, position: Position | None = None
                      ) -> tuple[int, tuple[int, int]]:
    """Copy `src` into `dst` (same shape and dtype, contiguous last dims); return (how many copied elements are
    NaN/Inf — 0 for non-float dtypes —, checksum sums of `dst` at `position` in its tensor)."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"copy of {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
    position = position or Position.whole(dst)
    lib = library()
    if summed_where_it_lives(src):
        return copy_check_finite_torch(src, dst, position)
    # the C kernel checks the float dtypes it has codes for; another (float64, FP8) is checked by torch
    if lib is None or dst.device.type != "cpu" or src.numel() == 0 or (src.is_floating_point()
                                                                       and src.dtype not in DTYPE_CODES):
        bad = int(nonfinite(src).sum()) if src.is_floating_point() else 0
        sums = checksum_sums(src, position)
        dst.copy_(src)
        return bad, sums
    rows, cols, src_stride = rows_view(src)
    _, _, dst_stride = rows_view(dst)
    size = src.element_size()
    sums = sums_array()
    bad = lib.bridge_copy_rows_check_finite(src.data_ptr(), src_stride * size, dst.data_ptr(), dst_stride * size,
                                            rows, cols * size, DTYPE_CODES.get(src.dtype, -1), size,
                                            position.row0, position.ncols, position.col0, sums)
    return int(bad), (sums[0], sums[1])


_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def fold_checksum(nbytes: int, sums: tuple[int, int]) -> int:
    """Return the 64-bit checksum from a tensor's byte count and its sums (A, B)."""
    h = 0xCBF29CE484222325 ^ nbytes
    for v in sums:
        h = ((h ^ (int(v) & _MASK)) * _FNV_PRIME) & _MASK
    return h


def checksum_sums(t: torch.Tensor, position: Position | None = None) -> tuple[int, int]:
    """Return the checksum sums (A, B) of a tensor or 2-D view (contiguous last dim) at `position`: the C kernel
    for CPU tensors, torch integer ops where the tensor lives for device tensors (no copy to the host)."""
    position = position or Position.whole(t)
    if summed_where_it_lives(t):
        return checksum_sums_torch(t, position)
    lib = library()
    if lib is None or t.element_size() not in (1, 2, 4, 8):
        return checksum_sums_reference(t, position)
    if t.numel() == 0:
        return 0, 0
    rows, cols, stride = rows_view(t)
    sums = sums_array()
    lib.bridge_block_sums(t.data_ptr(), rows, cols, stride * t.element_size(), t.element_size(), position.row0,
                          position.ncols, position.col0, sums)
    return sums[0], sums[1]


def checksum(t: torch.Tensor) -> int:
    """Return the 64-bit checksum of a contiguous tensor (any dtype, any device)."""
    return checksums([t])[0]


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Return the 64-bit checksum of each contiguous tensor: the C kernel on host tensors, torch ops where device
    tensors live, whose sums come back together (`read_back`: one synchronisation, not one per tensor)."""
    return finish_checksums(tensors, checksum_figures(tensors))


def checksum_figures(tensors: list[torch.Tensor]) -> list:
    """Each contiguous tensor's checksum sums without a host synchronisation: (A, B) from the C kernel for a host
    tensor, an int64 [2] tensor where a device tensor lives; `finish_checksums` reads them back together (several
    calls' figures at once)."""
    figures = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("checksum needs a contiguous tensor")
        flat = t.detach().reshape(-1)
        figures.append(checksum_sums_device(flat) if summed_where_it_lives(flat) else checksum_sums(flat))
    return figures


def finish_checksums(tensors: list[torch.Tensor], figures: list) -> list[int]:
    """The 64-bit checksums of `tensors` from their `checksum_figures`, the device ones read back at once."""
    sums = list(figures)
    deferred = [i for i, f in enumerate(figures) if isinstance(f, torch.Tensor)]
    for i, (a, b) in zip(deferred, read_back([figures[i] for i in deferred])):
        sums[i] = unsigned_sums(a, b)
    return [fold_checksum(t.numel() * t.element_size(), s) for t, s in zip(tensors, sums)]


_SIGNED_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TORCH_CHUNK = 1 << 24  # elements per pass: the int64 temporaries stay a few hundred MB at most


def copy_check_finite_torch(src: torch.Tensor, dst: torch.Tensor, position: Position) -> tuple[int, tuple[int, int]]:
    """`copy_check_finite` in torch ops where `src` lives: `copy_check_finite_deferred`, read back at once."""
    count, a, b = copy_check_finite_deferred(src, dst, position).tolist()
    return count, unsigned_sums(a, b)


def copy_check_finite_deferred(src: torch.Tensor, dst: torch.Tensor, position: Position) -> torch.Tensor:
    """`copy_check_finite` in torch ops where `src` lives (a GPU rank's shard; the arena may be on another device,
    which should not run every rank's checks), without a host synchronisation: return an int64 [3] tensor on
    `src`'s device, (NaN/Inf count, checksum sums A, B), for the caller to read back with its other figures
    (`read_back`). The caller waits for the copy before it reports the bucket."""
    bad = nonfinite(src).sum().reshape(1) if src.is_floating_point() else \
        torch.zeros(1, dtype=torch.int64, device=src.device)
    figures = torch.cat([bad.to(torch.int64), checksum_sums_device(src, position)])
    dst.copy_(src)
    return figures


def read_back(figures: list[torch.Tensor]) -> list[list[int]]:
    """Read 1-D int64 tensors back to the host with one transfer per device (one synchronisation for a whole
    bucket's figures instead of one per tensor piece); return their values in order."""
    return ReadBack(figures).values()


class ReadBack:
    """1-D int64 figures on their way to the host: one transfer per device, started at once — a GPU's into pinned
    memory without waiting, an event recorded behind it — and finished by `values`, which waits for that event
    only: the caller queues more work (the next bucket) in between, so the GPU does not drain."""

    def __init__(self, figures: list[torch.Tensor]):
        self.sizes = [f.numel() for f in figures]
        self.transfers = []  # (indices, host tensor, event or None)
        by_device: dict = {}
        for i, f in enumerate(figures):
            by_device.setdefault(f.device, []).append(i)
        for device, indices in by_device.items():
            flat = torch.cat([figures[i] for i in indices])
            event = None
            if device.type == "cuda":
                with torch.cuda.device(device):
                    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                flat = host
            self.transfers.append((indices, flat, event))

    def values(self) -> list[list[int]]:
        """The figures' values in order, once their transfers are done (one wait per device)."""
        values: list = [None] * len(self.sizes)
        for indices, host, event in self.transfers:
            if event is not None:
                event.synchronize()
            flat, start = host.tolist(), 0
            for i in indices:
                values[i] = flat[start: start + self.sizes[i]]
                start += self.sizes[i]
        return values


def unsigned_sums(a: int, b: int) -> tuple[int, int]:
    """Checksum sums read back from int64 device tensors, as the C kernel's unsigned 64-bit values."""
    return a & _MASK, b & _MASK


def checksum_sums_torch(t: torch.Tensor, position: Position | None = None) -> tuple[int, int]:
    """`checksum_sums` in torch integer ops on any device: `checksum_sums_device`, read back once."""
    return unsigned_sums(*checksum_sums_device(t, position).tolist())


def checksum_sums_device(t: torch.Tensor, position: Position | None = None) -> torch.Tensor:
    """The checksum sums (A, B) as an int64 tensor [2] where `t` lives, without a host synchronisation, so that a
    caller reads several figures back at once (int64 sums and products wrap mod 2^64 as the C kernel's unsigned
    ones do); at most `_TORCH_CHUNK` elements at a time (rows, or pieces of a long row: a flat embedding's int64
    temporaries would otherwise take tens of GB)."""
    position = position or Position.whole(t)
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    if t.numel() == 0:
        return total
    width = t.element_size()
    matrix = t.detach().reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.detach().reshape(1, -1)  # as `rows_view`
    rows, cols = matrix.shape
    mask = (1 << (8 * width)) - 1 if width < 8 else None
    row_step, col_step = max(1, _TORCH_CHUNK // cols), min(cols, _TORCH_CHUNK)
    for r0 in range(0, rows, row_step):
        starts = (torch.arange(min(row_step, rows - r0), device=t.device, dtype=torch.int64)
                  + (position.row0 + r0)) * position.ncols
        for c0 in range(0, cols, col_step):
            block = matrix[r0:r0 + row_step, c0:c0 + col_step].contiguous()
            values = block.view(-1).view(_SIGNED_VIEWS[width]).to(torch.int64).view(block.shape)
            if mask is not None:
                values = values & mask
            columns = torch.arange(block.shape[1], device=t.device, dtype=torch.int64) + (position.col0 + c0 + 1)
            total += torch.stack([values.sum(), (values * (starts[:, None] + columns[None, :])).sum()])
    return total


def checksum_sums_reference(t: torch.Tensor, position: Position | None = None) -> tuple[int, int]:
    """NumPy reference of `checksum_sums`."""
    position = position or Position.whole(t)
    width = t.element_size()
    flat = t.detach().cpu().contiguous()
    if flat.numel() == 0:
        return 0, 0
    rows = 1 if flat.dim() <= 1 else flat.numel() // flat.shape[-1]  # every leading dimension's, as `rows_view`
    values = flat.view(-1).view(torch.uint8).numpy().view(f"<u{width}").astype(np.uint64).reshape(rows, -1)
    cols = values.shape[1]
    index = ((np.arange(rows, dtype=np.uint64)[:, None] + np.uint64(position.row0)) * np.uint64(position.ncols)
             + np.uint64(position.col0) + np.arange(cols, dtype=np.uint64)[None, :])
    with np.errstate(over="ignore"):
        a = int(values.sum(dtype=np.uint64)) & _MASK
        b = int((values * (index + np.uint64(1))).sum(dtype=np.uint64)) & _MASK
    return a, b
