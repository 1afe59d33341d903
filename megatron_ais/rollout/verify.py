"""Refit verification: after a sync, the engine scores a fixed probe sequence and its log-probs must agree with
the trainer's on the same weights, within a tolerance per engine precision.

Tolerances were calibrated on the tiny models (docs/rollout.md): fp32 engine vs fp32 trainer max |Δ| 1.7e-5;
bf16 engine mean |Δ| 0.015-0.02 on a random model, 0.073 after 150 SFT steps on digit sort (a trained model is
confident, and the random-token probe then has log-probs far in the tail, where bf16 rounding is largest), so
its bound is 0.25. The FP8 engine is compared with the BF16 trainer, so its check includes the
quantization mismatch itself: 0.05 on a random model, 0.12 after 300 SFT steps on the random-token probe; its
bound (0.5) catches wrong or badly stale weights (mean |Δ| of order 1), not small staleness. An FP8 KV cache
adds rounding of the same order (mean |Δ| 0.24 on the random tiny Qwen3 with an fp32 engine), so engines with
one are held to the fp8 row whatever their weights' precision (`refit_precision`). With W8A8 emulation
(`--rollout-fp8-activations emulate`) the activations are rounded to e4m3 too: on the running-sum SFT model with an
FP8 KV cache the probe's mean |Δ| was 0.54 with every decoder layer within 7-14 % (relative) of the trainer's, so
that engine has its own row (1.0): still below what wrong weights give (a stale lm_head 1.9, unpacked experts 8).
The 4-bit rows (1.5): an MXFP4 engine with an FP8 KV cache on the MoE model after 400 SFT and some GRPO steps gave
1.02-1.13 with replayed routes and every decoder layer within 0.6 (relative) of the trainer's, false alarms at 1.0.
The low-precision rows are checked on a trimmed mean, the tenth of probe positions with the largest |Δ| left out:
on a confident model a few random probe tokens sit far in the tail, where FP8 rounding moves a log-prob by
several nats (the W8A8 study's running-sum model, after some GRPO steps: mean 1.07 with one position at 7.1, a false
alarm that stopped the run), while wrong or stale weights move most positions.
MoE models: an engine whose rounding flips a near-tie route sends that token through other experts, which moves its
log-prob by far more than the rounding itself (a BF16 engine on the MoE model after 300 SFT steps: trimmed mean 0.35
against the trainer's own routing), so the trainer's reference replays the probe routes of the fleet's first engine at every
sync (`replayed_reference`): the check compares weights, and `rollout/routing_mismatch` reports the flips.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais.distributed import gather_on, share
from megatron_ais.errors import RefitVerificationError
from megatron_ais.refit_probe import trainer_layer_states, trainer_probe_reference, trainer_routing
from megatron_ais.rollout.fleet_layout import engine_name, from_every_engine

# (statistic, bound): fp32 is checked on the max, the low-precision engines on the trimmed mean
TOLERANCES = {"fp32": ("max", 1e-4), "bf16": ("trimmed mean", 0.25), "fp8": ("trimmed mean", 0.5),
              "fp8-w8a8": ("trimmed mean", 1.0), "nvfp4": ("trimmed mean", 1.5), "mxfp4": ("trimmed mean", 1.5)}
TRIMMED_FRACTION = 0.1  # of the probe positions, the largest |Δ|, left out of the trimmed mean


@dataclasses.dataclass(frozen=True)
class RefitReport:
    mean_abs_diff: float
    max_abs_diff: float
    worst_position: int
    passed: bool


def verify_refit(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, precision: str,
                 raise_on_failure: bool = True) -> RefitReport:
    """Compare the engine's and the trainer's probe log-probs; raise RefitVerificationError when out of tolerance."""
    diff = (engine_logprobs.double() - trainer_logprobs.double()).abs()
    if not bool(torch.isfinite(diff).all()):
        raise RefitVerificationError("refit verification: non-finite log-probs on the probe sequence")
    statistic, bound = TOLERANCES[precision]
    kept = diff.numel() - int(TRIMMED_FRACTION * diff.numel())
    value = diff.sort().values[:kept].mean().item() if statistic == "trimmed mean" else diff.max().item()
    report = RefitReport(diff.mean().item(), diff.max().item(), int(diff.argmax()), value <= bound)
    if not report.passed and raise_on_failure:
        raise RefitVerificationError(
            f"refit verification failed for the {precision} engine: {statistic} |engine - trainer| log-prob "
            f"{value:.3e} > {bound:.3g} (worst at probe position {report.worst_position}, |Δ| "
            f"{report.max_abs_diff:.3e}); the engine's weights are stale or corrupt")
    return report


@dataclasses.dataclass(frozen=True)
class RefitReference:
    """The trainer's probe log-probs for the weights the engines hold now: what a restarted engine's must match
    before it serves again (`RolloutManager`)."""

    probe: list[int]
    trainer_logprobs: torch.Tensor
    precision: str  # the tolerance row (`refit_precision`)
    # a MoE model's, before `replayed_reference` replays the engines' probe routes: the trainer's own routing, which
    # a healthy engine's rounding flips on near-tie routes, so an engine restarted meanwhile is checked later
    awaits_replay: bool = False

    def check(self, engine) -> tuple[str | None, torch.Tensor]:
        """`engine`'s probe log-probs, and why it fails the refit check against this reference (None: it passes)."""
        logprobs = engine.prompt_logprobs(self.probe)
        try:
            verify_refit(logprobs, self.trainer_logprobs, self.precision)
        except RefitVerificationError as err:
            return str(err), logprobs
        return None, logprobs

    def failure(self, engine) -> str | None:
        """Why `engine` fails the refit check against this reference, or None when it passes."""
        return self.check(engine)[0]

    def check_unless_dead(self, engine) -> tuple[str | None, torch.Tensor] | None:
        """`check`, or None when the engine died meanwhile: it is restarted at its next use, and a restarted engine
        serves only once it passes this same check (`RolloutManager`)."""
        try:
            return self.check(engine)
        except Exception:
            if engine.health_check():
                raise
            return None


