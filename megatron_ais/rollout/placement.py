"""Where a run's rollout engines go, on paper: a pure planner from the cluster (nodes, GPUs per node), the trainer's
layout, the engines' tensor parallelism and the placement mode to which GPUs each engine uses, which trainer rank
drives it, which node's staging arena feeds it, and what one weight sync moves into each node and across nodes.
`pretrain_grpo_ais.py --print-placement` prints it without starting anything.

Modes. `separate`: each node gives `--rollout-engines-per-node` x `--rollout-tensor-parallel-size` GPUs to engines
(after the trainer's GPUs, as slime places them) and the rest to the trainer; each engine is driven by a trainer
rank on its node. `colocated`: every trainer GPU also hosts an engine shard (vLLM's `external_launcher`, as verl's
hybrid engine), one engine per `--rollout-tensor-parallel-size` consecutive ranks; the run builds rollout TP 1 (one
engine inside every rank) and holds the engine's memory through training (no sleep mode), as the memory check here
counts it.

Feeding. One staging arena per node with engines: the bridge's writers on that node write their shards into it,
the rest arrives over the network once per node (not once per engine), forwarded node to node as a pipelined ring
broadcast over the node leaders (so no node's link carries a byte more than once each way), and every engine on
the node applies from it. The writers are DP replica 0 of every pipeline stage (dense shards over TP, expert shards over EP x expert-TP),
Megatron's rank order (TP fastest, then DP, then PP).

Memory (per GPU, GiB): an engine holds its share of the weights at the rollout precision, its KV cache and 2 GiB of
workspace (the budget `--rollout-gpu-memory-utilization` defaults to); a trainer rank holds BF16 weights, fp32
gradients and fp32 Adam state (main weights and two moments; over DP with the distributed optimizer). Activations
are not counted: the trainer's figure is a floor. A staging arena in GPU memory (`--bridge-arena auto` on GPUs) sits
on GPU 0 of its node, beside trainer rank 0: one sync per slot (two with `--max-off-policy-steps` >= 1) on the arena
rank's node, as many copies on every other node with engines, and every engine process on another GPU that maps it
by CUDA IPC opens a CUDA context there (`CUDA_CONTEXT_GIB` each).
"""
from __future__ import annotations

import dataclasses

from megatron_ais.bridge.arena import CUDA_CONTEXT_BYTES
from megatron_ais.bridge.delta import POSITION_BYTES as DELTA_POSITION_BYTES
from megatron_ais.bridge.quantization import FOUR_BIT_BLOCKS
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.model import ModelShape
from megatron_ais.rollout.fleet_layout import engine_gpus

GIB = 1024 ** 3
ENGINE_WORKSPACE_GIB = 2.0
CUDA_CONTEXT_GIB = CUDA_CONTEXT_BYTES / GIB  # what each engine process mapping a GPU arena pays on its GPU


