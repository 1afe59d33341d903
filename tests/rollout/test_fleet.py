"""The rollout fleet's data path on real gloo ranks: engines' shares of the prompts; each rank receives from the
engines' hosts exactly the rows its DP rank trains on (what cutting the whole batch would give it, advantages
included, for contiguous and token-balanced shares, one or two engines, and when one engine is retired mid-step and
the other makes its prompts), and fewer bytes than the whole batch; the same rows when each host starts making its
share ahead in a thread (`RowsAhead`, returning at once) and the exchange meets it later, also when an engine is
retired between the two (its share made again by the others); below --rollout-min-engines every rank stops,
naming every engine retired in the step; an error on one engine's host is raised on every rank naming that engine;
a process the background worker starts outlives the task that started it."""
import os
import threading

import pytest
import torch

from distributed import spawn


def _whole_batch(rows: int, group_size: int, seq_length: int, seed: int):
    """A batch of whole groups with varied response lengths and rewards (what engines would make)."""
    from megatron_ais.batch import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (rows, seq_length), generator=generator)
    mask = torch.zeros(rows, seq_length)
    for row in range(rows):
        start = int(torch.randint(1, 4, (), generator=generator))
        mask[row, start:start + int(torch.randint(1, seq_length - start, (), generator=generator))] = 1.0
    return RolloutBatch(tokens=tokens, labels=tokens.roll(-1, dims=1), mask=mask,
                        rollout_logprobs=-torch.rand(rows, seq_length, generator=generator) * mask,
                        rewards=torch.randint(0, 2, (rows,), generator=generator).float(), group_size=group_size,
                        reward_failures=1)


def _worker(engines: int, balanced: bool, retiring: bool):
    import torch.distributed as dist

    from megatron_ais.errors import EngineRetiredError, RolloutError
    from megatron_ais.grpo.advantages import AdvantageConfig
    from megatron_ais.batch import row_lengths
    from megatron_ais.batch import data_parallel_rows
    from megatron_ais.grpo.advantages import with_advantages
    from megatron_ais.distributed import initialize_distributed
    from megatron_ais.rollout.fleet_layout import FleetLayout, from_every_engine
    from megatron_ais.rollout.rows import BackgroundWorker, RowsAhead, exchange_rows, make_rows

    if not dist.is_initialized():
        initialize_distributed()
    rank, group_size, prompts = dist.get_rank(), 4, 6
    layout = FleetLayout.first_ranks(engines, rank)
    whole = with_advantages(_whole_batch(prompts * group_size, group_size, 12, seed=5), AdvantageConfig())

    def make(share: range):
        if retiring and rank == engines - 1:  # the last engine died past its restart budget
            raise EngineRetiredError("the rollout engine died again")
        return whole.rows(list(range(share.start * group_size, share.stop * group_size)))

    made = make_rows(make, layout, prompts, min_engines=1)
    got = exchange_rows(made, [0, 1], rank, balanced)
    expected = whole.rows(data_parallel_rows(row_lengths(whole.mask), 2, balanced)[rank])
    names = ("tokens", "labels", "mask", "rollout_logprobs", "rewards", "advantages")
    same = all(torch.equal(getattr(got.batch, name), getattr(expected, name)) for name in names)

    released = threading.Event()

    def make_once_released(share: range):  # made synchronously, this would wait for ever (30 s) for the release
        assert released.wait(30), "RowsAhead made the rows before returning"
        return make(share)

    ahead = RowsAhead(make_once_released, layout, prompts, BackgroundWorker("test-ahead"))
    released.set()
    made_ahead = make_rows(make, layout, prompts, min_engines=1, ahead=ahead)
    got_ahead = exchange_rows(made_ahead, [0, 1], rank, balanced)
    same = same and all(torch.equal(getattr(got_ahead.batch, name), getattr(expected, name)) for name in names)
    same = same and made_ahead.layout.hosts == made.layout.hosts and made_ahead.retired == made.retired
    if engines == 2:  # engine 1 retired (by a sync) after its share was started ahead: engine 0 makes that share
        ahead = RowsAhead(make, layout, prompts, BackgroundWorker("test-ahead-shrunk"))
        made_shrunk = make_rows(make, layout.without([1]), prompts, min_engines=1, ahead=ahead)
        got_shrunk = exchange_rows(made_shrunk, [0, 1], rank, balanced)
        same = same and all(torch.equal(getattr(got_shrunk.batch, name), getattr(expected, name)) for name in names)
        same = same and made_shrunk.layout.hosts == (0,) and not made_shrunk.retired
        same = same and [r.host for r in made_shrunk.records] == [0, 0]
    try:  # with a minimum of 2 serving engines a retirement stops every rank
        make_rows(make, layout, prompts, min_engines=2)
        stopped = None
    except EngineRetiredError as err:
        stopped = str(err)

    def fails_on_last_engine():
        if layout.engine_here == engines - 1:
            raise RuntimeError("engine core died")
        return layout.engine_here

    errors = []
    for compute in (fails_on_last_engine, lambda: (_ for _ in ()).throw(RolloutError("generation timed out"))):
        try:
            from_every_engine(compute, layout)
        except (RuntimeError, RolloutError) as err:
            errors.append((type(err).__name__, str(err)))
    return (same, torch.equal(got.rewards, whole.rewards), got.response_tokens == int(whole.mask.sum()),
            got.reward_failures, got.received_bytes, got.held_bytes, got.batch_bytes, made.layout.hosts,
            made.retired, stopped, errors)


