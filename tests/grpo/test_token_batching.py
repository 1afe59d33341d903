"""Batching by tokens changes where the FLOPs go, not what the update computes: on a batch of long-tailed lengths
the old and reference log-probs, λ, the loss and the parameters after one update equal the padded path's (fp32) at
DP2, TP2 and PP2; data-parallel ranks get balanced token counts; micro-batches keep to their budget; bad budgets are
refused naming the flag."""
import random

import pytest
import torch

from bench_train import rollout_batch
from conftest import make_model_dir
from distributed import spawn
from megatron_ais.batch import balanced_partition, row_lengths
from megatron_ais.forward import micro_batches, scatter_rows, token_budget_plan

S, B, GROUP = 32, 8, 4
LENGTHS = [31, 6, 9, 5, 22, 7, 5, 12]  # sequence lengths (prompt of 4 + response), long-tailed


def _worker(hf_dir, layouts):
    import dataclasses

    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.ais import AISConfig, AISState
    from megatron_ais.forward import fixed_plan
    from megatron_ais.grpo.loss import PolicyLossConfig
    from megatron_ais.forward import ParallelGroups, score_rows
    from megatron_ais.grpo.step import GRPOConfig, grpo_train_step, rows_of_whole_batch
    from megatron_ais.training import build_reference_chunks, setup_model_and_optimizer

    out = {}
    for name, flags in layouts:
        # Adam's first step divides each gradient by its own size: where a gradient is nearly zero that would turn
        # float noise into a full step; an epsilon of 1e-2 keeps such steps proportional to the gradient
        trainer, _, build = start_trainer("--hf-dir", hf_dir, "--fp32", "--seq-length", S, "--lr", "1e-2",
                                          "--adam-eps", "1e-2", *flags)
        build = dataclasses.replace(build, variable_seq_lengths=True)
        groups = ParallelGroups.from_parallel_state()
        batch = rollout_batch(LENGTHS, S, build.shape.vocab_size, prompt_length=4, group_size=GROUP)
        padded = GRPOConfig(loss=PolicyLossConfig(kl_coef=0.05), correction=AISConfig(),
                            vocab_size=build.shape.vocab_size, micro_batch_size=2)
        tokens = dataclasses.replace(padded, max_tokens_per_microbatch=2 * S)
        rows = {"tokens": batch.tokens, "labels": batch.labels}
        result = {}
        for label, config in (("padded", padded), ("tokens", tokens)):
            setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
            reference = build_reference_chunks(build, trainer.weights)
            plan = fixed_plan(B, 2, S) if label == "padded" else token_budget_plan(row_lengths(batch.mask), 2 * S)
            logprobs = score_rows(setup.ddp_chunks, rows, plan, groups, build.shape.vocab_size)
            metrics = grpo_train_step(setup.ddp_chunks, setup.optimizer, rows_of_whole_batch(batch, config, groups),
                                      config, AISState(), groups, reference).metrics
            params = torch.cat([p.detach().flatten() for p in setup.chunks[0].parameters()])
            result[label] = (logprobs, metrics, params)
        if groups.is_last_stage:
            (lp_a, m_a, p_a), (lp_b, m_b, p_b) = result["padded"], result["tokens"]
            out[name] = ((lp_a - lp_b).abs().mul(batch.mask).max().item(),
                         {k: (m_a[k], m_b[k]) for k in ("ais/lambda", "train/policy_loss", "train/kl",
                                                          "train/grad_norm", "ais/k3_kl")},
                         (p_a - p_b).abs().max().item())
        ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_token_batches_update_like_padded_ones_at_dp2_tp2_pp2(model_root):
    hf_dir = make_model_dir(model_root, "qwen3", hidden_size=64, intermediate_size=128)
    layouts = [("dp2", []), ("tp2", ["--tensor-model-parallel-size", "2"]),
               ("pp2", ["--pipeline-model-parallel-size", "2"])]
    results = {}
    for rank, rank_result in enumerate(spawn(2, _worker, hf_dir, layouts)):  # every rank's comparisons
        results.update({(name, rank): result for name, result in rank_result.items()})
    assert sorted(results) == [("dp2", 0), ("dp2", 1), ("pp2", 1), ("tp2", 0), ("tp2", 1)]
    # measured: log-probs within 3e-6, λ equal, losses within 5e-7 relative, parameters within 1.2e-7
    for name, (logprob_diff, metrics, param_diff) in results.items():
        assert logprob_diff < 1e-5, (name, logprob_diff)
        for key, (padded, tokens) in metrics.items():
            assert tokens == pytest.approx(padded, rel=1e-4, abs=1e-7), (name, key, padded, tokens)
        # the reference is the policy before the update: its log-probs, put back in the right rows and positions,
        # give a KL of zero (misplaced ones would not)
        assert abs(metrics["train/kl"][1]) < 1e-7 and abs(metrics["train/kl"][0]) < 1e-7, metrics["train/kl"]
        assert param_diff < 1e-6, (name, param_diff)


