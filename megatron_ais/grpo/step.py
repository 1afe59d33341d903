"""One GRPO optimizer phase for a rollout batch: old log-probs, mismatch correction (λ once per batch), PPO-clip
updates over mini-batches and epochs through megatron's pipeline schedule."""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.distributed as dist

from megatron_ais import platform
from megatron_ais.ais import (AISConfig, AISResult, AISState, ais_coefficient, apply_correction,
                              check_trainer_logprobs, exclude_invalid_sequences, invalid_sequences, max_abs_logratio,
                              mismatch_statistics, reduce_statistics)
from megatron_ais.ais.coefficient import EMPTY_RESULT
from megatron_ais.errors import RoutingReplayError
from megatron_ais.grpo.advantages import AdvantageConfig, group_advantages
from megatron_ais.grpo.batching import (MicroBatchPlan, balanced_partition, fixed_plan, micro_batches, row_lengths,
                                        scatter_rows, token_budget_plan)
from megatron_ais.grpo.logprobs import vocab_parallel_logprobs
from megatron_ais.grpo.loss import PolicyLossConfig, aggregate, global_normalizer, megatron_loss_scale, token_losses
from megatron_ais.routing_replay import check_routed_experts, forward_replaying


@dataclasses.dataclass
class RolloutBatch:
    """A rollout batch, identical on every rank; per-token tensors are aligned with `labels` (next tokens).

    tokens/labels [B, S] (right padded), mask [B, S] (1 on response tokens), rollout_logprobs [B, S] (the
    engine's log-probs of the sampled tokens), rewards [B]; consecutive groups of `group_size` share a prompt.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    # MoE routing replay: the engine's top-k expert ids [B, S, MoE layers, k] (int16) at every input position
    routed_experts: torch.Tensor | None = None
    reward_failures: int = 0  # rewards that raised or were not a number in [0, 1] (scored 0)
    reward_timeouts: int = 0  # rewards that ran past --reward-timeout-s (scored 0)
    # [B] each row's group advantage, computed where its whole group is (the engine's host); None: the batch is
    # whole and the same on every rank, which computes them and takes its share
    advantages: torch.Tensor | None = None

    def rows(self, indices: list[int]) -> "RolloutBatch":
        """The batch of the rows `indices` (in that order)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[indices] for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device: torch.device) -> "RolloutBatch":
        """Return the batch with its tensors on `device`."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


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
    max_tokens_per_microbatch: int | None = None  # token-budget micro-batches (grpo/batching.py); None: fixed
    sequence_multiple: int = 1  # micro-batch lengths are multiples of this (TP under sequence parallelism)
    moe_routing: tuple[int, int, int] | None = None  # (MoE layers, experts, top-k): what replayed routes must fit

    def plan(self, lengths: list[int], seq_length: int) -> MicroBatchPlan:
        """The micro-batches of rows of these lengths."""
        if self.max_tokens_per_microbatch is None:
            return fixed_plan(len(lengths), self.micro_batch_size, seq_length)
        return token_budget_plan(lengths, self.max_tokens_per_microbatch, self.sequence_multiple)


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """Process groups and positions, taken from megatron's parallel state at the call site."""

    data_parallel_group: object
    tensor_parallel_group: object
    data_parallel_rank: int
    data_parallel_size: int
    is_last_stage: bool

    @classmethod
    def from_parallel_state(cls) -> "ParallelGroups":
        from megatron.core import parallel_state as ps

        return cls(data_parallel_group=ps.get_data_parallel_group(with_context_parallel=True),
                   tensor_parallel_group=ps.get_tensor_model_parallel_group(),
                   data_parallel_rank=ps.get_data_parallel_rank(),
                   data_parallel_size=ps.get_data_parallel_world_size(),
                   is_last_stage=ps.is_pipeline_last_stage())


@dataclasses.dataclass
class GRPOStepResult:
    """What one rollout batch's update reports (λ and metrics are identical on every rank that logs)."""

    skipped: bool
    ais: AISResult
    metrics: dict


