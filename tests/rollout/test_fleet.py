"""The rollout fleet's data path on real gloo ranks: engines' shares of the prompts; each rank receives from the
engines' hosts exactly the rows its DP rank trains on (what cutting the whole batch would give it, advantages
included, for contiguous and token-balanced shares, one or two engines), and fewer bytes than the whole batch; an
error on one engine's host is raised on every rank naming that engine."""
import pytest
import torch

from distributed import spawn


def _whole_batch(rows: int, group_size: int, seq_length: int, seed: int):
    """A batch of whole groups with varied response lengths and rewards (what engines would make)."""
    from megatron_ais.grpo.step import RolloutBatch

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


def _worker(engines: int, balanced: bool):
    import torch.distributed as dist

    from megatron_ais.errors import RolloutError
    from megatron_ais.grpo.advantages import AdvantageConfig
    from megatron_ais.grpo.batching import row_lengths
    from megatron_ais.grpo.step import data_parallel_rows, with_advantages
    from megatron_ais.initialize import initialize_distributed
    from megatron_ais.rollout.fleet import FleetLayout, exchange_rows, from_every_engine

    initialize_distributed()
    rank, group_size, prompts = dist.get_rank(), 4, 6
    layout = FleetLayout.first_ranks(engines, rank)
    whole = with_advantages(_whole_batch(prompts * group_size, group_size, 12, seed=5), AdvantageConfig())

    def make_part():
        share = layout.prompts(prompts, layout.engine_here)
        return whole.rows(list(range(share.start * group_size, share.stop * group_size)))

    got = exchange_rows(make_part, layout, [0, 1], rank, balanced)
    expected = whole.rows(data_parallel_rows(row_lengths(whole.mask), 2, balanced)[rank])
    same = all(torch.equal(getattr(got.batch, name), getattr(expected, name))
               for name in ("tokens", "labels", "mask", "rollout_logprobs", "rewards", "advantages"))

    def fails_on_last_engine():
        if layout.engine_here == engines - 1:
            raise RuntimeError("engine core died")
        return layout.engine_here

    try:
        from_every_engine(fails_on_last_engine, layout)
        error = None
    except RuntimeError as err:
        error = str(err)
    try:
        from_every_engine(lambda: (_ for _ in ()).throw(RolloutError("generation timed out")), layout)
        shared_kind = None
    except RolloutError as err:
        shared_kind = str(err)
    return (same, torch.equal(got.rewards, whole.rewards), got.response_tokens == int(whole.mask.sum()),
            got.reward_failures, got.received_bytes, got.held_bytes, got.batch_bytes, error, shared_kind)


@pytest.mark.parametrize("engines,balanced", [(2, False), (2, True), (1, True)])
def test_each_rank_receives_only_its_rows(engines, balanced):
    results = spawn(2, _worker, engines, balanced)
    for rank, (same, rewards, tokens, failures, received, held, whole, error, shared_kind) in enumerate(results):
        assert same and rewards and tokens, rank
        assert failures == engines  # every engine's count, summed
        assert held < whole and received <= held, (held, received, whole)
        assert error.startswith(f"engine {engines - 1} (rank {engines - 1} on ")
        assert error.endswith("): RuntimeError: engine core died")
        assert shared_kind.startswith("engine 0 (rank 0 on ") and shared_kind.endswith("): generation timed out")
    if engines == 1:
        assert results[0][4] == 0 and results[1][4] == results[1][5]  # rank 0 made them all, rank 1 got its half


def test_prompt_shares_cover_the_step_in_order():
    from megatron_ais.rollout.fleet import FleetLayout

    for engines in (1, 2, 3, 5):
        layout = FleetLayout.first_ranks(engines, 0)
        for count in (engines, 7, 32):
            shares = [layout.prompts(count, e) for e in range(engines)]
            assert [i for share in shares for i in share] == list(range(count))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert FleetLayout.first_ranks(2, 1).engine_here == 1 and FleetLayout.first_ranks(2, 3).engine_here is None
