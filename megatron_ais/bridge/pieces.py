"""What one rank writes in a weight sync: its pieces of each bucket's HF tensors, copied or quantized to
blockwise FP8 into place (the staging arena or its stage's bucket buffer), each checked for NaN/Inf and
checksummed on the way; then the tensors assembled whole in the scratch region (FP8 ones whose pieces cut through
blocks, and every 4-bit one) are quantized — in host memory by every writer, each its share, on a GPU by the stage's
sender (`scratch_share`). The host kernels give their figures at once. On a GPU with
Triton a bucket is one pass (`kernels.bucket_pass`: one launch per dtype group, figures in one device array);
otherwise torch ops where the pieces live. Device figures stay where they are computed until the bucket's end
(`BucketSums`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from kernels.fp8.cpu import fp8_quantize_into, supports_quantize
from kernels.fp8.dispatch import blockwise_fp8_quantize
from kernels.bucket_pass import BucketPass, PassPiece, supports_pass
from kernels.fp8.format import refuse_corrupt, refuse_non_finite
from kernels.fp8.reference import blockwise_fp8_quantize_reference_deferred
from kernels.fp8.triton import blockwise_fp8_quantize_deferred, fp8_kernels_available
from kernels.integrity import (Position, ReadBack, all_finite, checksum_sums, checksum_sums_device,
                               copy_check_finite, copy_check_finite_deferred, unsigned_sums)
from megatron_ais.bridge.plan import Bucket, HFTarget, StagePlan
from megatron_ais.bridge.quantization import SCALE_SUFFIX, QuantizationPolicy, engine_tensor_specs, four_bit_tensors, \
    scale_group


def _on_host(*tensors: torch.Tensor) -> bool:
    """Whether a piece is written by the host kernels, its figures known at once; otherwise torch ops write it
    where its source lives and its figures come back at the bucket's end (`BucketSums`)."""
    return all(t.device.type == "cpu" for t in tensors)


def _refuse_copy(name: str, bad: int) -> None:
    raise ValueError(f"{name}: {bad} NaN/Inf values; refusing to send a corrupt weight to the engine")


class BucketSums:
    """The checksum sums of the tensors this rank writes in one bucket. The host kernels' figures are added as they
    come; figures computed on a GPU (torch ops' per piece, a bucket pass's per tensor row) stay there until `start`
    sends them all back without waiting and `resolve` reads them — one host synchronisation per bucket instead of
    one per piece, as late as the caller can wait — and refuses the first corrupt piece by name."""

    def __init__(self):
        self.totals: dict[str, list[int]] = {}
        self._deferred: list[tuple[torch.Tensor, tuple[str | None, ...], Callable[[int], None]]] = []
        self._rows: list[tuple[torch.Tensor, tuple[str | None, ...], tuple[Callable[[int], None], ...]]] = []
        self._reading: tuple | None = None

    def add(self, name: str, piece: tuple[int, int]) -> None:
        total = self.totals.setdefault(name, [0, 0])
        total[0] = (total[0] + piece[0]) & 0xFFFFFFFFFFFFFFFF
        total[1] = (total[1] + piece[1]) & 0xFFFFFFFFFFFFFFFF

    def defer(self, figures: torch.Tensor, names: tuple[str | None, ...], refuse: Callable[[int], None]) -> None:
        """`figures`: int64 [1 + 2 len(names)] where they were computed — the piece's corrupt count, then the
        (A, B) sums of each named tensor (None: not counted); `refuse(count)` raises for a corrupt piece."""
        self._deferred.append((figures, names, refuse))

    def defer_rows(self, figures: torch.Tensor, names: tuple[str | None, ...],
                   refusals: tuple[Callable[[int], None], ...]) -> None:
        """`figures`: int64 [len(names), 3] where they were computed (a bucket pass's) — each row's corrupt count and
        the (A, B) sums of its tensor (None: not counted); `refusals[r](count)` raises for a corrupt row."""
        self._rows.append((figures, names, refusals))

    def start(self) -> None:
        """Start reading the deferred figures back without waiting for them (`ReadBack`); `resolve` finishes."""
        self._reading = (self._deferred, self._rows,
                         ReadBack([f for f, _, _ in self._deferred] + [f.view(-1) for f, _, _ in self._rows]))
        self._deferred, self._rows = [], []

    def resolve(self) -> dict[str, list[int]]:
        """Read the deferred figures back (started by `start`, or now), refuse the first corrupt piece, and return
        every tensor's sums."""
        if self._reading is None:
            self.start()
        (deferred, rows, reading), self._reading = self._reading, None
        values = reading.values()
        for (_, names, refuse), figures in zip(deferred, values):
            if figures[0]:
                refuse(figures[0])
            for k, name in enumerate(names):
                if name is not None:
                    self.add(name, unsigned_sums(figures[1 + 2 * k], figures[2 + 2 * k]))
        for (_, names, refusals), figures in zip(rows, values[len(deferred):]):
            for k, (name, refuse) in enumerate(zip(names, refusals)):
                count, a, b = figures[3 * k: 3 * k + 3]
                if count:
                    refuse(count)
                if name is not None:
                    self.add(name, unsigned_sums(a, b))
        return self.totals


