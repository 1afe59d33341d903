"""tools/train_sft.py's path at TP2: starting from a converted Megatron checkpoint (--load) gives the same losses
as starting from the HF weights (--hf-dir); its --save checkpoint and HF export hold the trained weights."""
import json
import os

import pytest
import torch

import convert_checkpoint
from conftest import make_model_dir
from distributed import spawn


def _sft_worker(argv):
    from megatron_ais.arguments import SFT_FLAGS, SFTRunConfig, build_parser
    from megatron_ais.initialize import destroy_megatron
    from megatron_ais.sft import run_sft

    summary = run_sft(SFTRunConfig.from_args(build_parser("test", SFT_FLAGS).parse_args(argv), 2))
    destroy_megatron()
    return summary["losses"]


@pytest.mark.slow
def test_load_converted_checkpoint_then_save_and_export(model_root, tmp_path):
    hf_dir = make_model_dir(model_root, "llama", tie_word_embeddings=True)
    common = ["--tensor-model-parallel-size", "2", "--train-iters", "3", "--fp32", "--seq-length", "48",
              "--micro-batch-size", "4", "--lr", "3e-3", "--num-examples", "64", "--log-interval", "2"]
    from_hf = spawn(2, _sft_worker, common + ["--hf-dir", hf_dir, "--output-dir", str(tmp_path / "a")])
    megatron_dir = str(tmp_path / "megatron")
    convert_checkpoint.hf_to_megatron(hf_dir, megatron_dir, 2, 1)
    saved, exported = str(tmp_path / "saved"), str(tmp_path / "exported")
    from_load = spawn(2, _sft_worker, common + ["--load", megatron_dir, "--save", saved, "--export-hf-dir",
                                                exported, "--output-dir", str(tmp_path / "b")])
    losses = [r for r in from_hf + from_load if r]
    assert len(losses) == 4 and all(l == losses[0] for l in losses), losses  # 2 TP ranks x 2 runs
    assert losses[0][-1] < losses[0][0]
    # the saved (fp32) checkpoint converts back to what the run exported in the HF model's own dtype (bf16),
    # and differs from the start
    round_trip = convert_checkpoint.megatron_to_hf(saved, str(tmp_path / "rt"))
    from megatron_ais.mapping.hf_io import HFCheckpointReader
    a, b, start = HFCheckpointReader(round_trip), HFCheckpointReader(exported), HFCheckpointReader(hf_dir)
    assert sorted(a.names()) == sorted(b.names()) == sorted(start.names())
    for name in a.names():
        assert b.get(name).dtype == start.get(name).dtype == torch.bfloat16
        assert torch.equal(a.get(name).to(torch.bfloat16), b.get(name)), name
    assert not torch.equal(a.get("model.embed_tokens.weight"), start.get("model.embed_tokens.weight"))
    assert os.path.isfile(os.path.join(exported, "tokenizer.json"))
    assert os.path.isfile(os.path.join(str(tmp_path / "a"), "summary.json"))
    # every step's metrics are written, whichever steps --log-interval prints
    with open(tmp_path / "a" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]


def test_a_tokenizer_without_a_pad_token_pads_with_its_end_token(model_root):
    from megatron_ais.data.tasks import Example
    from megatron_ais.hf_assets import load_tokenizer
    from megatron_ais.sft import encode_sft_example

    tokenizer = load_tokenizer(make_model_dir(model_root, "llama"))
    tokenizer.pad_token = None  # as Llama 3's tokenizers ship
    encoded = encode_sft_example(tokenizer, Example("What is 2 + 3?", "5"), 48)
    padding = encoded["loss_mask"] == 0
    padding[:int(encoded["loss_mask"].nonzero().min())] = False  # the prompt
    assert padding.any() and (encoded["tokens"][padding] == tokenizer.eos_token_id).all()


def _sft_budgets_worker(argv, budgets):
    """run_sft once per token budget in one process world; each run's loss history."""
    import os

    from megatron.core import parallel_state as ps

    from megatron_ais.arguments import SFT_FLAGS, SFTRunConfig, build_parser
    from megatron_ais.sft import run_sft

    histories = []
    for budget in budgets:
        args = build_parser("test", SFT_FLAGS).parse_args(argv + ["--max-tokens-per-microbatch", budget])
        histories.append(run_sft(SFTRunConfig.from_args(args, int(os.environ["WORLD_SIZE"])))["losses"])
        ps.destroy_model_parallel()
    return histories


@pytest.mark.slow
def test_sft_by_token_budget_does_not_depend_on_the_grouping(model_root, tmp_path):
    """tools/train_sft.py's path at DP2 with --max-tokens-per-microbatch: two budgets that group the examples into
    different micro-batches (and share them out among the ranks by tokens) train to the same losses as one rank
    does, since the loss is the token mean over the global batch (a per-rank token mean would weigh the ranks'
    tokens differently: both budgets share the rows out alike, so only the one-rank run tells)."""
    hf_dir = make_model_dir(model_root, "llama")
    argv = ["--hf-dir", hf_dir, "--train-iters", "3", "--fp32", "--seq-length", "48", "--global-batch-size", "16",
            "--lr", "3e-3", "--num-examples", "64", "--task", "arithmetic", "--max-operand", "99",
            "--output-dir", str(tmp_path)]
    ranks = spawn(2, _sft_budgets_worker, argv, ["48", "200"])
    assert ranks[0] == ranks[1]  # both ranks report the DP-global loss
    small, large = ranks[0]
    assert len(small) == 3 and small[-1] < small[0]
    assert large == pytest.approx(small, rel=1e-5)
    (one_rank,) = spawn(1, _sft_budgets_worker, argv, ["200"])[0]
    assert one_rank == pytest.approx(small, rel=1e-5)


def _sft_runs_worker(runs):
    """run_sft for each argv in one process world; each run's (first step, losses)."""
    from megatron.core import parallel_state as ps

    from megatron_ais.arguments import SFT_FLAGS, SFTRunConfig, build_parser
    from megatron_ais.sft import run_sft

    out = []
    for argv in runs:
        summary = run_sft(SFTRunConfig.from_args(build_parser("test", SFT_FLAGS).parse_args(argv), 2))
        out.append((summary["first_step"], summary["losses"]))
        ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_sft_saves_at_its_interval_and_a_resumed_run_continues_bit_for_bit(model_root, tmp_path):
    # SFT saved once, after its last step, whatever --save-interval said, and a --load of its checkpoint started over
    from megatron_ais.checkpointing.store import committed_iterations

    hf_dir = make_model_dir(model_root, "llama")
    common = ["--train-iters", "3", "--fp32", "--seq-length", "48", "--micro-batch-size", "4", "--lr", "3e-3",
              "--num-examples", "64", "--save-interval", "1"]
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    runs = [["--hf-dir", hf_dir, "--save", whole, "--output-dir", whole, *common],
            ["--hf-dir", hf_dir, "--save", cut, "--output-dir", cut, *common[:1], "2", *common[2:]],
            ["--load", cut, "--save", cut, "--output-dir", cut, *common]]
    (first, uninterrupted), (_, before), (resumed_at, after) = spawn(2, _sft_runs_worker, runs)[0]
    assert committed_iterations(whole) == [3, 2] and committed_iterations(cut) == [3, 2]
    assert first == 1 and resumed_at == 3
    assert before == uninterrupted[:2] and after == uninterrupted[2:]
    with open(os.path.join(cut, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
