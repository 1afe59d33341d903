"""Process groups, megatron parallel state and seeds, in the order Megatron-LM's `initialize_megatron` uses."""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_ais import platform
from megatron_ais.distributed import initialize_distributed
from megatron_ais.parallel import ParallelLayout


def initialize_model_parallel(layout: ParallelLayout) -> None:
    """Create megatron's TP / PP / VPP / CP / EP / DP groups for the current world."""
    ps.initialize_model_parallel(
        **layout.megatron_sizes(), distributed_timeout_minutes=layout.distributed_timeout_minutes,
        # megatron's optimizer setup asks for the gloo copies of the DP groups (Megatron-LM's default as well)
        create_gloo_process_groups=True,
    )


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch per pipeline stage, and megatron's TP/EP RNG tracker (Megatron-LM semantics)."""
    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def initialize_megatron(layout: ParallelLayout, seed: int) -> None:
    """Apply the CPU compatibility layer, start torch.distributed, build parallel state for `layout` and seed."""
    platform.apply_cpu_compat()
    initialize_distributed(layout.distributed_timeout_minutes)
    layout.data_parallel(dist.get_world_size())  # refuses a world the layout does not fit
    initialize_model_parallel(layout)
    set_random_seed(seed)


def destroy_megatron() -> None:
    """Tear down parallel state and the default process group."""
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
