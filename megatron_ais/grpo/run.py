"""The GRPO + AIS run behind pretrain_grpo_ais.py: set up (or resume), then per step rollout → train → sync →
evaluate → save, each a short phase of `GRPORun`."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Callable

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ais.bridge.layout import BridgeLayout
from megatron_ais.bridge.quantization import check_engine_shapes
from megatron_ais.bridge.receiver import SyncReceiver
from megatron_ais.bridge.sync import SyncStats, WeightBridge
from megatron_ais.checkpointing.config import checkpoint_metadata
from megatron_ais.checkpointing.ranks import CheckpointRanks
from megatron_ais.checkpointing.background import BackgroundSaver
from megatron_ais.checkpointing.store import FORMATS, begin_save, commit_staged, write_staged
from megatron_ais.data.tasks import build_task
from megatron_ais.distributed import from_last_stage, gather_on, share
from megatron_ais.errors import ArgumentValidationError, TaskError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.forward import ParallelGroups
from megatron_ais.grpo.advantages import with_advantages
from megatron_ais.grpo.state import GRPOState, changed_flags, protected_iterations, reference_source
from megatron_ais.grpo.step import GRPOConfig, grpo_train_step
from megatron_ais.logging import RunLogger, grpo_console_line, plot_run
from megatron_ais.mapping.distributed import save_hf_checkpoint
from megatron_ais.rollout.fleet import PendingRollouts, build_fleet
from megatron_ais.rollout.kv_scales import calibrate_kv_cache_scales, rollout_sequences
from megatron_ais.rollout.manager import check_prompt_lengths, step_prompt_ids
from megatron_ais.rollout.rows import StepRollouts
from megatron_ais.rollout.verify import RefitReference, probe_tokens, refit_precision, trainer_probe_reference
from megatron_ais.routing_replay import routing_replay_enabled
from megatron_ais.sft import load_tokenizer
from megatron_ais.training import (WeightSource, build_reference_chunks, prepare_trainer, setup_model_and_optimizer,
                                   start_trainer, tokenizer_dir)


@dataclasses.dataclass(frozen=True)
class GRPOLoopConfig(FlagConfig):
    """The loop's schedule: rollout batches, sampling, optimizer steps per batch, evaluation and refit checks."""

    grpo_steps: int = flag(10, "Rollout batches (GRPO steps) to train on.", at_least=1)
    prompts_per_step: int = flag(16, "Prompts per rollout batch.", at_least=1)
    group_size: int = flag(4, "Responses sampled per prompt (the GRPO group).",
                           at_least=2, bound_note="GRPO's advantages compare the responses to one prompt")
    max_new_tokens: int = flag(16, "Longest response.", at_least=1)
    temperature: float = flag(1.0, "Rollout sampling temperature (> 0); the trainer's log-probs use the same.",
                              above=0, bound_note="the trainer's log-probs are log_softmax(logits / temperature)")
    top_p: float = flag(1.0, "Rollout nucleus sampling. Below 1 only with --is-correction none: the engine's log-probs "
                             "are renormalised over the nucleus and the trainer's are not, so every importance ratio "
                             "would measure the truncation rather than the FP8 mismatch.", above=0, at_most=1)
    num_minibatches: int = flag(1, "Optimizer steps per rollout batch.", at_least=1)
    ppo_epochs: int = flag(1, "Passes over each rollout batch.", at_least=1)
    rollout_seed: int | None = flag(None, "Seed of the rollout sampling (per step: derived from it and the step; "
                                          "default --seed). Saved in checkpoints, so a resumed run samples what the "
                                          "uninterrupted run would have.", type=int)
    ref_load: str | None = flag(None, "Checkpoint of the frozen reference policy for --kl-coef (default: the initial "
                                      "--load or --hf-dir; a resumed run keeps the reference of its first start).",
                                type=str)
    eval_interval: int = flag(5, "Evaluate held-out accuracy every this many steps.", at_least=1)
    eval_samples: int = flag(8, "Samples per held-out prompt at the rollout temperature: eval/accuracy is their mean "
                                "reward (avg@k, what the policy actually does); eval/greedy_accuracy is reported "
                                "beside it.", at_least=1)
    verify_refit_interval: int = flag(1, "Score the probe sequence and compare with the trainer every this many "
                                         "syncs (0 = never).", at_least=0)
    verify_refit_engines: int = flag(0, "Engines each refit check scores (0 = every serving engine); fewer take "
                                        "turns over the fleet, so each is checked every ceil(engines / this) checks.",
                                        at_least=0, bound_note="0 checks every engine")
    max_off_policy_steps: int = flag(
        0, "Policy versions a rollout batch may lag the weights it trains (η, AReaL's max_head_offpolicyness). 0: "
           "each step's batch is generated by the weights the step starts from (the synchronous loop). η ≥ 1: while "
           "step t trains, the engines generate the batches of the steps up to t + η with the weights step t starts "
           "from (η = 1: one step off policy, as slime's train_async.py); the importance correction sees the lag in "
           "the rollout log-probs. No batch after a step that evaluates or saves, or the last, is generated before "
           "that step's weights reach the engines, so a resumed run regenerates what the uninterrupted one trained "
           "on. Separate engines only.", at_least=0, bound_note="0: the synchronous loop")
    partial_rollouts: bool = flag(
        False, "With --max-off-policy-steps ≥ 1, sync each step's weights as soon as it has trained, while the "
               "engines generate: their unfinished requests are aborted, and resumed on the new weights with the "
               "tokens they have and those tokens' log-probs kept (slime's --partial-rollout, AReaL's interruptible "
               "generation). Every token records the version that sampled it (never more than η behind); which "
               "tokens a sync interrupts depends on timing, so such a run is not reproducible token for token.")
    moe_routing_replay: str | None = flag(
        None, "MoE routing replay (R3). rollout: the engine returns the experts it routes every rollout token to and "
              "the trainer's forwards (old, reference and training log-probs) use them, so the importance ratio "
              "measures only the precision mismatch; none: the trainer routes itself. Default: rollout for MoE "
              "models, none for dense ones.", choices=("none", "rollout"), type=str)

    def __post_init__(self):
        super().__post_init__()
        if self.partial_rollouts and not self.max_off_policy_steps:
            raise ArgumentValidationError("--partial-rollouts needs --max-off-policy-steps 1 or more (with 0 no "
                                          "generation runs while a sync does)")

    def evaluates_at(self, step: int) -> bool:
        return step % self.eval_interval == 0 or step == self.grpo_steps

    @property
    def staging_slots(self) -> int:
        """Buffers of the bridge's staging arena: two when syncs are written while the engines generate (η ≥ 1), so
        that a sync never writes the buffer of the weights the engines hold (a restarted engine reloads them)."""
        return 2 if self.max_off_policy_steps else 1

    def verifies_at(self, step: int) -> bool:
        return bool(self.verify_refit_interval) and step % self.verify_refit_interval == 0

    def waits_for_weights_after(self, step: int, saves_at: Callable[[int], bool]) -> bool:
        """Whether the batch after `step` is generated only once `step`'s weights reach the engines: `step`
        evaluates or saves (`saves_at`), so a resumed run regenerates what this one trains on (no batch follows the
        last step)."""
        return self.evaluates_at(step) or saves_at(step)

    def steps_ahead(self, step: int, submitted: int, saves_at: Callable[[int], bool]) -> range:
        """The steps after `submitted` (the last step whose batch is submitted) whose batches are generated while step
        `step` trains: up to --max-off-policy-steps ahead, and none after a step that waits for its weights
        (`waits_for_weights_after`)."""
        last = min(step + self.max_off_policy_steps, self.grpo_steps)
        for barrier in range(step, last):
            if self.waits_for_weights_after(barrier, saves_at):
                last = barrier
                break
        return range(submitted + 1, last + 1)