# relative error of a layer's output beyond which the engine is said to have left the trainer at that layer;
# measured on the default run's trained model against the BF16 trainer (random-token probe), layers 0-3:
# bf16 engine 0.006-0.018, fp8 engine 0.029-0.075; fp32 engine vs fp32 trainer 6e-7
LAYER_TOLERANCES = {"fp32": 1e-3, "bf16": 0.1, "fp8": 0.3, "fp8-w8a8": 0.3, "nvfp4": 0.6, "mxfp4": 0.6}


def layer_errors(engine_states: list[torch.Tensor], trainer_states: list[torch.Tensor]) -> list[float]:
    """Return, per decoder layer, ||engine - trainer|| / ||trainer|| of its output over the common positions."""
    errors = []
    for engine, trainer in zip(engine_states, trainer_states):
        n = min(engine.shape[0], trainer.shape[0])
        reference = trainer[:n].double()
        errors.append(((engine[:n].double() - reference).norm() / reference.norm().clamp(min=1e-30)).item())
    return errors


def layer_diagnosis(errors: list[float], precision: str) -> str:
    """Name the first layer whose output leaves the trainer's by more than the precision's tolerance."""
    bound = LAYER_TOLERANCES[precision]
    listing = ", ".join(f"{i}: {e:.1e}" for i, e in enumerate(errors))
    first = next((i for i, e in enumerate(errors) if e > bound), None)
    if first is None:
        return (f"; every decoder layer's output agrees within {bound:g} (relative: {listing}), so the final norm "
                "or lm_head differs (a stale pre-packed lm_head?)")
    return (f"; first mismatching layer: model.layers.{first} (relative error of its output {errors[first]:.2e} > "
            f"{bound:g}; per layer: {listing})")


def routing_mismatch(engine_ids: list[torch.Tensor], trainer_maps: list[torch.Tensor]) -> float:
    """Fraction of (token, MoE layer) pairs whose top-k expert set differs between engine and trainer, over the
    positions both routed."""
    differing = total = 0
    for ids, routing_map in zip(engine_ids, trainer_maps):
        tokens = min(ids.shape[0], routing_map.shape[0])
        engine_map = torch.zeros(tokens, routing_map.shape[1], dtype=torch.bool)
        engine_map.scatter_(1, ids[:tokens].long(), True)
        differing += int((engine_map != routing_map[:tokens]).any(dim=1).sum())
        total += tokens
    return differing / max(total, 1)


