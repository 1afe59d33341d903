"""--dynamic-sampling: the selection of informative groups (unit), the stream of rounds (round 0 is the stream of a
run without it; later rounds depend only on the seeds, the step and the round), the records every rank computes for
the picked rows agree with the rows the host picks, and on real gloo ranks a fleet of two engines' hosts samples
rounds until each DP rank holds a full share of groups with reward variance, or masks the filler groups of a step
still short after --max-sampling-rounds (and says so), the same on every submission of a step."""
import dataclasses
import random

import pytest
import torch

from distributed import spawn
from megatron_ais.batch import RolloutBatch
from megatron_ais.data.tasks import build_task, TaskConfig
from megatron_ais.grpo.advantages import AdvantageConfig, with_advantages
from megatron_ais.rollout.dynamic_sampling import DynamicSamplingConfig, select_groups, stream_seed
from megatron_ais.rollout.manager import step_example_indices, step_examples
from megatron_ais.rollout.rows import MadeRows, RowsRecord, pick_groups, picked_rows

GROUP = 4
PROMPTS = 6


def _informative(step: int, round_index: int, prompt: int) -> bool:
    """Two of every round's six prompts have reward variance; the others are all correct or all wrong."""
    return (prompt + 2 * round_index + step) % 3 == 0


def _group_rows(step: int, round_index: int, prompts: range, seq_length: int = 16) -> RolloutBatch:
    """Whole groups of the step's round's prompts, whose first token names (step, round, prompt)."""
    rows = len(prompts) * GROUP
    tokens = torch.zeros(rows, seq_length, dtype=torch.long)
    mask, rewards = torch.zeros(rows, seq_length), []
    for index, prompt in enumerate(prompts):
        if _informative(step, round_index, prompt):
            rewards += [1.0, 0.0, 0.0, 1.0]
        else:
            rewards += [float(prompt % 2)] * GROUP
        for member in range(GROUP):
            row = index * GROUP + member
            tokens[row, 0] = step * 10000 + round_index * 100 + prompt
            mask[row, 1:2 + (prompt + member + round_index) % 12] = 1.0
    batch = RolloutBatch(tokens=tokens, labels=tokens.roll(-1, 1), mask=mask, rollout_logprobs=-0.1 * mask,
                         rewards=torch.tensor(rewards), group_size=GROUP, truncated=1, repetitive=2)
    return with_advantages(batch, AdvantageConfig())


def test_selection_takes_the_first_informative_groups_and_fills_a_short_batch_with_blanks():
    rewards = [(1, 1), (0, 1), (0, 0), (1, 0), (0.5, 0.5), (0, 1)]
    full = select_groups(rewards, 2, rounds=2)
    assert full.picked == (1, 3) and not full.blank and full.informative == 2
    short = select_groups(rewards, 4, rounds=2)
    assert short.picked == (0, 1, 3, 5) and short.blank == {0} and short.informative == 3
    metrics = short.metrics(group_size=2)
    assert metrics["sampling/filtered_fraction"] == pytest.approx(3 / 6) and metrics["sampling/rounds"] == 2
    assert metrics["sampling/prompts_sampled"] == 6 and metrics["sampling/informative_groups"] == 3


def test_round_zero_is_the_stream_without_dynamic_sampling_and_later_rounds_depend_only_on_the_step():
    task = build_task(TaskConfig(task="arithmetic"), 3)
    assert stream_seed(7, 5, 0) == 7 * 100003 + 5
    before = random.Random(7 * 100003 + 5).sample(task.train, 8)  # how a step's prompts were drawn before rounds
    assert step_examples(task, 8, 7, 5) == before == step_examples(task, 8, 7, 5, 0)
    rounds = [step_examples(task, 8, 7, 5, r) for r in range(1, 4)]
    assert rounds == [step_examples(task, 8, 7, 5, r) for r in range(1, 4)]  # a resumed run draws the same
    assert all(r != before for r in rounds) and rounds[0] != rounds[1]
    # no training example twice in a step's rounds; once too few are left, a round draws from all of them again
    drawn = [i for r in range(4) for i in step_example_indices(len(task.train), 8, 7, 5, r)]
    assert len(set(drawn)) == len(drawn) == 32
    first_two = set(step_example_indices(12, 5, 7, 5, 0)) | set(step_example_indices(12, 5, 7, 5, 1))
    assert len(first_two) == 10 and len(set(step_example_indices(12, 5, 7, 5, 2))) == 5
    assert len({stream_seed(7, step, r) for step in range(1, 50) for r in range(4)}) == 49 * 4