def _copy_checked(src: torch.Tensor, dst: torch.Tensor, position: Position, name: str, sums: BucketSums,
                  counted: bool = True) -> None:
    """Copy a piece into place, adding its checksum sums to `sums` (when `counted`); refuse NaN/Inf naming the
    tensor."""
    if _on_host(src, dst):
        if src.dtype == dst.dtype:
            bad, piece = copy_check_finite(src, dst, position)
        else:
            dst.copy_(src)
            bad = 0 if all_finite(dst) else int((~torch.isfinite(dst)).sum())
            piece = checksum_sums(dst, position)
        if bad:
            _refuse_copy(name, bad)
        if counted:
            sums.add(name, piece)
        return
    src = src.to(dst.dtype)  # converted where it lives, so that the checks run there too
    sums.defer(copy_check_finite_deferred(src, dst, position), (name if counted else None,),
               functools.partial(_refuse_copy, name))


def quantize_into(src: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, q_position: Position,
                   s_position: Position, policy: QuantizationPolicy, name: str, scale_name: str,
                   sums: BucketSums) -> None:
    """Quantize a piece into place, adding the checksum sums of its codes and of its scales to `sums`."""
    if _on_host(src, q_out, s_out):
        if supports_quantize(src):
            sums.add(name, fp8_quantize_into(src, q_out, s_out, policy.block_size, policy.pow2_scale, name,
                                             q_position))
            sums.add(scale_name, checksum_sums(s_out, s_position))
            return
        q, s = blockwise_fp8_quantize(src, policy.block_size, policy.pow2_scale, name=name)
        sums.add(name, checksum_sums(q, q_position))
        sums.add(scale_name, checksum_sums(s, s_position))
        q_out.copy_(q)
        s_out.copy_(s)
        return
    quantize = blockwise_fp8_quantize_deferred if fp8_kernels_available(src.device) \
        else blockwise_fp8_quantize_reference_deferred
    q, s, corrupt = quantize(src, policy.block_size, policy.pow2_scale, name)
    # checksummed where the quantizer ran, as for copies
    sums.defer(torch.cat([corrupt, checksum_sums_device(q, q_position), checksum_sums_device(s, s_position)]),
               (name, scale_name), lambda _: refuse_non_finite(src, name))
    q_out.copy_(q)
    s_out.copy_(s)


def wait_for_device_writes(buffer) -> None:
    """Block until this process's copies into a GPU buffer are done: other processes read it next (the engine's
    verifier, the stage's sender) and CUDA orders nothing across processes."""
    if buffer is not None and buffer.data.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.synchronize(buffer.data.device)


@dataclasses.dataclass(frozen=True)
class CopyPiece:
    """A piece copied into place: `counted` when its checksum is the tensor's (not a scratch copy that is
    quantized whole: `scratch_share`)."""

    src: torch.Tensor
    dst: torch.Tensor
    position: Position
    name: str
    counted: bool
    nbytes: int

    def write(self, sums: BucketSums, policy: QuantizationPolicy) -> int:
        _copy_checked(self.src, self.dst, self.position, self.name, sums, self.counted)
        return self.nbytes


@dataclasses.dataclass(frozen=True)
class QuantizePiece:
    """A piece quantized into place: its FP8 codes `q` and their block scales `s`."""

    src: torch.Tensor
    q: torch.Tensor
    s: torch.Tensor
    q_position: Position
    s_position: Position
    name: str
    scale_name: str
    nbytes: int

    def write(self, sums: BucketSums, policy: QuantizationPolicy) -> int:
        quantize_into(self.src, self.q, self.s, self.q_position, self.s_position, policy, self.name,
                       self.scale_name, sums)
        return self.nbytes


