"""The GRPO + AIS run behind pretrain_grpo_ais.py: set up (or resume), then per step rollout → train → sync →
evaluate → save, each a short phase of `GRPORun`. The weight sync (`weight_sync.WeightSync`), the batches generated
ahead (`schedule.RolloutSchedule`) and the saves (`checkpointing.checkpointer.Checkpointer`) are objects of their
own."""
from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Callable, ContextManager

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ais import platform
from megatron_ais.bridge.aligned_forward import RolloutAlignedForward
from megatron_ais.bridge.layout import BridgeLayout
from megatron_ais.bridge.quantization import check_engine_shapes
from megatron_ais.checkpointing.checkpointer import Checkpointer
from megatron_ais.checkpointing.store import usable_iterations
from megatron_ais.data.tasks import build_task
from megatron_ais.distributed import from_last_stage
from megatron_ais.errors import ArgumentValidationError, TaskError
from megatron_ais.forward import ParallelGroups
from megatron_ais.grpo.advantages import with_advantages
from megatron_ais.grpo.schedule import RolloutSchedule
from megatron_ais.grpo.state import (DATA_SEED_KEY, GRPOState, changed_flags, check_data_seed, check_reference_kept,
                                     protected_iterations, reference_source, resumed_data_seed)
from megatron_ais.grpo.step import GRPOConfig, grpo_train_step
from megatron_ais.grpo.weight_sync import ARENA_RANK, WeightSync
from megatron_ais.hf_assets import load_tokenizer
from megatron_ais.logging import RunLogger, grpo_console_line, plot_run
from megatron_ais.mapping.distributed import save_hf_checkpoint
from megatron_ais.rollout.fleet import build_fleet
from megatron_ais.rollout.manager import check_prompt_lengths, step_prompt_ids
from megatron_ais.rollout.rows import StepRollouts
from megatron_ais.routing_replay import routing_replay_enabled
from megatron_ais.training import (WeightSource, build_reference_chunks, prepare_trainer, setup_model_and_optimizer,
                                   start_trainer, tokenizer_dir)


def policy_forward_weights(config, chunks: list, build) -> Callable[[], ContextManager]:
    """The context every forward of the policy runs in (`config`: the GRPORunConfig): with
    --rollout-aligned-forward the engine's weights (`RolloutAlignedForward`), else the policy's own."""
    if not config.aligned.rollout_aligned_forward:
        return contextlib.nullcontext
    return RolloutAlignedForward.from_parallel_state(chunks, build, config.bridge.policy,
                                                     config.engine.quantizes_activations(platform.is_cuda()))


