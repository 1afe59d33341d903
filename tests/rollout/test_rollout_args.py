"""Rollout and bridge flags build their configs; the engine's model directory follows the FP8 policy."""
import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open

from conftest import make_model_dir
from megatron_ais.arguments import GRPORunConfig
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.rollout.batching import rollouts_to_batch
from megatron_ais.engine.vllm_engine import Rollout
from megatron_ais.engine.config import EngineConfig
from megatron_ais.engine.model_dir import prepare_engine_dir
from megatron_ais.engine.feeds.broadcast import feed_backend, feed_device
from megatron_ais.engine.memory import ENGINE_OVERHEAD_BYTES, engine_memory_fraction
from pretrain_grpo_ais import build_grpo_parser


def _config(*argv):
    return GRPORunConfig.from_args(build_grpo_parser().parse_args(["--hf-dir", "/m", "--seed", "3", *argv]), 1)


def test_flags_to_configs():
    config = _config("--rollout-precision", "bf16", "--bridge-bucket-size-mb", "8", "--bridge-fp8-exclude",
                     "layers\\.0\\.")
    engine, bridge = config.engine, config.bridge
    assert (engine.precision, engine.kv_cache_gb, engine.seed) == ("bf16", 1.0, 3)
    assert bridge.bucket_bytes == 8 << 20 and bridge.policy.precision == "bf16"
    assert bridge.policy.exclude == ("layers\\.0\\.",)
    assert bridge.arena_on_gpu == torch.cuda.is_available() == bool(engine.staging_arena_gpu_copies)
    assert not _config("--bridge-arena", "host").bridge.arena_on_gpu
    assert engine.enforce_eager and engine.gpu_memory_utilization is None
    with pytest.raises(ValueError, match="--rollout-precision 'int4'"):
        EngineConfig(model_dir="/m", precision="int4")
    engine = _config("--no-rollout-enforce-eager", "--rollout-gpu-memory-utilization", "0.4").engine
    assert not engine.enforce_eager and engine.gpu_memory_utilization == 0.4
    with pytest.raises(ArgumentValidationError, match="--rollout-gpu-memory-utilization 1.5 must be in"):
        _config("--rollout-gpu-memory-utilization", "1.5")


def test_engine_memory_fraction_is_the_engines_own_budget():
    gib = 1 << 30
    # an 8B FP8 engine (about 9 GiB of weights) with a 20 GiB KV cache on an 80 GiB GPU, at engine TP 1 and 2
    assert engine_memory_fraction(20 * gib, 9 * gib, 1, 80 * gib) == (20 + 9 + ENGINE_OVERHEAD_BYTES / gib) / 80
    assert engine_memory_fraction(20 * gib, 9 * gib, 2, 80 * gib) == (20 + 4.5 + ENGINE_OVERHEAD_BYTES / gib) / 80
    assert engine_memory_fraction(20 * gib, 9 * gib, 1, 80 * gib) < 0.92  # vLLM's default, refused next to a trainer
    with pytest.raises(ValueError, match="lower --rollout-kv-cache-gb or raise --rollout-tensor-parallel-size"):
        engine_memory_fraction(75 * gib, 9 * gib, 1, 80 * gib)


@pytest.mark.parametrize("root,members,expected", [
    (None, [None, None], "gloo"),             # CPU
    ("GPU-a", ["GPU-b", "GPU-c"], "nccl"),     # engine workers on GPUs of their own
    ("GPU-a", ["GPU-a", "GPU-b"], "gloo"),     # worker 0 on the trainer rank's GPU: NCCL refuses duplicate GPUs
    ("GPU-a", ["GPU-b", "GPU-b"], "gloo"),
    ("GPU-a", [None], "gloo"),
])
def test_feed_backend_avoids_shared_gpus(root, members, expected):
    assert feed_backend(root, members) == expected
    if expected == "gloo":
        assert feed_device(expected) == "cpu"
    elif torch.cuda.is_available():  # the rank's own GPU, named: the feed's thread makes it current
        assert feed_device(expected) == f"cuda:{torch.cuda.current_device()}"


@pytest.mark.parametrize("argv,expected", [
    (["--rollout-kv-cache-scale-margin", "0.5"], "--rollout-kv-cache-scale-margin 0.5 must be at least 1"),
    (["--rollout-kv-cache-calibration-sequences", "0"], "--rollout-kv-cache-calibration-sequences 0 must be"),
    (["--rollout-gpu-memory-utilization", "0"], r"--rollout-gpu-memory-utilization 0.0 must be in \(0, 1\]"),
    pytest.param(["--bridge-arena", "gpu"], "--bridge-arena gpu needs CUDA",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only")),
])
def test_rollout_flags_are_validated(argv, expected):
    with pytest.raises(ArgumentValidationError, match=expected):
        _config(*argv)


def test_engine_dir_layout(model_root, tmp_path):
    hf_dir = make_model_dir(model_root, "qwen3", hidden_size=128, intermediate_size=256)
    out = prepare_engine_dir(EngineConfig(model_dir=hf_dir, precision="fp8"), str(tmp_path / "e"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight_scale_inv").dtype == torch.float32
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    # --bridge-fp8-exclude reaches the engine's directory as it reaches every sync (its layers were FP8 there and
    # then sent BF16 without scales)
    kept = _config("--rollout-precision", "fp8", "--bridge-fp8-exclude", "layers\\.1\\.mlp").engine
    out = prepare_engine_dir(dataclasses.replace(kept, model_dir=hf_dir), str(tmp_path / "kept"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"]["ignored_layers"] == ["model.layers.1.mlp.down_proj",
                                                               "model.layers.1.mlp.gate_proj",
                                                               "model.layers.1.mlp.up_proj"]
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.up_proj.weight").dtype == torch.bfloat16
        assert "model.layers.1.mlp.up_proj.weight_scale_inv" not in f.keys()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        prepare_engine_dir(EngineConfig(model_dir=str(tmp_path), precision="fp8"), str(tmp_path / "x"))


def test_rollouts_align_with_next_token_labels():
    rollouts = [Rollout(0, [1, 2, 3], [7, 8], [-0.5, -0.25], "stop"), Rollout(0, [1, 2, 3], [9], [-1.0], "length")]
    batch = rollouts_to_batch(rollouts, [1.0, 0.0], 2, 6, pad_token_id=0)
    assert batch.tokens[0].tolist() == [1, 2, 3, 7, 0, 0] and batch.labels[0].tolist() == [2, 3, 7, 8, 0, 0]
    assert batch.mask[0].tolist() == [0, 0, 1, 1, 0, 0] and batch.rollout_logprobs[0, 2:4].tolist() == [-0.5, -0.25]
    assert batch.mask[1].tolist() == [0, 0, 1, 0, 0, 0] and batch.labels[1, 2].item() == 9
    with pytest.raises(ValueError, match="--seq-length 3"):
        rollouts_to_batch(rollouts, [1.0, 0.0], 2, 3, pad_token_id=0)


def test_grpo_refuses_a_virtual_pipeline_naming_why():
    with pytest.raises(ArgumentValidationError, match="--virtual-pipeline-model-parallel-size: megatron's interleaved "
                                                      "schedule needs .* \\(the refit probe is one"):
        GRPORunConfig.from_args(build_grpo_parser().parse_args(
            ["--hf-dir", "/m", "--pipeline-model-parallel-size", "3", "--virtual-pipeline-model-parallel-size", "2"]),
            3)
