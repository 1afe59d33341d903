"""One GRPO optimizer phase for a rollout batch: old log-probs, mismatch correction (λ once per batch), PPO-clip
updates over mini-batches and epochs through megatron's pipeline schedule."""
from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from megatron_ais import platform
from megatron_ais.ais import (AISConfig, AISResult, AISState, ais_coefficient, apply_correction,
                              exclude_invalid_sequences, max_abs_logratio, mismatch_statistics, reduce_statistics)
from megatron_ais.ais.coefficient import EMPTY_RESULT, lag_metrics, lags_of_units, lambda_of_tokens, \
    results_per_lag
from megatron_ais.batch import RolloutBatch, data_parallel_rows, row_lengths
from megatron_ais.distributed import from_last_stage
from megatron_ais.errors import NonFiniteInputError, RoutingReplayError
from megatron_ais.forward import (MicroBatchPlan, ParallelGroups, fixed_plan, micro_batches, score_rows,
                                  token_budget_plan, vocab_parallel_logprobs)
from megatron_ais.grpo.advantages import AdvantageConfig, with_advantages
from megatron_ais.grpo.loss import PolicyLossConfig, aggregate, global_normalizer, megatron_loss_scale, token_losses
from megatron_ais.routing_replay import check_routed_experts, forward_replaying
from megatron_ais.training import train_step


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Everything a GRPO phase needs besides the model: loss, correction, batching and advantage options."""

    loss: PolicyLossConfig
    correction: AISConfig
    vocab_size: int
    micro_batch_size: int = 2
    num_minibatches: int = 1
    ppo_epochs: int = 1
    advantages: AdvantageConfig = AdvantageConfig()
    # the rollout's sampling temperature: trainer log-probs are those of the same tempered distribution
    temperature: float = 1.0
    max_tokens_per_microbatch: int | None = None  # token-budget micro-batches (forward.py); None: fixed
    sequence_multiple: int = 1  # micro-batch lengths are multiples of this (TP under sequence parallelism)
    moe_routing: tuple[int, int, int] | None = None  # (MoE layers, experts, top-k): what replayed routes must fit
    max_lag: int = 0  # --max-off-policy-steps: > 0 logs the mismatch per policy-version lag 0 .. max_lag

    @classmethod
    def for_run(cls, config, shape, routing_replay: bool) -> "GRPOConfig":
        """The phases' options of a run (`config`: an arguments.GRPORunConfig) on a model of this shape."""
        trainer, loop = config.trainer, config.loop
        return cls(loss=config.loss, correction=config.correction, vocab_size=shape.vocab_size,
                   micro_batch_size=trainer.training.micro_batch_size, num_minibatches=loop.num_minibatches,
                   ppo_epochs=loop.ppo_epochs, advantages=config.advantages, temperature=loop.temperature,
                   max_tokens_per_microbatch=trainer.training.max_tokens_per_microbatch,
                   sequence_multiple=trainer.layout.tensor if trainer.layout.sequence_parallel else 1,
                   moe_routing=(shape.num_layers, shape.num_experts, shape.moe_topk) if routing_replay else None,
                   max_lag=loop.max_off_policy_steps)

    def plan(self, lengths: list[int], seq_length: int) -> MicroBatchPlan:
        """The micro-batches of rows of these lengths."""
        if self.max_tokens_per_microbatch is None:
            return fixed_plan(len(lengths), self.micro_batch_size, seq_length)
        return token_budget_plan(lengths, self.max_tokens_per_microbatch, self.sequence_multiple)


@dataclasses.dataclass
class GRPOStepResult:
    """What one rollout batch's update reports (λ and metrics are identical on every rank that logs)."""

    skipped: bool
    ais: AISResult
    metrics: dict


def _policy_forward_step(config: GRPOConfig, groups: ParallelGroups, normalizer: float, scale: float,
                         data_iterator, model):
    mb = next(data_iterator)
    output = forward_replaying(model, mb)

    def loss_func(logits):
        logprobs, entropy = vocab_parallel_logprobs(logits / config.temperature, mb["labels"],
                                                    groups.tensor_parallel_group,
                                                    config.vocab_size, with_entropy=config.loss.entropy_coef > 0)
        per_token, parts = token_losses(logprobs, mb["old_logprobs"], mb["advantages"], mb["coefficient"],
                                        config.loss, ref_logprobs=mb.get("ref_logprobs"), entropy=entropy,
                                        mask=mb["keep"])
        loss = aggregate(per_token, mb["keep"], config.loss.loss_agg, normalizer)
        keep = mb["keep"]
        kl = (parts["kl"] * keep).sum().double() if "kl" in parts else \
            torch.zeros((), dtype=torch.float64, device=keep.device)
        report = torch.stack([loss.detach().double(), (parts["clipped"] * keep).sum().double(), keep.sum().double(),
                              kl])
        return loss * scale, {"report": report}

    return output, loss_func


