"""The run's rollout engines as one fleet: which trainer rank drives which engine, which prompts each engine serves,
and how the rows they make reach the data-parallel ranks that train on them.

Each node's separate engines are driven by its first ranks (colocated ones: every rank) and named by the global
rank that drives them; they take GPUs of their own after the trainer's when the node has them (`engine_gpus`), and
apply each verified sync from their node's copy of the staging arena (`bridge.node_copies`; nothing is copied per
engine). A step's prompts (and an evaluation's) are shared out in contiguous runs, whole groups each, and every
prompt is sampled with the seed of its index in the whole list (`engine.request_seed`), so the rows equal what one
engine would make. Every engine host computes its groups' advantages; then every rank learns only a small record
per engine (row lengths, rewards, counts) and receives from each host just the rows its DP rank trains on, as
tensors by point-to-point sends: no rank gathers or broadcasts the whole batch.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_ais.distributed import node_name, shared_failure
from megatron_ais.errors import ArgumentValidationError, EngineRetiredError, SyncError
from megatron_ais.flags import FlagConfig, flag

ROW_TENSORS = ("tokens", "labels", "mask", "rollout_logprobs", "rewards", "advantages", "routed_experts")


@dataclasses.dataclass(frozen=True)
class FleetConfig(FlagConfig):
    """How the run keeps its engines serving."""

    max_engine_restarts: int = flag(3, "Restarts each engine may have over the run (after dying or running past "
                                       "--rollout-generation-timeout-s); one that dies once more is retired, and the "
                                       "other engines take over its prompts in the same step.",
                                    name="--rollout-max-engine-restarts")
    min_engines: int = flag(1, "Fewest serving engines the run goes on with: below it every rank stops, naming the "
                               "retired engines and their last errors (the last checkpoint stays as it was).",
                            name="--rollout-min-engines")
    generation_timeout_s: float = flag(600.0, "Longest one engine's share of a step may take to generate (seconds, "
                                              "separate placement); past it the engine counts as dead: restarted.",
                                       name="--rollout-generation-timeout-s")

    def __post_init__(self):
        if self.max_engine_restarts < 0:
            raise ArgumentValidationError(f"--rollout-max-engine-restarts {self.max_engine_restarts} must be >= 0")
        if self.min_engines < 1:
            raise ArgumentValidationError(f"--rollout-min-engines {self.min_engines} must be at least 1")
        if self.generation_timeout_s <= 0:
            raise ArgumentValidationError(f"--rollout-generation-timeout-s {self.generation_timeout_s} must be "
                                          "positive")


@dataclasses.dataclass(frozen=True)
class FleetLayout:
    """The serving engines, each named by the global rank that drives it (`hosts`); `rank` is this process's."""

    hosts: tuple[int, ...]
    rank: int

    @classmethod
    def first_ranks(cls, engines: int, rank: int) -> "FleetLayout":
        """`engines` engines driven by global ranks 0 .. engines - 1."""
        return cls(tuple(range(engines)), rank)

    @classmethod
    def per_node(cls, engines_per_node: int, rank: int, node_of: list[str]) -> "FleetLayout":
        """`engines_per_node` engines on every node, driven by its first ranks (`node_of`: every global rank's
        node; `arguments` checks that each node has the ranks)."""
        hosts = []
        for node in dict.fromkeys(node_of):
            hosts += [r for r, n in enumerate(node_of) if n == node][:engines_per_node]
        return cls(tuple(hosts), rank)

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def engine_here(self) -> int | None:
        """The serving engine this rank drives (None: it drives none)."""
        return self.rank if self.rank in self.hosts else None

    def share(self, prompts: range, engine: int) -> range:
        """Engine `engine`'s share of `prompts`: a contiguous run, the shares differing by at most one."""
        index, count = self.hosts.index(engine), len(prompts)
        return prompts[count * index // self.size: count * (index + 1) // self.size]

    def without(self, retired: list[int]) -> "FleetLayout":
        return dataclasses.replace(self, hosts=tuple(h for h in self.hosts if h not in retired))

    def rotating(self, count: int, turn: int) -> "FleetLayout":
        """`count` of the serving engines (every one when 0 or at least as many as serve): the `turn`-th run of
        `count` consecutive engines, cycling over the fleet, so that every engine comes round every
        ceil(size / count) turns."""
        if not count or count >= self.size:
            return self
        start = turn * count % self.size
        chosen = {self.hosts[(start + i) % self.size] for i in range(count)}
        return dataclasses.replace(self, hosts=tuple(h for h in self.hosts if h in chosen))


def engine_name(rank: int) -> str:
    """How messages name the engine driven by global rank `rank`, on the node of the calling process."""
    return f"engine {rank} (rank {rank} on {node_name()})"


def cpu_core_of(engine: int) -> str:
    """The CPU core a CPU engine's worker is bound to when a node runs several (one each, round robin over the
    cores this process may use)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    return str(cores[engine % len(cores)])


def engine_gpus(engine: int, tensor_parallel: int, trainer_gpus: int, node_gpus: int) -> tuple[int, ...]:
    """The GPUs (indices among the node's visible ones) of a node's `engine`-th engine of `tensor_parallel` GPUs:
    after the trainer's `trainer_gpus` when the node has more (`node_gpus`; dedicated, as `rollout.placement`
    plans separate engines), else from its host rank's GPU on (beside trainer ranks, as one engine always ran
    beside rank 0). `check_engine_gpus` refuses what does not fit."""
    first = trainer_gpus if node_gpus > trainer_gpus else 0
    start = first + engine * tensor_parallel
    return tuple(range(start, start + tensor_parallel))


def check_engine_gpus(engines: int, tensor_parallel: int, trainer_gpus: int, node_gpus: int) -> None:
    """Refuse a node's engines whose GPUs (`engine_gpus`) would overlap or lie beyond the node's, naming the flags."""
    need, spare = engines * tensor_parallel, node_gpus - trainer_gpus
    if (spare > 0 and need > spare) or need > node_gpus:
        where = (f"its {spare} GPU(s) beyond the {trainer_gpus} trainer ranks (--nproc-per-node)" if spare > 0 else
                 f"its {node_gpus} GPUs")
        raise ArgumentValidationError(
            f"--rollout-engines-per-node {engines} x --rollout-tensor-parallel-size {tensor_parallel} = {need} "
            f"GPUs do not fit the node's engines into {where}; run fewer or smaller engines, or start as many "
            "trainer ranks as the node has GPUs (engines then share their host ranks' GPUs)")


@dataclasses.dataclass(frozen=True)
class Retired:
    """What `from_every_engine` returns for an engine that was retired (EngineRetiredError) while computing."""

    message: str  # names the engine and its host


def from_every_engine(compute: Callable[[], Any] | None, layout: FleetLayout) -> list:
    """Run `compute` on every serving engine's host (others pass None) and return the hosts' values, in `hosts`
    order, on every rank (a Retired for an engine retired meanwhile); if it raised on any host, every rank raises
    the first engine's error (its type when one of errors.SHARED_ERRORS, RuntimeError otherwise) naming the
    engine, its rank and its host. Values are pickled to every rank: small records only."""
    value, failure, name = None, None, engine_name(layout.rank)
    if layout.engine_here is not None:
        try:
            value = compute()
        except EngineRetiredError as err:
            value = Retired(f"{name}: {err}")
        except Exception as err:  # every rank must learn of any engine's failure, whatever raised it
            kind, message = shared_failure(err)
            failure = (kind, f"{name}: {message}")
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (value, failure))
    for host in layout.hosts:
        if parts[host][1] is not None:
            kind, message = parts[host][1]
            raise kind(message)
    return [parts[host][0] for host in layout.hosts]


def retire(results: list, layout: FleetLayout, min_engines: int, earlier: Sequence[str] = ()
           ) -> tuple[FleetLayout, list[str]]:
    """The layout without the engines `from_every_engine` found retired, and their messages; with fewer than
    `min_engines` left, EngineRetiredError on every rank (every rank has the same results) naming them and those
    retired `earlier` in the same phase (not yet told)."""
    retired = [(host, r.message) for host, r in zip(layout.hosts, results) if isinstance(r, Retired)]
    left = layout.without([host for host, _ in retired])
    if retired and left.size < min_engines:
        raise EngineRetiredError("; ".join([*earlier, *(message for _, message in retired)])
                                 + f"; {left.size} engine(s) left, fewer than --rollout-min-engines {min_engines}: "
                                 "stopping")
    return left, [message for _, message in retired]


def apply_on_every_engine(weights, copies, layout: FleetLayout, node_of: list[str], apply: Callable[[Any], Any],
                          sync_id: int) -> list:
    """Collective on every rank, after the bridge committed a sync (`weights`: the verified arena, on every rank):
    forward it to the other nodes' copies (`bridge.node_copies.NodeCopies`); if any copy differs, SyncError on every
    rank before any engine applies anything; else every serving engine applies its node's copy (the arena itself on
    the arena's node) with `apply`. Return `from_every_engine`'s results (what `apply` returned, or Retired)."""
    copy, error = copies.forward(weights)
    if error is not None:
        error = f"node {node_name()} (rank {layout.rank}): {error}"
    verdicts = from_every_engine(lambda: (copy, error), layout)
    errors = [error for _, error in verdicts if error is not None]
    if errors:
        raise SyncError(f"sync {sync_id} refused, every engine keeps its weights: " + "; ".join(errors))
    node_weights = {node_of[host]: copy for host, (copy, _) in zip(layout.hosts, verdicts) if copy is not None}
    return from_every_engine(lambda: apply(node_weights.get(node_of[layout.rank], weights)), layout)


@dataclasses.dataclass(frozen=True)
class RowsRecord:
    """What an engine's host tells every rank about the rows of one run of prompts it made (small: a few numbers
    per row)."""

    host: int
    first_prompt: int
    lengths: tuple[int, ...]  # each row's length to its last response token (`batching.row_lengths`)
    rewards: tuple[float, ...]
    response_tokens: int
    group_size: int
    columns: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # each row tensor's name, dtype, shape past rows
    reward_failures: int
    reward_timeouts: int
    seconds: float  # how long the engine's host took to make them

    @classmethod
    def of(cls, batch, host: int, first_prompt: int, seconds: float) -> "RowsRecord":
        from megatron_ais.grpo.batching import row_lengths

        return cls(host, first_prompt, tuple(row_lengths(batch.mask)), tuple(batch.rewards.tolist()),
                   int(batch.mask.sum()), batch.group_size,
                   tuple((name, t.dtype, tuple(t.shape[1:])) for name, t in row_tensors(batch)),
                   batch.reward_failures, batch.reward_timeouts, seconds)

    def empty(self, rows: int) -> dict[str, torch.Tensor]:
        """Tensors for `rows` of these rows (what a receiver fills)."""
        return {name: torch.empty((rows,) + shape, dtype=dtype) for name, dtype, shape in self.columns}

    def nbytes(self, rows: int) -> int:
        return rows * sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in self.columns)


def row_tensors(batch) -> list[tuple[str, torch.Tensor]]:
    """The batch's per-row tensors (its advantages included), by name."""
    return [(name, getattr(batch, name)) for name in ROW_TENSORS if getattr(batch, name) is not None]


