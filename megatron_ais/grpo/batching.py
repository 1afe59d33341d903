"""Which rows each data-parallel rank trains on, and how a rank's rows become micro-batches.

    fixed         --micro-batch-size rows per micro-batch, each padded to --seq-length (the default)
    token budget  --max-tokens-per-microbatch N: a rank's rows, longest first, fill micro-batches whose padded size
                  (rows x their own longest row, rounded up to what sequence parallelism needs) stays within N, each
                  padded only to its own longest row; the batch's rows are shared out among data-parallel ranks so
                  that their token counts balance (equal row counts, longest first to the least loaded rank)

Either way the loss keeps its data-parallel-global normaliser, so the update does not depend on the grouping.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ais import platform


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


def row_lengths(mask: torch.Tensor) -> list[int]:
    """Each row's length: its positions up to its last response token's (at least 1), from the response mask
    [rows, S] (aligned with the next-token labels)."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device).expand_as(mask)
    return [max(int(n), 1) for n in (positions * (mask > 0)).amax(dim=1).tolist()]


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


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Rows shared out among `parts` ranks, the same number each, balancing their token counts: longest first, each
    to the least loaded rank that has room (ties to the lowest rank); every rank's rows in batch order. The same on
    every rank, with no communication."""
    per_part = len(lengths) // parts
    loads, members = [0] * parts, [[] for _ in range(parts)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min((p for p in range(parts) if len(members[p]) < per_part), key=lambda p: (loads[p], p))
        loads[part] += lengths[index]
        members[part].append(index)
    return [sorted(m) for m in members]


def micro_batches(rows: dict[str, torch.Tensor], plan: MicroBatchPlan) -> list[dict[str, torch.Tensor]]:
    """The plan's micro-batches of `rows` (tensors [rows, S, ...]), each cut to its padded length, with position
    ids, on the trainer's device; a placeholder is one row of zeros (no response token: no loss, no statistics)."""
    out = []
    for members, length in zip(plan.rows, plan.lengths):
        if members:
            mb = {k: v[list(members), :length] for k, v in rows.items()}
        else:
            mb = {k: torch.zeros((1, length) + tuple(v.shape[2:]), dtype=v.dtype) for k, v in rows.items()}
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
