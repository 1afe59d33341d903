"""The trainer's side of every weight sync: the bridge that writes the policy's shards into the staging arena (its
receiver on the arena rank), the trainer's probe log-probs each engine's refit is checked against, the FP8 KV-cache
scales measured for the weights, and the one sync staged but not yet applied (with --max-off-policy-steps a step's
weights are staged while the engines generate, and applied once the batches submitted before them are in)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch.distributed as dist

from megatron_ais.bridge.layout import BridgeLayout
from megatron_ais.bridge.receiver import SyncReceiver
from megatron_ais.bridge.sync import SyncStats, WeightBridge
from megatron_ais.distributed import gather_on
from megatron_ais.kv_calibration import calibrate_kv_cache_scales
from megatron_ais.refit_probe import probe_tokens, trainer_probe_reference
from megatron_ais.rollout.verify import RefitReference, refit_precision

ARENA_RANK = 0  # the global rank of the bridge's receiver: the staging arena every engine applies from


@dataclasses.dataclass(frozen=True)
class StagedSync:
    """A step's weights written and verified in the bridge's staging arena, not yet applied by the engines: the
    receiver's verified arena (`bridge.arena.ArenaWeights`), the trainer's probe log-probs of those weights and
    their FP8 KV-cache scales (None without an FP8 KV cache)."""

    step: int
    weights: object
    reference: RefitReference
    kv_cache_scales: object = None
    shipped_bytes: int | None = None  # with --bridge-delta on, on rank 0: what every stage shipped to the arena


class WeightSync:
    """Syncs of one trainer's weights to the run's fleet (collective methods: every rank calls them in the same
    order). The run's state (`GRPOState`) keeps the KV-cache scales, which checkpoints save."""

    def __init__(self, config, model, build, groups, layout: BridgeLayout, fleet, state, log):
        self.config, self.loop = config, config.loop  # arguments.GRPORunConfig
        self.model, self.build, self.groups, self.layout = model, build, groups, layout
        self.fleet, self.state, self.log = fleet, state, log
        self.receiver = SyncReceiver(slots=self.loop.staging_slots,
                                     ipc_consumers=fleet.processes_mapping(ARENA_RANK, config.engine)
                                     ) if dist.get_rank() == ARENA_RANK else None
        self.bridge = WeightBridge(model.chunks, build, config.bridge, layout, self.receiver)
        self.probe = probe_tokens(build.shape.vocab_size)
        self.staged: StagedSync | None = None

    @property
    def fp8_kv_cache(self) -> bool:
        return self.config.engine.kv_cache_dtype == "fp8"

    def start(self, sequences: list[list[int]]) -> None:
        """A fresh run: the engines hold the initial export, whose refit reference and KV-cache scales (measured on
        `sequences`, the first step's prompts) they get."""
        reference = self.hold(self.refit_reference())
        if self.fp8_kv_cache:  # the scales change what the engines compute, and a MoE engine's routes
            self.calibrate_kv_cache(sequences)
            self.hold(reference)

    def resume(self, step: int, sequences: list[list[int]]) -> None:
        """A resumed run: the engines get what the bridge would have sent after step `step`, with the KV-cache scales
        the uninterrupted run measured then (on that step's rollouts, which the resumed run no longer has; a
        checkpoint without them: measured on `sequences`)."""
        reference = self.refit_reference()
        self.fleet.apply(self.write(step).committed, step, reference)
        if not self.fp8_kv_cache:
            self.state.kv_cache_scales = None
        elif self.state.kv_cache_scales is None:
            self.calibrate_kv_cache(sequences)
        else:
            self.fleet.set_kv_cache_scales(self.state.kv_cache_scales)
        reference = self.hold(reference)
        if self.fleet.restarted_unchecked():
            self.verify_refit(reference, 0, 0)

    def stage(self, step: int, calibration_sequences: Callable[[int], list[list[int]]]) -> None:
        """Write the weights step `step` trained into the staging arena, verified once, before any engine holds them
        (the engines may be generating): with their probe log-probs and, with an FP8 KV cache, their K/V scales
        measured on `calibration_sequences(count)` (collective)."""
        reference = self.refit_reference()
        if self.fp8_kv_cache:
            self.measure_kv_cache(calibration_sequences(self.config.kv_calibration.sequences))
        stats = self.write(step)
        shipped = None
        if self.config.bridge.delta == "on":  # what the delta saves, logged with the apply: the stages' senders'
            gathered = gather_on(stats.shipped_bytes, dst=0)
            shipped = sum(gathered) if gathered is not None else None
        self.staged = StagedSync(step, stats.committed, reference, self.state.kv_cache_scales, shipped)

    def apply_staged(self) -> dict:
        """Every engine applies the staged weights and their KV-cache scales, then the refit of every engine (or of
        this turn's few, --verify-refit-engines) is checked; return what the step logs of it. Each host's generation
        in the background, if any, ends or steps aside first (`RolloutFleet.generation_paused`)."""
        staged, self.staged = self.staged, None
        step, scales = staged.step, staged.kv_cache_scales
        with self.fleet.generation_paused():
            self.fleet.apply(staged.weights, step, staged.reference)
            if self.fp8_kv_cache:
                self.fleet.set_kv_cache_scales(scales)
            reference = self.hold(staged.reference)
            unchecked = self.fleet.restarted_unchecked()
            metrics = {f"rollout/engine{host}_weight_version": v for host, v in self.fleet.engine_versions.items()}
            if unchecked or self.loop.verifies_at(step):  # an engine restarted unchecked: every engine is checked
                metrics.update(self.verify_refit(reference, 0 if unchecked else self.loop.verify_refit_engines,
                                                 step // self.loop.verify_refit_interval - 1))
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
            refit_precision(self.config.engine, self.build.precision), awaits_replay=self.build.shape.is_moe)

    def verify_refit(self, reference: RefitReference, engines: int, turn: int) -> dict:
        """The refit check of `engines` serving engines (0: every one), the `turn`-th run of them (collective)."""
        return self.fleet.verify_refit(self.model.ddp_chunks, self.probe, self.groups, self.build.shape.vocab_size,
                                       reference, engines, turn, self.build.shape.is_moe)

    def hold(self, reference: RefitReference) -> RefitReference:
        """What the engines' refit is checked against until the next sync (`RolloutFleet.hold_refit_reference`: a
        MoE model's replays the engines' probe routes); collective, once they hold the weights of `reference`."""
        return self.fleet.hold_refit_reference(self.model.ddp_chunks, self.probe, self.groups,
                                               self.build.shape.vocab_size, reference, self.build.shape.is_moe)

    def write(self, sync_id: int) -> SyncStats:
        """Bridge the current policy into the staging arena, verified once (collective on every rank); return the
        sync's stats, whose `committed` is the verified arena, which `RolloutFleet.apply` forwards to the other nodes'
        copies (each verified) and every engine applies."""
        stats = self.bridge.sync(sync_id)
        if self.layout.is_sender and self.bridge.completed == 1:
            self.log.info(f"bridge: {stats.tensors} tensors in {stats.buckets} buckets, {stats.bytes / 1e6:.1f} MB "
                          f"from this stage by {stats.transport}, {stats.seconds:.2f} s")
        return stats

    def calibrate_kv_cache(self, sequences: list[list[int]]) -> None:
        """FP8 KV cache: measure the policy's K/V scales on `sequences` and install them in the engines."""
        if not self.fp8_kv_cache:
            return
        self.measure_kv_cache(sequences)
        self.fleet.set_kv_cache_scales(self.state.kv_cache_scales)

    def measure_kv_cache(self, sequences: list[list[int]]) -> None:
        """The trainer's policy's FP8 KV-cache K/V scales on `sequences` (split over DP ranks; collective on every
        rank), kept in the run's state."""
        calibration = self.config.kv_calibration
        self.state.kv_cache_scales = calibrate_kv_cache_scales(
            self.model.ddp_chunks, sequences[:calibration.sequences], self.build.seq_length,
            self.config.trainer.training.micro_batch_size, self.groups, self.build.shape.vocab_size,
            self.build.shape.num_layers, calibration.scale_margin)

    def close(self) -> None:
        self.bridge.close()
        if self.receiver is not None:
            self.receiver.close()
