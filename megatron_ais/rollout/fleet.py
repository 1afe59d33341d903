"""The run's rollout engines as one fleet: which trainer rank drives which engine, which prompts each engine serves,
and how the rows they make reach the data-parallel ranks that train on them.

Engine e is driven by global rank e, so every engine runs on the node of the bridge's staging arena (the first
node) and applies each verified sync from that one arena (`feeds.shared_memory` maps it; nothing is copied per
engine). A step's prompts (and an evaluation's) are shared out in contiguous runs, whole groups each, and every
prompt is sampled with the seed of its index in the whole list (`engine.request_seed`), so the rows equal what one
engine would make. Every engine host computes its groups' advantages; then every rank learns only a small record
per engine (row lengths, rewards, counts) and receives from each host just the rows its DP rank trains on, as
tensors by point-to-point sends: no rank gathers or broadcasts the whole batch.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ais.errors import SHARED_ERRORS

ROW_TENSORS = ("tokens", "labels", "mask", "rollout_logprobs", "rewards", "advantages", "routed_experts")


@dataclasses.dataclass(frozen=True)
class FleetLayout:
    """Engine e is driven by global rank `hosts[e]`; `rank` is this process's."""

    hosts: tuple[int, ...]
    rank: int

    @classmethod
    def first_ranks(cls, engines: int, rank: int) -> "FleetLayout":
        """`engines` engines driven by global ranks 0 .. engines - 1 (the first node's; `arguments` checks that
        the node has them)."""
        return cls(tuple(range(engines)), rank)

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def engine_here(self) -> int | None:
        """The engine this rank drives (None: it drives none)."""
        return self.hosts.index(self.rank) if self.rank in self.hosts else None

    def prompts(self, count: int, engine: int) -> range:
        """Engine `engine`'s share of `count` prompts: a contiguous run, the shares differing by at most one."""
        return range(count * engine // self.size, count * (engine + 1) // self.size)


def cpu_core_of(engine: int) -> str:
    """The CPU core a CPU engine's worker is bound to when a node runs several (one each, round robin over the
    cores this process may use)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    return str(cores[engine % len(cores)])


def from_every_engine(compute: Callable[[], Any] | None, layout: FleetLayout) -> list:
    """Run `compute` on every engine's host (others pass None) and return the hosts' values, in engine order, on
    every rank; if it raised on any host, every rank raises the first engine's error (its type when one of
    errors.SHARED_ERRORS, RuntimeError otherwise) naming the engine, its rank and its host. Values are pickled to
    every rank: small records only."""
    value, failure = None, None
    if layout.engine_here is not None:
        try:
            value = compute()
        except Exception as err:  # every rank must learn of any engine's failure, whatever raised it
            kind = type(err) if isinstance(err, SHARED_ERRORS) else RuntimeError
            failure = (kind, f"{type(err).__name__}: {err}" if kind is RuntimeError else str(err))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (value, failure, socket.gethostname()))
    for engine, host in enumerate(layout.hosts):
        _, failure, hostname = parts[host]
        if failure is not None:
            kind, message = failure
            raise kind(f"engine {engine} (rank {host} on {hostname}): {message}")
    return [parts[host][0] for host in layout.hosts]


@dataclasses.dataclass(frozen=True)
class RowsRecord:
    """What an engine's host tells every rank about the rows it made this step (small: a few numbers per row)."""

    lengths: tuple[int, ...]  # each row's length to its last response token (`batching.row_lengths`)
    rewards: tuple[float, ...]
    response_tokens: int
    group_size: int
    columns: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # each row tensor's name, dtype, shape past rows
    reward_failures: int
    reward_timeouts: int
    seconds: float  # how long the engine's host took to make them

    @classmethod
    def of(cls, batch, seconds: float) -> "RowsRecord":
        from megatron_ais.grpo.batching import row_lengths

        return cls(tuple(row_lengths(batch.mask)), tuple(batch.rewards.tolist()), int(batch.mask.sum()),
                   batch.group_size, tuple((name, t.dtype, tuple(t.shape[1:])) for name, t in row_tensors(batch)),
                   batch.reward_failures, batch.reward_timeouts, seconds)

    def empty(self, rows: int) -> dict[str, torch.Tensor]:
        """Tensors for `rows` of the engine's rows (what a receiver fills)."""
        return {name: torch.empty((rows,) + shape, dtype=dtype) for name, dtype, shape in self.columns}

    def nbytes(self, rows: int) -> int:
        return rows * sum(dtype.itemsize * _numel(shape) for _, dtype, shape in self.columns)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def row_tensors(batch) -> list[tuple[str, torch.Tensor]]:
    """The batch's per-row tensors (its advantages included), by name."""
    return [(name, getattr(batch, name)) for name in ROW_TENSORS if getattr(batch, name) is not None]


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """One step's rollouts as a rank holds them: the rows its DP rank trains on (`batch`, advantages included) and
    the batch-wide figures every rank knows."""

    batch: object  # grpo.step.RolloutBatch of this rank's rows
    rewards: torch.Tensor  # [B] every row's reward, in batch order
    response_tokens: int
    reward_failures: int
    reward_timeouts: int
    received_bytes: int  # row bytes this rank was sent by other ranks
    held_bytes: int  # row bytes of the rows it trains on
    batch_bytes: int  # row bytes of the whole batch
    engine_tokens_per_s: tuple[float, ...]  # each engine's response tokens per second of its generation
    made: object = None  # the RolloutBatch this rank's engine made (None on other ranks)


