"""The run's rollout engines as one object: `RolloutFleet` owns the engines (separate or colocated), their
placement (GPUs, CPU cores), each engine's committed weight version, restarts and retirements, the nodes' copies of
the staging arena and the engine hosts' managers. The loop asks it for a step's rows (`submit(step).wait()`), hands
it each committed sync (`apply`), the FP8 KV-cache scales and the refit reference, and asks for evaluations and
refit checks; it never sees an engine.

Every rank builds one (`build_fleet`, collective); engine e lives on global rank e (`fleet_layout.FleetLayout`),
whose `RolloutManager` generates, scores and evaluates its share.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist

from megatron_ais.batch import RolloutBatch
from megatron_ais.bridge.node_copies import NodeCopies, node_leaders
from megatron_ais.distributed import node_name, ranks_on_this_node
from megatron_ais.engine.config import EngineConfig
from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig
from megatron_ais.errors import EngineRetiredError, as_sync_error
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.rollout.dynamic_sampling import DynamicSamplingConfig, GroupSelection, select_groups
from megatron_ais.rollout.fleet_layout import (FleetLayout, Retired, apply_on_every_engine, cpu_core_of, engine_gpus,
                                               from_every_engine, retire)
from megatron_ais.rollout.manager import RolloutManager, RolloutPlan, ServingPolicy, mean_rewards
from megatron_ais.rollout.rewards import RewardScorer
from megatron_ais.rollout.rows import (BackgroundWorker, MadeRows, RowsAhead, StepRollouts, exchange_rows, make_rows,
                                      pick_groups)
from megatron_ais.rollout.verify import RefitReference, replayed_reference, verify_refit_on_all_ranks


@dataclasses.dataclass(frozen=True)
class FleetConfig(FlagConfig):
    """How the run keeps its engines serving."""

    max_engine_restarts: int = flag(3, "Restarts each engine may have over the run (after dying or running past "
                                       "--rollout-generation-timeout-s); one that dies once more is retired, and the "
                                       "other engines take over its prompts in the same step.",
                                    name="--rollout-max-engine-restarts", at_least=0)
    min_engines: int = flag(1, "Fewest serving engines the run goes on with: below it every rank stops, naming the "
                               "retired engines and their last errors (the last checkpoint stays as it was).",
                            name="--rollout-min-engines", at_least=1)
    generation_timeout_s: float = flag(600.0, "Longest one engine's share of a step may take to generate (seconds, "
                                              "separate placement); past it the engine counts as dead: restarted.",
                                       name="--rollout-generation-timeout-s", above=0)



class PendingRollouts:
    """A submitted step's rollouts: `wait()` returns the rows this rank trains on (collective on first call). Made at
    submission, or, submitted ahead, generated while the trainer trains and exchanged when the loop waits."""

    def __init__(self, step: int, collect: Callable[[], StepRollouts]):
        self.step, self._collect, self._rollouts = step, collect, None

    def wait(self) -> StepRollouts:
        if self._rollouts is None:
            self._rollouts = self._collect()
        return self._rollouts


class RolloutFleet:
    """The run's serving engines, on every rank (collective methods: every rank calls them in the same order)."""

    def __init__(self, layout: FleetLayout, node_of: list[str], data_parallel_rank_of: list[int],
                 data_parallel_rank: int, manager: RolloutManager | None, node_copies: NodeCopies,
                 config: FleetConfig, prompts_per_step: int, eval_prompts: int, balanced: bool,
                 log: Callable[[str], None], dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()):
        self.layout, self.node_of, self.manager, self.node_copies = layout, node_of, manager, node_copies
        self.data_parallel_rank_of, self.data_parallel_rank = data_parallel_rank_of, data_parallel_rank
        self.config, self.prompts_per_step, self.eval_prompts = config, prompts_per_step, eval_prompts
        self.balanced, self.log = balanced, log  # balanced: DP shares balance tokens (--max-tokens-per-microbatch)
        self.dynamic_sampling = dynamic_sampling
        self.engine_versions: dict[int, int] = {}  # the trainer step whose weights each serving engine holds
        self.policy_version = 0  # the trainer step whose weights the engines hold (the last sync's id; 0: initial)
        self._ahead_worker: BackgroundWorker | None = None  # the thread that generates ahead, started at first use

    @property
    def size(self) -> int:
        """Serving engines."""
        return self.layout.size

    def processes_mapping(self, rank: int, engine: EngineConfig) -> int:
        """The engine processes on other GPUs of `rank`'s node that map a GPU buffer of `rank` by CUDA IPC (a CUDA
        context each there): every worker of a separate engine on the node, every colocated engine but `rank`'s."""
        here = sum(1 for host in self.layout.hosts if self.node_of[host] == self.node_of[rank])
        if engine.placement == "separate":
            return here * engine.tensor_parallel_size
        return here - (rank in self.layout.hosts)  # the engine inside `rank` maps it on its own GPU

    def submit(self, step: int, ahead: bool = False) -> PendingRollouts:
        """Step `step`'s rollouts: every serving engine makes its share (an engine retired meanwhile leaves its share
        to the others), every rank receives the rows its DP rank trains on (`rows.StepRollouts`). With
        --dynamic-sampling, rounds of prompts are made until the step has its informative groups
        (`dynamic_sampling.py`). `ahead`: each host starts generating its share of the first round now, in a thread,
        and returns at once; the rest (collectives, later rounds) happens at `wait()`, which every rank calls before
        the fleet's next collective. Otherwise the rows are made and exchanged here."""
        if ahead and self._ahead_worker is None:
            self._ahead_worker = BackgroundWorker("rollouts-ahead")
        first = RowsAhead(functools.partial(self._round_rows, step, 0, self.policy_version), self.layout,
                          self.prompts_per_step, self._ahead_worker) if ahead else None
        versions = {"policy_version": self.policy_version, "generated_ahead": ahead}
        pending = PendingRollouts(step, lambda: dataclasses.replace(self._collect(step, first), **versions))
        if not ahead:
            pending.wait()
        return pending

    def _round_rows(self, step: int, round_index: int, policy_version: int, prompts: range):
        return self.manager.rollout_rows(step, prompts, round_index, policy_version)

    def _collect(self, step: int, first: RowsAhead | None) -> StepRollouts:
        if not self.dynamic_sampling.enabled:
            made = self._make_round(step, 0, first)
            return exchange_rows(made, self.data_parallel_rank_of, self.data_parallel_rank, self.balanced)
        rounds, selection = [], None
        while selection is None or (selection.informative < self.prompts_per_step
                                    and len(rounds) < self.dynamic_sampling.max_rounds):
            rounds.append(self._make_round(step, len(rounds), first if not rounds else None))
            selection = select_groups([rewards for made in rounds for record in made.records
                                       for rewards in record.group_rewards()], self.prompts_per_step, len(rounds))
        if selection.blank:
            self.log(f"step {step}: dynamic sampling found {selection.informative} of {self.prompts_per_step} groups "
                     f"with reward variance in {len(rounds)} round(s) (--max-sampling-rounds); it trains on them, "
                     f"the other {len(selection.blank)} groups' responses are masked out of the loss")
        return self._exchange_selected(rounds, selection)

    def _make_round(self, step: int, round_index: int, ahead: RowsAhead | None = None) -> MadeRows:
        """The rows of one round of the step's prompts, every serving engine making its share (`ahead`: started
        earlier)."""
        made = make_rows(functools.partial(self._round_rows, step, round_index, self.policy_version), self.layout,
                         self.prompts_per_step, self.config.min_engines, ahead)
        self._retire(made.layout, made.retired)
        return made

    def _exchange_selected(self, rounds: list[MadeRows], selection: GroupSelection) -> StepRollouts:
        """Every rank's rows of the selected groups, with dynamic sampling's metrics."""
        picked = pick_groups(rounds, list(selection.picked), set(selection.blank), self.prompts_per_step)
        rollouts = exchange_rows(picked, self.data_parallel_rank_of, self.data_parallel_rank, self.balanced)
        return dataclasses.replace(rollouts, sampling=selection.metrics(picked.records[0].group_size))

    def apply(self, weights, sync_id: int, reference: RefitReference) -> None:
        """Every serving engine applies a committed sync (`weights`: the verified arena) from its node's copy; one
        that died is restarted with it and must agree with `reference` (the trainer's probe log-probs of these
        weights, kept for later restarts), or is retired past its budget. `sync_id`: the trainer step whose weights
        they are."""
        def apply_here(node_weights) -> int:
            with as_sync_error(f"sync {sync_id}: ", passing=(EngineRetiredError,)):
                return self.manager.apply_weights(node_weights, reference, sync_id)

        results = apply_on_every_engine(weights, self.node_copies, self.layout, self.node_of, apply_here, sync_id)
        self.policy_version = sync_id
        self.engine_versions = {host: v for host, v in zip(self.layout.hosts, results) if not isinstance(v, Retired)}
        self._retire(*retire(results, self.layout, self.config.min_engines))

    @contextlib.contextmanager
    def generation_paused(self):
        """A weight sync's block: on each engine's host, once the generation running in the background (if any) has
        ended or, with --partial-rollouts, stepped aside until the block ends (`turns.EngineTurns`)."""
        with self.manager.turns.sync() if self.manager is not None else contextlib.nullcontext():
            yield

    def set_kv_cache_scales(self, scales) -> None:
        """Every serving engine takes the FP8 KV-cache scales; one that died meanwhile is restarted, or retired past
        its restart budget, as in a weight sync."""
        results = from_every_engine(lambda: self.manager.set_kv_cache_scales(scales), self.layout)
        self._retire(*retire(results, self.layout, self.config.min_engines))

    def hold_refit_reference(self, ddp_chunks: list, probe: list[int], groups, vocab_size: int,
                             reference: RefitReference, moe: bool) -> RefitReference:
        """Collective, once the engines hold their weights (and KV-cache scales): the reference an engine restarted
        later must agree with before it serves again, and every refit check's until the next sync. A MoE model's
        replays the probe routes of the fleet's first engine (`replayed_reference`), at every sync, checked or not:
        its rounding flips near-tie routes, which the trainer's own routing would read as wrong weights."""
        if moe:
            reference = replayed_reference(self.manager.engine if self.manager else None, ddp_chunks, probe, groups,
                                           vocab_size, reference, self.layout)
        if self.manager is not None:
            self.manager.refit_reference = reference
        return reference

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """Held-out accuracy: each serving engine evaluates its share of the held-out prompts, every rank gets the
        means. Before the first step (`step` None) an engine's failure stops the run; later a dead engine's share
        is skipped for this evaluation."""
        def evaluate_share(prompts: range):
            if step is None:
                return self.manager.evaluate(prompts)
            return self.manager.evaluate_unless_dead(step, prompts)

        prompts = range(self.eval_prompts)
        return mean_rewards(from_every_engine(lambda: evaluate_share(self.layout.share(prompts, self.layout.rank)),
                                              self.layout))

    def restarted_unchecked(self) -> bool:
        """Collective: whether any engine was restarted without its refit check since the last call (inside a MoE
        model's sync, `RolloutManager._restart`): the sync's check must then cover every engine."""
        return any(from_every_engine(lambda: self.manager.take_restarted_unchecked(), self.layout))

    def verify_refit(self, ddp_chunks: list, probe: list[int], groups, vocab_size: int, reference: RefitReference,
                     engines: int, turn: int, moe: bool) -> dict[str, float]:
        """The refit check of `engines` serving engines (0: every one), the `turn`-th run of them over the fleet,
        against `reference` (`hold_refit_reference`'s)."""
        engine, fleet = self.manager.engine if self.manager else None, self.layout.rotating(engines, turn)
        return verify_refit_on_all_ranks(engine, ddp_chunks, probe, groups, vocab_size, reference.precision, fleet,
                                         moe, reference.trainer_logprobs)

    def close(self) -> None:
        """Release the node copies, the engine and its reward workers."""
        self.node_copies.close()
        if self.manager is not None:
            self.manager.engine.shutdown()
            self.manager.scorer.close()

    def _retire(self, layout: FleetLayout, messages: list[str]) -> None:
        """Go on with the engines still serving (`layout`), telling the user which were retired."""
        for message in messages:
            self.log(f"{message}; {layout.size} engine(s) serve on")
        self.layout = layout


