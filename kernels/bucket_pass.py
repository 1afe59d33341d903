"""One pass over a weight-sync bucket on a GPU: one Triton launch per (kind, dtypes) group reads every source
element once and writes it into place — copied, converted, or quantized to blockwise FP8 with its block scale —
while it counts NaN/Inf and adds the integrity sums of what it wrote (`kernels.integrity`: A = sum v,
B = sum (i + 1) v mod 2^64, the C kernel's and the manifests' sums) into one preallocated int64 row per tensor:
(NaN/Inf count, A, B). No temporary the size of a piece and no host synchronisation: the caller reads the
figures back once per bucket. `sums` pieces only read (the receiver's verification).

The tables are built once per plan: one row per piece (addresses, strides, sizes, where it sits in its tensor,
its figures row) and one per tile (piece, first row, first column). A copied piece is cut into
`COPY_TILE` tiles of its 2-D view, a quantized one into its block_size x block_size blocks (one scale each).
`run_reference` walks the same tiles in torch: the kernel is tested against it, and it against today's sums and
codes.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from kernels.cpu_library import rows_view
from kernels.fp8.reference import blockwise_fp8_quantize_reference_deferred
from kernels.fp8.triton import LAUNCH_LOCK, fp8_kernels_available, triton_available
from kernels.integrity import Position, checksum_sums_device

try:
    import triton
    import triton.language as tl

    from kernels.fp8.triton import quantize_block
except ImportError:  # optional: CPU images may ship none
    triton = None

KINDS = {"copy": 0, "quantize": 1, "sums": 2}
COPY_TILE = (32, 256)  # 8192 elements: 16 KB of BF16 per program, a handful of atomics per tile
SUMS_TILE = (32, 256)  # the receiver's tiles: it only reads
NUM_WARPS = {"copy": 8, "quantize": 16, "sums": 8}  # tools/bench_bucket_pass.py --sweep times the alternatives
# columns of a piece's row in the piece table (the kernel reads them by number)
(SRC, SRC_STRIDE, DST, DST_STRIDE, ROWS, COLS, POS_ROW0, POS_NCOLS, POS_COL0, ROW, COUNTED, SCALE, SCALE_STRIDE,
 SCALE_ROW, SCALE_INDEX, SCALE_NCOLS) = range(16)
PIECE_COLUMNS = 16
_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.int64}

if triton is not None:
    _TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
           torch.float64: tl.float64, torch.float8_e4m3fn: tl.float8e4nv, torch.uint8: tl.uint8,
           torch.uint16: tl.uint16, torch.uint32: tl.uint32, torch.int64: tl.int64}

    @triton.jit
    def _sums_into(figures_ptr, row, bits, rows_index, cols_index):
        # B = sum v (i + 1) with i + 1 = rows_index[r] + cols_index[c]: from the row and column sums, so that no
        # index the size of the tile is held (the sums wrap mod 2^64 either way)
        row_sums = tl.sum(bits, 1)
        col_sums = tl.sum(bits, 0)
        tl.atomic_add(figures_ptr + row * 3 + 1, tl.sum(row_sums, 0))
        tl.atomic_add(figures_ptr + row * 3 + 2, tl.sum(row_sums * rows_index, 0) + tl.sum(col_sums * cols_index, 0))

    @triton.jit
    def _bucket_pass_kernel(pieces_ptr, tiles_ptr, figures_ptr, KIND: tl.constexpr, SRC_T: tl.constexpr,
                            DST_T: tl.constexpr, BITS_T: tl.constexpr, FLOAT: tl.constexpr, TILE_R: tl.constexpr,
                            TILE_C: tl.constexpr, POW2: tl.constexpr, ALIGNED: tl.constexpr):
        tile = tiles_ptr + tl.program_id(0).to(tl.int64) * 3
        piece = pieces_ptr + tl.load(tile) * 16
        r_start = tl.load(tile + 1)
        c_start = tl.load(tile + 2)
        cols = tl.load(piece + 5)
        src = tl.load(piece + 0).to(tl.pointer_type(SRC_T))
        src_stride = tl.load(piece + 1)
        dst = tl.load(piece + 2).to(tl.pointer_type(DST_T))
        dst_stride = tl.load(piece + 3)
        if ALIGNED:  # what the host checked (`_aligned`), told to the compiler: 16-byte loads and stores
            c_start = tl.multiple_of(c_start, TILE_C)
            cols = tl.multiple_of(cols, 16)
            src = tl.multiple_of(src, 16)
            src_stride = tl.multiple_of(src_stride, 16)
            dst = tl.multiple_of(dst, 16)
            dst_stride = tl.multiple_of(dst_stride, 16)
        r = r_start + tl.arange(0, TILE_R)
        c = c_start + tl.arange(0, TILE_C)
        inside = (r[:, None] < tl.load(piece + 4)) & (c[None, :] < cols)
        x = tl.load(src + r[:, None] * src_stride + c[None, :], mask=inside, other=0)
        row = tl.load(piece + 9)
        if KIND == 2:
            y = x
        else:
            dst = dst + r[:, None] * dst_stride + c[None, :]
            if KIND == 1:
                y, scale, finite = quantize_block(x.to(tl.float32), POW2)
                block_r = r_start // TILE_R
                block_c = c_start // TILE_C
                tl.store(tl.load(piece + 11).to(tl.pointer_type(tl.float32)) + block_r * tl.load(piece + 12)
                         + block_c, scale)
                index = tl.load(piece + 14) + block_r * tl.load(piece + 15) + block_c + 1
                scale_bits = scale.to(tl.uint32, bitcast=True).to(tl.int64)
                scale_row = tl.load(piece + 13)
                tl.atomic_add(figures_ptr + scale_row * 3 + 1, scale_bits)
                tl.atomic_add(figures_ptr + scale_row * 3 + 2, scale_bits * index)
            else:
                y = x.to(DST_T)
                if FLOAT:
                    finite = tl.abs(y.to(tl.float32)) <= 3.4028234663852886e38
            tl.store(dst, y, mask=inside)
            if FLOAT:
                tl.atomic_add(figures_ptr + row * 3, tl.sum(tl.sum(tl.where(inside & ~finite, 1, 0).to(tl.int64),
                                                                   1), 0))
        if tl.load(piece + 10) != 0:
            bits = tl.where(inside, y.to(BITS_T, bitcast=True).to(tl.int64), 0)
            _sums_into(figures_ptr, row, bits, (tl.load(piece + 6) + r) * tl.load(piece + 7),
                       tl.load(piece + 8) + c + 1)


@dataclasses.dataclass(frozen=True)
class PassPiece:
    """One piece of a bucket pass. `src`: a 1-D or 2-D view with a contiguous last dim; `dst`: where it goes
    (copy: same shape; quantize: its FP8 codes, with `scale` its block scales); `position`: where what is summed
    sits in its tensor (dst's, or src's for `sums`); `row`: its figures row (NaN/Inf count, and the sums when
    `counted`)."""

    kind: str
    src: torch.Tensor
    position: Position
    row: int
    counted: bool = True
    dst: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    scale_position: Position | None = None
    scale_row: int = -1

    @property
    def out_dtype(self) -> torch.dtype:
        return self.src.dtype if self.dst is None else self.dst.dtype


def flat_sums_pieces(t: torch.Tensor, row: int) -> list[PassPiece]:
    """A contiguous tensor's `sums` pieces: its elements as full rows of `SUMS_TILE[1]` columns, and the rest as one
    short row (positions say the flat index)."""
    flat, width = t.detach().reshape(-1), SUMS_TILE[1]
    full = flat.numel() // width * width
    pieces = [PassPiece("sums", flat[:full].view(-1, width), Position(0, width, 0), row)] if full else []
    if flat.numel() > full:
        pieces.append(PassPiece("sums", flat[full:].view(1, -1), Position(full // width, width, 0), row))
    return pieces


def _aligned(piece: PassPiece) -> bool:
    """Whether the piece's addresses are 16-byte aligned and its row length and row strides multiples of 16
    elements (its launch then lets the compiler use 16-byte loads and stores; the hidden sizes of real models are)."""
    views = [piece.src] + ([piece.dst] if piece.dst is not None else [])
    return all(v.data_ptr() % 16 == 0 and rows_view(v)[1] % 16 == 0 and rows_view(v)[2] % 16 == 0 for v in views)


def _tile(kind: str, block_size: int) -> tuple[int, int]:
    return {"copy": COPY_TILE, "sums": SUMS_TILE}.get(kind, (block_size, block_size))


def _piece_row(piece: PassPiece) -> list[int]:
    rows, cols, src_stride = rows_view(piece.src)
    values = [0] * PIECE_COLUMNS
    values[SRC:COLS + 1] = [piece.src.data_ptr(), src_stride, 0, 0, rows, cols]
    values[POS_ROW0:COUNTED + 1] = [piece.position.row0, piece.position.ncols, piece.position.col0, piece.row,
                                    int(piece.counted)]
    if piece.dst is not None:
        values[DST], values[DST_STRIDE] = piece.dst.data_ptr(), rows_view(piece.dst)[2]
    if piece.kind == "quantize":
        s_pos = piece.scale_position
        values[SCALE:SCALE_NCOLS + 1] = [piece.scale.data_ptr(), rows_view(piece.scale)[2], piece.scale_row,
                                         s_pos.row0 * s_pos.ncols + s_pos.col0, s_pos.ncols]
    return values


def _tiles(piece_index: int, piece: PassPiece, block_size: int) -> torch.Tensor:
    rows, cols, _ = rows_view(piece.src)
    tr, tc = _tile(piece.kind, block_size)
    r0 = torch.arange(0, rows, tr, dtype=torch.int64)
    c0 = torch.arange(0, cols, tc, dtype=torch.int64)
    grid = torch.stack(torch.meshgrid(r0, c0, indexing="ij"), -1).reshape(-1, 2)
    return torch.cat([torch.full((grid.shape[0], 1), piece_index, dtype=torch.int64), grid], 1)


@dataclasses.dataclass
class PassLaunch:
    """One kernel launch: the pieces of one kind and pair of dtypes (and alignment), as their tables on the
    device."""

    kind: str
    src_dtype: torch.dtype
    out_dtype: torch.dtype
    aligned: bool
    piece_table: torch.Tensor
    tile_table: torch.Tensor


class BucketPass:
    """A bucket's pass, built once per plan: its launches and its figures [rows, 3] (NaN/Inf count, A, B per
    tensor row) where the pieces live. `run` zeroes the figures, launches, and returns them without waiting."""

    def __init__(self, pieces: list[PassPiece], rows: int, block_size: int = 128, pow2_scale: bool = False):
        self.block_size, self.pow2_scale = block_size, pow2_scale
        device = pieces[0].src.device if pieces else torch.device("cpu")
        groups: dict[tuple, list[PassPiece]] = {}
        for p in pieces:
            if p.src.numel():
                groups.setdefault((p.kind, p.src.dtype, p.out_dtype, _aligned(p)), []).append(p)
        self.launches = []
        for (kind, src_dtype, out_dtype, aligned), group in groups.items():
            piece_table = torch.tensor([_piece_row(p) for p in group], dtype=torch.int64)
            tile_table = torch.cat([_tiles(i, p, block_size) for i, p in enumerate(group)])
            self.launches.append(PassLaunch(kind, src_dtype, out_dtype, aligned, piece_table.to(device),
                                            tile_table.to(device)))
        self.figures = torch.zeros(rows, 3, dtype=torch.int64, device=device)

    def run(self) -> torch.Tensor:
        self.figures.zero_()
        for launch in self.launches:
            _launch(launch, self.figures, self.block_size, self.pow2_scale)
        return self.figures


def launch_constants(kind: str, src_dtype: torch.dtype, out_dtype: torch.dtype, aligned: bool, block_size: int,
                     pow2_scale: bool) -> dict:
    """The kernel's compile-time constants for a launch of `kind` (what Triton compiles one binary for)."""
    tile = _tile(kind, block_size)
    src, out = (_BITS[src_dtype.itemsize],) * 2 if kind == "sums" else (src_dtype, out_dtype)  # sums read raw bits
    return dict(KIND=KINDS[kind], SRC_T=_TL[src], DST_T=_TL[out], BITS_T=_TL[_BITS[out.itemsize]],
                FLOAT=kind != "sums" and out_dtype.is_floating_point, TILE_R=tile[0], TILE_C=tile[1], POW2=pow2_scale,
                ALIGNED=aligned)