class PhaseTimes:
    """Wall-clock seconds of a step's phases (a phase entered twice: the sum)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.time()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - start


@dataclasses.dataclass(frozen=True)
class StagedSync:
    """A step's weights written and verified in the bridge's staging arena, not yet applied by the engines: the
    receiver's verified arena (`bridge.arena.ArenaWeights`), the trainer's probe log-probs of those weights and
    their FP8 KV-cache scales (None without an FP8 KV cache)."""

    step: int
    weights: object
    reference: RefitReference
    kv_cache_scales: object = None
    shipped_bytes: int | None = None  # with --bridge-delta fp8, on rank 0: what every stage shipped to the arena


class GRPORun:
    """One GRPO + AIS run (every rank builds one). `run()` is the whole loop; the run holds the phases, its state
    (`GRPOState`), the trainer's model, optimizer and bridge; the engines are the `RolloutFleet`'s. Global rank 0
    holds the bridge's staging arena and the logger."""

    arena_rank = 0  # the bridge's receiver (the staging arena every engine applies from) and the logger

    def __init__(self, config):
        self.config = config  # arguments.GRPORunConfig
        self.trainer, self.loop = config.trainer, config.loop

    def run(self) -> dict:
        """Set up or resume, train every remaining step, and return the summary. Each step's weights are written
        into the staging arena once it has trained (`stage`). With --max-off-policy-steps η the batches of the next
        η steps are submitted before a step trains (`submit_ahead`), generating while the step trains and its
        weights are staged (the other buffer of the arena), and the engines apply them once the batches submitted
        before are in (`sync_behind`), or, with --partial-rollouts, at once, interrupting them."""
        self.setup()
        pending, staged = {}, None  # step -> PendingRollouts submitted ahead; weights staged, not yet applied
        for step in range(self.state.step + 1, self.loop.grpo_steps + 1):
            times = PhaseTimes()
            with times.phase("rollout"):
                rollouts = (pending.pop(step, None) or self.submit(step)).wait()
            synced = self.sync_behind(staged, pending, times)
            pending.update(self.submit_ahead(step, max(pending, default=step)))
            with times.phase("train"):
                result = self.train(rollouts.batch, step - 1)
            with times.phase("sync"):
                staged = self.stage(step, rollouts)
                if not pending or self.loop.partial_rollouts:
                    synced.update(self.apply_staged(staged))
                    staged = None
            evaluated = self.evaluate(step)
            self.record(step, rollouts, result.metrics, synced, evaluated, times.seconds)
            self.save(step)
        return self.finish()

    def setup(self) -> None:
        """Check the task, the output directories, the model (one look at the checkpoint) and its FP8 shapes before
        any process group starts, and that no live run holds --save or --load; hold --save for the run; then build
        the trainer, the engine and the bridge. A fresh run evaluates the initial policy, a resumed one gives the
        engine the saved weights."""
        self.started = time.time()
        trainer = self.trainer
        self.task = build_task(trainer.task, trainer.training.seed)  # bad task flags or prompt files fail here
        if len(self.task.train) < self.loop.prompts_per_step:
            raise TaskError(f"--prompts-per-step {self.loop.prompts_per_step} exceeds the {len(self.task.train)} "
                            "training examples of the task; lower it or raise --num-examples")
        self.hf_config, self.build = prepare_trainer(trainer)
        try:
            check_engine_shapes(self.build.shape, self.config.bridge.policy, self.config.engine.tensor_parallel_size)
        except ValueError as err:
            raise ArgumentValidationError(str(err)) from err
        self.routing_replay = routing_replay_enabled(self.loop.moe_routing_replay, self.build.shape.is_moe)
        if self.routing_replay and self.loop.partial_rollouts:
            raise ArgumentValidationError(
                "--partial-rollouts with MoE routing replay: the engine routes a sample once it is done, with the "
                "weights it holds then, not those that sampled a resumed sample's first tokens; use "
                "--moe-routing-replay none or leave --partial-rollouts out")
        self.tokenizer = load_tokenizer(tokenizer_dir(trainer))
        check_prompt_lengths(self.tokenizer, self.task, self.loop.max_new_tokens, trainer.model.seq_length,
                             self.config.engine.max_model_len)
        self.lock = start_trainer(trainer)
        self.saver = BackgroundSaver() if trainer.checkpoint.async_save else None
        self._setup_trainer()
        self._setup_fleet()
        self._setup_bridge()
        self._start_or_resume()

    def _setup_trainer(self) -> None:
        """The policy (resumed, or its weights loaded), its optimizer, the run's state, the KL reference."""
        trainer, config = self.trainer, self.config
        self.model = setup_model_and_optimizer(self.build, trainer.weights, trainer.training,
                                               trainer.checkpoint.finetune, run_kind="grpo")
        saved, loaded = self.model.run_state, self.model.loaded
        unverified = trainer.checkpoint.allow_unverified_checkpoint
        reference = (saved or {}).get("reference_source") or reference_source(
            self.loop.ref_load, trainer.checkpoint.load, trainer.model.hf_dir, loaded.iteration if loaded else None,
            unverified)
        self.state = GRPOState.begin(saved, trainer.training.seed, self.loop.rollout_seed, reference)
        self.groups = ParallelGroups.from_parallel_state()
        self.checkpoint_ranks = CheckpointRanks.from_parallel_state()
        self.bridge_layout = BridgeLayout.from_parallel_state(self.arena_rank)
        self.reference = None
        if config.loss.kl_coef:
            self.reference = build_reference_chunks(self.build,
                                                    WeightSource(**self.state.reference, allow_unverified=unverified))
        self.grpo = GRPOConfig(loss=config.loss, correction=config.correction, vocab_size=self.build.shape.vocab_size,
                               micro_batch_size=trainer.training.micro_batch_size,
                               num_minibatches=self.loop.num_minibatches, ppo_epochs=self.loop.ppo_epochs,
                               advantages=config.advantages, temperature=self.loop.temperature,
                               max_tokens_per_microbatch=trainer.training.max_tokens_per_microbatch,
                               sequence_multiple=trainer.layout.tensor if trainer.layout.sequence_parallel else 1,
                               moe_routing=(self.build.shape.num_layers, self.build.shape.num_experts,
                                            self.build.shape.moe_topk) if self.routing_replay else None,
                               max_lag=self.loop.max_off_policy_steps)
        self.probe = probe_tokens(self.build.shape.vocab_size)

    def _setup_fleet(self) -> None:
        """The logger, and the rollout fleet: on each engine's host rank an engine started from an HF export of the
        initial policy (one file per pipeline stage) with its rollout manager."""
        trainer, state, out = self.trainer, self.state, self.trainer.logging.output_dir
        if state.data_seed != trainer.training.seed:
            self.task = build_task(trainer.task, state.data_seed)
            check_prompt_lengths(self.tokenizer, self.task, self.loop.max_new_tokens, trainer.model.seq_length,
                                 self.config.engine.max_model_len)
        # a resumed run's logs continue from the checkpoint: later steps logged before the crash are dropped
        self.log = RunLogger(trainer.logging, dist.get_rank() == self.arena_rank,
                             resume_step=state.step if state.saved is not None else None, run_config=trainer.flags,
                             total_steps=self.loop.grpo_steps)
        init_dir = os.path.join(out, "engine_init")
        save_hf_checkpoint(self.model.chunks, self.build, self.hf_config, init_dir,
                           ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                           is_stage_writer=self.bridge_layout.is_sender, assets_from=self.model.assets_dir)
        dist.barrier()  # the export is complete before any engine reads it
        self.fleet = build_fleet(self.config, self.tokenizer, self.task, (state.data_seed, state.rollout_seed),
                                 init_dir, self.log, self.routing_replay,
                                 functools.partial(with_advantages, config=self.config.advantages),
                                 self.groups.data_parallel_rank, self.arena_rank)

    def _setup_bridge(self) -> None:
        """Global rank 0 receives syncs into the staging arena (double-buffered with η ≥ 1) and verifies them once;
        every rank writes its shards (`write_weights`); the fleet forwards each committed sync to the other nodes
        and every engine applies it (`apply_staged`)."""
        self.receiver = SyncReceiver(apply=lambda weights: weights, slots=self.loop.staging_slots) \
            if dist.get_rank() == self.arena_rank else None
        self.bridge = WeightBridge(self.model.chunks, self.build, self.config.bridge, self.bridge_layout, self.receiver)

    def _start_or_resume(self) -> None:
        """A fresh run measures the KV-cache scales and evaluates the initial policy; a resumed one gives the engine
        what the bridge would have sent after the saved step, with the KV-cache scales the uninterrupted run measured
        then (on that step's rollouts, which the resumed run no longer has)."""
        state = self.state
        # each step's batch: the step whose weights generated it, and whether it was generated while a step trained
        self.generated_by: dict[int, tuple[int, bool]] = {}
        first_prompts = step_prompt_ids(self.tokenizer, self.task, self.loop.prompts_per_step, state.data_seed,
                                        state.step + 1)
        if state.saved is None:
            self.fleet.set_refit_reference(self.refit_reference())  # the engines hold the initial export
            self.calibrate_kv_cache(first_prompts)
            state.eval_before = self.fleet.evaluate()
            return
        self.log.info(f"resuming GRPO at step {state.step + 1} from {self.trainer.checkpoint.load} (iteration "
                      f"{self.model.loaded.iteration})")
        changed = changed_flags(state.saved.get("args", {}), self.trainer.flags)
        if changed:
            self.log.info("flags that differ from the saved run: " + ", ".join(changed))
        reference = self.refit_reference()
        self.fleet.apply(self.write_weights(state.step).committed, state.step, reference)
        if self.config.engine.kv_cache_dtype != "fp8":
            state.kv_cache_scales = None
        elif state.kv_cache_scales is None:
            self.calibrate_kv_cache(first_prompts)
        else:
            self.fleet.set_kv_cache_scales(state.kv_cache_scales)

    def submit(self, step: int, ahead: bool = False) -> PendingRollouts:
        """Step `step`'s rollouts (the rows this rank's DP rank trains on, with the batch-wide figures, at `wait()`),
        generated by the weights the engines hold now; `ahead`: while this rank trains."""
        self.generated_by[step] = (self.fleet.policy_version, ahead)
        return self.fleet.submit(step, ahead)

    def submit_ahead(self, step: int, submitted: int) -> dict[int, PendingRollouts]:
        """Submit the batches generated while step `step` trains (`GRPOLoopConfig.steps_ahead`)."""
        def saves_at(later: int) -> bool:
            return self.trainer.checkpoint.saves_at(later, self.loop.grpo_steps)

        return {later: self.submit(later, ahead=True) for later in self.loop.steps_ahead(step, submitted, saves_at)}

    def sync_behind(self, staged: StagedSync | None, pending: dict[int, PendingRollouts], times: PhaseTimes) -> dict:
        """The engines apply the previous step's staged weights (that step trained while batches were generated)
        once every batch submitted before is in (the engines change weights between batches, never during one);
        what the step logs of it."""
        if staged is None:
            return {}
        with times.phase("sync"):
            for later in sorted(pending):
                pending[later].wait()
            return self.apply_staged(staged)

    def train(self, batch, policy_version: int):
        """One GRPO update of the weights of step `policy_version` on the batch (λ once for the batch)."""
        return grpo_train_step(self.model.ddp_chunks, self.model.optimizer, batch, self.grpo, self.state.ais,
                               self.groups, self.reference, policy_version)

    def stage(self, step: int, rollouts: StepRollouts) -> StagedSync:
        """The weights step `step` trained, before any engine holds them (collective; the engines may be generating):
        their probe log-probs, their FP8 KV-cache scales measured on this step's first rollouts (the first engine's),
        and the bridge's write of them into the staging arena, verified once."""
        reference = self.refit_reference()
        if self.config.engine.kv_cache_dtype == "fp8":
            first, count = rollouts.first_rows, self.config.kv_calibration.sequences
            self.measure_kv_cache(share(lambda: rollout_sequences(first.tokens, first.mask, count),
                                        src=rollouts.first_host))
        stats = self.write_weights(step)
        shipped = None
        if self.config.bridge.delta == "fp8":  # what the delta saves, logged with the apply: the stages' senders'
            gathered = gather_on(stats.shipped_bytes, dst=0)
            shipped = sum(gathered) if gathered is not None else None
        return StagedSync(step, stats.committed, reference, self.state.kv_cache_scales, shipped)

    def apply_staged(self, staged: StagedSync) -> dict:
        """Every engine applies the staged weights and their KV-cache scales, then the refit of every engine (or of
        this turn's few, --verify-refit-engines) is checked; return what the step logs of it. Each host's generation
        in the background, if any, ends or steps aside first (`RolloutFleet.generation_paused`)."""
        step, scales = staged.step, staged.kv_cache_scales
        with self.fleet.generation_paused():
            self.fleet.apply(staged.weights, step, staged.reference)
            if self.config.engine.kv_cache_dtype == "fp8":
                self.fleet.set_kv_cache_scales(scales)
            metrics = {f"rollout/engine{host}_weight_version": v for host, v in self.fleet.engine_versions.items()}
            if self.loop.verifies_at(step):
                metrics.update(self.fleet.verify_refit(
                    self.model.ddp_chunks, self.probe, self.groups, self.build.shape.vocab_size, staged.reference,
                    self.loop.verify_refit_engines, step // self.loop.verify_refit_interval - 1,
                    self.build.shape.is_moe))
        if staged.shipped_bytes is not None:
            metrics.update({"bridge/shipped_bytes": staged.shipped_bytes,
                            "bridge/node_copy_bytes": self.fleet.node_copies.sent_bytes})
        if scales is not None:
            metrics.update({"rollout/kv_cache_k_scale_max": max(k for _, k, _ in scales.scales),
                            "rollout/kv_cache_v_scale_max": max(v for _, _, v in scales.scales)})
        return metrics

    def refit_reference(self) -> RefitReference:
        """The trainer's probe log-probs for its current weights (collective): an engine given them serves (after a
        restart, again) only once its own agree."""
        return RefitReference(
            self.probe, trainer_probe_reference(self.model.ddp_chunks, self.probe, self.groups,
                                                self.build.shape.vocab_size),
            refit_precision(self.config.engine, self.build.precision))

    def evaluate(self, step: int) -> dict:
        """Held-out accuracy at evaluation steps (each engine evaluates its share; every rank knows the means)."""
        if not self.loop.evaluates_at(step):
            return {}
        return self.fleet.evaluate(step)

    def record(self, step: int, rollouts: StepRollouts, train_metrics: dict, synced: dict, evaluated: dict,
               seconds: dict[str, float]) -> None:
        """Log the step: its metrics into the history, tensorboard and metrics.jsonl, and its console line."""
        metrics = from_last_stage(dict(train_metrics), self.groups.pipeline_group)
        metrics.update(synced)
        version, ahead = self.generated_by.pop(step)
        # a batch generated while the trainer trained: the engines' own rates (the loop waited only for the rest)
        tokens_per_s = sum(rollouts.engine_tokens_per_s.values()) if ahead else \
            rollouts.response_tokens / max(seconds["rollout"], 1e-9)
        metrics.update({"rollout/policy_version": version, "rollout/version_lag": step - 1 - version,
                        "rollout/reward": float(rollouts.rewards.mean()),
                        "rollout/reward_failures": rollouts.reward_failures,
                        "rollout/reward_timeouts": rollouts.reward_timeouts, "time/rollout_s": seconds["rollout"],
                        "time/train_s": seconds["train"], "time/sync_s": seconds.get("sync", 0.0),
                        "rollout/tokens_per_s": tokens_per_s,
                        "rollout/engines": self.fleet.size,
                        **{f"rollout/engine{host}_tokens_per_s": rate
                           for host, rate in rollouts.engine_tokens_per_s.items()},
                        "rollout/received_bytes": rollouts.received_bytes,
                        "rollout/rank_bytes_fraction": rollouts.held_bytes / max(rollouts.batch_bytes, 1),
                        "rollout/truncated_fraction": rollouts.truncated / max(rollouts.sampled_rows, 1),
                        **rollouts.sampling})
        if self.loop.partial_rollouts:  # responses a sync interrupted, finished on the next weights
            metrics["rollout/partial_fraction"] = rollouts.partial / max(rollouts.sampled_rows, 1)
        metrics.update(evaluated)
        self.state.step = step
        self.state.history.append({"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
        line = None
        if self.trainer.logging.prints(step, self.loop.grpo_steps):
            accuracy = f" acc {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""
            line = (f"{grpo_console_line(step, metrics)} | reward {metrics['rollout/reward']:.3f}{accuracy} | "
                    f"{metrics['rollout/tokens_per_s']:.0f} tok/s | rollout {seconds['rollout']:.1f}s train "
                    f"{seconds['train']:.1f}s sync {seconds.get('sync', 0.0):.1f}s")
        self.log.step(step, metrics, line)

    def save(self, step: int) -> None:
        """A checkpoint every --save-interval steps and after the last one. With --async-save the save returns once
        the state is copied and its files are written in the background; every rank commits a finished one here, at
        the next step's boundary (or before the next save, or in `finish`)."""
        checkpoint = self.trainer.checkpoint
        if self.saver is not None:
            self._log_committed(self.saver.poll())
        if not checkpoint.saves_at(step, self.loop.grpo_steps):
            return
        metadata = checkpoint_metadata(self.build, self.hf_config, step, self.groups.data_parallel_size,
                                       self.trainer.training.use_distributed_optimizer)
        protect = protected_iterations(self.state.reference, checkpoint.save) if self.config.loss.kl_coef else ()
        if self.saver is not None:
            self._log_committed(self.saver.wait())  # one outstanding save at a time
        staged = begin_save(checkpoint.save, step, self.model.chunks, metadata, self.model.assets_dir,
                            self.checkpoint_ranks, optimizer=self.model.optimizer,
                            run_state=self.state.run_state(self.loop.prompts_per_step, self.trainer.flags),
                            dp_group=self.groups.data_parallel_group, keep=checkpoint.keep_checkpoints,
                            protect=protect, fmt=FORMATS[checkpoint.ckpt_format], snapshot=self.saver is not None)
        if self.saver is not None:
            self.saver.start(staged)
        else:
            commit_staged(write_staged(staged))
            self._log_committed(step)

    def _log_committed(self, iteration: int | None) -> None:
        if iteration is not None:
            self.log.info(f"saved checkpoint {self.trainer.checkpoint.save} iteration {iteration}")

    def write_weights(self, sync_id: int) -> SyncStats:
        """Bridge the current policy into the staging arena, verified once (collective on every rank); return the
        sync's stats, whose `committed` is the verified arena, which `RolloutFleet.apply` forwards to the other nodes'
        copies (each verified) and every engine applies."""
        stats = self.bridge.sync(sync_id)
        if self.bridge_layout.is_sender and self.bridge.completed == 1:
            self.log.info(f"bridge: {stats.tensors} tensors in {stats.buckets} buckets, {stats.bytes / 1e6:.1f} MB "
                          f"from this stage by {stats.transport}, {stats.seconds:.2f} s")
        return stats

    def calibrate_kv_cache(self, sequences: list[list[int]]) -> None:
        """FP8 KV cache: measure the policy's K/V scales on `sequences` and install them in the engines."""
        if self.config.engine.kv_cache_dtype != "fp8":
            return
        self.measure_kv_cache(sequences)
        self.fleet.set_kv_cache_scales(self.state.kv_cache_scales)

    def measure_kv_cache(self, sequences: list[list[int]]) -> None:
        """The trainer's policy's FP8 KV-cache K/V scales on `sequences` (split over DP ranks; collective on every
        rank), kept in the run's state."""
        calibration = self.config.kv_calibration
        self.state.kv_cache_scales = calibrate_kv_cache_scales(
            self.model.ddp_chunks, sequences[:calibration.sequences], self.build.seq_length,
            self.trainer.training.micro_batch_size, self.groups, self.build.shape.vocab_size,
            self.build.shape.num_layers, calibration.scale_margin)

    def finish(self) -> dict:
        """Commit an outstanding background save, write the summary (and the run's figure) and release the engine,
        the bridge and the logs."""
        if self.saver is not None:
            self._log_committed(self.saver.wait())
        history, before = self.state.history, self.state.eval_before
        accuracy_before = before.get("eval/accuracy")
        summary = {"accuracy_before": accuracy_before, "greedy_accuracy_before": before.get("eval/greedy_accuracy"),
                   "accuracy_after": next((h["eval/accuracy"] for h in reversed(history) if "eval/accuracy" in h),
                                          accuracy_before),
                   "steps": self.loop.grpo_steps, "wall_s": time.time() - self.started, "history": history}
        self.log.summary(summary)
        if self.log.enabled and history:
            plot_run(history, os.path.join(self.trainer.logging.output_dir, "run.png"), accuracy_before)
        self.log.close()
        self.bridge.close()
        self.fleet.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.lock is not None:
            self.lock.release()
        return summary
