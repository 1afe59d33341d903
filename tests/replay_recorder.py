"""pretrain_grpo_ais.py with its MoE routing replay recorded, for tests/test_pretrain_grpo_ais.py: every trainer rank
saves under $REPLAY_RECORD_DIR the expert ids its engine returned for rollouts (`RolloutEngine.route`), those of the
refit check's probe apart (`RolloutEngine.probe_routing`), and, for every forward given ids to replay, those ids, whether it computed gradients (the update) or
not (scoring), and the routing map each router used. Nothing else changes: the run is the entry point's `main`."""
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pretrain_grpo_ais  # noqa: E402  (first, as for the entry point itself: vLLM's engine processes import it)


def record_routing(directory: str) -> None:
    """Wrap the engine's `route` and the routers' replay so that what passes through is saved in `directory`."""
    # here, not above: vLLM's engine processes import this module too (as __mp_main__) and need none of it
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ais import routing_replay
    from megatron_ais.engine.vllm_engine import RolloutEngine

    counter, rank = itertools.count(), os.environ["RANK"]

    def save(kind: str, record: dict) -> None:
        torch.save(record, os.path.join(directory, f"{kind}-rank{rank}-{next(counter)}.pt"))

    route, probe_routing, probing = RolloutEngine.route, RolloutEngine.probe_routing, []

    def recorded_route(self, sequences):
        routes = route(self, sequences)
        if not probing:
            save("engine", {"routes": [r.clone() for r in routes]})
        return routes

    def unrecorded_probe_routing(self, token_ids):
        probing.append(True)
        try:
            routes = probe_routing(self, token_ids)
        finally:
            probing.pop()
        save("probe", {"routes": torch.stack(routes, dim=1)})
        return routes

    set_replayed_routes, pending = routing_replay.set_replayed_routes, []

    def recorded_set_replayed_routes(model, ids):
        for hooks, record in pending:  # the replaying forward is over: save what its routers did
            for hook in hooks:
                hook.remove()
            save("replay", record)
        pending.clear()
        if ids is not None:
            record = {"ids": ids.detach().cpu(), "grad": torch.is_grad_enabled(), "maps": {}}
            hooks = [router.register_forward_hook(
                lambda module, args, output, layer=router.layer_number - 1: record["maps"].__setitem__(
                    layer, output[1].detach().cpu())) for router in model.modules() if isinstance(router, TopKRouter)]
            pending.append((hooks, record))
        set_replayed_routes(model, ids)

    RolloutEngine.route, RolloutEngine.probe_routing = recorded_route, unrecorded_probe_routing
    routing_replay.set_replayed_routes = recorded_set_replayed_routes


if __name__ == "__main__":
    record_routing(os.environ["REPLAY_RECORD_DIR"])
    sys.exit(pretrain_grpo_ais.main())