@dataclasses.dataclass(frozen=True)
class ClusterConfig(FlagConfig):
    """The cluster a plan is for (`--print-placement`), and how many engines each node runs."""

    print_placement: bool = flag(False, "Print where the engines and trainer ranks go on --cluster-nodes x "
                                        "--cluster-gpus-per-node GPUs, and what each weight sync moves per node and "
                                        "across nodes, for the model and flags given; start nothing and exit.")
    nodes: int = flag(1, "Nodes of the cluster --print-placement plans for.", name="--cluster-nodes", at_least=1)
    gpus_per_node: int = flag(8, "GPUs per node of that cluster.", name="--cluster-gpus-per-node", at_least=1)
    gpu_memory_gb: float = flag(80.0, "Memory of one GPU (GiB; H100 SXM: 80).", name="--cluster-gpu-memory-gb", above=0)
    link_gb_per_s: float = flag(50.0, "Network bandwidth into or out of one node (GB/s; 400 Gb/s InfiniBand: 50), "
                                      "for the sync-time estimate.", name="--cluster-link-gb-per-s", above=0)
    engines_per_node: int = flag(1, "Rollout engines per node (separate placement), each driven by one of the "
                                    "node's first ranks and taking --rollout-tensor-parallel-size GPUs: GPUs of its "
                                    "own after the trainer's when the node has more GPUs than trainer ranks (what "
                                    "--print-placement plans), else its host ranks' GPUs; on CPU one core each.",
                                 name="--rollout-engines-per-node", at_least=1)


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """One model's weights as a sync moves them: dense and expert bytes at the rollout precision (FP8 linear layers
    with fp32 128x128 block scales, or 4-bit codes with their group scales; the rest BF16), the elements of the
    engine's tensors (a byte of two 4-bit codes is one), the trainer's parameter counts, and the engine's per-token KV
    bytes."""

    dense_sync: int
    expert_sync: int
    dense_parameters: int
    expert_parameters: int
    kv_bytes_per_token: int
    sync_elements: int = 0

    @property
    def sync(self) -> int:
        return self.dense_sync + self.expert_sync

    def delta_sync(self, changed_fraction: float) -> int:
        """Bytes of a delta sync (`bridge.delta`) when `changed_fraction` of every tensor's elements changed: a
        4-byte position and the element's bytes per changed element."""
        return round(changed_fraction * (self.sync + DELTA_POSITION_BYTES * self.sync_elements))

    @classmethod
    def of(cls, shape, precision: str, kv_cache_dtype: str = "auto") -> "ModelBytes":
        """From a ModelShape; `precision` the rollout's (fp8, nvfp4, mxfp4, bf16, fp32)."""
        h, hd, layers = shape.hidden_size, shape.head_dim, shape.num_layers
        # per linear weight: the bytes and the elements of its code and of its share of the scales
        four_bit = {p: 0.5 + 1 / block for p, block in FOUR_BIT_BLOCKS.items()}  # a byte per two codes, per scale
        linear_bytes = {"fp8": 1 + 4 / (128 * 128), **four_bit, "bf16": 2, "fp32": 4}[precision]
        linear_elements = {"fp8": 1 + 1 / (128 * 128), **four_bit}.get(precision, 1)
        other_bytes = 4 if precision == "fp32" else 2
        attention = h * hd * (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads)
        norms = 2 * h + (2 * hd if shape.qk_norm else 0) + (hd * (shape.num_attention_heads + 2 *
                                                                   shape.num_key_value_heads) if shape.qkv_bias else 0)
        embeddings = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2) + h
        if shape.is_moe:
            experts = shape.num_experts * 3 * h * shape.moe_ffn_hidden_size
            router, mlp = shape.num_experts * h, 0
        else:
            experts, router, mlp = 0, 0, 3 * h * shape.ffn_hidden_size
        dense_linear = layers * (attention + mlp)
        dense_other = layers * (norms + router) + embeddings
        kv_element = 1 if kv_cache_dtype == "fp8" else 2
        return cls(dense_sync=round(dense_linear * linear_bytes + dense_other * other_bytes),
                   expert_sync=round(layers * experts * linear_bytes),
                   dense_parameters=dense_linear + dense_other, expert_parameters=layers * experts,
                   kv_bytes_per_token=2 * layers * shape.num_key_value_heads * hd * kv_element,
                   sync_elements=round((dense_linear + layers * experts) * linear_elements + dense_other))


@dataclasses.dataclass(frozen=True)
class EngineSlot:
    index: int
    node: int
    gpus: tuple[int, ...]  # local GPU indices on its node
    host_rank: int  # the global trainer rank that drives it


@dataclasses.dataclass(frozen=True)
class NodePlan:
    node: int
    trainer_ranks: tuple[int, ...]
    engines: tuple[int, ...]
    written_here: int  # bytes of one sync the node's own writers put into its arena
    received: int  # bytes of one sync that reach its arena over the network (0 without engines)
    sent: int  # bytes of one sync its writers send to other nodes' arenas


@dataclasses.dataclass(frozen=True)
class Placement:
    mode: str
    cluster: ClusterConfig
    rollout_tensor_parallel: int
    trainer_world: int
    data_parallel: int
    model: ModelBytes
    nodes: tuple[NodePlan, ...]
    engines: tuple[EngineSlot, ...]
    engine_gpu_gib: float
    trainer_gpu_gib: float
    arena_slots: int = 0  # the staging arena's buffers in GPU memory on the arena rank's node (0: in host memory)

    def arena_gpu_gib(self, node: int) -> float:
        """GPU 0 of `node`, beyond its trainer rank's share: the staging arena's buffers (its slots on node 0, as
        many copies on every other node with engines) and the CUDA context of each engine process on another GPU of
        the node that maps them."""
        engines = [e for e in self.engines if e.node == node]
        if not self.arena_slots or not engines:
            return 0.0
        mapping = sum(1 for e in engines for gpu in e.gpus if gpu != 0)
        return self.arena_slots * self.model.sync / GIB + mapping * CUDA_CONTEXT_GIB

    @property
    def cross_node_bytes(self) -> int:
        return sum(n.received for n in self.nodes)

    @property
    def sync_seconds(self) -> float:
        """The network's share of one sync: the busiest node's link, each direction at the link's bandwidth."""
        busiest = max(max(n.received, n.sent) for n in self.nodes)
        return busiest / (self.cluster.link_gb_per_s * 1e9)


