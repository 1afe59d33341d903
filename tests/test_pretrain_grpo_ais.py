"""pretrain_grpo_ais.py end to end on 2 gloo ranks (DP2): SFT checkpoint -> FP8 rollouts in a separate vLLM
engine -> rewards -> GRPO + AIS update -> bridge sync -> refit verification -> logs and the last line."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, make_model_dir


@pytest.mark.slow
def test_two_grpo_steps_end_to_end(model_root, tmp_path):
    import convert_checkpoint

    hf_dir = make_model_dir(model_root, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, initializer_range=0.02)
    checkpoint = str(tmp_path / "megatron")
    convert_checkpoint.hf_to_megatron(hf_dir, checkpoint, 1, 1)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "pretrain_grpo_ais.py"), "--load", checkpoint, "--seq-length", "64",
           "--grpo-steps", "2", "--eval-interval", "2", "--eval-prompts", "8", "--prompts-per-step", "4",
           "--group-size", "4", "--micro-batch-size", "4", "--rollout-kv-cache-gb", "0.25",
           "--output-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("accuracy_before=") and " steps=2 " in last and "wall_s=" in last
    summary = json.load(open(out / "summary.json"))
    assert len(summary["history"]) == 2
    first = summary["history"][0]
    assert 0.0 <= first["ais/lambda"] <= 1.0 and first["ais/num_units"] > 0
    assert "eval/accuracy" in summary["history"][1]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))
    assert (out / "run.png").stat().st_size > 10_000
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and "λ" in steps[0] and "rollout" in steps[0]
