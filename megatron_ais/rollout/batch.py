"""Turn engine rollouts into the trainer's rollout batch (per-token tensors aligned with next-token labels)."""
from __future__ import annotations

import torch

from megatron_ais.grpo.step import RolloutBatch
from megatron_ais.rollout.engine import Rollout


def rollouts_to_batch(rollouts: list[Rollout], rewards: list[float], group_size: int, seq_length: int,
                      pad_token_id: int) -> RolloutBatch:
    """Return a RolloutBatch: tokens = prompt + response (right padded), labels = tokens shifted by one; the
    response token at absolute position p is predicted at label index p - 1, where mask and log-prob go."""
    count = len(rollouts)
    tokens = torch.full((count, seq_length), pad_token_id, dtype=torch.long)
    labels = torch.full((count, seq_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros(count, seq_length)
    logprobs = torch.zeros(count, seq_length)
    for row, r in enumerate(rollouts):
        ids = r.prompt_token_ids + r.token_ids
        if len(ids) - 1 > seq_length:
            raise ValueError(f"rollout {row} has {len(ids)} tokens; --seq-length {seq_length} must be at least "
                             "prompt length + max new tokens - 1")
        n = len(ids) - 1
        tokens[row, :n] = torch.tensor(ids[:-1])
        labels[row, :n] = torch.tensor(ids[1:])
        start = len(r.prompt_token_ids) - 1
        mask[row, start:start + r.length] = 1.0
        logprobs[row, start:start + r.length] = torch.tensor(r.logprobs, dtype=torch.float32)
    return RolloutBatch(tokens=tokens, labels=labels, mask=mask, rollout_logprobs=logprobs,
                        rewards=torch.tensor(rewards, dtype=torch.float32), group_size=group_size)