class PhaseTimes:
    """Wall-clock seconds of a step's phases (a phase entered twice: the sum)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.time()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - start


def rollout_metrics(step: int, rollouts: StepRollouts, seconds: dict[str, float], engines: int,
                    partial_rollouts: bool) -> dict:
    """What a step logs of its rollouts: the weights that generated them, rewards, rates and bytes."""
    # a batch generated while the trainer trained: the engines' own rates (the loop waited only for the rest)
    tokens_per_s = sum(rollouts.engine_tokens_per_s.values()) if rollouts.generated_ahead else \
        rollouts.response_tokens / max(seconds["rollout"], 1e-9)
    metrics = {"rollout/policy_version": rollouts.policy_version,
               "rollout/version_lag": step - 1 - rollouts.policy_version,
               "rollout/reward": float(rollouts.rewards.mean()), "rollout/reward_failures": rollouts.reward_failures,
               "rollout/reward_timeouts": rollouts.reward_timeouts, "time/rollout_s": seconds["rollout"],
               "time/train_s": seconds["train"], "time/sync_s": seconds.get("sync", 0.0),
               "rollout/tokens_per_s": tokens_per_s, "rollout/engines": engines,
               **{f"rollout/engine{host}_tokens_per_s": rate for host, rate in rollouts.engine_tokens_per_s.items()},
               "rollout/received_bytes": rollouts.received_bytes,
               "rollout/rank_bytes_fraction": rollouts.held_bytes / max(rollouts.batch_bytes, 1),
               "rollout/truncated_fraction": rollouts.truncated / max(rollouts.sampled_rows, 1),
               "rollout/repetitive_fraction": rollouts.repetitive / max(rollouts.sampled_rows, 1), **rollouts.sampling}
    if partial_rollouts:  # responses a sync interrupted, finished on the next weights
        metrics["rollout/partial_fraction"] = rollouts.partial / max(rollouts.sampled_rows, 1)
    return metrics


def console_line(step: int, metrics: dict, seconds: dict[str, float]) -> str:
    accuracy = f" acc {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""
    return (f"{grpo_console_line(step, metrics)} | reward {metrics['rollout/reward']:.3f}{accuracy} | "
            f"{metrics['rollout/tokens_per_s']:.0f} tok/s | rollout {seconds['rollout']:.1f}s train "
            f"{seconds['train']:.1f}s sync {seconds.get('sync', 0.0):.1f}s")


class GRPORun:
    """One GRPO + AIS run (every rank builds one). `run()` is the whole loop; the run holds its state (`GRPOState`),
    the trainer's model and optimizer, the fleet of engines, the weight sync, the rollout schedule and the
    checkpointer. Global rank 0 holds the bridge's staging arena and the logger."""

    def __init__(self, config):
        self.config = config  # arguments.GRPORunConfig
        self.trainer, self.loop = config.trainer, config.loop

    def run(self) -> dict:
        """Set up or resume, train every remaining step, and return the summary. Each step's weights are staged once
        it has trained; with --max-off-policy-steps η the batches of the next η steps are submitted before a step
        trains, generating while it trains, and the engines apply its weights once the batches submitted before are
        in (`sync_behind`), or, with --partial-rollouts, at once, interrupting them."""
        self.setup()
        for step in range(self.state.step + 1, self.loop.grpo_steps + 1):
            times = PhaseTimes()
            with times.phase("rollout"):
                rollouts = self.schedule.rollouts(step)
            synced = self.sync_behind(times)
            self.schedule.submit_ahead(step)
            with times.phase("train"):
                result = self.train(rollouts.batch, step - 1)
            with times.phase("sync"):
                synced.update(self.sync(step, rollouts))
            evaluated = self.evaluate(step)
            self.record(step, rollouts, result.metrics, synced, evaluated, times.seconds)
            self.save(step)
        return self.finish()

    def setup(self) -> None:
        """Check the task, the output directories, the model (one look at the checkpoint) and its FP8 shapes before
        any process group starts, and that no live run holds --save or --load; hold --save for the run; then build
        the trainer, the fleet, the weight sync and the schedule. A fresh run evaluates the initial policy, a resumed
        one gives the engines the saved weights."""
        self.started = time.time()
        self._check_flags()
        self.lock = start_trainer(self.trainer)
        self._setup_trainer()
        self.log = RunLogger(self.trainer.logging, dist.get_rank() == ARENA_RANK, run_config=self.trainer.flags,
                             resume_step=self.state.step if self.state.saved is not None else None,
                             total_steps=self.loop.grpo_steps)
        self.checkpointer = Checkpointer(
            self.trainer.checkpoint, self.build, self.hf_config, self.model.chunks, self.model.optimizer,
            self.model.assets_dir, (self.groups.data_parallel_group, self.groups.data_parallel_size),
            self.trainer.training.use_distributed_optimizer,
            on_commit=lambda it: self.log.info(f"saved checkpoint {self.trainer.checkpoint.save} iteration {it}"))
        bridge_layout = BridgeLayout.from_parallel_state(ARENA_RANK)
        self._setup_fleet(bridge_layout.is_sender)
        self.weights = WeightSync(self.config, self.model, self.build, self.groups, bridge_layout, self.fleet,
                                  self.state, self.log)
        self.schedule = RolloutSchedule(
            self.fleet, self.loop, lambda step: self.checkpointer.saves_at(step, self.loop.grpo_steps))
        self._start_or_resume()

    def _check_flags(self) -> None:
        """The task (drawn with the resumed run's data seed), the model's FP8 shapes and the options that depend on the
        model, and the prompts' lengths."""
        trainer = self.trainer
        self.hf_config, self.build = prepare_trainer(trainer, "grpo")  # --load's lock and metadata first
        self.data_seed = resumed_data_seed(trainer.checkpoint, trainer.training.seed)
        self.task = build_task(trainer.task, self.data_seed)  # bad task flags or prompt files fail here
        if len(self.task.train) < self.loop.prompts_per_step:
            raise TaskError(f"--prompts-per-step {self.loop.prompts_per_step} exceeds the {len(self.task.train)} "
                            "training examples of the task; lower it or raise --num-examples")
        try:
            check_engine_shapes(self.build.shape, self.config.bridge.policy, self.config.engine.tensor_parallel_size)
        except ValueError as err:
            raise ArgumentValidationError(str(err)) from err
        self.routing_replay = routing_replay_enabled(self.loop.moe_routing_replay, self.build.shape.is_moe,
                                                     self.loop.partial_rollouts)
        if self.loop.ref_load and self.config.loss.kl_coef:  # the reference is read after --save is locked
            usable_iterations(self.loop.ref_load, trainer.checkpoint.allow_unverified_checkpoint, flag="--ref-load")
        self.tokenizer = load_tokenizer(tokenizer_dir(trainer))
        check_prompt_lengths(self.tokenizer, self.task, self.loop.max_new_tokens, trainer.model.seq_length,
                             self.config.engine.max_model_len)

    def _setup_trainer(self) -> None:
        """The policy (resumed, or its weights loaded), its optimizer, the run's state, the KL reference."""
        trainer, config = self.trainer, self.config
        self.model = setup_model_and_optimizer(self.build, trainer.weights, trainer.training,
                                               trainer.checkpoint.finetune, run_kind="grpo")
        saved, loaded = self.model.run_state, self.model.loaded
        unverified = trainer.checkpoint.allow_unverified_checkpoint
        reference = (saved or {}).get("reference_source") or reference_source(
            self.loop.ref_load, trainer.checkpoint.load, trainer.model.hf_dir, loaded and loaded.iteration, unverified)
        self.state = GRPOState.begin(saved, trainer.training.seed, self.loop.rollout_seed, reference)
        check_data_seed(self.state, self.data_seed, trainer.checkpoint.load)
        self.groups = ParallelGroups.from_parallel_state()
        self.reference = None
        if config.loss.kl_coef:
            check_reference_kept(self.state.reference, trainer.checkpoint, self.state.step + 1, self.loop.grpo_steps)
            self.reference = build_reference_chunks(self.build,
                                                    WeightSource(**self.state.reference, allow_unverified=unverified))
        self.grpo = GRPOConfig.for_run(config, self.build.shape, self.routing_replay)
        self.forward_weights = policy_forward_weights(config, self.model.chunks, self.build)

    def _setup_fleet(self, is_stage_writer: bool) -> None:
        """The rollout fleet: on each engine's host rank an engine started from an HF export of the initial policy
        (one file per pipeline stage) with its rollout manager."""
        trainer, state = self.trainer, self.state
        init_dir = os.path.join(trainer.logging.output_dir, "engine_init")
        save_hf_checkpoint(self.model.chunks, self.build, self.hf_config, init_dir,
                           ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                           is_stage_writer=is_stage_writer, assets_from=self.model.assets_dir)
        dist.barrier()  # the export is complete before any engine reads it
        self.fleet = build_fleet(self.config, self.tokenizer, self.task, (state.data_seed, state.rollout_seed),
                                 init_dir, self.log, self.routing_replay,
                                 functools.partial(with_advantages, config=self.config.advantages),
                                 self.groups.data_parallel_rank, ARENA_RANK)

    def _start_or_resume(self) -> None:
        """A fresh run measures the KV-cache scales and evaluates the initial policy; a resumed one gives the engines
        the saved step's weights (`WeightSync.resume`)."""
        state = self.state
        first_prompts = step_prompt_ids(self.tokenizer, self.task, self.loop.prompts_per_step, state.data_seed,
                                        state.step + 1)
        if state.saved is None:
            self.weights.start(first_prompts)
            state.eval_before = self.fleet.evaluate()
            return
        self.log.info(f"resuming GRPO at step {state.step + 1} from {self.trainer.checkpoint.load} (iteration "
                      f"{self.model.loaded.iteration})")
        changed = changed_flags(state.saved.get("args", {}), self.trainer.flags)
        if changed:
            self.log.info("flags that differ from the saved run: " + ", ".join(changed))
        self.weights.resume(state.step, first_prompts)

    def sync_behind(self, times: PhaseTimes) -> dict:
        """The engines apply the previous step's staged weights (that step trained while batches were generated)
        once every batch submitted before is in; what the step logs of it."""
        if self.weights.staged is None:
            return {}
        with times.phase("sync"):
            self.schedule.wait_submitted()
            return self.weights.apply_staged()

    def sync(self, step: int, rollouts: StepRollouts) -> dict:
        """Stage the weights step `step` trained (FP8 KV-cache scales measured on its rollouts); the engines apply
        them now unless batches are generating (then `sync_behind` does, at the next step) or --partial-rollouts
        interrupts those."""
        self.weights.stage(step, rollouts.calibration_sequences)
        if self.schedule.generating and not self.loop.partial_rollouts:
            return {}
        return self.weights.apply_staged()

    def train(self, batch, policy_version: int):
        """One GRPO update of the weights of step `policy_version` on the batch (λ once for the batch)."""
        return grpo_train_step(self.model.ddp_chunks, self.model.optimizer, batch, self.grpo, self.state.ais,
                               self.groups, self.reference, policy_version, self.forward_weights)

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
        metrics.update(rollout_metrics(step, rollouts, seconds, self.fleet.size, self.loop.partial_rollouts))
        metrics.update(evaluated)
        self.state.step = step
        self.state.history.append({"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
        prints = self.trainer.logging.prints(step, self.loop.grpo_steps)
        self.log.step(step, metrics, console_line(step, metrics, seconds) if prints else None)

    def save(self, step: int) -> None:
        """A checkpoint every --save-interval steps and after the last one (with --async-save, a finished background
        save is committed here, at the step boundary)."""
        self.checkpointer.poll()
        if not self.checkpointer.saves_at(step, self.loop.grpo_steps):
            return
        protect = protected_iterations(self.state.reference, self.trainer.checkpoint.save) \
            if self.config.loss.kl_coef else ()
        # λ's state (EMA, anchor) moves on the last pipeline stage, and the first stage's rank 0 writes the run state
        self.state.ais.load_state_dict(from_last_stage(self.state.ais.state_dict(), self.groups.pipeline_group))
        self.checkpointer.save(step, self.state.run_state(self.loop.prompts_per_step, self.trainer.flags), protect,
                               metadata={DATA_SEED_KEY: self.state.data_seed})

    def finish(self) -> dict:
        """Commit an outstanding save, write the summary and the run's figure, release what the run holds."""
        self.checkpointer.wait()
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
        self.fleet.close()
        self.weights.close()
        if self.lock is not None:
            self.lock.release()
        return summary
