"""Production launchers: every examples/*.sh is valid bash whose pretrain_grpo_ais.py flags parse with our parser;
the nemo-run launcher (in .venv-launch) dry-runs a Slurm job with the requested nodes and GPUs and really runs
a tiny 2-step job with the local executor."""
import glob
import json
import os
import subprocess
import sys

import pytest

from megatron_ais.arguments import GRPORunConfig
from megatron_ais.rollout.engine import engine_memory_fraction

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_PYTHON = os.path.join(ROOT, ".venv-launch", "bin", "python")
NEMO_RUN = os.path.join(ROOT, "examples", "nemo_run_grpo_ais.py")
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "examples", "*.sh")))


def _grpo_parser():
    sys.path.insert(0, ROOT)
    from pretrain_grpo_ais import build_grpo_parser

    return build_grpo_parser()


def test_there_are_example_scripts():
    assert any(path.endswith("qwen3_8b_grpo_ais.sh") for path in SCRIPTS)
    assert any(path.endswith("qwen3_30b_a3b_grpo_ais.sh") for path in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_example_script_is_valid_bash_and_its_flags_parse(script):
    subprocess.run(["bash", "-n", script], check=True)
    for env in ({}, {"SLURM_NNODES": "4", "SLURM_NODEID": "3", "TP": "8"}):
        printed = subprocess.run(["bash", script], env={**os.environ, **env, "PRINT_ARGS": "1"}, check=True,
                                 capture_output=True, text=True).stdout.splitlines()
        args = _grpo_parser().parse_args(printed)
        assert args.rollout_precision == "fp8" and args.is_correction == "ais"
        assert args.tensor_model_parallel_size == int(env.get("TP", "4"))
        # 32 query / 8 (Qwen3-8B) or 4 (Qwen3-30B-A3B) KV heads must split over TP or share evenly
        assert 32 % args.tensor_model_parallel_size == 0
        # the engine shares its GPUs with trainer ranks: its budget (KV cache + FP8 weights of about 9 GB for 8B,
        # 31 GB for 30B-A3B, split over the engine's TP) and, unless it is in host memory, the staging arena (the
        # weights once more) leave at least half of an 80 GB H100's GPU 0 to the trainer
        fp8_weights = (31 if "30b_a3b" in script else 9) << 30
        gpu0 = engine_memory_fraction(int(args.rollout_kv_cache_gb * (1 << 30)), fp8_weights,
                                      args.rollout_tensor_parallel_size, 80 << 30) * (80 << 30)
        gpu0 += fp8_weights if args.bridge_arena != "host" else 0
        assert gpu0 <= 40 << 30
        # the rollout batch splits into whole DP shares, mini-batches and micro-batches at every documented size
        for nodes in ((2, 3, 4) if "30b_a3b" in script else (1, 2, 3, 4)):
            GRPORunConfig.from_args(args, 8 * nodes)
        if "30b_a3b" in script:
            world = 8 * int(env.get("SLURM_NNODES", "2"))
            assert args.expert_model_parallel_size == 8 and args.sequence_parallel
            # megatron's expert groups: EP x expert-TP x PP must divide the world (as our validator checks)
            assert world % (args.expert_model_parallel_size * args.expert_tensor_parallel_size) == 0
            assert args.save == "/checkpoints/qwen3-30b-a3b-grpo-ais"


def test_nemo_run_slurm_dryrun_has_nodes_and_gpus(tmp_path):
    proc = subprocess.run([LAUNCH_PYTHON, NEMO_RUN, "--executor", "slurm", "--account", "acct", "--partition", "batch",
                           "--nodes", "3", "--gpus-per-node", "8", "--container-image", "registry/megatron-ais:1",
                           "--container-mounts", "/lustre/models:/models", "--job-dir", str(tmp_path / "jobs"),
                           "--dryrun"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    for expected in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                     "#SBATCH --account=acct", "registry/megatron-ais:1", "/lustre/models:/models",
                     "job command: cd /workspace/megatron-ais && bash examples/qwen3_8b_grpo_ais.sh",
                     "export HF_MODEL=/models/Qwen3-8B", "export MASTER_ADDR=$head_node_ip"):
        assert expected in out, expected


def test_nemo_run_slurm_moe_recipe_submits_the_moe_script(tmp_path):
    proc = subprocess.run([LAUNCH_PYTHON, NEMO_RUN, "--executor", "slurm", "--account", "acct", "--recipe",
                           "qwen3_30b_a3b", "--nodes", "2", "--job-dir", str(tmp_path / "jobs"), "--dryrun"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    for expected in ("#SBATCH --nodes=2", "bash examples/qwen3_30b_a3b_grpo_ais.sh",
                     "export HF_MODEL=/models/Qwen3-30B-A3B", "export CHECKPOINT_PATH=/checkpoints/qwen3-30b-a3b"):
        assert expected in out, expected


def test_nemo_run_slurm_needs_an_account():
    proc = subprocess.run([LAUNCH_PYTHON, NEMO_RUN, "--executor", "slurm", "--dryrun"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--account" in proc.stderr


@pytest.mark.slow
def test_nemo_run_local_executor_runs_two_steps(tmp_path, model_root):
    from conftest import make_model_dir

    hf_dir = make_model_dir(model_root, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, initializer_range=0.02)
    out = tmp_path / "run"
    proc = subprocess.run([LAUNCH_PYTHON, NEMO_RUN, "--executor", "local", "--hf-dir", hf_dir, "--grpo-steps", "2",
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.load(open(out / "summary.json"))
    assert [h["step"] for h in summary["history"]] == [1, 2]
