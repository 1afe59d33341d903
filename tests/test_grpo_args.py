"""pretrain_grpo_ais.py's loop flags are checked before anything heavy starts: counts, the split of a rollout batch
into data-parallel shares, mini-batches and micro-batches, and every config the flags build."""
import re

import pytest

from megatron_ais.arguments import GRPORunConfig
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.rollout.verify import refit_precision
from pretrain_grpo_ais import build_grpo_parser


def _config(*argv, world=1):
    return GRPORunConfig.from_args(build_grpo_parser().parse_args(["--hf-dir", "/m", *argv]), world)


def test_defaults_and_the_make_run_recipe_pass():
    _config()
    _config("--top-p", "0.9", "--is-correction", "none")
    config = _config("--prompts-per-step", "32", "--group-size", "8", "--micro-batch-size", "16", "--seq-length", "64",
                     world=2)
    assert config.trainer.training.micro_batch_size == 16 and config.loop.group_size == 8
    assert config.engine.seed == config.trainer.training.seed  # the engine samples with the run's seed


def test_configs_take_the_flags_and_keep_one_default():
    """Every flag lands in its config field; a field's default is its flag's default."""
    config = _config("--is-cap", "3", "--ais-exponents", "1", "0", "2", "--rollout-precision", "bf16",
                     "--bridge-fp8-exclude", "q_proj", "--rollout-kv-cache-calibration-sequences", "4",
                     "--advantage-no-std", "--no-rollout-enforce-eager", "--fp32")
    delta = _config("--bridge-delta", "on", "--bridge-full-sync-interval", "4").bridge
    assert (delta.delta, delta.full_sync_interval) == ("on", 4)
    assert config.correction.cap == 3.0 and config.correction.exponents == (1.0, 0.0, 2.0)
    assert config.correction.variance_exponent == 2.0
    assert config.engine.precision == "bf16" and not config.engine.enforce_eager
    assert config.bridge.policy.precision == "bf16" and config.bridge.policy.exclude == ("q_proj",)
    assert config.kv_calibration.sequences == 4 and config.advantages.no_std
    assert config.trainer.model.precision == "fp32"
    from megatron_ais.ais import AISConfig
    from megatron_ais.bridge.config import BridgeConfig
    from megatron_ais.engine.config import EngineConfig

    defaults = _config()
    assert defaults.correction == AISConfig()
    assert defaults.bridge == BridgeConfig()
    assert defaults.engine == EngineConfig(seed=defaults.engine.seed)


