"""GRPO with FP8 vLLM rollouts and Adaptive Importance Sampling on Megatron-Core (the way pretrain_gpt.py sits
over megatron): flags and the loop live in megatron_ais.

    python -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_grpo_ais.py \\
        --load runs/sft/checkpoint --rollout-precision fp8 --is-correction ais --grpo-steps 20
"""
import sys

from megatron_ais.ais import add_correction_args
from megatron_ais.arguments import ALL_GROUPS, ArgumentValidationError, build_parser
from megatron_ais.bridge.sync import add_bridge_args
from megatron_ais.checkpointing import CheckpointError
from megatron_ais.data.tasks import TaskError, add_task_args
from megatron_ais.grpo.loss import add_grpo_args
from megatron_ais.recipe import add_recipe_args, run_grpo
from megatron_ais.rollout.engine import add_rollout_args


def build_grpo_parser():
    """Return the parser of every pretrain_grpo_ais.py flag, grouped by concern."""
    return build_parser(__doc__.split("\n\n")[0], ALL_GROUPS + (add_task_args, add_grpo_args, add_correction_args,
                                                               add_rollout_args, add_bridge_args, add_recipe_args))


def main(argv=None) -> int:
    parser = build_grpo_parser()
    args = parser.parse_args(argv)
    try:
        summary = run_grpo(args)
    except (ArgumentValidationError, CheckpointError, TaskError) as err:
        parser.error(str(err))
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"accuracy_before={summary['accuracy_before']:.4f} accuracy_after={summary['accuracy_after']:.4f} "
              f"steps={summary['steps']} wall_s={summary['wall_s']:.1f}", flush=True)
    from megatron_ais.initialize import destroy_megatron
    destroy_megatron()
    return 0


if __name__ == "__main__":
    sys.exit(main())