CASES = [(2, False, False), (2, True, False), (1, True, False), (2, False, True)]  # engines, balanced, retiring


def _every_case():
    return [_worker(*case) for case in CASES]


def test_each_rank_receives_only_its_rows():
    per_rank = spawn(2, _every_case)
    for case, results in enumerate(zip(*per_rank)):
        _check_case(*CASES[case], results)


def _check_case(engines, balanced, retiring, results):
    for rank, (same, rewards, tokens, failures, received, held, whole, hosts, retired, stopped, errors) in \
            enumerate(results):
        assert same and rewards and tokens, rank
        assert failures == engines  # every run of prompts' count, summed (engine 0 made two when engine 1 retired)
        assert held < whole and received <= held, (held, received, whole)
        (kind, message), (shared_kind, shared_message) = errors
        assert kind == "RuntimeError" and message.startswith(f"engine {engines - 1} (rank {engines - 1} on ")
        assert message.endswith("): RuntimeError: engine core died")
        assert shared_kind == "RolloutError" and shared_message.startswith("engine 0 (rank 0 on ")
        assert shared_message.endswith("): generation timed out")
        if retiring:  # engine 1's prompts were made by engine 0 in the same step; rank 1 was sent its half
            assert hosts == (0,) and len(retired) == 1 and retired[0].startswith("engine 1 (rank 1 on ")
            assert stopped.endswith("1 engine(s) left, fewer than --rollout-min-engines 2: stopping")
        else:
            assert hosts == tuple(range(engines)) and not retired and stopped is None
    if engines == 1 or retiring:
        assert results[0][4] == 0 and results[1][4] == results[1][5]  # rank 0 made them all, rank 1 got its half


def test_prompt_shares_cover_the_step_in_order():
    from megatron_ais.rollout.fleet_layout import FleetLayout

    for engines in (1, 2, 3, 5):
        layout = FleetLayout.first_ranks(engines, 0)
        for count in (engines, 7, 32):
            shares = [layout.share(range(count), e) for e in range(engines)]
            assert [i for share in shares for i in share] == list(range(count))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert FleetLayout.first_ranks(2, 1).engine_here == 1 and FleetLayout.first_ranks(2, 3).engine_here is None
    assert FleetLayout.first_ranks(3, 0).without([1]).share(range(4, 10), 2) == range(7, 10)


def test_refit_checks_rotate_over_the_serving_engines():
    from megatron_ais.rollout.fleet_layout import FleetLayout

    layout = FleetLayout((0, 1, 8, 9, 16), rank=0)
    assert layout.rotating(0, 3) == layout and layout.rotating(5, 3) == layout  # 0 or all: every engine
    turns = [layout.rotating(2, turn).hosts for turn in range(5)]
    assert turns == [(0, 1), (8, 9), (0, 16), (1, 8), (9, 16)]
    # every engine is checked within ceil(5 / 2) = 3 consecutive checks
    for first in range(3):
        assert set().union(*turns[first:first + 3]) == set(layout.hosts)
    assert layout.rotating(2, 0).rank == 0 and layout.without([1]).rotating(1, 1).hosts == (8,)


def test_stopping_names_every_engine_retired_in_the_step():
    """Engine 1 retired in a step's first round, engine 0 in the round that made engine 1's share: the stop names
    both (the first had not yet been told)."""
    from megatron_ais.errors import EngineRetiredError
    from megatron_ais.rollout.fleet_layout import FleetLayout, Retired, retire

    left, told = retire([("rows",), Retired("engine 1: died")], FleetLayout((0, 1), rank=0), min_engines=1)
    assert left.hosts == (0,) and told == ["engine 1: died"]
    with pytest.raises(EngineRetiredError, match=r"^engine 1: died; engine 0: died; 0 engine\(s\) left, fewer than "
                                                 r"--rollout-min-engines 1: stopping$"):
        retire([Retired("engine 0: died")], left, 1, told)


