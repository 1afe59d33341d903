"""Launch GRPO + AIS as a nemo-run experiment, the way a login node or a laptop submits jobs.

Runs in the launcher environment `.venv-launch` (nemo-run cannot share the training venv, see docs/install.md);
the job itself runs with the training environment.

    # this machine: a tiny-model job through the training venv's torchrun (CPU, gloo)
    .venv-launch/bin/python examples/nemo_run_grpo_ais.py --executor local --grpo-steps 2

    # Slurm, multi-node H100: submits examples/qwen3_8b_grpo_ais.sh (one task per node, torchrun inside) in the
    # container built from our Dockerfile; --dryrun prints the sbatch script instead of submitting
    .venv-launch/bin/python examples/nemo_run_grpo_ais.py --executor slurm --account ACCT --partition batch \\
        --nodes 4 --gpus-per-node 8 --container-image registry/megatron-ais:latest \\
        --container-mounts /lustre/models:/models /lustre/data:/data /lustre/ckpt:/checkpoints --dryrun

    # the MoE recipe (examples/qwen3_30b_a3b_grpo_ais.sh: TP2, EP8 on 6 GPUs and 2 engines per node, 4 or 8 nodes)
    .venv-launch/bin/python examples/nemo_run_grpo_ais.py --executor slurm --recipe qwen3_30b_a3b --nodes 4 ...
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# recipe -> (script, HF_MODEL, CHECKPOINT_PATH, OUTPUT_DIR) inside the container
RECIPES = {
    "qwen3_8b": ("examples/qwen3_8b_grpo_ais.sh", "/models/Qwen3-8B", "/checkpoints/qwen3-8b-grpo-ais",
                 "/results/qwen3-8b-grpo-ais"),
    "qwen3_30b_a3b": ("examples/qwen3_30b_a3b_grpo_ais.sh", "/models/Qwen3-30B-A3B",
                      "/checkpoints/qwen3-30b-a3b-grpo-ais", "/results/qwen3-30b-a3b-grpo-ais"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--executor", choices=("local", "slurm"), default="local", help="Where the job runs.")
    parser.add_argument("--dryrun", action="store_true", help="Print what would run (the sbatch script on Slurm).")
    parser.add_argument("--name", default="grpo-ais", help="Experiment name.")
    local = parser.add_argument_group("local executor (tiny model, CPU)")
    local.add_argument("--nproc-per-node", type=int, default=2, help="Trainer ranks (torchrun --nproc-per-node).")
    local.add_argument("--hf-dir", default=os.path.join(REPO, "runs", "tiny-qwen3"),
                       help="HF model to train; made by tools/make_tiny_model.py when missing.")
    local.add_argument("--grpo-steps", type=int, default=2, help="GRPO steps of the local job.")
    local.add_argument("--output-dir", default=os.path.join(REPO, "runs", "nemo-run-local"), help="Run directory.")
    slurm = parser.add_argument_group("slurm executor (multi-node H100)")
    slurm.add_argument("--account", default=None, help="Slurm account (required with --executor slurm).")
    slurm.add_argument("--partition", default=None, help="Slurm partition.")
    slurm.add_argument("--recipe", choices=sorted(RECIPES), default="qwen3_8b",
                       help="Production script to submit: dense Qwen3-8B (1-4 nodes, 4 engines each) or MoE "
                            "Qwen3-30B-A3B (4 or 8 nodes, 2 engines each).")
    slurm.add_argument("--nodes", type=int, default=1, help="Nodes (1-4 for Qwen3-8B, 4 or 8 for Qwen3-30B-A3B).")
    slurm.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node.")
    slurm.add_argument("--engines-per-node", type=int, default=None,
                       help="Rollout engines per node, each on GPUs of its own after the trainer's (the script's "
                            "ENGINES_PER_NODE; default: the recipe's fleet).")
    slurm.add_argument("--max-off-policy-steps", type=int, default=None,
                       help="MAX_OFF_POLICY_STEPS of the qwen3_8b recipe (1: rollouts of the next step overlap "
                            "training, 0: synchronous; default: the recipe's, 1).")
    slurm.add_argument("--partial-rollouts", action="store_true",
                       help="PARTIAL_ROLLOUTS=1 of the qwen3_8b recipe: syncs interrupt the engines' requests, "
                            "which resume on the new weights (needs --max-off-policy-steps >= 1).")
    slurm.add_argument("--socket-ifname", default=None,
                       help="Network interface(s) the nodes reach each other on (e.g. ib0, or eth0,eth1), exported "
                            "as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME: gloo carries the runs' host tensors "
                            "(manifests, checksums, a host arena's node copies) and, on nodes with several NICs, "
                            "otherwise takes the one the hostname resolves to, which other nodes may not reach.")
    slurm.add_argument("--time", default="04:00:00", help="Wall-clock limit.")
    slurm.add_argument("--container-image", default="megatron-ais:latest", help="Image built from our Dockerfile.")
    slurm.add_argument("--container-mounts", nargs="*", default=[], help="host:container mounts (models, data, ckpt).")
    slurm.add_argument("--job-dir", default=os.path.join(REPO, "runs", "nemo-run-jobs"),
                       help="Where nemo-run writes sbatch scripts and logs (shared filesystem on a cluster).")
    slurm.add_argument("--code-dir", default="/workspace/megatron-ais", help="The repository inside the image.")
    slurm.add_argument("--hf-model", default=None, help="HF_MODEL inside the container (default: the recipe's).")
    slurm.add_argument("--prompt-file", default="/data/gsm8k/train.jsonl", help="PROMPT_FILE inside the container.")
    slurm.add_argument("--checkpoint-path", default=None,
                       help="CHECKPOINT_PATH (resumed automatically when it holds a checkpoint; default: the recipe's).")
    slurm.add_argument("--results-dir", default=None, help="OUTPUT_DIR inside the container (default: the recipe's).")
    args = parser.parse_args(argv)
    _, hf_model, checkpoint_path, results_dir = RECIPES[args.recipe]
    args.hf_model = args.hf_model or hf_model
    args.checkpoint_path = args.checkpoint_path or checkpoint_path
    args.results_dir = args.results_dir or results_dir
    if args.executor == "slurm" and not args.account:
        parser.error("--executor slurm needs --account ACCOUNT")
    return args


def local_command(args) -> str:
    """The local job: make the tiny model if needed, then torchrun the recipe with the training venv (through
    tools/torchrun.py: a rank's error is one line, the ranks' output in the run's log)."""
    python = os.path.join(REPO, ".venv", "bin", "python")
    make_model = (f"test -f {shlex.quote(os.path.join(args.hf_dir, 'config.json'))} || {python} "
                  f"tools/make_tiny_model.py --arch qwen3 --out {shlex.quote(args.hf_dir)}")
    recipe = [python, "tools/torchrun.py", "--log", os.path.join(args.output_dir, "logs", "trainer.log"), "--standalone",
              "--nproc-per-node", str(args.nproc_per_node),
              "pretrain_grpo_ais.py", "--hf-dir", args.hf_dir, "--seq-length", "64", "--grpo-steps",
              str(args.grpo_steps), "--eval-interval", str(args.grpo_steps), "--eval-prompts", "8",
              "--eval-samples", "2", "--prompts-per-step", "4", "--group-size", "4", "--micro-batch-size", "4",
              "--rollout-kv-cache-gb", "0.25", "--rollout-placement", "colocated",  # an engine in each rank
              "--output-dir", args.output_dir]
    return f"cd {shlex.quote(REPO)} && {make_model} && {shlex.join(recipe)}"


def slurm_environment(args) -> dict[str, str]:
    """What the recipe's script reads (NNODES / NODE_RANK / MASTER_ADDR come from Slurm)."""
    return {"GPUS_PER_NODE": str(args.gpus_per_node), "HF_MODEL": args.hf_model, "PROMPT_FILE": args.prompt_file,
            "CHECKPOINT_PATH": args.checkpoint_path, "OUTPUT_DIR": args.results_dir,
            # nemo-run's sbatch script resolves the head node before these exports; scontrol may be absent in
            # the container, so the rendezvous address is passed in
            "MASTER_ADDR": "$head_node_ip", "MASTER_PORT": "6000",
            "TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "NCCL_NVLS_ENABLE": "0",
            **({"ENGINES_PER_NODE": str(args.engines_per_node)} if args.engines_per_node else {}),
            **({"MAX_OFF_POLICY_STEPS": str(args.max_off_policy_steps)}
               if args.max_off_policy_steps is not None else {}),
            **({"PARTIAL_ROLLOUTS": "1"} if args.partial_rollouts else {}),
            **({"GLOO_SOCKET_IFNAME": args.socket_ifname, "NCCL_SOCKET_IFNAME": args.socket_ifname}
               if args.socket_ifname else {})}


def build_experiment(args):
    """Return (task, executor) for the chosen executor."""
    import nemo_run as run

    if args.executor == "local":
        return run.Script(inline=local_command(args)), run.LocalExecutor()
    task = run.Script(inline=f"cd {shlex.quote(args.code_dir)} && bash {RECIPES[args.recipe][0]}")
    executor = run.SlurmExecutor(
        account=args.account, partition=args.partition, nodes=args.nodes,
        ntasks_per_node=1,  # one torchrun per node, which starts the trainer's ranks; the engines take the rest
        gpus_per_node=args.gpus_per_node, time=args.time, exclusive=True,
        container_image=args.container_image, container_mounts=list(args.container_mounts),
        env_vars=slurm_environment(args),
        packager=run.Packager(),  # the code is in the image (Dockerfile), nothing to ship
        tunnel=run.LocalTunnel(job_dir=args.job_dir))
    return task, executor


def main(argv=None) -> int:
    args = parse_args(argv)
    import nemo_run as run

    task, executor = build_experiment(args)
    with run.Experiment(args.name, executor=executor, log_level="WARN") as experiment:
        experiment.add(task, name=args.name)
        if args.dryrun:
            print(f"job command: {task.inline}", flush=True)
            experiment.dryrun()
            return 0
        experiment.run(sequential=True, detach=args.executor == "slurm", tail_logs=args.executor == "local")
    if args.executor == "local":
        status = experiment.status(return_dict=True) or {}
        states = [str(info.get("status", "")) for info in status.values()]
        if not states or any("SUCCEEDED" not in s for s in states):
            print(f"job did not succeed: {status}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
