"""Bad configurations are rejected before anything heavy starts, with messages naming the flag and the fix: flag
combinations when the configs are built, the model's shape and the checkpoint when the run reads them (once)."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, make_model_dir
from megatron_ais.arguments import SFT_FLAGS, SFTRunConfig, build_parser
from megatron_ais.errors import ArgumentValidationError, CheckpointError
from megatron_ais.model import MOE_MODEL_TYPES, SUPPORTED_MODEL_TYPES, ModelShape, check_model_layout, \
    check_supported_hf_config
from megatron_ais.training import read_model_config

CONFIG = {"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96,
          "num_hidden_layers": 4, "intermediate_size": 192, "vocab_size": 300, "max_position_embeddings": 512}


def _args(*argv):
    return build_parser("test", SFT_FLAGS).parse_args(list(argv))


def _check_model(argv, hf_config):
    from megatron_ais.parallel import ParallelLayout

    args = _args(*argv)
    check_model_layout(hf_config, ParallelLayout.from_args(args), args.seq_length)


def _check_run(argv, world):
    """What an entry point checks before starting megatron: the flags, then the model they name."""
    trainer = SFTRunConfig.from_args(_args(*argv), world).trainer
    read_model_config(trainer.model, trainer.layout, trainer.checkpoint.load)


@pytest.mark.parametrize("argv,config,expected", [
    (["--tensor-model-parallel-size", "4"], {}, "--num-attention-heads 6 (config.json) is not divisible by "
                                                "--tensor-model-parallel-size 4"),
    (["--tensor-model-parallel-size", "3"], {"num_key_value_heads": 2}, "--num-key-value-heads 2"),
    (["--pipeline-model-parallel-size", "3"], {}, "--num-layers 4 (config.json) is not divisible by "
                                                  "--pipeline-model-parallel-size 3"),
    (["--tensor-model-parallel-size", "2"], {"intermediate_size": 191}, "--intermediate-size 191"),
    (["--seq-length", "1024"], {}, "--seq-length 1024 exceeds max_position_embeddings 512"),
    (["--tensor-model-parallel-size", "4"], {"num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 12,
                                             "head_dim": 3}, "fused QKV projection has 18 rows"),
])
def test_model_shape_errors_name_the_flag(argv, config, expected):
    with pytest.raises(ArgumentValidationError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _check_model(argv, {**CONFIG, **config})


MOE = {**CONFIG, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


@pytest.mark.parametrize("argv,config,expected", [
    (["--expert-model-parallel-size", "2"], CONFIG, "need a MoE model"),
    (["--expert-model-parallel-size", "3"], MOE, "num_experts 8 (config.json) is not divisible by "
                                                 "--expert-model-parallel-size 3"),
    (["--expert-tensor-parallel-size", "3"], MOE, "moe_intermediate_size 64"),
    # expert-TP rank 1 would have written nothing and loaded rank 0's expert shards (a torch checkpoint's shard is
    # named by the TP rank)
    (["--expert-tensor-parallel-size", "2"], MOE, "--expert-tensor-parallel-size 2 does not divide "
                                                  "--tensor-model-parallel-size 1"),
    (["--tensor-model-parallel-size", "2"], MOE, "needs --sequence-parallel"),
])
def test_moe_errors_name_the_flag(argv, config, expected):
    with pytest.raises(ArgumentValidationError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _check_model(argv, config)


def test_valid_layouts_pass_including_fewer_kv_heads_than_tp():
    _check_model(["--tensor-model-parallel-size", "2"], {**CONFIG, "num_key_value_heads": 1})
    _check_model(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], CONFIG)
    # every Qwen3-MoE layer is sparse: its dense intermediate_size is never split over TP
    _check_model(["--tensor-model-parallel-size", "2", "--sequence-parallel"], {**MOE, "intermediate_size": 191})


@pytest.mark.parametrize("argv,world,expected", [
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--virtual-pipeline-model-parallel-size", "2"], 1, "needs --pipeline-model-parallel-size > 1"),
    (["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "255"], 2,
     "--seq-length 255 must be a multiple of --tensor-model-parallel-size 2"),
    (["--context-parallel-size", "2"], 2, "--context-parallel-size 2: the training steps do not split"),
    pytest.param(["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"], 2,
                 "with --pipeline-model-parallel-size 2 gives wrong results over gloo",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="gloo (CPU) only")),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 2, "--global-batch-size 6 is not divisible"),
    (["--pipeline-model-parallel-size", "3", "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size",
      "8", "--micro-batch-size", "2"], 3, "a step's 4 micro-batch\\(es\\) .* must be a multiple of "
                                         "--pipeline-model-parallel-size 3"),
    (["--pipeline-model-parallel-size", "3", "--virtual-pipeline-model-parallel-size", "2",
      "--max-tokens-per-microbatch", "512"], 3, "with --max-tokens-per-microbatch: the interleaved schedule"),
    (["--make-vocab-size-divisible-by", "0"], 1, "--make-vocab-size-divisible-by 0 must be at least 1"),
])
def test_parallel_errors_name_the_flag(argv, world, expected, tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        import json
        json.dump(CONFIG, f)
    with pytest.raises(ArgumentValidationError, match=expected):
        _check_run(["--hf-dir", str(tmp_path), *argv], world)


def test_missing_model_and_checkpoint(tmp_path):
    with pytest.raises(ArgumentValidationError, match="pass --hf-dir DIR"):
        _check_run([], 1)
    with pytest.raises(ArgumentValidationError, match=f"--hf-dir {tmp_path} has no config.json"):
        _check_run(["--hf-dir", str(tmp_path)], 1)
    with pytest.raises(CheckpointError, match=f"--load {tmp_path} has no latest_checkpointed_iteration.txt"):
        _check_run(["--load", str(tmp_path)], 1)


@pytest.mark.parametrize("change,expected", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope type 'yarn'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
      "attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "config.json holds quantized weights"),
    ({"model_type": "qwen2", "hidden_size": 256, "num_attention_heads": 4, "head_dim": 32},
     "head_dim 32 with model_type qwen2: vLLM's Qwen2 takes hidden_size / num_attention_heads = 64"),
])
def test_unsupported_configs(change, expected):
    with pytest.raises(ArgumentValidationError, match=expected):
        check_supported_hf_config({**CONFIG, **change})


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_omitted_keys_mean_what_transformers_reads(model_type):
    """vLLM reads a config through transformers' class, whose defaults differ by model (Qwen3-MoE does not
    renormalise its top-k weights unless norm_topk_prob says so; Qwen3 defaults to 32 KV heads of 128)."""
    from transformers import AutoConfig

    cfg = {"model_type": model_type, "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
           "intermediate_size": 512, "vocab_size": 300}
    if model_type in MOE_MODEL_TYPES:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    shape = ModelShape.from_hf_config(cfg)
    reference = AutoConfig.for_model(**cfg)
    assert shape.num_key_value_heads == reference.num_key_value_heads
    assert shape.head_dim == getattr(reference, "head_dim", None) or 256 // 4
    assert shape.max_position_embeddings == reference.max_position_embeddings
    assert shape.rms_norm_eps == reference.rms_norm_eps and shape.rope_theta == reference.rope_parameters["rope_theta"]
    assert shape.tie_word_embeddings == reference.tie_word_embeddings
    if model_type in MOE_MODEL_TYPES:
        assert shape.moe_norm_topk_prob == reference.norm_topk_prob
        assert shape.moe_aux_loss_coeff == reference.router_aux_loss_coef


def test_vocab_padding_matches_megatron_lm():
    shape = ModelShape.from_hf_config(CONFIG)
    assert shape.padded_vocab_size(128, 1) == 384
    assert shape.padded_vocab_size(128, 4) == 512
    assert shape.padded_vocab_size(1, 3) == 300


def test_cli_reports_bad_layout_without_traceback(model_root):
    hf_dir = make_model_dir(model_root, "llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "4"}  # what torchrun gives rank 0 of 4
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_sft.py"), "--hf-dir", hf_dir,
                           "--tensor-model-parallel-size", "4"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "--num-attention-heads 6" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "hf-to-megatron",
                           "--hf-dir", hf_dir, "--save", os.path.join(str(model_root), "x"),
                           "--tensor-model-parallel-size", "4"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--tensor-model-parallel-size 4" in proc.stderr


def test_sft_refuses_examples_longer_than_the_sequence_and_an_export_over_its_input_writing_nothing(model_root,
                                                                                                     tmp_path):
    hf_dir = make_model_dir(model_root, "qwen3")
    save, out = tmp_path / "ckpt", tmp_path / "out"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # what torchrun gives a 1-rank run
    used = tmp_path / "used"  # an earlier export's weights: a loader would read them before the new index
    used.mkdir()
    (used / "model.safetensors").write_bytes(b"")
    for extra, expected in ((["--seq-length", "8"], "--seq-length 8: an example of the task is "),
                            (["--export-hf-dir", hf_dir], f"--export-hf-dir {hf_dir} is the --hf-dir the run starts"),
                            (["--export-hf-dir", str(used)], f"--export-hf-dir {used} already holds weights")):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_sft.py"), "--hf-dir", hf_dir,
                               "--save", str(save), "--output-dir", str(out), *extra],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not save.exists() and not out.exists()


def test_help_documents_every_flag_by_group():
    text = build_parser("test").format_help()
    for group in ("model:", "parallelism:", "training:", "checkpointing:", "logging:"):
        assert group in text
    for action in build_parser("test")._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