def build_fleet(config, tokenizer, task, seeds: tuple[int, int], model_dir: str, log, routing_replay: bool,
                with_advantages: Callable[[RolloutBatch], RolloutBatch], data_parallel_rank: int,
                arena_rank: int) -> RolloutFleet:
    """Collective on every rank: place the fleet (every rank learns every rank's node and DP rank), start each
    engine on its host rank from `model_dir` (an HF export of the initial policy) with its rollout manager, and
    the node copies of the staging arena held by `arena_rank`. `config` is the run's `arguments.GRPORunConfig`,
    `seeds` the run's (data, rollout) seeds, `log` its `logging.RunLogger`."""
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, (node_name(), data_parallel_rank))
    node_of = [node for node, _ in places]
    colocated = config.engine.placement == "colocated"  # then every rank holds an engine
    layout = FleetLayout.per_node(dist.get_world_size() if colocated else config.cluster.engines_per_node,
                                  dist.get_rank(), node_of, dist.new_group())
    loop, trainer, index = config.loop, config.trainer, layout.engine_here
    leaders = node_leaders(layout.hosts, node_of, arena_rank)
    manager = None
    if index is not None:
        plan = rollout_plan(config, tokenizer.eos_token_id, seeds[0], with_advantages, routing_replay)
        several, out = layout.size > 1, trainer.logging.output_dir
        engine = RolloutEngine(engine_config(config.engine, model_dir, index, several, (arena_rank, *leaders)),
                               os.path.join(out, f"engine-{index}" if several else "engine"))
        manager = RolloutManager(engine, tokenizer, task, plan, *seeds, engine_log(log, index, several),
                                 RewardScorer(task.reward, config.rewards),
                                 serving_policy(config.fleet, separate=not colocated))
    dist.barrier()
    copies = NodeCopies(arena_rank, leaders, dist.get_rank(),
                        config.bridge.delta, config.bridge.full_sync_interval, config.bridge.arena_on_gpu,
                        loop.staging_slots)
    return RolloutFleet(layout, node_of, [dp for _, dp in places], data_parallel_rank, manager, copies, config.fleet,
                        loop.prompts_per_step, len(task.eval), trainer.training.max_tokens_per_microbatch is not None,
                        log.info, config.dynamic_sampling)


