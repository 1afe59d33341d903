"""How one Megatron parameter is laid out over tensor-parallel ranks relative to its Hugging Face tensors.

Each layout has two pure functions, inverse to each other:
  `shard(hf_tensors, ctx) -> Tensor`       the calling TP rank's Megatron shard, built from full HF tensors;
  `merge(shards, ctx) -> list[Tensor]`     the full HF tensors, built from all TP ranks' shards in rank order.
They are used by the HF loader, the exporter, the offline converter and the resharding bridge alike.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ShardContext:
    """The facts a layout needs: TP position, attention geometry and vocabulary sizes."""

    tp_size: int
    tp_rank: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


class Layout:
    """Base: one HF tensor, split over TP along `dim` (None = replicated)."""

    name = "base"
    dim: int | None = None

    def shard(self, hf: list[torch.Tensor], ctx: ShardContext) -> torch.Tensor:
        (t,) = hf
        if self.dim is None:
            return t
        return t.chunk(ctx.tp_size, dim=self.dim)[ctx.tp_rank]

    def merge(self, shards: list[torch.Tensor], ctx: ShardContext) -> list[torch.Tensor]:
        if self.dim is None:
            return [shards[0]]
        return [torch.cat(shards, dim=self.dim)]


class Replicated(Layout):
    """Same full tensor on every TP rank (norms)."""

    name = "replicated"


class ColumnParallel(Layout):
    """ColumnParallelLinear: output rows split over TP."""

    name = "column_parallel"
    dim = 0


class RowParallel(Layout):
    """RowParallelLinear: input columns split over TP."""

    name = "row_parallel"
    dim = 1


class VocabParallel(Layout):
    """Embedding / output layer: rows padded to the padded vocabulary, then split over TP."""

    name = "vocab_parallel"
    dim = 0

    def shard(self, hf, ctx):
        (t,) = hf
        pad = ctx.padded_vocab_size - t.shape[0]
        if pad < 0:
            raise ValueError(f"HF vocabulary {t.shape[0]} exceeds the padded size {ctx.padded_vocab_size}")
        # Padded rows are zero: their logits are 0 and log-prob code masks them out of the vocabulary.
        full = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        return full.chunk(ctx.tp_size, dim=0)[ctx.tp_rank]

    def merge(self, shards, ctx):
        return [torch.cat(shards, dim=0)[: ctx.vocab_size]]


class FusedQKV(Layout):
    """`linear_qkv` weight or bias: rows grouped per KV head, [q heads of group | k | v] per group.

    TP splits the fused rows evenly; with fewer KV heads than TP ranks megatron gathers the activations
    and each rank picks its group, so the row layout is the same in both cases.
    """

    name = "fused_qkv"

    @staticmethod
    def _geometry(ctx):
        ng = ctx.num_key_value_heads
        return ng, ctx.num_attention_heads // ng, ctx.head_dim

    def shard(self, hf, ctx):
        q, k, v = hf
        ng, per_group, hd = self._geometry(ctx)
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(ng, per_group, hd, *rest), k.reshape(ng, 1, hd, *rest),
                           v.reshape(ng, 1, hd, *rest)], dim=1)
        return fused.reshape(-1, *rest).chunk(ctx.tp_size, dim=0)[ctx.tp_rank]

    def merge(self, shards, ctx):
        ng, per_group, hd = self._geometry(ctx)
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        grouped = full.reshape(ng, per_group + 2, hd, *rest)
        q = grouped[:, :per_group].reshape(ng * per_group * hd, *rest)
        k = grouped[:, per_group].reshape(ng * hd, *rest)
        v = grouped[:, per_group + 1].reshape(ng * hd, *rest)
        return [q, k, v]


class GatedFC1(Layout):
    """SwiGLU `linear_fc1`: each TP rank holds [gate_r ; up_r] (megatron applies the GLU to the local shard)."""

    name = "gated_fc1"

    def shard(self, hf, ctx):
        gate, up = hf
        return torch.cat([gate.chunk(ctx.tp_size, dim=0)[ctx.tp_rank], up.chunk(ctx.tp_size, dim=0)[ctx.tp_rank]])

    def merge(self, shards, ctx):
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return [torch.cat(gates, dim=0), torch.cat(ups, dim=0)]


REPLICATED = Replicated()
COLUMN_PARALLEL = ColumnParallel()
ROW_PARALLEL = RowParallel()
VOCAB_PARALLEL = VocabParallel()
FUSED_QKV = FusedQKV()
GATED_FC1 = GatedFC1()


@dataclasses.dataclass(frozen=True)
class Piece:
    """A contiguous run of one TP rank's shard inside one full HF tensor, along the split dim `dim`:
    shard[src_start : src_start + length] lands at hf[hf_index][dst_start : dst_start + length]."""

    hf_index: int
    dim: int
    dst_start: int
    src_start: int
    length: int


def split_dim(layout: Layout) -> int:
    """Return the dim along which a layout's shards and HF tensors are cut (0 for replicated tensors)."""
    return layout.dim if layout.dim is not None else 0


def shard_placement(layout: Layout, shard_shape: tuple[int, ...], ctx: ShardContext
                    ) -> tuple[list[tuple[int, ...]], list[list[Piece]]]:
    """Return (full HF shapes, pieces of each TP rank) for a parameter whose shards have `shard_shape`.

    Derived from `layout.merge` applied to position tensors, so the scatter every rank does on its own always
    agrees with the gather-and-merge it replaces. A replicated tensor is placed by TP rank 0 alone.
    """
    dim = split_dim(layout)
    size = shard_shape[dim]
    position_shape = [1] * len(shard_shape)
    position_shape[dim] = size
    positions = [(torch.arange(size) + rank * size).view(position_shape) for rank in range(ctx.tp_size)]
    shapes, pieces = [], [[] for _ in range(ctx.tp_size)]
    for index, merged in enumerate(layout.merge(positions, ctx)):
        full = list(shard_shape)
        full[dim] = merged.shape[dim]
        shapes.append(tuple(full))
        ids = merged.reshape(-1).tolist()
        start = 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or ids[end] != ids[end - 1] + 1 or ids[end] // size != ids[start] // size:
                pieces[ids[start] // size].append(Piece(index, dim, start, ids[start] % size, end - start))
                start = end
    return shapes, pieces