def _check_rollout_tensor_parallel(shape, rollout_tp: int) -> None:
    heads, kv_heads = shape.num_attention_heads, shape.num_key_value_heads
    if heads % rollout_tp or (kv_heads % rollout_tp and rollout_tp % kv_heads):
        raise ArgumentValidationError(
            f"--rollout-tensor-parallel-size {rollout_tp} does not split the model's {heads} attention heads and "
            f"{kv_heads} KV heads (vLLM needs heads divisible by it, and KV heads divisible by it or it by them); "
            f"use a divisor of {heads}")


def _writers(layout, trainer_world: int, model: ModelBytes) -> dict[int, int]:
    """Global trainer rank -> bytes of one sync it writes: DP replica 0 of each stage, dense shards over TP, expert
    shards over EP x expert-TP (Megatron's rank order: TP fastest, then DP, then PP)."""
    dp = trainer_world // layout.model_parallel
    per_stage_ranks = layout.tensor * dp
    written: dict[int, int] = {}
    for stage in range(layout.pipeline):
        first = stage * per_stage_ranks
        for tp_rank in range(layout.tensor):
            rank = first + tp_rank
            written[rank] = written.get(rank, 0) + model.dense_sync // (layout.pipeline * layout.tensor)
        expert_ranks = layout.expert * layout.expert_tensor_size
        for index in range(expert_ranks):
            rank = first + index
            written[rank] = written.get(rank, 0) + model.expert_sync // (layout.pipeline * expert_ranks)
    return written


def _engine_slots(cluster: ClusterConfig, mode: str, rollout_tp: int, trainer_per_node: int) -> list[EngineSlot]:
    """Separate: each node's engines on the GPUs after its trainer ranks, driven by its first trainer ranks.
    Colocated: one engine per `rollout_tp` consecutive GPUs, driven by the first rank on them."""
    engines = []
    for node in range(cluster.nodes):
        first_rank = node * trainer_per_node
        if mode == "separate":
            for k in range(cluster.engines_per_node):
                engines.append(EngineSlot(len(engines), node,
                                          engine_gpus(k, rollout_tp, trainer_per_node, cluster.gpus_per_node),
                                          first_rank + k % trainer_per_node))
        else:
            for start in range(0, cluster.gpus_per_node, rollout_tp):
                engines.append(EngineSlot(len(engines), node, tuple(range(start, start + rollout_tp)),
                                          first_rank + start))
    return engines


def _check_memory(cluster: ClusterConfig, mode: str, engine_gib: float, trainer_gib: float, weights_gib: float,
                  kv_cache_gb: float, arena_gib: float = 0.0) -> None:
    if engine_gib > cluster.gpu_memory_gb:
        raise ArgumentValidationError(
            f"an engine needs {engine_gib:.1f} GiB per GPU (weights {weights_gib:.1f} + --rollout-kv-cache-gb "
            f"{kv_cache_gb:g} + {ENGINE_WORKSPACE_GIB:g} workspace), over --cluster-gpu-memory-gb "
            f"{cluster.gpu_memory_gb:g}; raise --rollout-tensor-parallel-size or lower --rollout-kv-cache-gb")
    need = engine_gib + trainer_gib if mode == "colocated" else trainer_gib
    if need > cluster.gpu_memory_gb:
        raise ArgumentValidationError(
            f"a trainer rank needs at least {trainer_gib:.1f} GiB per GPU before activations"
            + (f" and its colocated engine {engine_gib:.1f} GiB" if mode == "colocated" else "")
            + f", over --cluster-gpu-memory-gb {cluster.gpu_memory_gb:g}; raise --tensor-model-parallel-size or "
            "--pipeline-model-parallel-size, use --use-distributed-optimizer"
            + (", lower --rollout-kv-cache-gb or use --rollout-placement separate" if mode == "colocated" else ""))
    if need + arena_gib > cluster.gpu_memory_gb:
        raise ArgumentValidationError(
            f"GPU 0 of the arena rank's node needs {need + arena_gib:.1f} GiB before activations: trainer rank 0's "
            f"{need:.1f} and the bridge's staging arena {arena_gib:.1f} (its buffers and the CUDA contexts of the "
            f"engine processes that map it), over --cluster-gpu-memory-gb {cluster.gpu_memory_gb:g}; put the arena "
            "in host memory (--bridge-arena host), sync synchronously (--max-off-policy-steps 0: one buffer) or "
            "lower the trainer's memory (more model parallelism, --use-distributed-optimizer)")