def test_sharded_evaluation_means_are_the_whole_evaluations():
    """Each engine evaluates its share of the held-out prompts (the samples equal one engine's: per-prompt seeds,
    tests/rollout/test_fleet_nodes.py) and returns sums and counts; their means are the whole evaluation's."""
    from megatron_ais.rollout.fleet_layout import FleetLayout
    from megatron_ais.rollout.manager import mean_rewards

    rewards = [[1.0, 0.0], [0.5, 0.5], [0.0, 0.0], [1.0, 1.0], [0.25, 1.0], [0.0, 1.0], [1.0, 0.75]]  # per prompt
    whole = sum(map(sum, rewards)) / sum(map(len, rewards))
    for engines in (1, 2, 3, 7):
        layout = FleetLayout.first_ranks(engines, 0)
        parts = [{"eval/accuracy": (sum(sum(rewards[i]) for i in share), sum(len(rewards[i]) for i in share))}
                 for share in (layout.share(range(len(rewards)), e) for e in layout.hosts)]
        assert mean_rewards(parts)["eval/accuracy"] == pytest.approx(whole, rel=1e-12)
    assert mean_rewards([{"eval/accuracy": (1.0, 2)}, {}]) == {}  # an engine that skipped: no evaluation


# a process that asks to die with its parent (what `lifetime.exit_with_parent` asks of every process a run starts,
# vLLM's engine core included), says so, then waits
CHILD = ("from megatron_ais.lifetime import exit_with_parent; import time; exit_with_parent(); print('ready', "
         "flush=True); time.sleep(60)")


def _started_by(run_in_thread) -> "subprocess.Popen":
    """A CHILD started by a task that returns once the child is ready (as starting vLLM's engine returns once its
    core answers), run by `run_in_thread`."""
    import subprocess
    import sys

    started = []

    def start():
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        started.append(child)

    run_in_thread(start)
    return started[0]


def _alive_after(child, seconds: float = 3.0) -> bool:
    import time

    deadline = time.time() + seconds
    while time.time() < deadline and child.poll() is None:
        time.sleep(0.05)
    alive = child.poll() is None
    child.kill()
    child.wait()
    return alive


def test_a_process_started_by_the_background_worker_outlives_the_task_that_started_it():
    """The engine a host's background generation restarts must outlive that generation: Linux's parent-death signal
    follows the thread that started a process, so a thread per task would take the engine with it when the task
    ends (the control); the worker's one long-lived thread does not."""
    from megatron_ais.rollout.rows import BackgroundWorker

    worker = BackgroundWorker("test-lifetime")

    def on_worker(task):
        assert worker.start(task).wait(30)

    def on_a_thread_of_its_own(task):
        thread = threading.Thread(target=task)
        thread.start()
        thread.join()

    assert _alive_after(_started_by(on_worker))
    assert not _alive_after(_started_by(on_a_thread_of_its_own))


def _beside_a_training_collective_worker():
    import torch.distributed as dist

    from megatron_ais.distributed import initialize_distributed
    from megatron_ais.grpo.advantages import AdvantageConfig, with_advantages
    from megatron_ais.rollout.fleet_layout import FleetLayout
    from megatron_ais.rollout.rows import exchange_rows, make_rows

    if not dist.is_initialized():
        initialize_distributed()
    rank, group_size, prompts = dist.get_rank(), 4, 4
    layout = FleetLayout((0, 1), rank, dist.new_group())
    whole = with_advantages(_whole_batch(prompts * group_size, group_size, 12, seed=7), AdvantageConfig())
    training = torch.ones(4)
    # rank 0 has a training collective in flight on another group, which rank 1 joins only after the rollouts
    pending = dist.all_reduce(training, async_op=True) if rank == 0 else None
    made = make_rows(lambda share: whole.rows(list(range(share.start * group_size, share.stop * group_size))),
                     layout, prompts, min_engines=1)
    got = exchange_rows(made, [0, 1], rank, balanced=False)
    if rank == 1:
        dist.all_reduce(training)
    else:
        pending.wait()
    return got.batch.tokens.shape[0], float(training[0])


