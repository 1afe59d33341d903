"""The rollout batch and how its rows are shared out: the types the fleet makes and the trainer consumes, below
both (`rollout/` and `grpo/` import them; this module imports nothing of the package)."""
from __future__ import annotations

import dataclasses

import torch

ROW_TENSORS = ("tokens", "labels", "mask", "rollout_logprobs", "rewards", "advantages", "routed_experts",
               "policy_versions")


@dataclasses.dataclass
class RolloutBatch:
    """Rollout rows: a whole batch, or the rows one data-parallel rank trains on (what the fleet delivers to each
    rank, with their advantages); per-token tensors are aligned with `labels` (next tokens).

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
    truncated: int = 0  # responses cut by --max-new-tokens
    partial: int = 0  # responses sampled by more than one version of the weights (--partial-rollouts)
    repetitive: int = 0  # responses that repeat an n-gram back to back (`rollout/repetition.py`)
    # [B] each row's group advantage, computed where its whole group is (the engine's host); None until then (the
    # GRPO step refuses a batch without them)
    advantages: torch.Tensor | None = None
    # [B, S] int32: the trainer step whose weights sampled each response token (-1 off the response), with
    # --max-off-policy-steps > 0; None: every token was sampled by the weights the step starts from
    policy_versions: torch.Tensor | None = None

    def cached_sequences(self, count: int) -> list[list[int]]:
        """The first `count` rows as token ids up to their last response token's input position (the K/V an engine
        cached for them), from the right-padded tokens and response mask."""
        out = []
        for row in range(min(count, self.tokens.shape[0])):
            positions = self.mask[row].nonzero()
            if positions.numel():
                out.append(self.tokens[row, :int(positions.max()) + 1].tolist())
        return out

    def rows(self, indices: list[int]) -> "RolloutBatch":
        """The batch of the rows `indices` (in that order)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[indices] for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device: torch.device) -> "RolloutBatch":
        """Return the batch with its tensors on `device`."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


def row_tensors(batch) -> list[tuple[str, torch.Tensor]]:
    """The batch's per-row tensors (its advantages included), by name."""
    return [(name, getattr(batch, name)) for name in ROW_TENSORS if getattr(batch, name) is not None]


def row_lengths(mask: torch.Tensor) -> list[int]:
    """Each row's length: its positions up to its last response token's (at least 1), from the response mask
    [rows, S] (aligned with the next-token labels)."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device).expand_as(mask)
    return [max(int(n), 1) for n in (positions * (mask > 0)).amax(dim=1).tolist()]


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


def data_parallel_rows(lengths: list[int], ranks: int, balanced: bool) -> list[list[int]]:
    """The rows (of a batch whose rows have these lengths) each DP rank trains on: equal contiguous shares, or with a
    token budget, shares whose token counts balance (`balanced_partition`); the same on every rank."""
    if len(lengths) % ranks:
        raise ValueError(f"rollout batch of {len(lengths)} sequences does not split over {ranks} DP ranks")
    if balanced:
        return balanced_partition(lengths, ranks)
    per_rank = len(lengths) // ranks
    return [list(range(rank * per_rank, (rank + 1) * per_rank)) for rank in range(ranks)]