def _launch(launch: PassLaunch, figures: torch.Tensor, block_size: int, pow2_scale: bool) -> None:
    device = launch.tile_table.device
    # Triton launches on the current device: make it the tables' (the arena may not be on the current one)
    with LAUNCH_LOCK, torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _bucket_pass_kernel[(launch.tile_table.shape[0],)](
            launch.piece_table, launch.tile_table, figures, num_warps=NUM_WARPS[launch.kind],
            **launch_constants(launch.kind, launch.src_dtype, launch.out_dtype, launch.aligned, block_size,
                               pow2_scale))


# what the pass copies, converts and quantizes (a `sums` pass reads any width in `_BITS`)
PASS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn)


def supports_pass(tensors: list[torch.Tensor], sums_only: bool = False) -> bool:
    """Whether the kernel takes these tensors: Triton present, all on one CUDA device, of dtypes it writes (FP8 on a
    GPU that Triton compiles e4m3 for) or widths it sums."""
    if not triton_available() or not tensors:
        return False
    device = tensors[0].device
    if device.type != "cuda" or any(t.device != device for t in tensors):
        return False
    if sums_only:
        return all(t.element_size() in _BITS for t in tensors)
    return all(t.dtype in PASS_DTYPES for t in tensors) and (
        all(t.dtype != torch.float8_e4m3fn for t in tensors) or fp8_kernels_available(device))