def test_the_records_every_rank_computes_agree_with_the_rows_the_host_picks():
    rounds = []
    for round_index in range(2):
        made = {start: _group_rows(1, round_index, range(start, stop)) for start, stop in ((0, 3), (3, 6))}
        records = [RowsRecord.of(batch, host, start, 0.5) for host, (start, batch) in enumerate(made.items())]
        rounds.append(MadeRows(records, None, made, []))
    picked, blank = [1, 4, 5, 7, 9, 10], {5, 9}
    rows = pick_groups(rounds, picked, blank, PROMPTS)
    assert [r.first_prompt for r in rows.records] == [0, 1, 3, 4]
    for record in rows.records:
        assert record == dataclasses.replace(RowsRecord.of(rows.made[record.first_prompt], record.host,
                                                           record.first_prompt, record.seconds),
                                             reward_failures=0, reward_timeouts=0, truncated=0, repetitive=0)
    firsts = torch.cat([rows.made[r.first_prompt].tokens[::GROUP, 0] for r in rows.records]).tolist()
    assert firsts == [10001, 10004, 10005, 10101, 10103, 10104]  # step 1; round 1, prompt 1: stream position 7
    blank_rows = picked_rows(_group_rows(1, 0, range(6)), [1, 5], {5})
    assert blank_rows.mask[GROUP:].sum() == 0 and blank_rows.mask[:GROUP].sum() > 0
    assert len(rows.made_records) == 4 and sum(r.truncated for r in rows.made_records) == 4
    assert sum(r.repetitive for r in rows.made_records) == 8


class _GroupMaker:
    """Stands in for an engine host's RolloutManager: the same whole groups for the same (step, round, prompts),
    as the real one makes from the seeds (the stream test above)."""

    def rollout_rows(self, step: int, prompts: range, round_index: int = 0, policy_version: int = 0) -> RolloutBatch:
        return _group_rows(step, round_index, prompts)


def _fleet_worker(max_rounds: int, balanced: bool):
    import torch.distributed as dist

    from megatron_ais.distributed import initialize_distributed
    from megatron_ais.rollout.fleet import FleetConfig, RolloutFleet
    from megatron_ais.rollout.fleet_layout import FleetLayout

    if not dist.is_initialized():
        initialize_distributed()
    rank, said = dist.get_rank(), []
    fleet = RolloutFleet(FleetLayout.first_ranks(2, rank), ["node"] * 2, [0, 1], rank, _GroupMaker(), None,
                         FleetConfig(), PROMPTS, 0, balanced, said.append,
                         DynamicSamplingConfig(enabled=True, max_rounds=max_rounds))
    # step 1 again, its first round generated ahead (--max-off-policy-steps): the same rows as made at once
    got = [fleet.submit(1).wait(), fleet.submit(2).wait(), fleet.submit(1, ahead=True).wait()]
    out = []
    for rollouts in got:
        batch = rollouts.batch
        out.append((batch.tokens[:, 0].tolist(), batch.rewards.tolist(), batch.mask.sum(dim=1).tolist(),
                    rollouts.rewards.tolist(), rollouts.sampling, rollouts.truncated, rollouts.sampled_rows,
                    rollouts.repetitive))
    return out, said


FLEET_CASES = [(3, False), (3, True), (2, False)]  # --max-sampling-rounds, token-balanced DP shares