def _ring_forwarding(written: dict[int, int], serving: list[int]) -> dict[int, int]:
    """Bytes each node sends when every node's writes reach every other serving node's arena by a pipelined ring
    broadcast over the node leaders (what NCCL's broadcast does): a node sends its own writes once, and forwards each
    other node's writes unless it is the last in that ring."""
    sent = dict.fromkeys(written, 0)
    for source, nbytes in written.items():
        if not nbytes:
            continue
        others = [n for n in sorted(serving, key=lambda n: (n - source) % len(written)) if n != source]
        for node in [source] + others[:-1]:
            sent[node] += nbytes if others else 0
    return sent


def trainer_memory_gib(layout, data_parallel: int, model: ModelBytes, distributed_optimizer: bool) -> float:
    """A trainer rank's weights (BF16), gradients (fp32) and Adam state (fp32 main weights and two moments, sharded
    over DP with the distributed optimizer), in GiB: the floor before activations."""
    expert_dp = max(1, data_parallel * layout.tensor // (layout.expert * layout.expert_tensor_size))
    dense = model.dense_parameters / (layout.tensor * layout.pipeline)
    experts = model.expert_parameters / (layout.expert * layout.expert_tensor_size * layout.pipeline)
    optimizer = 12 * (dense / data_parallel + experts / expert_dp) if distributed_optimizer else 12 * (dense + experts)
    return ((dense + experts) * (2 + 4) + optimizer) / GIB


def trainer_gpus_per_node(cluster: ClusterConfig, mode: str, rollout_tp: int) -> int:
    """The GPUs of each node the trainer gets: every one when colocated, else what the engines leave."""
    gpus = cluster.gpus_per_node
    if mode == "separate":
        engine_gpus = cluster.engines_per_node * rollout_tp
        if engine_gpus >= gpus:
            raise ArgumentValidationError(
                f"--rollout-engines-per-node {cluster.engines_per_node} x --rollout-tensor-parallel-size {rollout_tp} "
                f"= {engine_gpus} GPUs leaves no GPU of the node's {gpus} (--cluster-gpus-per-node) to the trainer; "
                "run fewer or smaller engines")
        return gpus - engine_gpus
    if mode != "colocated":
        raise ArgumentValidationError(f"--rollout-placement {mode!r} must be separate or colocated")
    if cluster.engines_per_node != 1:
        raise ArgumentValidationError("--rollout-engines-per-node applies to --rollout-placement separate; "
                                      "colocated engines are one per --rollout-tensor-parallel-size trainer GPUs")
    if gpus % rollout_tp:
        raise ArgumentValidationError(f"--rollout-tensor-parallel-size {rollout_tp} does not divide "
                                      f"--cluster-gpus-per-node {gpus}: colocated engines span whole GPU groups")
    return gpus


def plan_placement(cluster: ClusterConfig, layout, shape, *, mode: str, rollout_tp: int, precision: str,
                   kv_cache_gb: float, kv_cache_dtype: str = "auto", distributed_optimizer: bool = False,
                   arena_slots: int = 0) -> Placement:
    """The plan, or an ArgumentValidationError naming the flag that makes the layout impossible. `arena_slots`: the
    staging arena's buffers in GPU memory (0: in host memory)."""
    _check_rollout_tensor_parallel(shape, rollout_tp)
    trainer_per_node = trainer_gpus_per_node(cluster, mode, rollout_tp)
    trainer_world = cluster.nodes * trainer_per_node
    data_parallel = layout.data_parallel(trainer_world)
    model = ModelBytes.of(shape, precision, kv_cache_dtype)

    engines = _engine_slots(cluster, mode, rollout_tp, trainer_per_node)
    node_engines = {n: [e.index for e in engines if e.node == n] for n in range(cluster.nodes)}
    writers = _writers(layout, trainer_world, model)
    written = {n: sum(b for r, b in writers.items() if r // trainer_per_node == n) for n in range(cluster.nodes)}
    serving = [n for n in range(cluster.nodes) if node_engines[n]]
    sent = _ring_forwarding(written, serving)
    nodes = tuple(NodePlan(node=n, trainer_ranks=tuple(range(n * trainer_per_node, (n + 1) * trainer_per_node)),
                           engines=tuple(node_engines[n]), written_here=written[n],
                           received=model.sync - written[n] if node_engines[n] else 0, sent=sent[n])
                  for n in range(cluster.nodes))

    engine_gib = model.sync / rollout_tp / GIB + kv_cache_gb + ENGINE_WORKSPACE_GIB
    trainer_gib = trainer_memory_gib(layout, data_parallel, model, distributed_optimizer)
    plan = Placement(mode, cluster, rollout_tp, trainer_world, data_parallel, model, nodes, tuple(engines),
                     engine_gib, trainer_gib, arena_slots)
    _check_memory(cluster, mode, engine_gib, trainer_gib, model.sync / rollout_tp / GIB, kv_cache_gb,
                  max(plan.arena_gpu_gib(n) for n in range(cluster.nodes)))
    return plan


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def format_placement(plan: Placement, layout, model_name: str, delta: str = "off") -> str:
    """The plan as a person reads it: the layout, one line per node, the engines, memory and one sync's traffic
    (`delta`: --bridge-delta, whose node copies' bytes it adds)."""
    c, gb = plan.cluster, 1e9
    lines = [
        f"placement for {model_name}: {c.nodes} node(s) x {c.gpus_per_node} GPUs ({c.gpu_memory_gb:g} GiB), "
        f"--rollout-placement {plan.mode}",
        f"trainer: {plan.trainer_world} ranks = TP {layout.tensor} x PP {layout.pipeline} x DP {plan.data_parallel}"
        + (f" (EP {layout.expert}, expert-TP {layout.expert_tensor_size})" if plan.model.expert_parameters else "")
        + f"; at least {plan.trainer_gpu_gib:.1f} GiB per GPU before activations",
        f"engines: {len(plan.engines)} x rollout TP {plan.rollout_tensor_parallel}; "
        f"{plan.engine_gpu_gib:.1f} GiB per engine GPU (weights, KV cache, workspace); one sync = "
        f"{plan.model.sync / gb:.2f} GB ({plan.model.expert_sync / gb:.2f} GB experts)",
        "node | trainer ranks | engines (GPUs, driving rank) | sync bytes written here | received | sent",
    ]
    for node in plan.nodes:
        engines = ", ".join(f"e{e.index} (GPU {_ranks(e.gpus)}, rank {e.host_rank})"
                            for e in plan.engines if e.node == node.node) or "-"
        lines.append(f"{node.node} | {_ranks(node.trainer_ranks)} | {engines} | {node.written_here / gb:.2f} GB | "
                     f"{node.received / gb:.2f} GB | {node.sent / gb:.2f} GB")
    lines.append(f"across nodes per sync: {plan.cross_node_bytes / gb:.2f} GB in all (each node's arena fed once, "
                 f"not once per engine); busiest link {max(max(n.received, n.sent) for n in plan.nodes) / gb:.2f} GB "
                 f"≈ {plan.sync_seconds:.2f} s at --cluster-link-gb-per-s {c.link_gb_per_s:g}")
    if plan.arena_slots:
        others = [n.node for n in plan.nodes[1:] if n.engines]
        lines.append(f"staging arena on GPU 0 of node 0: {plan.arena_slots} buffer(s) of one sync and the CUDA "
                     f"contexts of the engine processes that map it, {plan.arena_gpu_gib(0):.1f} GiB beside trainer "
                     f"rank 0" + (f"; as many copies on GPU 0 of every other node with engines, "
                                  f"{plan.arena_gpu_gib(others[0]):.1f} GiB there" if others else ""))
    else:
        lines.append("staging arena in host memory (--bridge-arena host)")
    if delta == "on":
        lines.append(f"--bridge-delta on: each other node's copy of the arena receives a 4-byte position and the "
                     f"bytes of each changed element: {plan.model.delta_sync(0.01) / gb:.2f} GB with 1 % of the "
                     f"elements changed, {plan.model.delta_sync(0.001) / gb:.2f} GB with 0.1 %, against "
                     f"{plan.model.sync / gb:.2f} GB for a full sync")
    return "\n".join(lines)


def describe_placement(config, hf_config: dict, model_name: str) -> str:
    """`--print-placement`: the plan of a run's configs (arguments.GRPORunConfig built for the planned trainer world)
    and its model's HF config."""
    engine, layout = config.engine, config.trainer.layout
    plan = plan_placement(config.cluster, layout, ModelShape.from_hf_config(hf_config), mode=engine.placement,
                          rollout_tp=engine.tensor_parallel_size, precision=engine.precision,
                          kv_cache_gb=engine.kv_cache_gb, kv_cache_dtype=engine.kv_cache_dtype,
                          distributed_optimizer=config.trainer.training.use_distributed_optimizer,
                          # a plan is for a GPU cluster: --bridge-arena auto puts the arena in GPU memory there
                          arena_slots=0 if config.bridge.arena == "host" else config.loop.staging_slots)
    return format_placement(plan, layout, model_name, config.bridge.delta)