def test_rollout_collectives_do_not_wait_behind_a_training_one():
    """The fleet's collectives (the hosts' records, the row exchange) run on the fleet's own process group: with a
    collective in flight on another group that one rank joins only after the rollouts, the rollouts still go
    through (on a shared group the ranks would issue their collectives in different orders and hang)."""
    assert spawn(2, _beside_a_training_collective_worker, timeout=90) == [(8, 2.0), (8, 2.0)]


def _retired_leader_worker():
    """Three ranks on two simulated nodes: rank 0 holds the arena (node0), ranks 1 and 2 each host an engine on
    node1, where rank 1, the first, holds the node's copy. With rank 1's engine retired, what does rank 2 apply?"""
    os.environ["MEGATRON_AIS_NODE_NAME"] = "node0" if os.environ["RANK"] == "0" else "node1"
    import torch.distributed as dist

    from megatron_ais.bridge.arena import ArenaWeights, SharedBuffer
    from megatron_ais.bridge.buckets import manifest_entry
    from megatron_ais.bridge.node_copies import NodeCopies, node_leaders
    from megatron_ais.distributed import initialize_distributed, node_name
    from megatron_ais.rollout.fleet_layout import FleetLayout, apply_on_every_engine

    initialize_distributed()
    rank = dist.get_rank()
    node_of = [None] * dist.get_world_size()
    dist.all_gather_object(node_of, node_name())
    fleet = FleetLayout.per_node(2, rank, node_of)
    copies = NodeCopies(0, node_leaders(fleet.hosts, node_of, 0), rank)
    tensor = torch.arange(16, dtype=torch.float32)
    arena = SharedBuffer.create(f"test-retired-leader-{os.getpid()}", 64) if rank == 0 else None
    if arena is not None:
        arena.data.copy_(tensor.view(torch.uint8))
    weights = ArenaWeights(arena.ref if arena is not None else None, (manifest_entry("w", tensor, 0),))
    applied = apply_on_every_engine(weights, copies, fleet.without([1]), node_of, lambda w: w is weights, 1)
    copies.close()
    if arena is not None:
        arena.close()
    return fleet.hosts, copies.leaders, applied


def test_the_engines_of_a_node_whose_copy_holder_retired_apply_that_copy():
    # they applied the arena rank's own weights: on a real cluster a /dev/shm file or CUDA handle of another node,
    # so the first sync after the retirement stopped the run
    (hosts, leaders, applied), *_ = spawn(3, _retired_leader_worker, timeout=120)
    assert hosts == (0, 1, 2) and leaders == (1,)
    assert applied == [True, False]  # rank 0 applies the arena; rank 2 the copy its node's retired engine host holds


class _DyingOnceEngine:
    """An engine that dies in its first weight sync; its probe log-probs are 0.35 off the trainer's own routing
    (a healthy BF16 MoE engine's near-tie routes, measured in rollout/verify.py), within tolerance once replayed."""

    def __init__(self):
        self.updates, self.restarts = 0, 0

    def update_weights(self, weights):
        self.updates += 1
        if self.updates == 1:
            raise RuntimeError("EngineCore died")
        return self.updates

    def health_check(self):
        return self.updates > 1 or self.restarts > 0

    def restart(self, weights=None):
        self.restarts += 1
        return 0

    def prompt_logprobs(self, probe):
        return torch.full((len(probe) - 1,), -1.35)

    def shutdown(self):
        pass


@pytest.mark.parametrize("moe", [True, False])
def test_an_engine_restarted_inside_a_moe_sync_waits_for_the_replayed_check(moe):
    # its own-routing reference failed a healthy MoE engine every restart until it was retired
    from megatron_ais.errors import EngineRetiredError
    from megatron_ais.rollout.manager import RolloutManager, ServingPolicy
    from megatron_ais.rollout.verify import RefitReference

    messages, engine = [], _DyingOnceEngine()
    manager = RolloutManager(engine, None, None, None, 0, 0, messages.append, None, ServingPolicy(max_restarts=3))
    own_routing = RefitReference([1, 2, 3, 4, 5], torch.full((4,), -1.0), "bf16", awaits_replay=moe)
    if not moe:  # a dense model's reference is the trainer's: the same engine fails it, restart after restart
        with pytest.raises(EngineRetiredError, match="failed its refit check"):
            manager.apply_weights("weights", own_routing, 1)
        return
    assert manager.apply_weights("weights", own_routing, 1) == 1
    assert engine.restarts == 1 and engine.updates == 2
    assert manager.take_restarted_unchecked() and not manager.take_restarted_unchecked()
    assert messages[-1] == "weight sync: the restarted engine's refit is checked once the sync is applied"