@dataclasses.dataclass
class MadeRows:
    """A step's rows as the engines made them: every rank's records (in prompt order), the serving engines after
    any retirement, and on each host the RolloutBatch of each of its records (by first prompt)."""

    records: list[RowsRecord]
    layout: FleetLayout
    made: dict[int, Any]
    retired: list[str]


def make_rows(make: Callable[[range], Any] | None, layout: FleetLayout, count: int, min_engines: int) -> MadeRows:
    """Every serving engine makes the rows of its share of prompts 0 .. count - 1 (`make(prompts)` on its host: a
    RolloutBatch with advantages); the share of an engine retired meanwhile goes to the others, until every prompt
    is made or fewer than `min_engines` serve (EngineRetiredError on every rank)."""
    pending, records, made, retired = [range(count)], [], {}, []
    while pending:
        assigned = {host: [layout.share(p, host) for p in pending if layout.share(p, host)] for host in layout.hosts}

        def make_assigned() -> list[RowsRecord]:
            out = []
            for prompts in assigned[layout.rank]:
                start = time.perf_counter()
                made[prompts.start] = make(prompts)
                out.append(RowsRecord.of(made[prompts.start], layout.rank, prompts.start, time.perf_counter() - start))
            return out

        results = from_every_engine(make_assigned, layout)
        pending = [p for host, r in zip(layout.hosts, results) if isinstance(r, Retired) for p in assigned[host]]
        records += [record for r in results if not isinstance(r, Retired) for record in r]
        layout, messages = retire(results, layout, min_engines, retired)
        retired += messages
    return MadeRows(sorted(records, key=lambda r: r.first_prompt), layout, made, retired)


