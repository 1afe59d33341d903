"""--overlong through real rollouts: a fleet built from the run's flags (`build_fleet`, one gloo rank, a real FP32
vLLM engine) samples a step whose responses the limit cuts or not (the model's end-of-text row scaled so that some
stop within --max-new-tokens and others run to it). Which responses were cut is read from the rows themselves (the
full length and no end-of-text at its end), apart from the engine's finish reasons: mask takes exactly those rows out
of the loss and keeps the others and every reward; soft-penalty adds verl's DAPO length penalty to exactly the rewards
of the responses in the buffer; keep changes nothing; every mode counts the cut responses."""
import dataclasses
import functools
import glob
import os
import shutil

import pytest
import torch

from conftest import make_model_dir
from distributed import spawn
from dapo_reference import dapo_overlong_reward

MAX_NEW_TOKENS, BUFFER, PENALTY = 4, 2, 0.5
EOS_SCALE = 20.0  # the end-of-text logit's spread: it wins in about one context of five


def _stopping_model(model_root, out: str) -> str:
    """The end-to-end tests' tiny model with its end-of-text output row scaled by EOS_SCALE."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    source = make_model_dir(model_root, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, initializer_range=0.02)
    shutil.copytree(source, out)
    config = AutoConfig.from_pretrained(out)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        tensors = load_file(path)
        if head in tensors:
            tensors[head][config.eos_token_id] *= EOS_SCALE
            save_file(tensors, path, metadata={"format": "pt"})
    return out


def _overlong_fleet_worker(model_dir: str, work: str):
    from megatron_ais.arguments import GRPORunConfig
    from megatron_ais.data.tasks import build_task
    from megatron_ais.distributed import initialize_distributed
    from megatron_ais.grpo.advantages import with_advantages
    from megatron_ais.logging import RunLogger
    from megatron_ais.rollout.fleet import build_fleet
    from megatron_ais.rollout.overlong import OverlongConfig
    from megatron_ais.hf_assets import load_tokenizer
    from pretrain_grpo_ais import build_grpo_parser

    initialize_distributed()
    args = build_grpo_parser().parse_args([
        "--hf-dir", model_dir, "--output-dir", work, "--overlong", "mask", "--max-new-tokens", str(MAX_NEW_TOKENS),
        "--prompts-per-step", "4", "--group-size", "4", "--seq-length", "64", "--task", "arithmetic",
        "--max-operand", "9", "--rollout-precision", "fp32", "--rollout-kv-cache-gb", "0.25"])
    config = GRPORunConfig.from_args(args, 1)
    seed = config.trainer.training.seed
    tokenizer = load_tokenizer(model_dir)
    task = build_task(config.trainer.task, seed)
    log = RunLogger(config.trainer.logging, True, total_steps=1)
    fleet = build_fleet(config, tokenizer, task, (seed, seed), model_dir, log, False,
                        functools.partial(with_advantages, config=config.advantages), 0, 0)
    made = {}
    try:
        made["mask"] = fleet.submit(1).wait()  # the flags' mode, handed to the engine's host by the fleet
        for mode in ("keep", "soft-penalty"):
            fleet.manager.plan = dataclasses.replace(fleet.manager.plan, overlong=OverlongConfig(
                mode=mode, buffer_tokens=BUFFER, penalty=PENALTY))
            made[mode] = fleet.submit(1).wait()
    finally:
        fleet.close()
    return ({mode: (r.batch.labels, r.batch.mask, r.batch.rewards, r.truncated) for mode, r in made.items()},
            tokenizer.eos_token_id)


@pytest.mark.slow
def test_overlong_modes_shape_exactly_the_responses_the_limit_cut(model_root, tmp_path):
    model_dir = _stopping_model(model_root, str(tmp_path / "model"))
    batches, eos = spawn(1, _overlong_fleet_worker, model_dir, str(tmp_path / "run"))[0]
    labels, mask, rewards, truncated = batches["keep"]
    lengths = mask.sum(dim=1).long()
    last = [int(labels[row, mask[row].nonzero().max()]) for row in range(len(labels))]
    cut = torch.tensor([int(n) == MAX_NEW_TOKENS and token != eos for n, token in zip(lengths, last)])
    assert 0 < int(cut.sum()) < len(cut), (lengths.tolist(), last)  # some responses cut, some stopped
    for mode in ("keep", "mask", "soft-penalty"):
        assert batches[mode][3] == int(cut.sum()), mode
        assert torch.equal(batches[mode][0], labels), mode  # the same responses in every mode
    _, masked, masked_rewards, _ = batches["mask"]
    assert torch.equal(masked[cut], torch.zeros_like(masked[cut])) and torch.equal(masked[~cut], mask[~cut])
    assert torch.equal(masked_rewards, rewards)
    penalty = torch.tensor([dapo_overlong_reward(int(n), MAX_NEW_TOKENS, BUFFER, PENALTY) for n in lengths])
    assert (penalty < 0).any() and (penalty == 0).any(), lengths.tolist()
    _, soft_mask, soft_rewards, _ = batches["soft-penalty"]
    assert torch.equal(soft_mask, mask)
    assert torch.allclose(soft_rewards.double(), rewards.double() + penalty.double(), atol=1e-6)