def _every_fleet_case():
    return [_fleet_worker(*case) for case in FLEET_CASES]


def test_two_engines_collect_full_batches_of_informative_groups_or_mask_a_short_steps_fillers():
    per_rank = spawn(2, _every_fleet_case)
    for case, results in enumerate(zip(*per_rank)):
        check = _check_full if FLEET_CASES[case][0] == 3 else _check_short
        check(*results)


def _check_full(rank0_result, rank1_result):
    (rank0, said0), (rank1, said1) = rank0_result, rank1_result
    assert not said0 and not said1
    for step, (mine0, mine1) in zip((1, 2, 1), zip(rank0, rank1)):
        rows = len(mine0[0]) + len(mine1[0])
        assert rows == PROMPTS * GROUP and len(mine0[0]) == len(mine1[0])  # full, equal DP shares
        groups = {}
        for tokens, rewards, tokens_in_loss, *_ in (mine0, mine1):
            for first, reward, in_loss in zip(tokens, rewards, tokens_in_loss):
                groups.setdefault(first, []).append(reward)
                assert in_loss > 0
        assert len(groups) == PROMPTS and all(max(r) > min(r) for r in groups.values())  # no zero-variance group
        # the first six informative groups of the stream: two per round over three rounds
        expected = sorted(step * 10000 + r * 100 + p for r in range(3) for p in range(PROMPTS) if _informative(step, r, p))
        assert sorted(groups) == expected
        sampling = mine0[4]
        assert sampling == mine1[4] and sampling["sampling/rounds"] == 3 and sampling["sampling/prompts_sampled"] == 18
        assert sampling["sampling/filtered_fraction"] == pytest.approx(12 / 18)
        assert mine0[5] == 6 and mine0[6] == 18 * GROUP  # truncated and made responses count every round
        assert mine0[7] == 12  # so do repetitive ones
    assert rank0[0] == rank0[2] and rank1[0] == rank1[2]  # step 1 again (made ahead): the same stream


def _check_short(rank0_result, rank1_result):
    """A step short after the last round trains on its informative groups; the batch keeps its shape."""
    (rank0, said0), (rank1, _) = rank0_result, rank1_result
    tokens = rank0[0][0] + rank1[0][0]
    in_loss = rank0[0][2] + rank1[0][2]
    rewards = rank0[0][1] + rank1[0][1]
    assert len(tokens) == PROMPTS * GROUP
    trained = {t for t, n in zip(tokens, in_loss) if n > 0}
    assert len(trained) == 4  # two rounds of two informative groups
    for group in trained:
        group_rewards = [r for t, r in zip(tokens, rewards) if t == group]
        assert max(group_rewards) > min(group_rewards)
    assert len(set(tokens) - trained) == 2  # two blank groups, masked out of the loss
    assert rank0[0][4]["sampling/informative_groups"] == 4
    assert any("found 4 of 6 groups with reward variance in 2 round(s)" in line for line in said0)


def _parity_or_all(response: str, answer: str) -> float:
    """A reward a random tiny model earns: every response is right for an "all" prompt (an all-correct group),
    otherwise a response is right when its text has an even length (its group usually mixed)."""
    return 1.0 if answer == "all" else float(len(response) % 2 == 0)