def tokens_per_second(records: list[RowsRecord]) -> dict[int, float]:
    """Each engine's response tokens per second of making its rows (all its runs of prompts together)."""
    made: dict[int, list[float]] = {}
    for record in records:
        tokens_seconds = made.setdefault(record.host, [0.0, 0.0])
        tokens_seconds[0] += record.response_tokens
        tokens_seconds[1] += record.seconds
    return {host: tokens / max(seconds, 1e-9) for host, (tokens, seconds) in made.items()}


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
    engine_tokens_per_s: dict[int, float]  # each engine's response tokens per second of making its rows
    first_host: int  # the host that made the batch's first rows
    first_rows: object = None  # their RolloutBatch, on that host (None elsewhere)


def exchange_rows(rows: MadeRows, data_parallel_rank_of: list[int], data_parallel_rank: int,
                  balanced: bool) -> StepRollouts:
    """Every rank's rows from the engines' hosts, by point-to-point sends (each host sends each rank only rows of
    its DP rank). `data_parallel_rank_of` is every global rank's DP rank, `balanced` whether DP shares balance
    tokens (--max-tokens-per-microbatch) rather than being contiguous."""
    from megatron_ais.grpo.step import RolloutBatch, data_parallel_rows

    records, me = rows.records, rows.layout.rank
    offsets = [0]
    for record in records:
        offsets.append(offsets[-1] + len(record.lengths))
    shares = data_parallel_rows([n for record in records for n in record.lengths], max(data_parallel_rank_of) + 1,
                                balanced)

    def record_rows(index: int, dp_rank: int) -> list[int]:
        return [row - offsets[index] for row in shares[dp_rank] if offsets[index] <= row < offsets[index + 1]]

    requests, pieces, received = [], [], 0
    for index, record in enumerate(records):  # every pair of ranks meets its messages in this order
        if record.host == me:
            tensors = row_tensors(rows.made[record.first_prompt])
            for rank, dp_rank in enumerate(data_parallel_rank_of):
                wanted = record_rows(index, dp_rank)
                if rank != me and wanted:
                    requests += [dist.isend(t[wanted].contiguous(), dst=rank) for _, t in tensors]
            mine = record_rows(index, data_parallel_rank)
            if mine:
                pieces.append({name: t[mine] for name, t in tensors})
            continue
        mine = record_rows(index, data_parallel_rank)
        if mine:
            piece = record.empty(len(mine))
            requests += [dist.irecv(t, src=record.host) for t in piece.values()]
            received += record.nbytes(len(mine))
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
                        engine_tokens_per_s=tokens_per_second(records),
                        first_host=records[0].host, first_rows=rows.made.get(0) if records[0].host == me else None)