def test_data_parallel_ranks_get_balanced_tokens():
    rng = random.Random(0)
    lengths = [min(int(rng.paretovariate(1.2) * 40), 1024) for _ in range(512)]  # long-tailed, capped
    for ranks in (2, 4, 8):
        parts = balanced_partition(lengths, ranks)
        assert sorted(i for p in parts for i in p) == list(range(512)) and {len(p) for p in parts} == {512 // ranks}
        loads = [sum(lengths[i] for i in p) for p in parts]
        assert max(loads) <= 1.05 * sum(loads) / ranks, loads
        contiguous = [sum(lengths[r * 512 // ranks:(r + 1) * 512 // ranks]) for r in range(ranks)]
        assert max(loads) < max(contiguous)  # what today's contiguous split gives


def test_micro_batches_keep_to_the_budget_and_round_trip():
    lengths = [31, 6, 9, 5, 22, 7, 5, 12, 1]
    plan = token_budget_plan(lengths, budget=40, multiple=2)
    assert sorted(i for rows in plan.rows for i in rows) == list(range(len(lengths)))
    for rows, length in zip(plan.rows, plan.lengths):
        assert length % 2 == 0 and length >= max(lengths[i] for i in rows) and len(rows) * length <= 40
    assert plan.padded_tokens() < len(lengths) * 32
    values = torch.arange(9 * 32, dtype=torch.float32).view(9, 32)
    mask = torch.zeros(9, 32)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    assert row_lengths(mask) == lengths
    mbs = micro_batches({"tokens": values, "labels": values}, plan.with_placeholders(len(plan) + 1, 2))
    assert mbs[-1]["tokens"].shape == (1, 2) and not mbs[-1]["tokens"].any()
    back = scatter_rows([mb["labels"] for mb in mbs], plan.with_placeholders(len(plan) + 1, 2), (9, 32))
    assert torch.equal(back * mask, values * mask)


@pytest.mark.parametrize("argv,expected", [
    (["--max-tokens-per-microbatch", "100"], "--max-tokens-per-microbatch 100 is smaller than one sequence of "
                                             "--seq-length 256"),
    (["--max-tokens-per-microbatch", "0"], "--max-tokens-per-microbatch 0 must be at least 1"),
])
def test_bad_budgets_are_refused_naming_the_flag(argv, expected):
    from megatron_ais.arguments import GRPORunConfig
    from megatron_ais.errors import ArgumentValidationError
    from pretrain_grpo_ais import build_grpo_parser

    with pytest.raises(ArgumentValidationError, match=expected):
        GRPORunConfig.from_args(build_grpo_parser().parse_args(["--hf-dir", "/m", *argv]), 1)
    # with a budget --micro-batch-size no longer has to divide the mini-batches
    GRPORunConfig.from_args(build_grpo_parser().parse_args(["--hf-dir", "/m", "--micro-batch-size", "7",
                                                            "--max-tokens-per-microbatch", "512"]), 1)
