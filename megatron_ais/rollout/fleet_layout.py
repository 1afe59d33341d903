"""The serving engines as a layout, and the collectives over them: which trainer rank drives which engine, which
prompts each engine serves, a value computed on every engine's host and known to every rank, retirements, and a
committed sync applied by every engine from its node's copy.

Each node's separate engines are driven by its first ranks (colocated ones: every rank) and named by the global
rank that drives them; they take GPUs of their own after the trainer's when the node has them (`engine_gpus`), and
apply each verified sync from their node's copy of the staging arena (`bridge.node_copies`; nothing is copied per
engine). A step's prompts (and an evaluation's) are shared out in contiguous runs, whole groups each, and every
prompt is sampled with the seed of its index in the whole list (`engine.request_seed`), so the rows equal what one
engine would make.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import torch.distributed as dist

from megatron_ais.distributed import node_name, shared_failure
from megatron_ais.errors import ArgumentValidationError, EngineRetiredError, SyncError


@dataclasses.dataclass(frozen=True)
class FleetLayout:
    """The serving engines, each named by the global rank that drives it (`hosts`); `rank` is this process's.
    `group`: the process group of every rank that the fleet's collectives run on (None: the world's), apart from the
    groups training uses, so that rollout traffic never queues behind a training collective."""

    hosts: tuple[int, ...]
    rank: int
    group: Any = dataclasses.field(default=None, compare=False)

    @classmethod
    def first_ranks(cls, engines: int, rank: int) -> "FleetLayout":
        """`engines` engines driven by global ranks 0 .. engines - 1."""
        return cls(tuple(range(engines)), rank)

    @classmethod
    def per_node(cls, engines_per_node: int, rank: int, node_of: list[str], group=None) -> "FleetLayout":
        """`engines_per_node` engines on every node, driven by its first ranks (`node_of`: every global rank's
        node; `arguments` checks that each node has the ranks)."""
        hosts = []
        for node in dict.fromkeys(node_of):
            hosts += [r for r, n in enumerate(node_of) if n == node][:engines_per_node]
        return cls(tuple(hosts), rank, group)

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


def outcome_here(compute: Callable[[], Any] | None, layout: FleetLayout) -> tuple[Any, tuple | None]:
    """This rank's part of `from_every_engine`: on a serving engine's host `compute()`'s value (a Retired when it
    retired the engine) or the failure every rank must learn of; elsewhere nothing. No collective: an engine's host
    may compute it in a thread ahead of time."""
    if layout.engine_here is None:
        return None, None
    name = engine_name(layout.rank)
    try:
        return compute(), None
    except EngineRetiredError as err:
        return Retired(f"{name}: {err}"), None
    except Exception as err:  # every rank must learn of any engine's failure, whatever raised it
        kind, message = shared_failure(err)
        return None, (kind, f"{name}: {message}")


def shared_outcomes(outcome: tuple[Any, tuple | None], layout: FleetLayout) -> list:
    """Every host's `outcome_here`, on every rank, in `hosts` order (collective); raises the first engine's failure
    (see `from_every_engine`)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, outcome, group=layout.group)
    for host in layout.hosts:
        if parts[host][1] is not None:
            kind, message = parts[host][1]
            raise kind(message)
    return [parts[host][0] for host in layout.hosts]


def from_every_engine(compute: Callable[[], Any] | None, layout: FleetLayout) -> list:
    """Run `compute` on every serving engine's host (others pass None) and return the hosts' values, in `hosts`
    order, on every rank (a Retired for an engine retired meanwhile); if it raised on any host, every rank raises
    the first engine's error (its type when one of errors.SHARED_ERRORS, RuntimeError otherwise) naming the
    engine, its rank and its host. Values are pickled to every rank: small records only."""
    return shared_outcomes(outcome_here(compute, layout), layout)


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
    rank before any engine applies anything; else the copies are committed and every serving engine applies its
    node's copy (the arena itself on the arena's node) with `apply`. Return `from_every_engine`'s results (what
    `apply` returned, or Retired)."""
    copy, error = copies.forward(weights)
    if error is not None:
        error = f"node {node_name()} (rank {layout.rank}): {error}"
    # from every rank, not the serving hosts only: a node's copy stays with the host it was given to, whose own
    # engine may have been retired since
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (copy, error), group=layout.group)
    errors = [error for _, error in verdicts if error is not None]
    if errors:
        raise SyncError(f"sync {sync_id} refused, every engine keeps its weights: " + "; ".join(errors))
    copies.commit()
    node_weights = {node_of[rank]: copy for rank, (copy, _) in enumerate(verdicts) if copy is not None}
    return from_every_engine(lambda: apply(node_weights.get(node_of[layout.rank], weights)), layout)
