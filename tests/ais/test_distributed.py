"""λ from statistics all-reduced over DP ranks holding different numbers of tokens is bit-identical on every
rank and equals a single-process computation on the concatenated batch (AIS-R's diagnostics and the bias test)."""
import pytest
import torch

from distributed import spawn
from megatron_ais.ais import AISConfig, ais_coefficient, mismatch_statistics


def _rank_batch(rank, level_seed=0):
    g = torch.Generator().manual_seed(100 + rank + level_seed)
    b = 1 + 2 * rank  # 1, 3, 5, 7 sequences: different local token counts
    trainer = -torch.rand(b, 9, generator=g) * 4
    rollout = trainer + 0.2 * torch.randn(b, 9, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, 9).clone()
    mask = (torch.rand(b, 9, generator=g) > 0.3).float()
    return trainer, rollout, adv, mask


def _worker(level, lambda_rule):
    import torch.distributed as dist

    from megatron_ais.ais import reduce_statistics
    from megatron_ais.distributed import initialize_distributed

    initialize_distributed()
    cfg = AISConfig(level=level, lambda_rule=lambda_rule)
    stats = mismatch_statistics(*_rank_batch(dist.get_rank()), cfg)
    stats = reduce_statistics(stats, dist.group.WORLD)
    result = ais_coefficient(stats, cfg)
    return result.lam.hex(), result


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_lambda_bit_identical_and_equal_to_single_process(world):
    for level, lambda_rule in (("token", "diagnostics"), ("sequence", "diagnostics"), ("token", "bias-test")):
        results = spawn(world, _worker, level, lambda_rule)
        assert len({hex_lam for hex_lam, _ in results}) == 1, results
        parts = [_rank_batch(r) for r in range(world)]
        whole = [torch.cat([p[i] for p in parts]) for i in range(4)]
        cfg = AISConfig(level=level, lambda_rule=lambda_rule)
        single = ais_coefficient(mismatch_statistics(*whole, cfg), cfg)
        for _, distributed in results:  # every rank's
            assert distributed.lam == pytest.approx(single.lam, rel=1e-13, abs=1e-15)
            assert distributed.num_units == single.num_units
            assert (distributed.bias, distributed.bias_z) == pytest.approx((single.bias, single.bias_z), rel=1e-12)
        if lambda_rule == "diagnostics":
            assert 0 < single.lam < 1
        else:  # noise only: z is small, λ clipped to 0 (or the mean is negative)
            assert single.lam == (max(0.0, 1 - 1 / single.bias_z ** 2) if single.bias > 0 else 0.0)
