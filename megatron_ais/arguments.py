"""Megatron-style `--kebab-case` flags, grouped by concern, and the typed configs the entry points build from them
once, with the checks of flag combinations (pure: nothing here opens a file or starts a process).

Each flag is declared on the config field it fills (`flags.flag`), in the module that owns the concern; this module
only says which configs make up a run and under which --help heading they appear. The model's shape comes from
the Hugging Face `config.json` (or a `--load` checkpoint), which the run's setup reads and checks once.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Iterable

import torch

from megatron_ais import platform
from megatron_ais.ais import AISConfig
from megatron_ais.bridge.aligned_forward import AlignedForwardConfig
from megatron_ais.bridge.config import BridgeConfig
from megatron_ais.bridge.quantization import QUANTIZED_PRECISIONS, QuantizationPolicy
from megatron_ais.checkpointing.config import CheckpointConfig
from megatron_ais.data.tasks import TaskConfig
from megatron_ais.distributed import ranks_on_this_node
from megatron_ais.engine.config import EngineConfig
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagParser, add_flag_group, plain_flag_values
from megatron_ais.grpo.advantages import AdvantageConfig
from megatron_ais.grpo.loop_config import GRPOLoopConfig
from megatron_ais.grpo.loss import SEQUENCE_LOSSES, PolicyLossConfig
from megatron_ais.kv_calibration import KVCacheCalibrationConfig
from megatron_ais.logging import LoggingConfig
from megatron_ais.model import ModelConfig
from megatron_ais.parallel import ParallelLayout
from megatron_ais.rollout.dynamic_sampling import DynamicSamplingConfig
from megatron_ais.rollout.fleet import FleetConfig
from megatron_ais.rollout.fleet_layout import check_engine_gpus
from megatron_ais.rollout.overlong import OverlongConfig
from megatron_ais.rollout.placement import ClusterConfig
from megatron_ais.rollout.rewards import RewardConfig
from megatron_ais.sft import SFTConfig
from megatron_ais.training import TrainingConfig, WeightSource

# (--help heading, the configs whose flags it lists)
TRAINER_FLAGS = (("model", (ModelConfig,)), ("parallelism", (ParallelLayout,)), ("training", (TrainingConfig,)),
                 ("checkpointing", (CheckpointConfig,)), ("logging", (LoggingConfig,)), ("task", (TaskConfig,)))
# a GRPO run's training heading also lists QaRL's rollout-aligned forward
GRPO_TRAINER_FLAGS = tuple((title, (*configs, AlignedForwardConfig) if title == "training" else configs)
                           for title, configs in TRAINER_FLAGS)
GRPO_FLAGS = GRPO_TRAINER_FLAGS + (
    ("grpo", (PolicyLossConfig, AdvantageConfig, OverlongConfig, DynamicSamplingConfig)),
    ("importance-sampling correction", (AISConfig,)), ("rollout", (EngineConfig, KVCacheCalibrationConfig)),
    ("rollout fleet", (ClusterConfig, FleetConfig)), ("rewards", (RewardConfig,)),
    ("bridge", (BridgeConfig, QuantizationPolicy)), ("grpo loop", (GRPOLoopConfig,)))
SFT_FLAGS = TRAINER_FLAGS + (("sft", (SFTConfig,)),)


def build_parser(description: str, groups: Iterable[tuple[str, tuple]] = TRAINER_FLAGS, prog: str | None = None
                 ) -> argparse.ArgumentParser:
    """Return a parser with the flags of `groups` (`prog`: the script's name in messages)."""
    parser = FlagParser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for title, configs in groups:
        add_flag_group(parser, title, *configs)
    return parser


def launched_world_size(parser: argparse.ArgumentParser) -> int:
    """The world size torchrun gave this process; a script started without it is told how to start."""
    if "RANK" not in os.environ:
        parser.error(f"{parser.prog} runs one process per rank under torchrun: python -m torch.distributed.run "
                     f"--nproc-per-node N {parser.prog} [flags]")
    return int(os.environ.get("WORLD_SIZE", "1"))


def _configs(build):
    """Run `build`; a config's own ValueError is a flag error."""
    try:
        return build()
    except ArgumentValidationError:
        raise
    except ValueError as err:
        raise ArgumentValidationError(str(err)) from err


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What every trainer entry point runs with: the model, its parallel layout, training, checkpoints, logs and
    the task; `flags` are the plain flag values a checkpoint records."""

    model: ModelConfig
    layout: ParallelLayout
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    task: TaskConfig
    flags: dict[str, Any]

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int) -> "TrainerConfig":
        """The trainer's configs, checked against each other and the world size."""
        config = _configs(lambda: cls(ModelConfig.from_args(args), ParallelLayout.from_args(args),
                                      TrainingConfig.from_args(args), CheckpointConfig.from_args(args),
                                      LoggingConfig.from_args(args), TaskConfig.from_args(args),
                                      plain_flag_values(args)))
        config.layout.data_parallel(world_size)
        platform.check_cpu_path_variables()
        tp, seq_length = config.layout.tensor, config.model.seq_length
        if config.layout.sequence_parallel and seq_length % tp:
            raise ArgumentValidationError(f"--sequence-parallel splits sequences over TP: --seq-length {seq_length} "
                                          f"must be a multiple of --tensor-model-parallel-size {tp}")
        budget = config.training.max_tokens_per_microbatch
        if budget is not None and budget < seq_length:
            raise ArgumentValidationError(
                f"--max-tokens-per-microbatch {budget} is smaller than one sequence of --seq-length {seq_length}; "
                f"give it at least {seq_length} tokens (a few sequences' worth keeps the micro-batches few)")
        return config

    def data_parallel(self, world_size: int) -> int:
        return self.layout.data_parallel(world_size)

    @property
    def weights(self) -> WeightSource:
        """Where the policy's weights come from: --load, else --hf-dir."""
        return WeightSource(self.checkpoint.load, self.model.hf_dir,
                            allow_unverified=self.checkpoint.allow_unverified_checkpoint)


@dataclasses.dataclass(frozen=True)
class GRPORunConfig:
    """Everything pretrain_grpo_ais.py runs with, built once from its flags."""

    trainer: TrainerConfig
    loop: GRPOLoopConfig
    loss: PolicyLossConfig
    advantages: AdvantageConfig
    correction: AISConfig
    engine: EngineConfig
    kv_calibration: KVCacheCalibrationConfig
    bridge: BridgeConfig
    cluster: ClusterConfig
    rewards: RewardConfig
    fleet: FleetConfig
    overlong: OverlongConfig = OverlongConfig()
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    aligned: AlignedForwardConfig = AlignedForwardConfig()

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int) -> "GRPORunConfig":
        """The run's configs, checked before anything heavy starts: each on its own, then their combinations (the
        rollout batch's split into data-parallel shares, mini-batches and micro-batches, sampling against the
        correction, the engine's placement against the world)."""
        trainer = TrainerConfig.from_args(args, world_size)

        def build():
            engine = EngineConfig.from_args(args, seed=trainer.training.seed)
            bridge = BridgeConfig.from_args(args, precision=engine.precision)
            loop = GRPOLoopConfig.from_args(args)
            return cls(trainer, loop, PolicyLossConfig.from_args(args, max_response_tokens=loop.max_new_tokens),
                       AdvantageConfig.from_args(args), AISConfig.from_args(args),
                       dataclasses.replace(engine, quantization_exclude=bridge.policy.exclude,
                                           staging_arena_gpu_copies=loop.staging_slots if bridge.arena_on_gpu else 0),
                       KVCacheCalibrationConfig.from_args(args), bridge, ClusterConfig.from_args(args),
                       RewardConfig.from_args(args), FleetConfig.from_args(args), OverlongConfig.from_args(args),
                       DynamicSamplingConfig.from_args(args), AlignedForwardConfig.from_args(args))

        config = _configs(build)
        config.check(world_size)
        return config

    def check(self, world_size: int) -> None:
        """Refuse flag combinations that describe an impossible run, naming the flags."""
        loop, training = self.loop, self.trainer.training
        if self.correction.lambda_per_lag and not loop.max_off_policy_steps:
            raise ArgumentValidationError("--ais-lambda-per-lag needs --max-off-policy-steps 1 or more (at 0 every "
                                          "token has lag 0: one λ)")
        if self.correction.stale_lambda_floor and not loop.max_off_policy_steps:
            raise ArgumentValidationError("--ais-stale-lambda-floor needs --max-off-policy-steps 1 or more (at 0 no "
                                          "token is stale)")
        if loop.top_p < 1 and self.correction.correction != "none":
            raise ArgumentValidationError(
                f"--top-p {loop.top_p} with --is-correction {self.correction.correction}: the engine's log-probs are "
                "renormalised over the nucleus and the trainer's are not, so the importance ratios would measure the "
                "truncation; use --top-p 1 or --is-correction none")
        if self.trainer.layout.virtual_pipeline is not None:
            raise ArgumentValidationError(
                "--virtual-pipeline-model-parallel-size: megatron's interleaved schedule needs every pass's micro-batch "
                "count to be a multiple of --pipeline-model-parallel-size, and GRPO's are not (the refit probe is one, "
                "a token budget makes what fits); drop the flag")
        if loop.max_new_tokens >= self.trainer.model.seq_length:
            raise ArgumentValidationError(
                f"--max-new-tokens {loop.max_new_tokens} leaves no room for the prompt in --seq-length "
                f"{self.trainer.model.seq_length}; raise --seq-length or lower --max-new-tokens")
        self._check_grpo_options()
        # with a token budget micro-batches take what fits: --micro-batch-size does not apply
        check_rollout_batch(loop, 1 if training.max_tokens_per_microbatch else training.micro_batch_size,
                            self.trainer.data_parallel(world_size))
        self._check_fleet(world_size)

    def _check_grpo_options(self) -> None:
        """Refuse GRPO options that do not fit the run's other flags, naming them."""
        loop, correction = self.loop, self.correction
        if self.overlong.mode == "soft-penalty" and self.overlong.buffer_tokens >= loop.max_new_tokens:
            raise ArgumentValidationError(
                f"--overlong-buffer-tokens {self.overlong.buffer_tokens} must be below --max-new-tokens "
                f"{loop.max_new_tokens} (the penalty grows over the last tokens before the limit); lower it")
        if self.aligned.rollout_aligned_forward and self.bridge.policy.precision not in QUANTIZED_PRECISIONS:
            raise ArgumentValidationError(
                f"--rollout-aligned-forward with --rollout-precision {self.bridge.policy.precision}: the engine's "
                f"weights are the trainer's own, there is nothing to align to; use --rollout-precision "
                f"{' or '.join(QUANTIZED_PRECISIONS)}, or drop the flag")
        if self.loss.policy_loss in SEQUENCE_LOSSES and correction.correction != "none" and correction.level == "token":
            raise ArgumentValidationError(
                f"--policy-loss {self.loss.policy_loss} with --is-correction {correction.correction} at --is-level "
                "token: its ratio and clip are per sequence, so the mismatch correction must be too; add --is-level "
                "geometric (the same geometric mean as its ratio) or --is-level sequence, or use --is-correction none")

    def _check_fleet(self, world_size: int) -> None:
        """Refuse engines the run cannot drive or place, naming the flags."""
        loop, engines = self.loop, self.cluster.engines_per_node
        ranks_on_node = ranks_on_this_node(world_size)
        nodes = self.cluster.nodes if self.cluster.print_placement else max(1, world_size // ranks_on_node)
        if self.fleet.min_engines > engines * nodes:
            raise ArgumentValidationError(f"--rollout-min-engines {self.fleet.min_engines} exceeds the run's "
                                          f"{engines * nodes} engine(s) ({engines} per node, "
                                          f"--rollout-engines-per-node, on {nodes} node(s))")
        if self.engine.cpu_core is not None and (self.engine.placement == "colocated" or engines > 1):
            raise ArgumentValidationError(
                f"--rollout-cpu-core {self.engine.cpu_core} binds the one separate engine of a node; with "
                f"--rollout-placement {self.engine.placement} and --rollout-engines-per-node {engines} the engines "
                "are bound (or not) by the run: drop the flag")
        waited = 60 * self.trainer.layout.distributed_timeout_minutes
        for flag, seconds in (("--rollout-generation-timeout-s", self.fleet.generation_timeout_s),
                              ("--rollout-engine-call-timeout-s", self.engine.call_timeout_s)):
            if self.engine.placement == "separate" and seconds >= waited:
                raise ArgumentValidationError(
                    f"{flag} {seconds:g} is not below --distributed-timeout-minutes "
                    f"{self.trainer.layout.distributed_timeout_minutes} ({waited} s): the ranks waiting for the "
                    "engine would time out first, without saying why; lower the one or raise the other")
        if loop.max_off_policy_steps and self.engine.placement == "colocated":
            raise ArgumentValidationError(
                f"--max-off-policy-steps {loop.max_off_policy_steps} with --rollout-placement colocated: a colocated "
                "engine shares its trainer rank's process and device, so it cannot generate while the rank trains; "
                "use --rollout-placement separate or --max-off-policy-steps 0")
        if engines > 1 and not self.cluster.print_placement:
            if self.engine.placement == "colocated":
                raise ArgumentValidationError(
                    f"--rollout-engines-per-node {engines} with --rollout-placement colocated: colocated engines are "
                    "one inside every trainer rank; drop the flag or use --rollout-placement separate")
            if engines > ranks_on_node:
                raise ArgumentValidationError(
                    f"--rollout-engines-per-node {engines} exceeds the {ranks_on_node} trainer ranks of the node, one "
                    "of which drives each engine; lower it or start more ranks per node (--nproc-per-node)")
            if engines > loop.prompts_per_step:
                raise ArgumentValidationError(
                    f"--rollout-engines-per-node {engines} exceeds --prompts-per-step {loop.prompts_per_step}: every "
                    "engine serves at least one prompt group; lower it or raise --prompts-per-step")
        if self.engine.placement == "separate" and torch.cuda.is_available() and not self.cluster.print_placement:
            check_engine_gpus(engines, self.engine.tensor_parallel_size, ranks_on_node, torch.cuda.device_count())


def check_rollout_batch(loop: GRPOLoopConfig, micro_batch_size: int, dp: int) -> None:
    """A rollout batch must split into equal data-parallel shares, equal mini-batches and whole micro-batches."""
    sequences, num_minibatches = loop.prompts_per_step * loop.group_size, loop.num_minibatches
    if sequences % dp:
        raise ArgumentValidationError(
            f"a rollout batch of --prompts-per-step {loop.prompts_per_step} x --group-size {loop.group_size} = "
            f"{sequences} sequences does not split over {dp} data-parallel ranks; use a multiple of {dp}")
    per_rank = sequences // dp
    if per_rank % num_minibatches:
        raise ArgumentValidationError(
            f"{per_rank} sequences per data-parallel rank do not split into --num-minibatches {num_minibatches} "
            "equal mini-batches; change --num-minibatches or --prompts-per-step")
    if (per_rank // num_minibatches) % micro_batch_size:
        raise ArgumentValidationError(
            f"mini-batches of {per_rank // num_minibatches} sequences per data-parallel rank are not a multiple "
            f"of --micro-batch-size {micro_batch_size} (every micro-batch must be full: pipeline stages "
            "exchange fixed shapes); change --micro-batch-size or the batch flags")


@dataclasses.dataclass(frozen=True)
class SFTRunConfig:
    """Everything tools/train_sft.py runs with."""

    trainer: TrainerConfig
    sft: SFTConfig

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int) -> "SFTRunConfig":
        trainer = TrainerConfig.from_args(args, world_size)
        config = _configs(lambda: cls(trainer, SFTConfig.from_args(args)))
        gbs, mbs = config.sft.global_batch_size, trainer.training.micro_batch_size
        dp = trainer.data_parallel(world_size)
        if gbs is not None and gbs % (mbs * dp):
            raise ArgumentValidationError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size {dp}; "
                f"use a multiple of {mbs * dp}")
        check_interleaved_micro_batches(trainer, (gbs or mbs * dp) // (mbs * dp))
        return config


def check_interleaved_micro_batches(trainer: TrainerConfig, micro_batches: int) -> None:
    """With a virtual pipeline, megatron's interleaved schedule needs each step's micro-batches to be a multiple of
    the pipeline's stages (a token budget makes a varying number)."""
    layout = trainer.layout
    if layout.virtual_pipeline is None:
        return
    if trainer.training.max_tokens_per_microbatch is not None:
        raise ArgumentValidationError("--virtual-pipeline-model-parallel-size with --max-tokens-per-microbatch: the "
                                      "interleaved schedule needs a fixed micro-batch count; drop one of the two")
    if micro_batches % layout.pipeline:
        raise ArgumentValidationError(
            f"--virtual-pipeline-model-parallel-size: a step's {micro_batches} micro-batch(es) (--global-batch-size "
            f"over --micro-batch-size x data-parallel size) must be a multiple of --pipeline-model-parallel-size "
            f"{layout.pipeline} for megatron's interleaved schedule; raise --global-batch-size")
