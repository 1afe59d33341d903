"""Pure helpers of the engine's probes (`RolloutEngine.prompt_logprobs`, `probe_layer_states`, `route`): the
teacher-forced log-probs of a prompt from vLLM's prompt log-probs, the decoder layers' outputs and the MoE routers'
expert ids as the workers captured them (`worker_extension`), which sequences one forward can prefill together,
and each sequence's routes from what the routers recorded."""
from __future__ import annotations

import torch

from megatron_ais.engine.worker_extension import from_wire
from megatron_ais.errors import RolloutError


def teacher_forced_logprobs(prompt_logprobs: list, token_ids: list[int]) -> torch.Tensor:
    """The log-probs of token_ids[1:] in vLLM's `prompt_logprobs` of token_ids (its first entry has no context)."""
    return torch.tensor([entry[t].logprob for entry, t in zip(prompt_logprobs[1:], token_ids[1:])])


def layer_states(captured: list) -> list[torch.Tensor | None]:
    """Each decoder layer's output [tokens, hidden] from what `LayerStateCapture` sent (None: the layer did not run)."""
    return [None if state is None else from_wire(state) for state in captured]


def routing_calls(captured: list) -> list[list[torch.Tensor]]:
    """Per MoE layer, per forward, the expert ids [rows, k] from what `RoutingCapture` sent."""
    return [[from_wire(ids) for ids in calls] for calls in captured]


def one_forward_batches(sequences: list[list[int]], max_tokens: int, max_sequences: int) -> list[list[list[int]]]:
    """Consecutive batches of sequences whose prefill fits one scheduler step (token budget and sequence count)."""
    batches, current, tokens = [], [], 0
    for sequence in sequences:
        if current and (tokens + len(sequence) > max_tokens or len(current) == max_sequences):
            batches.append(current)
            current, tokens = [], 0
        current.append(sequence)
        tokens += len(sequence)
    return batches + ([current] if current else [])


def routes_of_one_forward(layers: list[list[torch.Tensor]], sequences: list[list[int]]) -> list[torch.Tensor] | None:
    """Each sequence's expert ids [len(sequence), MoE layers, k] from `layers` (`routing_calls`) of sequences
    prefilled together; None if the engine needed more than one forward (then the rows' order is not known)."""
    total = sum(len(s) for s in sequences)
    if not all(len(calls) == 1 and calls[0].shape[0] >= total for calls in layers):
        return None
    if not layers:
        return [torch.zeros(len(s), 0, 0, dtype=torch.int16) for s in sequences]
    rows = torch.stack([calls[0][:total] for calls in layers], dim=1)  # rows past `total`: CUDA-graph padding
    return list(rows.split([len(s) for s in sequences]))


def routes_of_one_sequence(layers: list[list[torch.Tensor]], sequence: list[int]) -> torch.Tensor:
    """One sequence's expert ids [len(sequence), MoE layers, k] from `layers` (`routing_calls`) of its prefill alone,
    over however many forwards it took."""
    rows = [torch.cat(calls) for calls in layers]
    if any(r.shape[0] != len(sequence) for r in rows):
        raise RolloutError(f"the engine routed {[r.shape[0] for r in rows]} positions of a {len(sequence)}-token "
                           "sequence in its MoE layers")
    return torch.stack(rows, dim=1) if rows else torch.zeros(len(sequence), 0, 0, dtype=torch.int16)