def split_micro_batches(rows: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Return micro-batches of `micro_batch_size` rows, each with its position ids, on the trainer's device."""
    count = next(iter(rows.values())).shape[0]
    out = []
    for start in range(0, count, micro_batch_size):
        mb = {k: v[start:start + micro_batch_size] for k, v in rows.items()}
        seq = mb["tokens"].shape[1]
        mb["position_ids"] = torch.arange(seq).unsqueeze(0).expand(mb["tokens"].shape[0], seq).contiguous()
        out.append(platform.to_device(mb))
    return out


def forward_logprobs(ddp_chunks: list, micro_batches: list[dict], groups: ParallelGroups, vocab_size: int,
                     temperature: float = 1.0) -> list[torch.Tensor] | None:
    """Return the trainer's log-probs of each micro-batch's labels under log_softmax(logits / temperature), one
    [rows, length] tensor per micro-batch (last pipeline stage; None elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = forward_replaying(model, mb)

        def loss_func(logits):
            logprobs, _ = vocab_parallel_logprobs(logits / temperature, mb["labels"], groups.tensor_parallel_group,
                                                  vocab_size)
            return logits.sum() * 0.0, {"logprobs": logprobs.detach()}

        return output, loss_func

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches) if len(ddp_chunks) == 1
            else [iter(micro_batches) for _ in ddp_chunks], model=ddp_chunks if len(ddp_chunks) > 1 else ddp_chunks[0],
            num_microbatches=len(micro_batches), seq_length=max(mb["tokens"].shape[1] for mb in micro_batches),
            micro_batch_size=max(mb["tokens"].shape[0] for mb in micro_batches), forward_only=True)
    return [o["logprobs"] for o in out] if groups.is_last_stage else None


def compute_logprobs(ddp_chunks: list, micro_batches: list[dict], seq_length: int, micro_batch_size: int,
                     groups: ParallelGroups, vocab_size: int, temperature: float = 1.0) -> torch.Tensor | None:
    """Return the trainer's log-probs [B_local, S] of the labels of equally shaped micro-batches [micro_batch_size,
    seq_length] under log_softmax(logits / temperature) (last pipeline stage; None elsewhere)."""
    out = forward_logprobs(ddp_chunks, micro_batches, groups, vocab_size, temperature)
    return None if out is None else torch.cat(out)


def score_rows(ddp_chunks: list, rows: dict[str, torch.Tensor], plan: MicroBatchPlan, groups: ParallelGroups,
               vocab_size: int, temperature: float = 1.0) -> torch.Tensor | None:
    """Return the trainer's log-probs [rows, S] of `rows`' labels, computed in the plan's micro-batches (zero
    beyond each micro-batch's length; last pipeline stage, None elsewhere)."""
    out = forward_logprobs(ddp_chunks, micro_batches(rows, plan), groups, vocab_size, temperature)
    return None if out is None else scatter_rows(out, plan, tuple(rows["tokens"].shape))


def _policy_forward_step(config: GRPOConfig, groups: ParallelGroups, normalizer: float, scale: float,
                         data_iterator, model):
    mb = next(data_iterator)
    output = forward_replaying(model, mb)

    def loss_func(logits):
        logprobs, entropy = vocab_parallel_logprobs(logits / config.temperature, mb["labels"],
                                                    groups.tensor_parallel_group,
                                                    config.vocab_size, with_entropy=config.loss.entropy_coef > 0)
        per_token, parts = token_losses(logprobs, mb["old_logprobs"], mb["advantages"], mb["coefficient"],
                                        config.loss, ref_logprobs=mb.get("ref_logprobs"), entropy=entropy)
        loss = aggregate(per_token, mb["keep"], config.loss.loss_agg, normalizer)
        keep = mb["keep"]
        kl = (parts["kl"] * keep).sum().double() if "kl" in parts else \
            torch.zeros((), dtype=torch.float64, device=keep.device)
        report = torch.stack([loss.detach().double(), (parts["clipped"] * keep).sum().double(), keep.sum().double(),
                              kl])
        return loss * scale, {"report": report}

    return output, loss_func


def data_parallel_rows(lengths: list[int], ranks: int, balanced: bool) -> list[list[int]]:
    """The rows (of a batch whose rows have these lengths) each DP rank trains on: equal contiguous shares, or with a
    token budget, shares whose token counts balance (`batching.balanced_partition`); the same on every rank."""
    if len(lengths) % ranks:
        raise ValueError(f"rollout batch of {len(lengths)} sequences does not split over {ranks} DP ranks")
    if balanced:
        return balanced_partition(lengths, ranks)
    per_rank = len(lengths) // ranks
    return [list(range(rank * per_rank, (rank + 1) * per_rank)) for rank in range(ranks)]


def with_advantages(batch: RolloutBatch, config: AdvantageConfig) -> RolloutBatch:
    """The batch (whole groups) with each row's group advantage. A sequence left out for a NaN rollout log-prob is
    left out of its group's mean and std too."""
    return dataclasses.replace(batch, advantages=group_advantages(
        batch.rewards, batch.group_size, not config.no_std, config.leave_one_out,
        valid=~invalid_sequences(batch.rollout_logprobs, batch.mask)))