@dataclasses.dataclass(frozen=True)
class FourBitPiece:
    """Whole weights quantized to 4 bits into place by one writer (`scratch_share`): one `scale_group` (`sources`:
    views of the scratch region) and its engine tensors' views (`outputs`, in `four_bit_tensors` order)."""

    sources: tuple[tuple[str, torch.Tensor], ...]
    outputs: tuple[torch.Tensor, ...]

    def write(self, sums: BucketSums, policy: QuantizationPolicy) -> int:
        for (engine_name, value), out in zip(four_bit_tensors(list(self.sources), policy), self.outputs):
            out.copy_(value.reshape(out.shape))
            if _on_host(out):
                sums.add(engine_name, checksum_sums(out))
            else:
                sums.defer(torch.cat([torch.zeros(1, dtype=torch.int64, device=out.device),
                                      checksum_sums_device(out)]), (engine_name,), lambda _: None)
        return sum(out.numel() * out.element_size() for out in self.outputs)


def bucket_pieces(plan: StagePlan, targets: list[HFTarget], bucket: Bucket, buffer, base: int, scratch_base: int,
                  block_size: int) -> list[CopyPiece | QuantizePiece]:
    """This rank's pieces of a bucket's `targets` as views of `buffer`, whose stage layout starts at byte `base` and
    scratch region at `scratch_base`. An FP8 piece that cuts through blocks is copied into the scratch area (not
    counted: the sender's quantization of the whole tensor is)."""
    tensors, scratch, pieces = {t.name: t for t in plan.tensors}, dict(bucket.scratch), []
    for target in targets:
        if not target.quantized or not target.blockwise_local:
            if target.quantized:
                dst = buffer.view(scratch_base + scratch[target.name], target.param.dtype, target.shape)
            else:
                main = tensors[target.name]
                dst = buffer.view(base + main.offset, main.torch_dtype, main.shape)
            for p in target.pieces:
                out = dst.narrow(p.dim, p.dst_start, p.length)
                pieces.append(CopyPiece(target.param.narrow(p.dim, p.src_start, p.length), out,
                                        Position.of_piece(target.shape, p.dim, p.dst_start), target.name,
                                        not target.quantized, out.numel() * out.element_size()))
            continue
        main, scale = tensors[target.name], tensors[target.name + SCALE_SUFFIX]
        q = buffer.view(base + main.offset, main.torch_dtype, main.shape)
        s = buffer.view(base + scale.offset, scale.torch_dtype, scale.shape)
        for p in target.pieces:
            pieces.append(QuantizePiece(target.param.narrow(p.dim, p.src_start, p.length),
                                        q.narrow(p.dim, p.dst_start, p.length),
                                        s.narrow(p.dim, p.dst_start // block_size, -(-p.length // block_size)),
                                        Position.of_piece(main.shape, p.dim, p.dst_start),
                                        Position.of_piece(scale.shape, p.dim, p.dst_start // block_size), target.name,
                                        scale.name, p.length * q.numel() // q.shape[p.dim]))
    return pieces


class PieceWrites:
    """A bucket's pieces written one by one: host kernels, or torch ops where they live (a GPU without Triton,
    or pieces spread over devices)."""

    read_back_waits = False  # reading the figures back does not wait for every write: `wait_for_device_writes`

    def __init__(self, pieces: list[CopyPiece | QuantizePiece]):
        self.pieces = pieces

    def write(self, sums: BucketSums, policy: QuantizationPolicy) -> int:
        return sum(piece.write(sums, policy) for piece in self.pieces)


class OnePassWrites:
    """A bucket's pieces written by one pass (`kernels.bucket_pass`, tables built once): its figures, one row per
    tensor, go to `sums`; reading them back waits for the pass's writes too (same stream, same device)."""

    read_back_waits = True

    def __init__(self, pieces: list[CopyPiece | QuantizePiece], policy: QuantizationPolicy):
        rows: dict[str, int] = {}
        refusals: dict[str, Callable[[int], None]] = {}

        def row(name: str, refuse: Callable[[str, int], None]) -> int:
            refusals.setdefault(name, functools.partial(refuse, name))
            return rows.setdefault(name, len(rows))

        passes = []
        for p in pieces:
            if isinstance(p, CopyPiece):
                passes.append(PassPiece("copy", p.src, p.position, row(p.name, _refuse_copy), p.counted, p.dst))
            else:
                passes.append(PassPiece("quantize", p.src, p.q_position, row(p.name, refuse_corrupt), True, p.q, p.s,
                                        p.s_position, row(p.scale_name, refuse_corrupt)))
        counted = {p.name for p in pieces if not isinstance(p, CopyPiece) or p.counted} | {
            p.scale_name for p in pieces if isinstance(p, QuantizePiece)}
        self.names = tuple(n if n in counted else None for n in rows)
        self.refusals = tuple(refusals[n] for n in rows)
        self.nbytes = sum(p.nbytes for p in pieces)
        self.bucket_pass = BucketPass(passes, len(rows), policy.block_size, policy.pow2_scale)

    def write(self, sums: BucketSums, policy: QuantizationPolicy) -> int:
        sums.defer_rows(self.bucket_pass.run(), self.names, self.refusals)
        return self.nbytes


def bucket_writes(pieces: list[CopyPiece | QuantizePiece | FourBitPiece], policy: QuantizationPolicy
                  ) -> PieceWrites | OnePassWrites:
    """How a bucket's pieces are written: one pass where the kernel takes every tensor (copies and FP8), else piece
    by piece."""
    if any(isinstance(p, FourBitPiece) for p in pieces):
        return PieceWrites(pieces)
    tensors = [t for p in pieces for t in ((p.src, p.dst) if isinstance(p, CopyPiece) else (p.src, p.q, p.s))]
    return OnePassWrites(pieces, policy) if supports_pass(tensors) else PieceWrites(pieces)


def _four_bit_pieces(plan: StagePlan, bucket: Bucket, buffer, base: int, scratch_base: int, policy
                     ) -> list[FourBitPiece]:
    """`scratch_pieces` of a 4-bit stage: one piece per `scale_group` (whose members share the bucket:
    `plan._bucket_units`)."""
    tensors = {t.name: t for t in plan.tensors}
    targets = {t.name: t for t in plan.targets}
    offsets = dict(bucket.scratch)
    pieces = []
    for name, _ in bucket.scratch:
        group = scale_group(name, policy)
        if group[0] != name:
            continue  # a later member of the group its first member's piece writes
        sources = tuple((member, buffer.view(scratch_base + offsets[member], targets[member].param.dtype,
                                             targets[member].shape)) for member in group)
        outputs = tuple(buffer.view(base + tensors[spec].offset, tensors[spec].torch_dtype, tensors[spec].shape)
                        for member in group for spec, _, _ in engine_tensor_specs(member, targets[member].shape,
                                                                                  policy))
        pieces.append(FourBitPiece(sources, outputs))
    return pieces


def scratch_pieces(plan: StagePlan, bucket: Bucket, buffer, base: int, scratch_base: int,
                   policy: QuantizationPolicy) -> list[QuantizePiece | FourBitPiece]:
    """The quantized tensors of a bucket whose pieces the writers assembled in the scratch region, as whole tensors
    to quantize into place (`scratch_share`: which writer quantizes which)."""
    if policy.precision != "fp8":
        return _four_bit_pieces(plan, bucket, buffer, base, scratch_base, policy)
    tensors, targets = {t.name: t for t in plan.tensors}, {t.name: t for t in plan.targets}
    pieces = []
    for name, offset in bucket.scratch:
        full = buffer.view(scratch_base + offset, targets[name].param.dtype, targets[name].shape)
        main, scale = tensors[name], tensors[name + SCALE_SUFFIX]
        q = buffer.view(base + main.offset, main.torch_dtype, main.shape)
        s = buffer.view(base + scale.offset, scale.torch_dtype, scale.shape)
        pieces.append(QuantizePiece(full, q, s, Position.whole(q), Position.whole(s), main.name, scale.name,
                                    q.numel()))
    return pieces


def scratch_share(pieces: list[QuantizePiece | FourBitPiece], writer: int, writers: int, is_sender: bool
                  ) -> list[QuantizePiece | FourBitPiece]:
    """Writer `writer`'s part (of `writers`) of a bucket's scratch quantization. Every writer of the stage maps the
    buffer: in host memory they split the tensors by size — largest first, each to the writer with the fewest
    elements so far, the same split on every writer — so that the C kernels run on every writer's core (one alone
    took most of a 4-bit sync); in GPU memory the sender takes them all (one device does the work either way)."""
    if not pieces or not _on_host(*(p.q if isinstance(p, QuantizePiece) else p.outputs[0] for p in pieces)):
        return pieces if is_sender else []
    sizes = [p.src.numel() if isinstance(p, QuantizePiece) else sum(src.numel() for _, src in p.sources)
             for p in pieces]
    loads, owner = [0] * writers, [0] * len(pieces)
    for index in sorted(range(len(pieces)), key=lambda i: -sizes[i]):
        owner[index] = loads.index(min(loads))
        loads[owner[index]] += sizes[index]
    return [piece for piece, who in zip(pieces, owner) if who == writer]