@pytest.mark.parametrize("argv,world,expected", [
    (["--eval-interval", "0"], 1, "--eval-interval 0 must be at least 1"),
    (["--eval-samples", "0"], 1, "--eval-samples 0 must be at least 1"),
    (["--eval-prompts", "0"], 1, "--eval-prompts 0 must be at least 1"),
    (["--num-minibatches", "0"], 1, "--num-minibatches 0 must be at least 1"),
    (["--group-size", "1"], 1, "--group-size 1 must be at least 2 (GRPO's advantages compare"),
    (["--max-new-tokens", "256"], 1, "--max-new-tokens 256 leaves no room for the prompt in --seq-length 256"),
    # 3 x 4 = 12 sequences over DP 8
    (["--prompts-per-step", "3", "--micro-batch-size", "1"], 8, "12 sequences does not split over 8 data-parallel"),
    # 16 x 4 = 64 over DP 2 = 32 per rank, 3 mini-batches
    (["--num-minibatches", "3"], 2, "32 sequences per data-parallel rank do not split into --num-minibatches 3"),
    # 32 per rank, 4 mini-batches of 8, micro-batch 3
    (["--num-minibatches", "4", "--micro-batch-size", "3"], 2, "mini-batches of 8 sequences per data-parallel rank "
                                                               "are not a multiple of --micro-batch-size 3"),
    (["--rollout-tensor-parallel-size", "2", "--rollout-placement", "colocated"], 1,
     "--rollout-tensor-parallel-size > 1 needs --rollout-placement separate"),
    (["--rollout-placement", "colocated", "--rollout-engines-per-node", "2"], 2,
     "--rollout-engines-per-node 2 with --rollout-placement colocated: colocated engines are one inside every"),
    (["--rollout-weight-feed", "broadcast", "--rollout-placement", "colocated"], 1,
     "--rollout-weight-feed broadcast feeds a separate engine's workers"),
    (["--verify-refit-engines", "-1"], 1, "--verify-refit-engines -1 must be at least 0 (0 checks every engine)"),
    (["--rollout-placement", "separate", "--rollout-generation-timeout-s", "1800"], 1,
     "--rollout-generation-timeout-s 1800 is not below --distributed-timeout-minutes 30 (1800 s)"),
    (["--rollout-engine-call-timeout-s", "2400"], 1,
     "--rollout-engine-call-timeout-s 2400 is not below --distributed-timeout-minutes 30 (1800 s)"),
    (["--rollout-engine-call-timeout-s", "0"], 1, "--rollout-engine-call-timeout-s"),
    (["--temperature", "0"], 1, "--temperature 0.0 must be at least 0.01"),
    (["--temperature", "0.005"], 1, "--temperature 0.005 must be at least 0.01 (vLLM raises a lower temperature"),
    (["--top-p", "0.9"], 1, "--top-p 0.9 with --is-correction ais: the engine's log-probs are renormalised"),
    (["--is-cap", "0.5"], 1, "--is-cap"),
    (["--clip-low", "1.5"], 1, "--clip-low 1.5 must be in [0, 1)"),
    (["--rollout-cpu-core", "1", "--rollout-placement", "colocated"], 1,
     "--rollout-cpu-core 1 binds the one separate engine of a node; with --rollout-placement colocated"),
    (["--rollout-cpu-core", "one"], 1, "--rollout-cpu-core 'one' is not a CPU list (write 1, 2-3 or 0,2)"),
    (["--max-off-policy-steps", "-1"], 1, "--max-off-policy-steps -1 must be at least 0 (0: the synchronous loop)"),
    (["--partial-rollouts"], 1, "--partial-rollouts needs --max-off-policy-steps 1 or more"),
    (["--ais-lambda-per-lag"], 1, "--ais-lambda-per-lag needs --max-off-policy-steps 1 or more"),
    (["--ais-lambda-per-lag", "--is-correction", "tis", "--max-off-policy-steps", "1", "--rollout-placement",
      "separate"], 1, "--ais-lambda-per-lag with --is-correction tis: only AIS has a λ"),
    (["--max-off-policy-steps", "1", "--rollout-placement", "colocated"], 1,
     "--max-off-policy-steps 1 with --rollout-placement colocated: a colocated engine shares its trainer rank's"),
    (["--bridge-full-sync-interval", "0"], 1, "--bridge-full-sync-interval 0 must be at least 1 (delta syncs between full ones)"),
    (["--ais-stale-lambda-floor", "1"], 1, "--ais-stale-lambda-floor needs --max-off-policy-steps 1 or more"),
    (["--ais-stale-lambda-floor", "1.5"], 1, "--ais-stale-lambda-floor 1.5 must be in [0, 1]"),
    (["--ais-stale-lambda-floor", "1", "--is-correction", "tis", "--max-off-policy-steps", "1",
      "--rollout-placement", "separate"], 1, "--ais-stale-lambda-floor with --is-correction tis: only AIS has a λ"),
    (["--rollout-aligned-forward", "--rollout-precision", "bf16"], 1,
     "--rollout-aligned-forward with --rollout-precision bf16: the engine's weights are the trainer's own"),
])
def test_bad_loop_flags_are_refused_up_front(argv, world, expected):
    with pytest.raises(ArgumentValidationError, match=re.escape(expected)):
        _config(*argv, world=world)


def _refit_row(*argv):
    config = _config(*argv)
    return refit_precision(config.engine, config.trainer.model.precision)


