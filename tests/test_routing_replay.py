"""Routed expert ids for MoE routing replay: what is refused (naming the MoE layer), which runs replay by default,
how a batch carries the ids (padding routed to distinct experts)."""
import pytest
import torch

from megatron_ais.errors import ArgumentValidationError, RoutingReplayError
from megatron_ais.rollout.batching import rollouts_to_batch
from megatron_ais.engine.vllm_engine import Rollout
from megatron_ais.routing_replay import check_routed_experts, routing_replay_enabled


def _ids(sequences=2, positions=5, layers=3, experts=8, topk=2, seed=0):
    scores = torch.rand(sequences, positions, layers, experts, generator=torch.Generator().manual_seed(seed))
    return scores.argsort(-1)[..., :topk].to(torch.int16)


def test_well_formed_ids_pass():
    check_routed_experts(_ids(), num_layers=3, num_experts=8, topk=2)


@pytest.mark.parametrize("ids,message", [
    (_ids(layers=2), "expected [sequences, positions, 3 MoE layers, top-2]"),
    (_ids(topk=3), "expected [sequences, positions, 3 MoE layers, top-2]"),
    (_ids()[0], "do not fit the trainer's model"),
])
def test_ids_of_the_wrong_shape_are_refused(ids, message):
    with pytest.raises(RoutingReplayError) as err:
        check_routed_experts(ids, num_layers=3, num_experts=8, topk=2)
    assert message in str(err.value)


def test_placeholder_micro_batches_route_to_distinct_experts():
    # a DP rank that runs fewer micro-batches than its peers runs token-less placeholders; their routes were zeros
    # (expert 0 chosen k times), which the router's replay must never be given
    from megatron_ais.forward import MicroBatchPlan, micro_batches

    rows = {"tokens": torch.ones(2, 5, dtype=torch.long), "routed_experts": _ids()}
    plan = MicroBatchPlan(rows=((0, 1),), lengths=(5,)).with_placeholders(2, 4)
    placeholder = micro_batches(rows, plan)[1]
    assert placeholder["routed_experts"].shape == (1, 4, 3, 2)
    check_routed_experts(placeholder["routed_experts"], num_layers=3, num_experts=8, topk=2)


def test_ids_out_of_range_or_repeated_are_refused_naming_the_layer():
    ids = _ids()
    ids[1, 3, 2, 0] = 8
    with pytest.raises(RoutingReplayError, match=r"MoE layer 2: routed expert id 8 is outside \[0, 8\)"):
        check_routed_experts(ids, num_layers=3, num_experts=8, topk=2)
    ids = _ids()
    ids[0, 0, 1, 0] = -1
    with pytest.raises(RoutingReplayError, match="MoE layer 1: routed expert id -1"):
        check_routed_experts(ids, num_layers=3, num_experts=8, topk=2)
    ids = _ids()
    ids[0, 4, 1] = torch.tensor([5, 5], dtype=torch.int16)
    with pytest.raises(RoutingReplayError, match="MoE layer 1: a token is routed to the same expert twice"):
        check_routed_experts(ids, num_layers=3, num_experts=8, topk=2)


def test_replay_is_the_default_for_moe_models_and_refused_for_dense_ones():
    assert routing_replay_enabled(None, is_moe=True) and not routing_replay_enabled(None, is_moe=False)
    assert not routing_replay_enabled("none", is_moe=True) and routing_replay_enabled("rollout", is_moe=True)
    with pytest.raises(ArgumentValidationError, match="--moe-routing-replay rollout needs a MoE model"):
        routing_replay_enabled("rollout", is_moe=False)


def test_a_batch_carries_each_rollouts_routes_at_its_input_positions():
    rollouts = [Rollout(0, [1, 2, 3], [4, 5], [-0.1, -0.2], "stop"), Rollout(0, [1, 2, 3], [6], [-0.3], "stop")]
    routes = [_ids(1, 4, 2, seed=1)[0], _ids(1, 3, 2, seed=2)[0]]  # prompt + response minus the last token
    batch = rollouts_to_batch(rollouts, [1.0, 0.0], 2, 8, 0, routes)
    assert batch.routed_experts.shape == (2, 8, 2, 2) and batch.routed_experts.dtype == torch.int16
    assert torch.equal(batch.routed_experts[0, :4], routes[0]) and torch.equal(batch.routed_experts[1, :3], routes[1])
    padding = torch.tensor([0, 1], dtype=torch.int16).expand(5, 2, 2)
    assert torch.equal(batch.routed_experts[1, 3:], padding)
    check_routed_experts(batch.routed_experts, num_layers=2, num_experts=8, topk=2)
    assert rollouts_to_batch(rollouts, [1.0, 0.0], 2, 8, 0).routed_experts is None
