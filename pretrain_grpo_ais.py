"""GRPO with FP8 vLLM rollouts and Adaptive Importance Sampling on Megatron-Core (the way pretrain_gpt.py sits
over megatron): the flags become typed configs once, here; the run lives in megatron_ais.grpo.run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_grpo_ais.py \\
        --load runs/sft/checkpoint --rollout-precision fp8 --is-correction ais --grpo-steps 20
"""
import os
import sys

from megatron_ais.errors import USAGE_ERRORS, ArgumentValidationError, reported_as_one_line
from megatron_ais.logging import apply_vllm_log_level, quiet_libraries

apply_vllm_log_level()  # at import: vLLM's engine processes import this module first (see the function)


def build_grpo_parser():
    """Return the parser of every pretrain_grpo_ais.py flag, grouped by concern."""
    # the trainer's modules (megatron-core: seconds) load when called, not at import: vLLM's spawned engine
    # processes import this module first and need none of them
    from megatron_ais.arguments import GRPO_FLAGS, build_parser

    return build_parser(__doc__.split("\n\n")[0], GRPO_FLAGS, prog="pretrain_grpo_ais.py")


def print_placement(parser, args) -> int:
    """--print-placement: the run's flags planned onto --cluster-nodes x --cluster-gpus-per-node GPUs; nothing
    starts (no torchrun needed)."""
    from megatron_ais.arguments import GRPORunConfig  # see build_grpo_parser
    from megatron_ais.checkpointing.store import read_checkpoint_metadata
    from megatron_ais.model import load_hf_config
    from megatron_ais.engine.config import EngineConfig
    from megatron_ais.rollout.placement import ClusterConfig, describe_placement, trainer_gpus_per_node

    try:
        engine = EngineConfig.from_args(args, seed=0)
        cluster = ClusterConfig.from_args(args)
        world = cluster.nodes * trainer_gpus_per_node(cluster, engine.placement, engine.tensor_parallel_size)
        config = GRPORunConfig.from_args(args, world)
        load, hf_dir = config.trainer.checkpoint.load, config.trainer.model.hf_dir
        if load:
            hf_config, name = read_checkpoint_metadata(load)["hf_config"], load
        elif hf_dir:
            hf_config, name = load_hf_config(hf_dir), hf_dir
        else:
            raise ArgumentValidationError("--print-placement needs the model: pass --hf-dir DIR (its config.json is "
                                          "enough, e.g. examples/models/qwen3-8b) or --load DIR")
        print(describe_placement(config, hf_config, name))
    except USAGE_ERRORS as err:
        parser.error(str(err))
    return 0


def main(argv=None) -> int:
    # before megatron is imported (it warns at import): library warnings on rank 0 only, once, on one line
    quiet_libraries(int(os.environ.get("RANK", "0")))
    from megatron_ais.arguments import GRPORunConfig, launched_world_size  # see build_grpo_parser
    from megatron_ais.grpo.run import GRPORun

    parser = build_grpo_parser()
    args = parser.parse_args(argv)
    if args.print_placement:
        return print_placement(parser, args)
    world_size = launched_world_size(parser)
    with reported_as_one_line(parser.prog, parser):
        summary = GRPORun(GRPORunConfig.from_args(args, world_size)).run()
    if int(os.environ["RANK"]) == 0:  # colocated engines may have torn torch.distributed down already
        print(f"accuracy_before={summary['accuracy_before']:.4f} accuracy_after={summary['accuracy_after']:.4f} "
              f"steps={summary['steps']} wall_s={summary['wall_s']:.1f}", flush=True)
    from megatron_ais.initialize import destroy_megatron
    destroy_megatron()
    return 0


if __name__ == "__main__":
    sys.exit(main())
