"""The trainer's log-prob forward and how rows become micro-batches: what the GRPO step, the refit check and the
KV-cache calibration all run (`grpo/`, `rollout/` import it; it imports nothing above the model layer).

Micro-batches, two ways:
    fixed         --micro-batch-size rows per micro-batch, each padded to --seq-length (the default)
    token budget  --max-tokens-per-microbatch N: a rank's rows, longest first, fill micro-batches whose padded size
                  (rows x their own longest row, rounded up to what sequence parallelism needs) stays within N, each
                  padded only to its own longest row; the batch's rows are shared out among data-parallel ranks so
                  that their token counts balance (`batch.data_parallel_rows`)
Either way the loss keeps its data-parallel-global normaliser, so the update does not depend on the grouping.

Log-probs and entropy come from vocab-parallel logits without gathering the full vocabulary: each TP rank holds
logits for its slice of the (padded) vocabulary; three all-reduces over the TP group (max, Σexp, target logit; plus
Σp·logit for the entropy) give exact full-vocabulary values. Padded vocabulary columns are excluded from the
softmax, so log-probs are those of the real vocabulary.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megatron_ais import platform
from megatron_ais.routing_replay import forward_replaying, padding_routes


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """Process groups and positions, taken from megatron's parallel state at the call site."""

    data_parallel_group: object
    tensor_parallel_group: object
    data_parallel_rank: int
    data_parallel_size: int
    is_last_stage: bool
    pipeline_group: object = None  # None: one pipeline stage

    @classmethod
    def from_parallel_state(cls) -> "ParallelGroups":
        return cls(data_parallel_group=ps.get_data_parallel_group(with_context_parallel=True),
                   tensor_parallel_group=ps.get_tensor_model_parallel_group(),
                   data_parallel_rank=ps.get_data_parallel_rank(),
                   data_parallel_size=ps.get_data_parallel_world_size(),
                   is_last_stage=ps.is_pipeline_last_stage(),
                   pipeline_group=ps.get_pipeline_model_parallel_group())


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """The row indices (into a rank's rows) of each micro-batch and the length it is padded to; a micro-batch with
    no rows is a token-less placeholder (a rank that must run as many micro-batches as its peers)."""

    rows: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.rows)

    def padded_tokens(self) -> int:
        return sum(max(len(r), 1) * length for r, length in zip(self.rows, self.lengths))

    def with_placeholders(self, count: int, length: int) -> "MicroBatchPlan":
        """The plan grown to `count` micro-batches by token-less ones of `length` positions."""
        missing = count - len(self.rows)
        return MicroBatchPlan(self.rows + ((),) * missing, self.lengths + (length,) * missing)


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def fixed_plan(count: int, micro_batch_size: int, seq_length: int) -> MicroBatchPlan:
    """--micro-batch-size rows per micro-batch, in order, each padded to the full sequence length."""
    rows = tuple(tuple(range(start, min(start + micro_batch_size, count))) for start in range(0, count, micro_batch_size))
    return MicroBatchPlan(rows, (seq_length,) * len(rows))


def token_budget_plan(lengths: list[int], budget: int, multiple: int = 1) -> MicroBatchPlan:
    """Rows longest first into micro-batches of at most `budget` padded tokens, each padded to its longest row
    rounded up to `multiple`."""
    rows, padded, current, longest = [], [], [], 0
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = max(longest, round_up(lengths[index], multiple))
        if current and (len(current) + 1) * length > budget:
            rows.append(tuple(sorted(current)))
            padded.append(longest)
            current, length = [], round_up(lengths[index], multiple)
        current.append(index)
        longest = length
    if current:
        rows.append(tuple(sorted(current)))
        padded.append(longest)
    return MicroBatchPlan(tuple(rows), tuple(padded))


def micro_batches(rows: dict[str, torch.Tensor], plan: MicroBatchPlan) -> list[dict[str, torch.Tensor]]:
    """The plan's micro-batches of `rows` (tensors [rows, S, ...]), each cut to its padded length, with position
    ids, on the trainer's device; a placeholder is one row of zeros (no response token: no loss, no statistics; no
    real position) whose routes, if any, are `padding_routes`."""
    out = []
    for members, length in zip(plan.rows, plan.lengths):
        if members:
            mb = {k: v[list(members), :length] for k, v in rows.items()}
        else:
            mb = {k: torch.zeros((1, length) + tuple(v.shape[2:]), dtype=v.dtype) for k, v in rows.items()}
            if "routed_experts" in rows:  # each token routed to k distinct experts, as a router must
                mb["routed_experts"] = padding_routes(length, *rows["routed_experts"].shape[2:]).unsqueeze(0)
        count = mb["tokens"].shape[0]
        mb["position_ids"] = torch.arange(length).unsqueeze(0).expand(count, length).contiguous()
        out.append(platform.to_device(mb))
    return out


def scatter_rows(outputs: list[torch.Tensor], plan: MicroBatchPlan, shape: tuple[int, int]) -> torch.Tensor:
    """Per-micro-batch outputs [rows, length] put back in their rows of a [rows, S] tensor (zero beyond each
    micro-batch's length; placeholders dropped)."""
    full = torch.zeros(shape, dtype=outputs[0].dtype, device=outputs[0].device) if outputs else torch.zeros(shape)
    for out, members, length in zip(outputs, plan.rows, plan.lengths):
        if members:
            full[list(members), :length] = out
    return full
def _tp_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum over TP ranks; forward all-reduce, backward identity (every TP rank computes the same loss)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return reduce_from_tensor_model_parallel_region(tensor, group)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, group, vocab_size: int,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (log p(label) [..], entropy [..] or None) for local logits [.., V_local] of TP rank's vocab slice.

    Computed in fp32; differentiable in `logits`.
    """
    tp_rank = dist.get_rank(group) if group is not None else 0
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    x = logits.float()
    real = torch.arange(start, start + local_vocab, device=x.device) < vocab_size
    # padded columns are excluded by multiplying their exp by 0; keeping them finite keeps every gradient finite
    max_logit = x.detach().masked_fill(~real, float("-inf")).max(dim=-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
    shifted = x - max_logit.unsqueeze(-1)
    exp = shifted.exp() * real
    sum_exp = _tp_sum(exp.sum(dim=-1), group)
    log_z = sum_exp.log()
    in_slice = (labels >= start) & (labels < start + local_vocab)
    local_label = (labels - start).clamp(0, local_vocab - 1)
    target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1)
    target = _tp_sum(torch.where(in_slice, target, torch.zeros_like(target)), group)
    logprobs = target - log_z
    if not with_entropy:
        return logprobs, None
    # H = log Z - Σ e^s·s / Z: each summed partial must depend on local logits only, because the all-reduce's
    # backward is the identity (Σ p·s summed per rank would miss p's dependence on other ranks through Z)
    entropy = log_z - _tp_sum((exp * shifted).sum(dim=-1), group) / sum_exp
    return logprobs, entropy


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
