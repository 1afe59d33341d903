"""The refit probe: a fixed token sequence, and the trainer's forward on it — its log-probs, each decoder layer's
output, each MoE layer's routes — which the refit check (`rollout/verify.py`) compares with an engine's."""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_ais.distributed import from_last_stage
from megatron_ais.forward import compute_logprobs, round_up, split_micro_batches
from megatron_ais.model import unwrap_model
from megatron_ais.routing_replay import padding_routes


def probe_tokens(vocab_size: int, length: int = 48, seed: int = 1234) -> list[int]:
    """Return the fixed probe sequence (same for every sync of a run)."""
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def trainer_probe_logprobs(ddp_chunks: list, probe: list[int], groups, vocab_size: int,
                           routes: torch.Tensor | None = None) -> torch.Tensor | None:
    """The trainer's teacher-forced log-probs of probe[1:] through the pipeline schedule (every stage calls it;
    the result is on the last stage, None elsewhere). `routes`: an engine's expert ids of the probe [len(probe), MoE
    layers, k] (`RolloutEngine.route`), which the trainer's routers then replay."""
    scored = len(probe) - 1
    padding = _fed_length(ddp_chunks, scored) - scored  # after the probe: causal attention keeps it out of the probe
    fed = probe + probe[1:1 + padding]
    row = {"tokens": torch.tensor([fed[:scored + padding]]), "labels": torch.tensor([fed[1:]])}
    if routes is not None:
        tail = padding_routes(padding, *routes.shape[1:]).to(routes.dtype)
        row["routed_experts"] = torch.cat([routes[:-1], tail]).unsqueeze(0)
    logprobs = compute_logprobs(ddp_chunks, split_micro_batches(row, 1), scored + padding, 1, groups, vocab_size)
    return None if logprobs is None else logprobs[0, :scored].cpu()  # compared with the engine's on the host


def _fed_length(ddp_chunks: list, length: int) -> int:
    """Sequence parallelism splits the fed positions evenly over TP: a multiple of its size."""
    config = unwrap_model(ddp_chunks[0]).config
    return round_up(length, config.tensor_model_parallel_size) if config.sequence_parallel else length


def _probe_with_hooks(ddp_chunks: list, probe: list[int], groups, vocab_size: int, pick, capture
                      ) -> dict[int, torch.Tensor]:
    """Run the probe through the trainer's pipeline schedule with a forward hook on `pick(layer)` of every decoder
    layer that has one; `capture(output)` turns the module's output into a [tokens, ...] tensor (sequence-parallel
    outputs are gathered over TP first). Return {global layer index: captured} on TP rank 0 and DP rank 0 only."""
    captured: dict[int, torch.Tensor] = {}

    def hook(layer):
        def record(module, inputs, output):
            value = capture(output)
            if layer.config.sequence_parallel:
                value = gather_from_sequence_parallel_region(value)
            # the probe's positions, not the padding after them; compared with the engine's on the host
            captured[layer.layer_number - 1] = value[:len(probe) - 1].detach().to("cpu", copy=True)
        return record

    handles = [pick(layer).register_forward_hook(hook(layer)) for chunk in ddp_chunks
               for layer in unwrap_model(chunk).decoder.layers if pick(layer) is not None]
    try:
        trainer_probe_logprobs(ddp_chunks, probe, groups, vocab_size)
    finally:
        for handle in handles:
            handle.remove()
    keep = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return captured if keep else {}


def trainer_layer_states(ddp_chunks: list, probe: list[int], groups, vocab_size: int) -> dict[int, torch.Tensor]:
    """Return {global layer index: decoder layer output [tokens, hidden]} for the probe (this rank's layers)."""
    states = _probe_with_hooks(ddp_chunks, probe, groups, vocab_size, lambda layer: layer,
                               lambda output: (output[0] if isinstance(output, tuple) else output).float())
    return {i: state[:, 0] for i, state in states.items()}


def trainer_routing(ddp_chunks: list, probe: list[int], groups, vocab_size: int) -> dict[int, torch.Tensor]:
    """Return {global layer index: routing map [tokens, experts] (bool)} of the probe through this rank's MoE
    layers (megatron's TopKRouter returns (probs, routing_map))."""
    maps = _probe_with_hooks(ddp_chunks, probe, groups, vocab_size, lambda layer: getattr(layer.mlp, "router", None),
                             lambda output: output[1].float())
    return {i: routing_map.bool() for i, routing_map in maps.items()}


def trainer_probe_reference(ddp_chunks: list, probe: list[int], groups, vocab_size: int,
                            routes: torch.Tensor | None = None) -> torch.Tensor:
    """The trainer's probe log-probs on every rank (collective over the pipeline), replaying `routes` if given."""
    return from_last_stage(trainer_probe_logprobs(ddp_chunks, probe, groups, vocab_size, routes),
                           groups.pipeline_group)