def rows_of_whole_batch(batch: RolloutBatch, config: GRPOConfig, groups: ParallelGroups) -> RolloutBatch:
    """This DP rank's rows of a batch every rank holds whole, with the batch's group advantages: for benchmarks and
    tests (in a run each engine's host computes the advantages of its whole groups and sends each rank its rows)."""
    rows = data_parallel_rows(row_lengths(batch.mask), groups.data_parallel_size,
                              config.max_tokens_per_microbatch is not None)[groups.data_parallel_rank]
    return with_advantages(batch, config.advantages).rows(rows)


def _local_rows(batch: RolloutBatch, groups: ParallelGroups
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict, torch.Tensor | None]:
    """This DP rank's rows; return (rows, response mask without the sequences excluded for NaN/Inf rollout
    log-probs, rollout log-probs with zeros off the mask, guard metrics, each token's policy version or None)."""
    mask, excluded = exclude_invalid_sequences(batch.rollout_logprobs, batch.mask.float())
    advantages = batch.advantages.unsqueeze(-1).expand_as(mask)
    bad_advantages = int((~torch.isfinite(advantages) & (mask > 0)).any(dim=-1).sum())
    counts = torch.tensor([float(excluded), float(mask.sum()), float(bad_advantages)], dtype=torch.float64)
    dist.all_reduce(counts, group=groups.data_parallel_group)
    if counts[2]:  # every rank of the DP group (and each pipeline stage holds the same rows) refuses the batch
        raise NonFiniteInputError(f"the batch's advantages are NaN/Inf on {int(counts[2])} sequences with valid "
                                  "tokens; refusing to train on them")
    metrics = {"guard/excluded_sequences": counts[0].item(), "guard/valid_tokens": counts[1].item()}
    rollout_lp = torch.where(mask > 0, batch.rollout_logprobs, torch.zeros(()))
    lengths = torch.tensor(row_lengths(batch.mask), device=mask.device)
    local = {"tokens": batch.tokens, "labels": batch.labels,
             "advantages": torch.where(mask > 0, advantages, torch.zeros(())),  # NaN x 0 is NaN
             "real_positions": torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]}
    if batch.routed_experts is not None:
        local["routed_experts"] = batch.routed_experts
    return local, mask, rollout_lp, metrics, batch.policy_versions