def _engine_fleet_worker(model_dir: str, work: str):
    import torch.distributed as dist

    from megatron_ais.data.tasks import Example, Task
    from megatron_ais.distributed import initialize_distributed
    from megatron_ais.engine.vllm_engine import RolloutEngine, SamplingConfig
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.rollout.fleet import FleetConfig, RolloutFleet
    from megatron_ais.rollout.fleet_layout import FleetLayout, cpu_core_of
    from megatron_ais.rollout.manager import RolloutManager, RolloutPlan
    from megatron_ais.rollout.rewards import RewardConfig, RewardScorer
    from megatron_ais.hf_assets import load_tokenizer

    initialize_distributed()
    rank, said = dist.get_rank(), []
    tokenizer = load_tokenizer(model_dir)
    examples = [Example(f"say {i}", "all" if i % 2 else "parity") for i in range(40)]
    task = Task(train=examples, eval=examples[:2], reward=_parity_or_all)
    sampling = SamplingConfig(n=GROUP, temperature=1.0, max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,))
    plan = RolloutPlan(4, sampling, 1, 0, 64, lambda batch: with_advantages(batch, AdvantageConfig()))
    engine = RolloutEngine(EngineConfig(model_dir=model_dir, precision="fp32", kv_cache_gb=0.25,
                                        placement="separate", cpu_core=cpu_core_of(rank)), f"{work}/engine-{rank}")
    manager = RolloutManager(engine, tokenizer, task, plan, 11, 12, said.append, RewardScorer(task.reward,
                                                                                              RewardConfig()))
    fleet = RolloutFleet(FleetLayout.first_ranks(2, rank), ["node"] * 2, [0, 1], rank, manager, None, FleetConfig(),
                         4, 0, False, said.append, DynamicSamplingConfig(enabled=True, max_rounds=12))
    try:
        # step 1 again, its first round generated ahead by both engines (--max-off-policy-steps): the same rows
        got = [fleet.submit(1).wait(), fleet.submit(2).wait(), fleet.submit(1, ahead=True).wait()]
    finally:
        engine.shutdown()
    return [(r.batch.tokens.tolist(), r.batch.rewards.tolist(), r.batch.mask.sum(dim=1).tolist(), r.sampling)
            for r in got], said


@pytest.mark.slow
def test_two_real_engines_train_only_on_groups_with_reward_variance_and_a_step_samples_the_same_again(model_root,
                                                                                                      tmp_path):
    """Two vLLM engines (one per rank) and a task where half the prompts are all-correct: every step collects its
    4 groups with reward variance over the rounds it needs, each DP rank holds a full half of them, and step 1
    submitted again (what a resumed run does) makes the same rows."""
    from conftest import make_model_dir

    # the end-to-end tests' model (vLLM's CPU attention takes head dims of 32 and more)
    model_dir = make_model_dir(model_root, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, initializer_range=0.02)
    (rank0, said0), (rank1, said1) = spawn(2, _engine_fleet_worker, model_dir, str(tmp_path))
    assert not any("dynamic sampling found" in line for line in said0 + said1), said0 + said1
    for (tokens0, rewards0, in_loss0, sampling), (tokens1, rewards1, in_loss1, _) in zip(rank0, rank1):
        assert len(tokens0) == len(tokens1) == 2 * GROUP  # full, equal DP shares: 4 groups of 4
        rewards = rewards0 + rewards1
        groups = [rewards[g * GROUP:(g + 1) * GROUP] for g in range(4)]
        assert all(max(g) > min(g) for g in groups), groups  # no trained group has zero reward variance
        assert all(n > 0 for n in in_loss0 + in_loss1)
        assert sampling["sampling/informative_groups"] == 4
        assert sampling["sampling/prompts_sampled"] == 4 * sampling["sampling/rounds"]
    # half the prompts are all-correct: the steps dropped groups and sampled further rounds
    assert sum(sampling["sampling/filtered_fraction"] for *_, sampling in rank0[:2]) > 0
    assert max(sampling["sampling/rounds"] for *_, sampling in rank0[:2]) > 1
    assert rank0[0][:3] == rank0[2][:3] and rank1[0][:3] == rank1[2][:3]  # step 1 again (made ahead): the same


def test_a_checkpoint_counts_the_consumed_prompts_dynamic_sampling_drew():
    from megatron_ais.grpo.state import GRPOState

    state = GRPOState.begin(None, seed=1, rollout_seed=None, reference={})
    state.history = [{"step": 1}, {"step": 2, "sampling/prompts_sampled": 24},
                     {"step": 3, "sampling/prompts_sampled": 8}]
    state.step = 3
    assert state.run_state(8, {})["consumed_prompts"] == 8 + 24 + 8
