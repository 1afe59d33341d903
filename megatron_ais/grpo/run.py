"""The GRPO + AIS run behind pretrain_grpo_ais.py: set up (or resume), then per step rollout → train → sync →
evaluate → save, each a short phase of `GRPORun`."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ais.bridge.layout import BridgeLayout
from megatron_ais.bridge.quantization import check_engine_shapes
from megatron_ais.bridge.receiver import SyncReceiver
from megatron_ais.bridge.sync import WeightBridge
from megatron_ais.checkpointing.config import checkpoint_metadata
from megatron_ais.checkpointing.ranks import CheckpointRanks
from megatron_ais.checkpointing.background import BackgroundSaver
from megatron_ais.checkpointing.store import FORMATS, begin_save, commit_staged, write_staged
from megatron_ais.data.tasks import build_task
from megatron_ais.distributed import from_last_stage, share
from megatron_ais.errors import ArgumentValidationError, TaskError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.forward import ParallelGroups
from megatron_ais.grpo.advantages import with_advantages
from megatron_ais.grpo.state import GRPOState, changed_flags, protected_iterations, reference_source
from megatron_ais.grpo.step import GRPOConfig, grpo_train_step
from megatron_ais.logging import RunLogger, grpo_console_line, plot_run
from megatron_ais.mapping.distributed import save_hf_checkpoint
from megatron_ais.rollout.fleet import build_fleet
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

    grpo_steps: int = flag(10, "Rollout batches (GRPO steps) to train on.")
    prompts_per_step: int = flag(16, "Prompts per rollout batch.")
    group_size: int = flag(4, "Responses sampled per prompt (the GRPO group).")
    max_new_tokens: int = flag(16, "Longest response.")
    temperature: float = flag(1.0, "Rollout sampling temperature (> 0); the trainer's log-probs use the same.")
    top_p: float = flag(1.0, "Rollout nucleus sampling. Below 1 only with --is-correction none: the engine's log-probs "
                             "are renormalised over the nucleus and the trainer's are not, so every importance ratio "
                             "would measure the truncation rather than the FP8 mismatch.")
    num_minibatches: int = flag(1, "Optimizer steps per rollout batch.")
    ppo_epochs: int = flag(1, "Passes over each rollout batch.")
    rollout_seed: int | None = flag(None, "Seed of the rollout sampling (per step: derived from it and the step; "
                                          "default --seed). Saved in checkpoints, so a resumed run samples what the "
                                          "uninterrupted run would have.", type=int)
    ref_load: str | None = flag(None, "Checkpoint of the frozen reference policy for --kl-coef (default: the initial "
                                      "--load or --hf-dir; a resumed run keeps the reference of its first start).",
                                type=str)
    eval_interval: int = flag(5, "Evaluate held-out accuracy every this many steps.")
    eval_samples: int = flag(8, "Samples per held-out prompt at the rollout temperature: eval/accuracy is their mean "
                                "reward (avg@k, what the policy actually does); eval/greedy_accuracy is reported "
                                "beside it.")
    verify_refit_interval: int = flag(1, "Score the probe sequence and compare with the trainer every this many "
                                         "syncs (0 = never).")
    verify_refit_engines: int = flag(0, "Engines each refit check scores (0 = every serving engine); fewer take "
                                        "turns over the fleet, so each is checked every ceil(engines / this) checks.")
    moe_routing_replay: str | None = flag(
        None, "MoE routing replay (R3). rollout: the engine returns the experts it routes every rollout token to and "
              "the trainer's forwards (old, reference and training log-probs) use them, so the importance ratio "
              "measures only the precision mismatch; none: the trainer routes itself. Default: rollout for MoE "
              "models, none for dense ones.", choices=("none", "rollout"), type=str)

    def __post_init__(self):
        for name in ("grpo-steps", "prompts-per-step", "num-minibatches", "ppo-epochs", "max-new-tokens",
                     "eval-interval", "eval-samples"):
            value = getattr(self, name.replace("-", "_"))
            if value < 1:
                raise ArgumentValidationError(f"--{name} {value} must be at least 1")
        if self.verify_refit_engines < 0:
            raise ArgumentValidationError(f"--verify-refit-engines {self.verify_refit_engines} must be >= 0 "
                                          "(0 checks every engine)")
        if self.temperature <= 0:
            raise ArgumentValidationError(f"--temperature {self.temperature} must be > 0 (the trainer's log-probs are "
                                          "log_softmax(logits / temperature))")
        if not 0 < self.top_p <= 1:
            raise ArgumentValidationError(f"--top-p {self.top_p} must be in (0, 1]")
        if self.group_size < 2:
            raise ArgumentValidationError(f"--group-size {self.group_size}: GRPO's advantages compare the responses "
                                          "to one prompt, so a group needs at least 2")

    def evaluates_at(self, step: int) -> bool:
        return step % self.eval_interval == 0 or step == self.grpo_steps

    def verifies_at(self, step: int) -> bool:
        return bool(self.verify_refit_interval) and step % self.verify_refit_interval == 0


class PhaseTimes:
    """Wall-clock seconds of a step's phases."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.time()
        yield
        self.seconds[name] = time.time() - start


