"""The one-pass bucket kernel alone (`kernels.bucket_pass`) against a plain copy of the same bytes on one GPU, at
several tile shapes and warp counts: a bucket of Qwen3-4B-shaped decoder layers (BF16 sources) copied into an
arena, quantized into it (blockwise FP8 codes and scales), and the arena's checksums (the receiver's `sums` pass).
Tells the kernel's own speed apart from the bridge's orchestration (`tools/bench_bridge.py` times whole syncs), and
which tiles and warps to keep.

    python3 tools/bench_bucket_pass.py [--layers 2 --hidden-size 2560 --intermediate-size 9728] [--sweep]

Compulsory bytes per pass: a copy reads and writes each element, a quantization reads it and writes its code (and
the scales), a `sums` pass reads it. Every configuration must produce the same figures (NaN/Inf counts and integrity
sums of what it wrote) as the kernel's defaults, or the tool says which did not and exits 1. Last line:
`copy_pass_over_copy=<x> quantize_pass_over_copy=<x> sums_pass_gbps=<x> copy_gbps=<x>` at the module's default
tiles and warps (GB/s over the copy's GB/s, both counting compulsory bytes). Needs a CUDA GPU with Triton;
`TRITON_INTERPRET=1` runs it on CPU tensors (slow: a smoke run of tiny shapes, timings meaningless).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_fp8_quant import _seconds  # noqa: E402

from kernels import bucket_pass  # noqa: E402
from kernels.bucket_pass import BucketPass, PassPiece, flat_sums_pieces  # noqa: E402
from kernels.fp8.format import scale_shape  # noqa: E402
from kernels.fp8.triton import fp8_kernels_available, triton_available  # noqa: E402
from kernels.integrity import Position  # noqa: E402

TILES = ((16, 256), (32, 256), (64, 256), (32, 512), (16, 1024))
WARPS = (4, 8, 16)


@dataclasses.dataclass(frozen=True)
class PassShape:
    """What the sweep varies: the copy and sums tiles and each kind's warps (`bucket_pass.COPY_TILE`, `SUMS_TILE`,
    `NUM_WARPS`)."""

    tile: tuple[int, int]
    warps: int

    @contextlib.contextmanager
    def applied(self, kind: str):
        """The module's tiles and `kind`'s warps set to this shape while the tables are built and the kernel runs,
        the module's own restored after."""
        saved = bucket_pass.COPY_TILE, bucket_pass.SUMS_TILE, bucket_pass.NUM_WARPS
        bucket_pass.COPY_TILE = bucket_pass.SUMS_TILE = self.tile
        bucket_pass.NUM_WARPS = {**saved[2], kind: self.warps}
        try:
            yield
        finally:
            bucket_pass.COPY_TILE, bucket_pass.SUMS_TILE, bucket_pass.NUM_WARPS = saved


def layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """One decoder layer's linear weights as the engine receives them (q, k, v, o, gate, up, down)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (intermediate, hidden), (intermediate, hidden),
            (hidden, intermediate)]


def _arena_views(arena: torch.Tensor, shapes: list[tuple[int, int]], dtype: torch.dtype, start: int = 0
                 ) -> tuple[list[torch.Tensor], int]:
    """Views of `arena` (bytes) for tensors of `shapes` and `dtype`, each at a 256-byte aligned offset."""
    views, offset = [], start
    for shape in shapes:
        nbytes = shape[0] * shape[1] * torch.empty(0, dtype=dtype).element_size()
        views.append(arena[offset: offset + nbytes].view(dtype).view(shape))
        offset += -(-nbytes // 256) * 256
    return views, offset


def build_pieces(sources: list[torch.Tensor], arena: torch.Tensor, block: int
                 ) -> dict[str, tuple[list[PassPiece], int]]:
    """The pieces and figures rows of the four passes over `sources` into `arena` (bytes): BF16 copies, FP8 codes
    and their scales, each tensor 256-byte aligned; the sums passes read what the copy and the quantization wrote."""
    shapes = [tuple(s.shape) for s in sources]
    copies, end = _arena_views(arena, shapes, torch.bfloat16)
    codes, end = _arena_views(arena, shapes, torch.float8_e4m3fn, end)
    scales, _ = _arena_views(arena, [scale_shape(s, block) for s in shapes], torch.float32, end)
    n = len(sources)
    copy = [PassPiece("copy", s, Position.whole(d), i, dst=d) for i, (s, d) in enumerate(zip(sources, copies))]
    quantize = [PassPiece("quantize", s, Position.whole(q), 2 * i, dst=q, scale=sc, scale_position=Position.whole(sc),
                          scale_row=2 * i + 1) for i, (s, q, sc) in enumerate(zip(sources, codes, scales))]
    sums_bf16 = [p for i, t in enumerate(copies) for p in flat_sums_pieces(t, i)]
    sums_fp8 = [p for i, t in enumerate(codes + scales) for p in flat_sums_pieces(t, i)]
    return {"copy": (copy, n), "quantize": (quantize, 2 * n), "sums (BF16 arena)": (sums_bf16, n),
            "sums (FP8 arena)": (sums_fp8, 2 * n)}


def arena_bytes(sources: list[torch.Tensor], block: int) -> int:
    """The bytes `build_pieces` lays out for `sources`: BF16 copies, FP8 codes, scales, and alignment."""
    needed = compulsory_bytes(sources, block)
    return needed["sums (BF16 arena)"] + needed["sums (FP8 arena)"] + 256 * 3 * len(sources)


def build_passes(sources: list[torch.Tensor], arena: torch.Tensor, block: int) -> dict[str, BucketPass]:
    """The four passes of one configuration (its tiles are read when the tables are built)."""
    return {kind: BucketPass(pieces, rows, block)
            for kind, (pieces, rows) in build_pieces(sources, arena, block).items()}


def compulsory_bytes(sources: list[torch.Tensor], block: int) -> dict[str, int]:
    elements = sum(s.numel() for s in sources)
    scale_bytes = 4 * sum(a * b for a, b in (scale_shape(tuple(s.shape), block) for s in sources))
    return {"copy": 4 * elements, "quantize": 3 * elements + scale_bytes, "sums (BF16 arena)": 2 * elements,
            "sums (FP8 arena)": elements + scale_bytes}


def triton_fp8_device(tool: str) -> torch.device | None:
    """The device the Triton FP8 kernels run on here: the GPU, or the CPU under `TRITON_INTERPRET=1`; None, with one
    line on stderr naming `tool`, where they cannot run."""
    cuda = torch.cuda.is_available()
    if not triton_available() or not (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        print(f"{tool}: needs a CUDA GPU with Triton (or TRITON_INTERPRET=1 on CPU tensors)", file=sys.stderr)
        return None
    device = torch.device("cuda" if cuda else "cpu")
    if cuda and not fp8_kernels_available(device):
        print(f"{tool}: {torch.cuda.get_device_name()}: Triton compiles no e4m3 for this GPU (sm_89 or later: Ada, "
              "Hopper)", file=sys.stderr)
        return None
    return device


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="Decoder layers in the bucket.")
    parser.add_argument("--hidden-size", type=int, default=2560)
    parser.add_argument("--intermediate-size", type=int, default=9728)
    parser.add_argument("--num-attention-heads", type=int, default=32)
    parser.add_argument("--num-key-value-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep", action="store_true",
                        help="Also time every tile of --tiles for copies and sums at every --warps, and the "
                             "quantization at each warp count.")
    parser.add_argument("--tiles", nargs="+", default=[f"{r}x{c}" for r, c in TILES], help="ROWSxCOLS tiles.")
    parser.add_argument("--warps", nargs="+", type=int, default=list(WARPS))
    args = parser.parse_args(argv)
    try:
        tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles]
    except ValueError:
        parser.error(f"--tiles takes ROWSxCOLS, e.g. 32x256; got {args.tiles}")
    if any(len(t) != 2 or min(t) < 1 or any(v & (v - 1) for v in t) for t in tiles):
        parser.error(f"--tiles: rows and columns are powers of two (Triton's blocks), e.g. 32x256; got {args.tiles}")
    device = triton_fp8_device("bench_bucket_pass.py")
    if device is None:
        return 2
    cuda = device.type == "cuda"
    block = 128
    shapes = layer_shapes(args.hidden_size, args.intermediate_size, args.num_attention_heads,
                          args.num_key_value_heads, args.head_dim) * args.layers
    g = torch.Generator(device=device).manual_seed(0)
    sources = [(torch.randn(s, generator=g, device=device) * 0.02).bfloat16() for s in shapes]
    needed = compulsory_bytes(sources, block)
    arena = torch.zeros(arena_bytes(sources, block), dtype=torch.uint8, device=device)
    flat_src = torch.cat([s.reshape(-1) for s in sources])
    flat_dst = torch.empty_like(flat_src)
    copy_s = _seconds(lambda: flat_dst.copy_(flat_src), args.repeats, cuda)
    copy_gbps = needed["copy"] / copy_s / 1e9
    print(f"| {torch.cuda.get_device_name() if cuda else 'CPU (Triton interpreter)'}, {args.layers} layers, "
          f"{flat_src.numel() / 1e6:.1f}M BF16 elements | tile | warps | seconds (median) | GB/s | over copy |")
    print("|---|---|---|---|---|---|")
    print(f"| plain copy (`copy_`) | | | {copy_s:.5f} | {copy_gbps:.1f} | 1.00 |")

    defaults = {kind: PassShape(bucket_pass.SUMS_TILE if kind.startswith("sums") else bucket_pass.COPY_TILE,
                                bucket_pass.NUM_WARPS[kind.split()[0]]) for kind in needed}
    configs = [(kind, shape) for kind, shape in defaults.items()]
    if args.sweep:
        configs += [(kind, PassShape(t, w)) for kind, t, w in itertools.product(
            ("copy", "sums (BF16 arena)", "sums (FP8 arena)"), tiles, args.warps)]
        configs += [("quantize", PassShape(defaults["quantize"].tile, w)) for w in args.warps]
    at_defaults, failed = {}, []  # kind -> (figures, GB/s) of its first configuration, the module's defaults
    for kind, shape in configs:
        with shape.applied(kind.split()[0]):
            passes = build_passes(sources, arena, block)
            if kind.startswith("sums"):  # what the sums read: the copy and the quantization, written once
                passes["copy"].run()
                passes["quantize"].run()
            work = passes[kind]
            seconds = _seconds(lambda: work.run(), args.repeats, cuda)
            figures = work.run().cpu()
        gbps = needed[kind] / seconds / 1e9
        at_defaults.setdefault(kind, (figures, gbps))
        if not torch.equal(figures, at_defaults[kind][0]):
            failed.append(f"{kind} at tile {shape.tile}, {shape.warps} warps")
        print(f"| {kind} pass | {'x'.join(map(str, shape.tile)) if kind != 'quantize' else f'{block}x{block}'} | "
              f"{shape.warps} | {seconds:.5f} | {gbps:.1f} | {gbps / copy_gbps:.2f} |")
    if failed:
        print("figures differ from the defaults' in: " + "; ".join(failed), file=sys.stderr)
        return 1
    print(f"copy_pass_over_copy={at_defaults['copy'][1] / copy_gbps:.2f} "
          f"quantize_pass_over_copy={at_defaults['quantize'][1] / copy_gbps:.2f} "
          f"sums_pass_gbps={at_defaults['sums (BF16 arena)'][1]:.1f} copy_gbps={copy_gbps:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
