"""MoE routing replay (R3): every forward that scores rollouts routes each token to the experts the engine chose.

The engine returns, per rollout, the top-k expert ids of every MoE layer at every position the trainer feeds
(prompt and response; `engine/vllm_engine.py RolloutEngine.route`); they travel with the batch as int16
[sequences, positions, MoE layers, k]. Before a pipeline chunk's forward, each of its routers is given its layer's
ids through megatron-core's `RouterReplay` (REPLAY_FORWARD), in the token order the router sees ([s, b] flattened,
this tensor-parallel rank's sequence shard under sequence parallelism); after the forward the routers route
themselves again (the refit probe measures how often they would disagree). Only the choice of experts is
replayed: the gating weights are still the trainer's own, a softmax over its router logits of the chosen experts
(Qwen3's renormalised top-k), so the router keeps its gradient; the auxiliary load-balancing loss is megatron's
own top-k on the trainer's scores, over the micro-batch's real tokens (`padding_mask`). The recipe does not
recompute activations, so no backward re-routing happens.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from megatron.core.utils import get_attr_wrapped_model

from megatron_ais.errors import ArgumentValidationError, RoutingReplayError


def routing_replay_enabled(choice: str | None, is_moe: bool, partial_rollouts: bool = False) -> bool:
    """Whether a run replays the engine's routing: --moe-routing-replay, by default on for MoE models (refused with
    --partial-rollouts)."""
    if choice == "rollout" and not is_moe:
        raise ArgumentValidationError("--moe-routing-replay rollout needs a MoE model and this one has no MoE layers; "
                                      "use --moe-routing-replay none or leave the flag out")
    enabled = is_moe if choice is None else choice == "rollout"
    if enabled and partial_rollouts:
        raise ArgumentValidationError(
            "--partial-rollouts with MoE routing replay: the engine routes a sample once it is done, with the "
            "weights it holds then, not those that sampled a resumed sample's first tokens; use "
            "--moe-routing-replay none or leave --partial-rollouts out")
    return enabled


def check_routed_experts(ids: torch.Tensor, num_layers: int, num_experts: int, topk: int) -> None:
    """Refuse routed expert ids that do not fit the model: shape [sequences, positions, num_layers, topk], ids in
    [0, num_experts), k distinct experts per token; the error names the first bad MoE layer."""
    if ids.dim() != 4 or ids.shape[2] != num_layers or ids.shape[3] != topk:
        raise RoutingReplayError(
            f"routed expert ids of shape {tuple(ids.shape)} do not fit the trainer's model: expected [sequences, "
            f"positions, {num_layers} MoE layers, top-{topk}]")
    for layer in range(num_layers):
        layer_ids = ids[:, :, layer].long()
        low, high = int(layer_ids.min()), int(layer_ids.max())
        if low < 0 or high >= num_experts:
            raise RoutingReplayError(f"MoE layer {layer}: routed expert id {low if low < 0 else high} is outside "
                                     f"[0, {num_experts})")
        ordered = layer_ids.sort(dim=-1).values
        if topk > 1 and (ordered[..., 1:] == ordered[..., :-1]).any():
            raise RoutingReplayError(f"MoE layer {layer}: a token is routed to the same expert twice")


def padding_routes(length: int, num_layers: int, topk: int) -> torch.Tensor:
    """Routes for positions no rollout fills (padding): experts 0..k-1, distinct as the router requires."""
    return torch.arange(topk, dtype=torch.int16).expand(length, num_layers, topk)


def _routers(model) -> list:
    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def _router_view(ids: torch.Tensor, layer: int, config) -> torch.Tensor:
    """One MoE layer's ids [b, s, k] as its router's [tokens, k] (int64): tokens in [s, b] order, this rank's
    sequence shard under sequence parallelism."""
    routes = ids[:, :, layer].transpose(0, 1)
    if config.sequence_parallel:
        shard = routes.shape[0] // ps.get_tensor_model_parallel_world_size()
        rank = ps.get_tensor_model_parallel_rank()
        routes = routes[rank * shard:(rank + 1) * shard]
    return routes.reshape(-1, routes.shape[-1]).long()


def set_replayed_routes(model, ids: torch.Tensor | None) -> None:
    """Make every router of `model` (one pipeline chunk) replay its layer's slice of ids [b, s, MoE layers, k]
    (global layer order) in the next forward; None: the routers route themselves."""
    for router in _routers(model):
        replay = router.router_replay
        replay.clear_indices()
        if ids is None:
            replay.clear_router_replay_action()
            continue
        replay.set_target_indices(_router_view(ids, router.layer_number - 1, router.config))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def padding_mask(model, micro_batch: dict) -> torch.Tensor | None:
    """Megatron's MoE padding mask of a micro-batch with `real_positions` [b, s] (True: a token of a sequence):
    True where no sequence fills the position, so the routers' load-balancing loss counts real tokens only.
    megatron-core 0.16.1 splits it over TP under sequence parallelism on the first pipeline stage only; a later
    stage is given its own share here."""
    real = micro_batch.get("real_positions")
    if real is None:
        return None
    padding = ~real.bool()
    if get_attr_wrapped_model(model, "pre_process") or not get_attr_wrapped_model(model, "config").sequence_parallel:
        return padding
    shard = padding.shape[1] // ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * shard
    return padding[:, start:start + shard].contiguous()


@contextlib.contextmanager
def load_balancing_off(model, off: bool):
    """In this block (when `off`) the chunk's routers add no load-balancing loss: megatron-core 0.16.1 divides it by
    the micro-batch's real tokens (moe_utils.switch_load_balancing_loss_func), so a micro-batch without one (a
    token-budget placeholder) would give the routers NaN gradients. Its coefficient is read at each forward."""
    configs = {id(router.config): router.config for router in _routers(model)}.values() if off else ()
    saved = [(config, config.moe_aux_loss_coeff) for config in configs]
    for config, _ in saved:
        config.moe_aux_loss_coeff = 0.0
    try:
        yield
    finally:
        for config, coefficient in saved:
            config.moe_aux_loss_coeff = coefficient


def forward_replaying(model, micro_batch: dict):
    """The chunk's forward of a micro-batch (tokens, position ids; its `padding_mask`), replaying its
    `routed_experts` if it has them (without them the routers are not touched: every replaying forward hands them
    back routing themselves); a micro-batch of padding alone adds no load-balancing loss."""
    ids = micro_batch.get("routed_experts")
    padding = padding_mask(model, micro_batch)
    # of the whole micro-batch, not this rank's sequence-parallel share: the loss's token count is reduced over TP
    real = micro_batch.get("real_positions")
    with load_balancing_off(model, real is not None and not bool(real.any())):
        if ids is None:
            return model(micro_batch["tokens"], micro_batch["position_ids"], attention_mask=None,
                         padding_mask=padding)
        set_replayed_routes(model, ids)
        try:
            return model(micro_batch["tokens"], micro_batch["position_ids"], attention_mask=None,
                         padding_mask=padding)
        finally:
            set_replayed_routes(model, None)