def refit_precision(engine, trainer_precision: str) -> str:
    """Which tolerance row of the refit check applies to an engine (its EngineConfig) against a trainer of
    `trainer_precision`: the widest of what it rounds — its weights' row (an fp32 engine against a BF16 trainer: the
    BF16 row, the trainer's own rounding), an FP8 KV cache's (it rounds K and V as FP8 weights round the linear
    layers: the FP8 row, which a 4-bit engine's wider row keeps), W8A8 emulation's."""
    rows = ["bf16" if engine.precision == "fp32" and trainer_precision == "bf16" else engine.precision]
    if engine.kv_cache_dtype == "fp8":
        rows.append("fp8")
    if engine.fp8_activations == "emulate":
        rows.append("fp8-w8a8")
    return max(rows, key=lambda row: TOLERANCES[row][1])


def _merged(parts: list[dict]) -> list:
    """Per-rank {global layer index: value} dicts, merged and ordered by layer."""
    merged = {i: value for part in parts for i, value in part.items()}
    return [merged[i] for i in sorted(merged)]


def _probe_routes_unless_dead(engine, probe: list[int]) -> torch.Tensor | None:
    try:
        return torch.stack(engine.probe_routing(probe), dim=1)
    except Exception:
        if engine.health_check():
            raise
        return None


def replayed_reference(engine, ddp_chunks: list, probe: list[int], groups, vocab_size: int,
                       reference: RefitReference, fleet) -> RefitReference:
    """A MoE model's refit reference: the trainer's probe log-probs with its routers replaying the probe routes of
    `fleet`'s first engine (its host's `engine`; collective on every rank), so that the check compares weights, not
    near-tie routes the engine's rounding flipped. `reference` itself when that engine died meanwhile."""
    host = fleet.hosts[0]
    routes = share(lambda: _probe_routes_unless_dead(engine, probe), src=host)
    if routes is None:
        return reference
    return dataclasses.replace(reference, trainer_logprobs=trainer_probe_reference(ddp_chunks, probe, groups,
                                                                                   vocab_size, routes),
                               awaits_replay=False)


def verify_refit_on_all_ranks(engine, ddp_chunks: list, probe: list[int], groups, vocab_size: int, precision: str,
                              fleet, moe: bool = False, trainer: torch.Tensor | None = None) -> dict[str, float]:
    """Collective refit check of the engines of `fleet` (`rollout.fleet_layout.FleetLayout`: every serving engine, or
    the turn's few of them, `FleetLayout.rotating`): every stage scores the
    probe (the last stage's log-probs go to the first), each engine's host (`engine` there, None elsewhere) compares
    them with its engine's. A failed check names the engine, its host and the first decoder layer whose output
    differs, and raises on every rank; an engine that died meanwhile is left out (its restart, at its next use, runs
    the same check). Return (on every rank) how far the engines' probe log-probs are apart
    (`rollout/engine_probe_spread`: 0 when every engine holds the same weights), and for MoE models (on the first
    engine's host) the fraction of probe (token, layer) pairs whose top-k experts differ between its engine and the
    trainer (`rollout/routing_mismatch`). `trainer`: the trainer's probe log-probs when already computed
    (`trainer_probe_reference`)."""
    if trainer is None:
        trainer = trainer_probe_reference(ddp_chunks, probe, groups, vocab_size)
    reference = RefitReference(probe, trainer, precision)
    checked = {host: result for host, result in zip(fleet.hosts, from_every_engine(
        lambda: reference.check_unless_dead(engine), fleet)) if result is not None}
    failed = next((host for host, (error, _) in checked.items() if error is not None), None)
    if failed is not None:  # where does the engine's forward leave the trainer's? that engine's host compares
        parts = gather_on(trainer_layer_states(ddp_chunks, probe, groups, vocab_size), dst=failed)
        error = share(lambda: f"{engine_name(failed)}: {checked[failed][0]}"
                      + layer_diagnosis(layer_errors(engine.probe_layer_states(probe), _merged(parts)), precision),
                      src=failed)
        raise RefitVerificationError(error + "; stopping")
    if not checked:
        return {}
    first = next(iter(checked.values()))[1]
    metrics = {"rollout/engine_probe_spread": max(float((lp - first).abs().max()) for _, lp in checked.values())}
    if not moe or fleet.hosts[0] not in checked:
        return metrics
    parts = gather_on(trainer_routing(ddp_chunks, probe, groups, vocab_size), dst=fleet.hosts[0])
    if fleet.rank == fleet.hosts[0]:
        metrics["rollout/routing_mismatch"] = routing_mismatch(engine.probe_routing(probe), _merged(parts))
    return metrics
