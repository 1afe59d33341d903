"""The refit check's statistic for low-precision engines: a trimmed mean of the probe's |Δ| log-prob (the tenth of
positions with the largest |Δ| left out), so that a few tail tokens of a confident model do not stop a run, while
weights that move most positions are refused."""
import pytest
import torch

from megatron_ais.errors import RefitVerificationError
from megatron_ais.rollout.verify import verify_refit


def _logprobs(diffs):
    trainer = -torch.linspace(1.0, 12.0, len(diffs))
    return trainer + torch.tensor(diffs), trainer


def test_a_few_tail_positions_far_off_pass_and_a_broad_shift_is_refused():
    tail = [0.2] * 44 + [8.0] * 4  # mean 0.85: over the fp8 row's 0.5, a false alarm before the trimmed mean
    report = verify_refit(*_logprobs(tail), "fp8")
    assert report.passed and report.mean_abs_diff == pytest.approx(0.85) and report.max_abs_diff == pytest.approx(8.0)
    with pytest.raises(RefitVerificationError, match="trimmed mean \\|engine - trainer\\| log-prob 6.000e-01 > 0.5"):
        verify_refit(*_logprobs([0.6] * 44 + [8.0] * 4), "fp8")
    with pytest.raises(RefitVerificationError):  # more than a tenth of the positions far off
        verify_refit(*_logprobs([0.2] * 40 + [8.0] * 8), "fp8")
    with pytest.raises(RefitVerificationError):  # fp32 engines keep the max
        verify_refit(*_logprobs([0.0] * 47 + [1e-3]), "fp32")


def test_the_4bit_rows_pass_a_trained_moe_engines_own_rounding_and_refuse_wrong_weights():
    # an MXFP4 engine with an FP8 KV cache on the trained MoE (replayed routes): trimmed means 1.02-1.13 measured
    for precision in ("nvfp4", "mxfp4"):
        assert verify_refit(*_logprobs([1.13] * 44 + [7.3] * 4), precision).passed
        with pytest.raises(RefitVerificationError, match=f"failed for the {precision} engine"):
            verify_refit(*_logprobs([1.9] * 48), precision)  # a stale lm_head's size
