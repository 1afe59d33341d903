"""Production launchers: every examples/*.sh is valid bash whose pretrain_grpo_ais.py flags parse with our parser;
the nemo-run launcher (in .venv-launch) dry-runs a Slurm job with the requested nodes and GPUs and really runs
a tiny 2-step job with the local executor."""
import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest

from megatron_ais.arguments import GRPORunConfig

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


def _plan(args, script: str, nodes: int, monkeypatch):
    """The run's configs checked for `nodes` nodes of 8 GPUs, and the placement planner's plan of them."""
    from megatron_ais.model import ModelShape
    from megatron_ais.rollout.placement import plan_placement

    trainer_gpus = 8 - args.rollout_engines_per_node * args.rollout_tensor_parallel_size
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(trainer_gpus))  # torchrun's --nproc-per-node
    config = GRPORunConfig.from_args(args, trainer_gpus * nodes)
    model = "qwen3-30b-a3b" if "30b_a3b" in script else "qwen3-8b"
    with open(os.path.join(ROOT, "examples", "models", model, "config.json")) as f:
        shape = ModelShape.from_hf_config(json.load(f))
    engine = config.engine
    plan = plan_placement(dataclasses.replace(config.cluster, nodes=nodes), config.trainer.layout, shape,
                          mode=engine.placement, rollout_tp=engine.tensor_parallel_size, precision=engine.precision,
                          kv_cache_gb=engine.kv_cache_gb,
                          distributed_optimizer=config.trainer.training.use_distributed_optimizer)
    assert plan.trainer_world == trainer_gpus * nodes
    return config, plan


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_example_script_is_valid_bash_and_its_flags_parse(script, monkeypatch):
    subprocess.run(["bash", "-n", script], check=True)
    moe, parsed = "30b_a3b" in script, []
    for env in ({}, {"SLURM_NNODES": "4", "SLURM_NODEID": "3", "TP": "8"}):
        printed = subprocess.run(["bash", script], env={**os.environ, **env, "PRINT_ARGS": "1"}, check=True,
                                 capture_output=True, text=True).stdout.splitlines()
        args = _grpo_parser().parse_args(printed)
        assert args.rollout_precision == "fp8" and args.is_correction == "ais"
        assert args.tensor_model_parallel_size == int(env.get("TP", "2" if moe else "4"))
        # 32 query / 8 (Qwen3-8B) or 4 (Qwen3-30B-A3B) KV heads must split over TP or share evenly
        assert 32 % args.tensor_model_parallel_size == 0
        assert args.rollout_placement == "separate" and args.rollout_engines_per_node > 1
        assert args.max_off_policy_steps == (0 if moe else 1)  # the dense recipe overlaps rollouts and training
        assert not args.partial_rollouts
        parsed.append(args)
    if not moe:
        printed = subprocess.run(["bash", script], env={**os.environ, "PRINT_ARGS": "1", "PARTIAL_ROLLOUTS": "1"},
                                 check=True, capture_output=True, text=True).stdout.splitlines()
        assert _grpo_parser().parse_args(printed).partial_rollouts
    args = parsed[0]
    # at every documented size: the rollout batch splits into whole DP shares, mini-batches and micro-batches, the
    # engines (on GPUs of their own) fit an 80 GB H100 with their KV cache, and a trainer GPU keeps at least 20 GiB
    # for activations beside its weights, grads, Adam state and (when on the GPU) the staging arena
    for nodes in ((4, 8) if moe else (1, 2, 3, 4)):
        config, plan = _plan(args, script, nodes, monkeypatch)
        assert plan.engine_gpu_gib <= 72
        arena_gib = plan.model.sync / 2 ** 30 if args.bridge_arena != "host" else 0  # auto: GPU 0 on CUDA
        assert plan.trainer_gpu_gib + arena_gib <= 60, (nodes, plan.trainer_gpu_gib, arena_gib)
        assert config.fleet.min_engines <= len(plan.engines) <= args.prompts_per_step
    if moe:
        assert args.expert_model_parallel_size == 8 and args.sequence_parallel
        assert args.save == "/checkpoints/qwen3-30b-a3b-grpo-ais"


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_example_script_prints_its_placement_and_starts_nothing(script, tmp_path):
    proc = subprocess.run(["bash", script], env={**os.environ, "PRINT_PLACEMENT": "1", "NNODES": "4",
                                                 "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"],
                                                 "OUTPUT_DIR": str(tmp_path / "out")},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "placement for examples/models/qwen3-" in proc.stdout and "4 node(s) x 8 GPUs" in proc.stdout
    assert "e0 (GPU " in proc.stdout and not (tmp_path / "out").exists()


def test_nemo_run_slurm_dryrun_has_nodes_and_gpus(tmp_path):
    proc = subprocess.run([LAUNCH_PYTHON, NEMO_RUN, "--executor", "slurm", "--account", "acct", "--partition", "batch",
                           "--nodes", "3", "--gpus-per-node", "8", "--container-image", "registry/megatron-ais:1",
                           "--container-mounts", "/lustre/models:/models", "--job-dir", str(tmp_path / "jobs"),
                           "--max-off-policy-steps", "2", "--partial-rollouts", "--socket-ifname", "ib0", "--dryrun"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    for expected in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                     "#SBATCH --account=acct", "registry/megatron-ais:1", "/lustre/models:/models",
                     "job command: cd /workspace/megatron-ais && bash examples/qwen3_8b_grpo_ais.sh",
                     "export HF_MODEL=/models/Qwen3-8B", "export MASTER_ADDR=$head_node_ip",
                     "export MAX_OFF_POLICY_STEPS=2", "export PARTIAL_ROLLOUTS=1", "export GLOO_SOCKET_IFNAME=ib0",
                     "export NCCL_SOCKET_IFNAME=ib0"):
        assert expected in out, expected


def test_nemo_run_slurm_moe_recipe_submits_the_moe_script(tmp_path):
    proc = subprocess.run([LAUNCH_PYTHON, NEMO_RUN, "--executor", "slurm", "--account", "acct", "--recipe",
                           "qwen3_30b_a3b", "--nodes", "4", "--engines-per-node", "1", "--job-dir",
                           str(tmp_path / "jobs"), "--dryrun"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    for expected in ("#SBATCH --nodes=4", "bash examples/qwen3_30b_a3b_grpo_ais.sh", "export ENGINES_PER_NODE=1",
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