def rollout_plan(config, eos_token_id: int, data_seed: int, with_advantages, routing_replay: bool) -> RolloutPlan:
    """What every engine's manager makes of a step (`config`: the run's `arguments.GRPORunConfig`). Evaluations
    sample with the run's data seed: a resumed run's is the saved run's, whatever --seed it was given, so that its
    evaluations stay comparable with the ones before."""
    loop = config.loop
    sampling = SamplingConfig(n=loop.group_size, temperature=loop.temperature, top_p=loop.top_p,
                              max_new_tokens=loop.max_new_tokens, stop_token_ids=(eos_token_id,))
    return RolloutPlan(loop.prompts_per_step, sampling, loop.eval_samples, data_seed, config.trainer.model.seq_length,
                       with_advantages, routing_replay, config.overlong, policy_versions=loop.max_off_policy_steps > 0,
                       partial_rollouts=loop.partial_rollouts)


def engine_config(engine: EngineConfig, model_dir: str, index: int, several: bool,
                  arena_holders: tuple[int, ...]) -> EngineConfig:
    """This host's engine: a node's engines are driven by its first ranks, the k-th on its k-th CPU core when
    there are several; on GPUs a separate one takes GPUs of its own beyond the trainer's (else from its host
    rank's GPU on: `fleet_layout.engine_gpus`), a colocated one its rank's GPU. The staging arena (on the arena
    rank) or a node's copy of it (on that node's leader; `arena_holders`: those ranks) counts against the engine's
    memory when it is on the engine's first GPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", index))
    if not torch.cuda.is_available():
        return dataclasses.replace(engine, model_dir=model_dir,
                                   cpu_core=cpu_core_of(local_rank) if several else engine.cpu_core)
    gpus = None
    if engine.placement == "separate":
        gpus = engine_gpus(local_rank, engine.tensor_parallel_size, ranks_on_this_node(dist.get_world_size()),
                           torch.cuda.device_count())
    arena_here = dist.get_rank() in arena_holders and (gpus or (local_rank,))[0] == torch.cuda.current_device()
    return dataclasses.replace(engine, model_dir=model_dir, gpus=gpus,
                               staging_arena_gpu_copies=engine.staging_arena_gpu_copies if arena_here else 0)


def serving_policy(config: FleetConfig, separate: bool) -> ServingPolicy:
    """Separate engines restart alone; a colocated one lives in its trainer rank, whose vLLM groups span every
    rank: it is not restarted (its failure is the rank's)."""
    return ServingPolicy(config.max_engine_restarts if separate else 0,
                         config.generation_timeout_s if separate else None)


def engine_log(log, index: int, several: bool) -> Callable[[str], None]:
    """Where engine `index`'s manager tells the user what happened to it: the run's log on the logging rank,
    stderr on other hosts; lines name the engine when there are several."""
    prefix = f"engine {index}: " if several else ""
    if log.enabled:
        return lambda message: log.info(prefix + message)
    return lambda message: print(prefix + message, file=sys.stderr, flush=True)