def exchange_rows(make_part: Callable[[], Any] | None, layout: FleetLayout, data_parallel_rank_of: list[int],
                  data_parallel_rank: int, balanced: bool) -> StepRollouts:
    """Every rank's rows from the engines' hosts. `make_part()` makes the RolloutBatch of this rank's engine (with
    advantages; called on engine hosts only), `data_parallel_rank_of` is every global rank's DP rank, `balanced`
    whether DP shares balance tokens (--max-tokens-per-microbatch) rather than being contiguous."""
    from megatron_ais.grpo.step import RolloutBatch, data_parallel_rows

    part = None

    def make_record() -> RowsRecord:
        nonlocal part
        start = time.perf_counter()
        part = make_part()
        return RowsRecord.of(part, time.perf_counter() - start)

    records = from_every_engine(make_record, layout)
    offsets = [0]
    for record in records:
        offsets.append(offsets[-1] + len(record.lengths))
    shares = data_parallel_rows([n for record in records for n in record.lengths], max(data_parallel_rank_of) + 1,
                                balanced)

    def engine_rows(engine: int, dp_rank: int) -> list[int]:
        return [row - offsets[engine] for row in shares[dp_rank] if offsets[engine] <= row < offsets[engine + 1]]

    requests, pieces, received = [], [], 0
    me, engine_here = layout.rank, layout.engine_here
    if engine_here is not None:  # send every other rank the rows of its DP rank
        tensors = row_tensors(part)
        for rank, dp_rank in enumerate(data_parallel_rank_of):
            rows = engine_rows(engine_here, dp_rank)
            if rank != me and rows:
                requests += [dist.isend(t[rows].contiguous(), dst=rank) for _, t in tensors]
    for engine, host in enumerate(layout.hosts):
        rows = engine_rows(engine, data_parallel_rank)
        if not rows:
            continue
        if host == me:
            pieces.append({name: t[rows] for name, t in row_tensors(part)})
            continue
        piece = records[engine].empty(len(rows))
        requests += [dist.irecv(t, src=host) for t in piece.values()]
        received += records[engine].nbytes(len(rows))
        pieces.append(piece)
    for request in requests:
        request.wait()
    batch = RolloutBatch(**{name: torch.cat([piece[name] for piece in pieces]) for name in pieces[0]},
                         group_size=records[0].group_size)
    return StepRollouts(batch, torch.tensor([r for record in records for r in record.rewards]),
                        response_tokens=sum(r.response_tokens for r in records),
                        reward_failures=sum(r.reward_failures for r in records),
                        reward_timeouts=sum(r.reward_timeouts for r in records), received_bytes=received,
                        held_bytes=records[0].nbytes(len(shares[data_parallel_rank])),
                        batch_bytes=sum(r.nbytes(len(r.lengths)) for r in records),
                        engine_tokens_per_s=tuple(r.response_tokens / max(r.seconds, 1e-9) for r in records),
                        made=part)