def _plan(rows: dict[str, torch.Tensor], lengths: list[int], config: GRPOConfig,
          groups: ParallelGroups) -> MicroBatchPlan:
    """The micro-batches of some of a rank's rows. With a token budget every DP rank runs as many as the one that
    needs most (token-less placeholders fill in): MoE layers exchange tokens across data-parallel ranks in every
    micro-batch."""
    plan = config.plan(lengths, rows["tokens"].shape[1])
    if config.max_tokens_per_microbatch is not None and groups.data_parallel_size > 1:
        count = torch.tensor([len(plan)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=groups.data_parallel_group)
        plan = plan.with_placeholders(int(count), config.sequence_multiple)
    return plan


def _correct(ddp_chunks: list, local: dict, mask: torch.Tensor, rollout_lp: torch.Tensor, config: GRPOConfig,
             state: AISState, groups: ParallelGroups, metrics: dict, plan: MicroBatchPlan,
             lags: torch.Tensor | None = None,
             forward_weights: Callable[[], ContextManager] = contextlib.nullcontext) -> AISResult:
    """Score the rows with the policy before the update (old log-probs) and compute the correction once for the
    batch (λ from all-reduced statistics); fill in the rows' old log-probs, coefficients and keep mask. `lags`:
    each token's policy-version lag, whose diagnostics are logged lag by lag; `forward_weights()`: the context the
    policy's forward runs in."""
    with forward_weights():
        old_logprobs = score_rows(ddp_chunks, local, plan, groups, config.vocab_size, config.temperature)
    result, coefficient, keep = EMPTY_RESULT, torch.ones_like(mask), mask
    _refuse_corrupt_logprobs(old_logprobs, mask, groups)
    if groups.is_last_stage:
        stats = reduce_statistics(mismatch_statistics(old_logprobs, rollout_lp, local["advantages"], mask,
                                                      config.correction), groups.data_parallel_group)
        result = ais_coefficient(stats, config.correction, state)
        metrics["ais/max_abs_logratio"] = max_abs_logratio(old_logprobs, rollout_lp, mask, config.correction,
                                                           groups.data_parallel_group)
        if lags is not None:
            result = _per_lag(old_logprobs, rollout_lp, local["advantages"], mask, lags, config, state, groups,
                              metrics, result)
        correction = apply_correction(old_logprobs, rollout_lp, mask, config.correction, result)
        coefficient, keep = correction.coefficient, correction.keep
        metrics["guard/rejected_fraction"] = 1.0 - global_normalizer(keep, "token-mean", groups.data_parallel_group) \
            / metrics["guard/valid_tokens"]
        local["old_logprobs"] = old_logprobs
    else:
        local["old_logprobs"] = torch.zeros_like(mask)
    local.update(coefficient=coefficient, keep=keep)
    return result


def _refuse_corrupt_logprobs(old_logprobs: torch.Tensor | None, mask: torch.Tensor, groups: ParallelGroups) -> None:
    """Raise on every rank of the step when the trainer's log-probs (on the last stage, each DP rank its own) are
    non-finite on a valid token: a rank that raised alone would leave the others waiting in the next collective."""
    bad = torch.tensor([0.0 if old_logprobs is None else float((~torch.isfinite(old_logprobs) & (mask > 0)).sum())])
    if groups.is_last_stage:
        dist.all_reduce(bad, group=groups.data_parallel_group)
    bad = from_last_stage(bad, groups.pipeline_group)
    if bad.item():
        raise FloatingPointError(f"trainer log-probs are NaN/Inf on {int(bad.item())} valid tokens of the batch; "
                                 "the model weights or activations are corrupt, refusing to train")


def _per_lag(old_logprobs: torch.Tensor, rollout_lp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             lags: torch.Tensor, config: GRPOConfig, state: AISState, groups: ParallelGroups, metrics: dict,
             result: AISResult) -> AISResult:
    """Log the mismatch of each policy-version lag's tokens alone (DP-global; at a sequence level, each sequence's
    tokens at its largest lag: `lags_of_units`); with --ais-lambda-per-lag each lag's λ from them (and its own
    state) becomes its tokens' λ in `result`, and with --ais-stale-lambda-floor stale tokens' λ is at least the
    floor."""
    correction = config.correction
    lags = lags_of_units(lags, mask, correction)
    results, largest = results_per_lag(old_logprobs, rollout_lp, advantages, mask, lags, config.max_lag, correction,
                                       groups.data_parallel_group, state if correction.lambda_per_lag else None)
    metrics.update(lag_metrics(results, largest, with_lambda=correction.lambda_per_lag))
    if results:  # over the batch's response tokens (units), DP-global
        units = sum(result.num_units for result in results.values())
        metrics.update({"rollout/token_lag_mean": sum(lag * r.num_units for lag, r in results.items()) / units,
                        "rollout/token_lag_max": max(results)})
    return dataclasses.replace(result, token_lambda=lambda_of_tokens(result, results, lags, correction))


def _update(ddp_chunks: list, optimizer, local: dict, lengths: list[int], config: GRPOConfig,
            groups: ParallelGroups, forward_weights: Callable[[], ContextManager]) -> tuple[list, list]:
    """PPO-clip updates over --ppo-epochs passes of --num-minibatches mini-batches; return the micro-batches'
    loss reports and the grad norms."""
    reports, grad_norms = [], []
    per_rank = local["tokens"].shape[0]
    minibatch = per_rank // config.num_minibatches
    for _ in range(config.ppo_epochs):
        for start in range(0, per_rank, minibatch):
            part = {k: v[start:start + minibatch] for k, v in local.items()}
            normalizer = global_normalizer(part["keep"], config.loss.loss_agg, groups.data_parallel_group,
                                           config.loss.normalizer_scale) if groups.is_last_stage else 0.0
            micro = micro_batches(part, _plan(part, lengths[start:start + minibatch], config, groups))
            scale = megatron_loss_scale(len(micro), groups.data_parallel_size)
            step = train_step(ddp_chunks, optimizer, partial(_policy_forward_step, config, groups, normalizer, scale),
                              iter(micro), len(micro), max(mb["tokens"].shape[1] for mb in micro),
                              max(mb["tokens"].shape[0] for mb in micro), forward_weights)
            if not step.update_successful:
                raise FloatingPointError("optimizer skipped the update: non-finite gradients")
            grad_norms.append(step.grad_norm)
            reports += [o["report"] for o in step.losses]
    return reports, grad_norms


def _loss_metrics(reports: list, config: GRPOConfig, groups: ParallelGroups) -> dict:
    """Policy loss, clip fraction and KL over the DP batch (last stage only)."""
    if not groups.is_last_stage:
        return {}
    report = torch.stack(reports).sum(0)
    dist.all_reduce(report, group=groups.data_parallel_group)
    updates = config.ppo_epochs * config.num_minibatches
    metrics = {"train/policy_loss": report[0].item() / updates,
               "train/clip_fraction": report[1].item() / max(report[2].item(), 1.0)}
    if config.loss.kl_coef:
        metrics["train/kl"] = report[3].item() / max(report[2].item(), 1.0)
    return metrics


def grpo_train_step(ddp_chunks: list, optimizer, batch: RolloutBatch, config: GRPOConfig, state: AISState,
                    groups: ParallelGroups, reference_chunks: list | None = None,
                    policy_version: int | None = None,
                    forward_weights: Callable[[], ContextManager] = contextlib.nullcontext) -> GRPOStepResult:
    """Update the policy on this DP rank's rows of a rollout batch, advantages included; λ is computed once here and
    held for all mini-batches/epochs.

    `reference_chunks` (a frozen copy of the initial policy, same layout) is needed when --kl-coef > 0.
    `policy_version`: the step whose weights are updated; with the batch's per-token versions and `config.max_lag`
    > 0 the mismatch is also logged per version lag. `forward_weights()`: the context every forward of the policy
    runs in (`bridge.aligned_forward.RolloutAlignedForward`: the engine's weights; default: the policy's own).
    """
    if config.loss.kl_coef and reference_chunks is None:
        raise ValueError("--kl-coef > 0 needs a reference policy (reference_chunks)")
    if batch.advantages is None:
        raise ValueError("the rollout batch has no advantages: they are computed where its groups are whole "
                         "(grpo.advantages.with_advantages; a batch every rank holds whole: rows_of_whole_batch)")
    if batch.routed_experts is not None:
        if config.moe_routing is None:
            raise RoutingReplayError("the rollout batch carries routed expert ids but the model has no MoE layers")
        check_routed_experts(batch.routed_experts, *config.moe_routing)
        if batch.routed_experts.shape[:2] != batch.tokens.shape:  # a position without routes gets no expert at all
            raise RoutingReplayError(f"routed expert ids cover {tuple(batch.routed_experts.shape[:2])} (sequences, "
                                     f"positions), the batch's tokens {tuple(batch.tokens.shape)}")
    local, mask, rollout_lp, metrics, versions = _local_rows(batch.to(platform.device()), groups)
    lags = policy_version - versions if versions is not None and policy_version is not None and config.max_lag \
        else None
    if metrics["guard/valid_tokens"] == 0:
        return GRPOStepResult(skipped=True, ais=EMPTY_RESULT, metrics=metrics)
    lengths = row_lengths(mask)
    plan = _plan(local, lengths, config, groups)
    result = _correct(ddp_chunks, local, mask, rollout_lp, config, state, groups, metrics, plan, lags, forward_weights)
    if config.loss.kl_coef:
        ref_logprobs = score_rows(reference_chunks, local, plan, groups, config.vocab_size, config.temperature)
        local["ref_logprobs"] = ref_logprobs if groups.is_last_stage else torch.zeros_like(mask)
    reports, grad_norms = _update(ddp_chunks, optimizer, local, lengths, config, groups, forward_weights)
    metrics.update(_loss_metrics(reports, config, groups))
    metrics["train/grad_norm"] = grad_norms[-1]
    metrics.update(result.metrics())
    return GRPOStepResult(skipped=False, ais=result, metrics=metrics)
