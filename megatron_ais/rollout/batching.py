"""Turn engine rollouts into the trainer's rollout batch (per-token tensors aligned with next-token labels)."""
from __future__ import annotations

import torch

from megatron_ais.batch import RolloutBatch
from megatron_ais.engine.vllm_engine import Rollout
from megatron_ais.routing_replay import padding_routes


def rollouts_to_batch(rollouts: list[Rollout], rewards: list[float], group_size: int, seq_length: int,
                      pad_token_id: int, routes: list[torch.Tensor] | None = None,
                      policy_version: int | None = None) -> RolloutBatch:
    """Return a RolloutBatch: tokens = prompt + response (right padded), labels = tokens shifted by one; the
    response token at absolute position p is predicted at label index p - 1, where mask and log-prob go. `routes`
    (MoE routing replay): each rollout's expert ids [its input positions, MoE layers, k] from `RolloutEngine.route`.
    `policy_version`: the trainer step whose weights sampled the responses, recorded per response token (a rollout's
    own per-token `versions` where it has them: a partial rollout)."""
    count = len(rollouts)
    tokens = torch.full((count, seq_length), pad_token_id, dtype=torch.long)
    labels = torch.full((count, seq_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros(count, seq_length)
    logprobs = torch.zeros(count, seq_length)
    versions = None if policy_version is None else torch.full((count, seq_length), -1, dtype=torch.int32)
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
        if versions is not None:
            versions[row, start:start + r.length] = torch.tensor(r.versions, dtype=torch.int32) \
                if r.versions is not None else policy_version
    return RolloutBatch(tokens=tokens, labels=labels, mask=mask, rollout_logprobs=logprobs,
                        rewards=torch.tensor(rewards, dtype=torch.float32), group_size=group_size,
                        routed_experts=None if routes is None else _routed_experts(routes, seq_length),
                        policy_versions=versions)


def _routed_experts(routes: list[torch.Tensor], seq_length: int) -> torch.Tensor:
    """The rollouts' expert ids [B, S, MoE layers, k], padding positions routed to experts 0..k-1."""
    _, layers, topk = routes[0].shape
    out = padding_routes(seq_length, layers, topk).repeat(len(routes), 1, 1, 1)
    for row, route in enumerate(routes):
        out[row, :route.shape[0]] = route
    return out