def _local_rows(batch: RolloutBatch, config: GRPOConfig, groups: ParallelGroups
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]:
    """This DP rank's rows with their advantages (a whole batch, the same on every rank, is cut to this rank's
    share here); return (rows, response mask without the sequences excluded for NaN/Inf rollout log-probs, rollout
    log-probs with zeros off the mask, guard metrics)."""
    if batch.advantages is None:
        rows = data_parallel_rows(row_lengths(batch.mask), groups.data_parallel_size,
                                  config.max_tokens_per_microbatch is not None)[groups.data_parallel_rank]
        batch = with_advantages(batch, config.advantages).rows(rows)
    mask, excluded = exclude_invalid_sequences(batch.rollout_logprobs, batch.mask.float())
    counts = torch.tensor([float(excluded), float(mask.sum())], dtype=torch.float64)
    dist.all_reduce(counts, group=groups.data_parallel_group)
    metrics = {"guard/excluded_sequences": counts[0].item(), "guard/valid_tokens": counts[1].item()}
    rollout_lp = torch.where(mask > 0, batch.rollout_logprobs, torch.zeros(()))
    local = {"tokens": batch.tokens, "labels": batch.labels, "advantages": batch.advantages.unsqueeze(-1) * mask}
    if batch.routed_experts is not None:
        local["routed_experts"] = batch.routed_experts
    return local, mask, rollout_lp, metrics


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
             state: AISState, groups: ParallelGroups, metrics: dict, plan: MicroBatchPlan) -> AISResult:
    """Score the rows with the policy before the update (old log-probs) and compute the correction once for the
    batch (λ from all-reduced statistics); fill in the rows' old log-probs, coefficients and keep mask."""
    old_logprobs = score_rows(ddp_chunks, local, plan, groups, config.vocab_size, config.temperature)
    result, coefficient, keep = EMPTY_RESULT, torch.ones_like(mask), mask
    if groups.is_last_stage:
        check_trainer_logprobs(old_logprobs, mask)
        stats = reduce_statistics(mismatch_statistics(old_logprobs, rollout_lp, local["advantages"], mask,
                                                      config.correction), groups.data_parallel_group)
        result = ais_coefficient(stats, config.correction, state)
        metrics["ais/max_abs_logratio"] = max_abs_logratio(old_logprobs, rollout_lp, mask, config.correction,
                                                           groups.data_parallel_group)
        correction = apply_correction(old_logprobs, rollout_lp, mask, config.correction, result)
        coefficient, keep = correction.coefficient, correction.keep
        metrics["guard/rejected_fraction"] = 1.0 - global_normalizer(keep, "token-mean", groups.data_parallel_group) \
            / metrics["guard/valid_tokens"]
        local["old_logprobs"] = old_logprobs
    else:
        local["old_logprobs"] = torch.zeros_like(mask)
    local.update(coefficient=coefficient, keep=keep)
    return result


def _update(ddp_chunks: list, optimizer, local: dict, lengths: list[int], config: GRPOConfig,
            groups: ParallelGroups) -> tuple[list, list]:
    """PPO-clip updates over --ppo-epochs passes of --num-minibatches mini-batches; return the micro-batches'
    loss reports and the grad norms."""
    from megatron_ais.training import train_step

    reports, grad_norms = [], []
    per_rank = local["tokens"].shape[0]
    minibatch = per_rank // config.num_minibatches
    for _ in range(config.ppo_epochs):
        for start in range(0, per_rank, minibatch):
            part = {k: v[start:start + minibatch] for k, v in local.items()}
            normalizer = global_normalizer(part["keep"], config.loss.loss_agg, groups.data_parallel_group) \
                if groups.is_last_stage else 0.0
            micro = micro_batches(part, _plan(part, lengths[start:start + minibatch], config, groups))
            scale = megatron_loss_scale(len(micro), groups.data_parallel_size)
            step = train_step(ddp_chunks, optimizer, partial(_policy_forward_step, config, groups, normalizer, scale),
                              iter(micro), len(micro), max(mb["tokens"].shape[1] for mb in micro),
                              max(mb["tokens"].shape[0] for mb in micro))
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
                    groups: ParallelGroups, reference_chunks: list | None = None) -> GRPOStepResult:
    """Update the policy on one rollout batch; λ is computed once here and held for all mini-batches/epochs.

    `reference_chunks` (a frozen copy of the initial policy, same layout) is needed when --kl-coef > 0.
    """
    if config.loss.kl_coef and reference_chunks is None:
        raise ValueError("--kl-coef > 0 needs a reference policy (reference_chunks)")
    if batch.routed_experts is not None:
        if config.moe_routing is None:
            raise RoutingReplayError("the rollout batch carries routed expert ids but the model has no MoE layers")
        check_routed_experts(batch.routed_experts, *config.moe_routing)
    local, mask, rollout_lp, metrics = _local_rows(batch.to(platform.device()), config, groups)
    if metrics["guard/valid_tokens"] == 0:
        return GRPOStepResult(skipped=True, ais=EMPTY_RESULT, metrics=metrics)
    lengths = row_lengths(mask)
    plan = _plan(local, lengths, config, groups)
    result = _correct(ddp_chunks, local, mask, rollout_lp, config, state, groups, metrics, plan)
    if config.loss.kl_coef:
        ref_logprobs = score_rows(reference_chunks, local, plan, groups, config.vocab_size, config.temperature)
        local["ref_logprobs"] = ref_logprobs if groups.is_last_stage else torch.zeros_like(mask)
    reports, grad_norms = _update(ddp_chunks, optimizer, local, lengths, config, groups)
    metrics.update(_loss_metrics(reports, config, groups))
    metrics["train/grad_norm"] = grad_norms[-1]
    metrics.update(result.metrics())
    return GRPOStepResult(skipped=False, ais=result, metrics=metrics)
