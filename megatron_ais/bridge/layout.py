"""Who writes, who sends and who receives in a weight sync, from megatron's parallel state."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ais.bridge.plan import WriterRole
from megatron_ais.distributed import node_name


@dataclasses.dataclass(frozen=True)
class RankPosition:
    """Where one rank sits, as every rank learns it in one all-gather: its pipeline stage, data-parallel replica,
    whether it is context-parallel rank 0 and writes routed experts, its TP rank and host."""

    rank: int
    pp_rank: int
    dp_rank: int
    cp0: bool
    writes_experts: bool
    tp_rank: int
    host: str


@dataclasses.dataclass(frozen=True)
class BridgeLayout:
    """Who writes, who sends and who receives, from megatron's parallel state (taken at the call site).

    The engine lives on global rank `engine_rank`. Dense tensors are shared out among the data-parallel replicas
    on the writers' node(s) (`dense_writer_replicas`), routed experts are written by the ranks of
    expert-data-parallel replica 0 (context-parallel rank 0 both); each pipeline stage's sender is replica 0's TP
    rank 0, and `stage_senders[s]` is stage s's. `stage_writers[s]` are all the ranks that write for stage s.
    """

    engine_rank: int
    stage_senders: tuple[int, ...]
    is_sender: bool
    rank: int
    writes: bool = True
    pp_rank: int = 0
    tp_rank: int = 0
    hosts: tuple[tuple[str, ...], ...] = ()  # hosts[s]: hosts of stage s's writing ranks
    stage_writers: tuple[tuple[int, ...], ...] = ()
    role: WriterRole = WriterRole()

    @property
    def is_engine_rank(self) -> bool:
        return self.rank == self.engine_rank

    @classmethod
    def from_parallel_state(cls, engine_rank: int = 0) -> "BridgeLayout":
        """Collective: every rank's position is gathered once."""
        cp0 = ps.get_context_parallel_rank() == 0
        me = RankPosition(dist.get_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(), cp0,
                          cp0 and ps.get_expert_data_parallel_rank() == 0, ps.get_tensor_model_parallel_rank(),
                          node_name())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
        stages = sorted({p.pp_rank for p in everyone})
        dense = {s: dense_writer_replicas([p for p in everyone if p.pp_rank == s]) for s in stages}
        writers = [p for p in everyone if p.cp0 and (p.writes_experts or p.dp_rank in dense[p.pp_rank])]
        senders = tuple(next(p.rank for p in everyone if p.pp_rank == s and p.dp_rank == 0 and p.cp0 and p.tp_rank == 0)
                        for s in stages)
        replicas = dense[me.pp_rank]
        role = WriterRole(dense_replica=replicas.index(me.dp_rank) if cp0 and me.dp_rank in replicas else None,
                          dense_replicas=len(replicas), experts=me.writes_experts,
                          ep_rank=ps.get_expert_model_parallel_rank(),
                          ep_size=ps.get_expert_model_parallel_world_size())
        return cls(engine_rank=engine_rank, stage_senders=senders, is_sender=me.rank in senders, rank=me.rank,
                   writes=role.dense or me.writes_experts, pp_rank=me.pp_rank, tp_rank=me.tp_rank,
                   hosts=tuple(tuple(sorted({p.host for p in writers if p.pp_rank == s})) for s in stages),
                   stage_writers=tuple(tuple(p.rank for p in writers if p.pp_rank == s) for s in stages), role=role)


def dense_writer_replicas(stage: list[RankPosition]) -> list[int]:
    """The data-parallel replicas that share a stage's dense tensors: replica 0 and every other replica whose ranks
    all run on the hosts where the stage's writers run anyway (replica 0's and the expert writers'), so sharing
    the work never adds a node, and a stage on the engine's node keeps writing into shared memory."""
    ranks = [p for p in stage if p.cp0]
    hosts = {p.host for p in ranks if p.dp_rank == 0 or p.writes_experts}
    return [d for d in sorted({p.dp_rank for p in ranks}) if all(p.host in hosts for p in ranks if p.dp_rank == d)]


def stage_transports(hosts: tuple[tuple[str, ...], ...], transport: str, engine_host: str, engine_stage: int
                     ) -> list[str]:
    """Each pipeline stage's transport ('shm' or 'distributed') for --bridge-transport `transport`, from the hosts
    its writers run on: a stage on the engine's node writes into the arena (the engine's own stage always does),
    others ship their buckets; a shipped stage's writers must share a node."""
    modes = []
    for stage, stage_hosts in enumerate(hosts):
        local = stage_hosts == (engine_host,)
        if not local and (transport == "shm" or stage == engine_stage):
            raise ValueError(f"--bridge-transport {transport}: pipeline stage {stage} runs on {list(stage_hosts)}, "
                             f"not only on the engine's node {engine_host}; the engine's own stage must, and with "
                             "'shm' every stage must (use auto or distributed)")
        shipped = (transport == "distributed" and stage != engine_stage) or not local
        if shipped and len(stage_hosts) > 1:
            raise ValueError(f"pipeline stage {stage}'s writers run on {list(stage_hosts)}: a shipped stage assembles "
                             "each bucket in one node's shared buffer, so the ranks that write for it (its TP ranks, "
                             "and the EP x expert-TP ranks of MoE layers) must share a node; keep "
                             "--tensor-model-parallel-size and --expert-model-parallel-size x expert-TP within a node")
        modes.append("distributed" if shipped else "shm")
    return modes