def test_refit_tolerance_row_follows_what_is_compared():
    assert _refit_row("--rollout-precision", "fp8") == "fp8"
    assert _refit_row("--rollout-precision", "bf16", "--rollout-kv-cache-dtype", "fp8") == "fp8"
    # an fp32 engine against a BF16 trainer: the trainer's own rounding sets the bound
    assert _refit_row("--rollout-precision", "fp32") == "bf16"
    assert _refit_row("--rollout-precision", "fp32", "--fp32") == "fp32"
    assert _refit_row("--rollout-fp8-activations", "emulate", "--rollout-kv-cache-dtype", "fp8") == "fp8-w8a8"
    # a 4-bit engine with an FP8 KV cache keeps its own, wider row
    assert _refit_row("--rollout-precision", "mxfp4", "--rollout-kv-cache-dtype", "fp8") == "mxfp4"


def test_w8a8_emulation_needs_an_fp8_engine():
    with pytest.raises(ArgumentValidationError, match="--rollout-fp8-activations emulate quantizes the inputs of FP8 "
                                                      "linear layers; --rollout-precision bf16 has none"):
        _config("--rollout-precision", "bf16", "--rollout-fp8-activations", "emulate")


def test_the_dapo_gspo_and_dr_grpo_options_land_and_bad_combinations_name_their_flags():
    config = _config("--dynamic-sampling", "--max-sampling-rounds", "3", "--overlong", "soft-penalty",
                     "--overlong-buffer-tokens", "4", "--overlong-penalty", "0.5", "--policy-loss", "gspo",
                     "--loss-agg", "seq-mean-token-mean", "--is-level", "geometric", "--max-new-tokens", "16")
    assert config.dynamic_sampling.enabled and config.dynamic_sampling.max_rounds == 3
    assert (config.overlong.mode, config.overlong.buffer_tokens, config.overlong.penalty) == ("soft-penalty", 4, 0.5)
    assert config.loss.policy_loss == "gspo" and config.loss.max_response_tokens == 16
    assert _config("--loss-agg", "seq-mean-token-sum-norm", "--max-new-tokens", "24").loss.normalizer_scale == 24
    defaults = _config()
    assert not defaults.dynamic_sampling.enabled and defaults.overlong.mode == "keep"
    assert defaults.loss.policy_loss == "ppo" and defaults.loss.normalizer_scale == 1
    for argv, message in [
        (("--policy-loss", "gspo", "--loss-agg", "seq-mean-token-mean"),
         "--policy-loss gspo with --is-correction ais at --is-level token: .* add --is-level geometric"),
        (("--policy-loss", "gspo", "--is-correction", "none"), "--policy-loss gspo with --loss-agg token-mean: .* use "
                                                               "--loss-agg seq-mean-token-mean"),
        (("--overlong", "soft-penalty"), "--overlong soft-penalty needs --overlong-buffer-tokens of at least 1"),
        (("--overlong", "soft-penalty", "--overlong-buffer-tokens", "16", "--max-new-tokens", "16"),
         "--overlong-buffer-tokens 16 must be below --max-new-tokens 16"),
        (("--overlong-penalty", "-1"), "--overlong-penalty -1.0 must be at least 0"),
        (("--dynamic-sampling", "--max-sampling-rounds", "0"), "--max-sampling-rounds 0 must be at least 1"),
    ]:
        with pytest.raises(ArgumentValidationError, match=message):
            _config(*argv)
    assert _config("--policy-loss", "gspo", "--loss-agg", "seq-mean-token-mean", "--is-correction", "none")


def test_a_resumed_run_evaluates_with_the_saved_runs_seed():
    # --seed is kept from the saved run (the log says so): its evaluations sampled with the new one, so they were
    # not comparable with the evaluations before the resume
    from megatron_ais.rollout.fleet import rollout_plan

    plan = rollout_plan(_config("--seed", "5", "--eval-samples", "3"), 2, 11, None, False)
    assert plan.eval_seed == 11 and plan.eval_samples == 3 and plan.sampling.stop_token_ids == (2,)