class GRPORun:
    """One GRPO + AIS run (every rank builds one). `run()` is the whole loop; the run holds the phases, its state
    (`GRPOState`), the trainer's model, optimizer and bridge; the engines are the `RolloutFleet`'s. Global rank 0
    holds the bridge's staging arena and the logger."""

    arena_rank = 0  # the bridge's receiver (the staging arena every engine applies from) and the logger

    def __init__(self, config):
        self.config = config  # arguments.GRPORunConfig
        self.trainer, self.loop = config.trainer, config.loop

    def run(self) -> dict:
        """Set up or resume, train every remaining step, and return the summary."""
        self.setup()
        for step in range(self.state.step + 1, self.loop.grpo_steps + 1):
            times = PhaseTimes()
            with times.phase("rollout"):
                rollouts = self.rollout(step)
            with times.phase("train"):
                result = self.train(rollouts.batch)
            with times.phase("sync"):
                synced = self.sync(step, rollouts)
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
                                            self.build.shape.moe_topk) if self.routing_replay else None)
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
        """Global rank 0 receives syncs into the staging arena and verifies them once; every rank writes its
        shards; the fleet forwards each committed sync to the other nodes and every engine applies it
        (`sync_weights`)."""
        self.receiver = SyncReceiver(apply=lambda weights: weights) if dist.get_rank() == self.arena_rank else None
        self.bridge = WeightBridge(self.model.chunks, self.build, self.config.bridge, self.bridge_layout, self.receiver)

    def _start_or_resume(self) -> None:
        """A fresh run measures the KV-cache scales and evaluates the initial policy; a resumed one gives the engine
        what the bridge would have sent after the saved step, with the KV-cache scales the uninterrupted run measured
        then (on that step's rollouts, which the resumed run no longer has)."""
        state = self.state
        first_prompts = step_prompt_ids(self.tokenizer, self.task, self.loop.prompts_per_step, state.data_seed,
                                        state.step + 1)
        if state.saved is None:
            self.share_refit_reference()  # the engines hold the initial export
            self.calibrate_kv_cache(first_prompts)
            state.eval_before = self.fleet.evaluate()
            return
        self.log.info(f"resuming GRPO at step {state.step + 1} from {self.trainer.checkpoint.load} (iteration "
                      f"{self.model.loaded.iteration})")
        changed = changed_flags(state.saved.get("args", {}), self.trainer.flags)
        if changed:
            self.log.info("flags that differ from the saved run: " + ", ".join(changed))
        self.sync_weights(state.step)
        self.share_refit_reference()
        if self.config.engine.kv_cache_dtype != "fp8":
            state.kv_cache_scales = None
        elif state.kv_cache_scales is None:
            self.calibrate_kv_cache(first_prompts)
        else:
            self.fleet.set_kv_cache_scales(state.kv_cache_scales)

    def rollout(self, step: int) -> StepRollouts:
        """This step's rollouts: the rows this rank's DP rank trains on, with the batch-wide figures."""
        return self.fleet.submit(step).wait()

    def train(self, batch):
        """One GRPO update on the batch (λ once for the batch)."""
        return grpo_train_step(self.model.ddp_chunks, self.model.optimizer, batch, self.grpo, self.state.ais,
                               self.groups, self.reference)

    def sync(self, step: int, rollouts: StepRollouts) -> dict:
        """Bridge the updated policy into every engine, re-measure the FP8 KV-cache scales on this step's first
        rollouts (the first engine's), check the refit of every engine (or of this turn's few, --verify-refit-engines);
        return what the step logs of it."""
        self.sync_weights(step)
        reference = self.share_refit_reference()
        if self.config.engine.kv_cache_dtype == "fp8":
            first, count = rollouts.first_rows, self.config.kv_calibration.sequences
            self.calibrate_kv_cache(share(lambda: rollout_sequences(first.tokens, first.mask, count),
                                          src=rollouts.first_host))
        metrics = {f"rollout/engine{host}_weight_version": v for host, v in self.fleet.engine_versions.items()}
        if self.loop.verifies_at(step):
            metrics.update(self.fleet.verify_refit(
                self.model.ddp_chunks, self.probe, self.groups, self.build.shape.vocab_size, reference,
                self.loop.verify_refit_engines, step // self.loop.verify_refit_interval - 1, self.build.shape.is_moe))
        scales = self.state.kv_cache_scales
        if scales is not None:
            metrics.update({"rollout/kv_cache_k_scale_max": max(k for _, k, _ in scales.scales),
                            "rollout/kv_cache_v_scale_max": max(v for _, _, v in scales.scales)})
        return metrics

    def share_refit_reference(self):
        """The trainer's probe log-probs for the weights every engine now holds (collective), kept by the fleet: an
        engine restarted later serves again only once its own agree with them."""
        reference = RefitReference(
            self.probe, trainer_probe_reference(self.model.ddp_chunks, self.probe, self.groups,
                                                self.build.shape.vocab_size),
            refit_precision(self.config.engine, self.build.precision))
        self.fleet.set_refit_reference(reference)
        return reference

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
        metrics.update({"rollout/reward": float(rollouts.rewards.mean()),
                        "rollout/reward_failures": rollouts.reward_failures,
                        "rollout/reward_timeouts": rollouts.reward_timeouts, "time/rollout_s": seconds["rollout"],
                        "time/train_s": seconds["train"], "time/sync_s": seconds["sync"],
                        "rollout/tokens_per_s": rollouts.response_tokens / max(seconds["rollout"], 1e-9),
                        "rollout/engines": self.fleet.size,
                        **{f"rollout/engine{host}_tokens_per_s": rate
                           for host, rate in rollouts.engine_tokens_per_s.items()},
                        "rollout/received_bytes": rollouts.received_bytes,
                        "rollout/rank_bytes_fraction": rollouts.held_bytes / max(rollouts.batch_bytes, 1),
                        "rollout/truncated_fraction": rollouts.truncated / max(rollouts.sampled_rows, 1),
                        **rollouts.sampling})
        metrics.update(evaluated)
        self.state.step = step
        self.state.history.append({"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
        line = None
        if self.trainer.logging.prints(step, self.loop.grpo_steps):
            accuracy = f" acc {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""
            line = (f"{grpo_console_line(step, metrics)} | reward {metrics['rollout/reward']:.3f}{accuracy} | "
                    f"{metrics['rollout/tokens_per_s']:.0f} tok/s | rollout {seconds['rollout']:.1f}s train "
                    f"{seconds['train']:.1f}s sync {seconds['sync']:.1f}s")
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

    def sync_weights(self, sync_id: int) -> None:
        """Bridge the current policy into the arena, verified once, forward it to the other nodes' copies (each
        verified) and apply it to every engine (collective on every rank); a sync is complete when every engine
        has applied it."""
        stats = self.bridge.sync(sync_id)
        self.fleet.apply(stats.committed, sync_id)
        if self.bridge_layout.is_sender and self.bridge.completed == 1:
            self.log.info(f"bridge: {stats.tensors} tensors in {stats.buckets} buckets, {stats.bytes / 1e6:.1f} MB "
                          f"from this stage by {stats.transport}, {stats.seconds:.2f} s")

    def calibrate_kv_cache(self, sequences: list[list[int]]) -> None:
        """FP8 KV cache: measure the synced policy's K/V scales on `sequences` (split over DP ranks; collective on
        every rank) and install them in the engine."""
        if self.config.engine.kv_cache_dtype != "fp8":
            return
        calibration = self.config.kv_calibration
        self.state.kv_cache_scales = calibrate_kv_cache_scales(
            self.model.ddp_chunks, sequences[:calibration.sequences], self.build.seq_length,
            self.trainer.training.micro_batch_size, self.groups, self.build.shape.vocab_size,
            self.build.shape.num_layers, calibration.scale_margin)
        self.fleet.set_kv_cache_scales(self.state.kv_cache_scales)

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