def run_reference(pieces: list[PassPiece], rows: int, block_size: int = 128, pow2_scale: bool = False
                  ) -> torch.Tensor:
    """The kernel's torch reference, tile by tile over the same tiles: writes what it writes and returns the same
    figures [rows, 3] — each tile quantized by the reference quantizer, its sums by `checksum_sums_device` at the
    tile's position (int64 sums wrap mod 2^64 as the kernel's do)."""
    figures = torch.zeros(rows, 3, dtype=torch.int64)

    def add_sums(row: int, t: torch.Tensor, position: Position, r0: int, c0: int) -> None:
        at = Position(position.row0 + r0, position.ncols, position.col0 + c0)
        figures[row, 1:] += checksum_sums_device(t, at).cpu()

    for p in pieces:
        src = p.src if p.src.dim() == 2 else p.src.reshape(1, -1)
        dst = None if p.dst is None else (p.dst if p.dst.dim() == 2 else p.dst.reshape(1, -1))
        tr, tc = _tile(p.kind, block_size)
        for r0 in range(0, src.shape[0], tr):
            for c0 in range(0, src.shape[1], tc):
                x = src[r0:r0 + tr, c0:c0 + tc]
                if p.kind == "sums":
                    y = x
                elif p.kind == "copy":
                    y = x.to(dst.dtype)
                else:
                    y, scale, _ = blockwise_fp8_quantize_reference_deferred(x, block_size, pow2_scale)
                    s_row, s_col = r0 // block_size, c0 // block_size
                    p.scale[s_row, s_col] = scale[0, 0]
                    add_sums(p.scale_row, scale, p.scale_position, s_row, s_col)
                if p.kind != "sums":
                    dst[r0:r0 + tr, c0:c0 + tc] = y
                    if p.out_dtype.is_floating_point:
                        source = x if p.kind == "quantize" else y
                        figures[p.row, 0] += int((~torch.isfinite(source.float())).sum())
                if p.counted:
                    add_sums(p.row, y, p.position, r0, c0)
    return figures
