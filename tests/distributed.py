"""Multi-rank test helpers: real gloo processes through megatron_ais.launch.spawn, and a trainer started from its
flags the way the entry points start one."""
import os

from megatron_ais.launch import preload_in_ranks, spawn

# most multi-rank tests start a vLLM engine in their ranks: its import (7 s a rank) happens once, in the rank server
preload_in_ranks("vllm.entrypoints.llm")

__all__ = ["spawn", "start_trainer", "trainer_config"]


def trainer_config(*argv, world_size: int = 1):
    """The TrainerConfig of trainer flags (checked against `world_size`)."""
    from megatron_ais.arguments import TrainerConfig, build_parser

    return TrainerConfig.from_args(build_parser("test").parse_args([str(a) for a in argv]), world_size)


def start_trainer(*argv):
    """Parse trainer flags, read the model's config and start megatron at their layout in this rank's world; return
    (the TrainerConfig, the HF config, the ModelBuildConfig)."""
    from megatron_ais.training import initialize_trainer

    trainer = trainer_config(*argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    hf_config, build = initialize_trainer(trainer)
    return trainer, hf_config, build
