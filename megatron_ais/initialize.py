"""Process groups, megatron parallel state and seeds, in the order Megatron-LM's `initialize_megatron` uses."""
from __future__ import annotations

import dataclasses
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_ais import platform
from megatron_ais.arguments import validate_parallel_args


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """The parallel layout of a run; DP is derived from the world size."""

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None

    @classmethod
    def from_args(cls, args) -> "ParallelSizes":
        """Return the sizes named by the parallelism flags."""
        return cls(tensor=args.tensor_model_parallel_size, pipeline=args.pipeline_model_parallel_size,
                   virtual_pipeline=args.virtual_pipeline_model_parallel_size, context=args.context_parallel_size,
                   expert=args.expert_model_parallel_size, expert_tensor=args.expert_tensor_parallel_size)


def initialize_distributed(timeout_minutes: int = 30) -> None:
    """Start torch.distributed from the launcher's env (torchrun): gloo on CPU; NCCL and gloo (host tensors) on CUDA."""
    if dist.is_initialized():
        return
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"environment variable {var} is not set; launch with torchrun "
                               "(python -m torch.distributed.run --nproc-per-node N ...)")
    if platform.is_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=platform.distributed_backend(),
                            timeout=datetime.timedelta(minutes=timeout_minutes))


def initialize_model_parallel(sizes: ParallelSizes) -> None:
    """Create megatron's TP / PP / VPP / CP / EP / DP groups for the current world."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        virtual_pipeline_model_parallel_size=sizes.virtual_pipeline,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
        expert_tensor_parallel_size=sizes.expert_tensor,
        # megatron's optimizer setup asks for the gloo copies of the DP groups (Megatron-LM's default as well)
        create_gloo_process_groups=True,
    )


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch per pipeline stage, and megatron's TP/EP RNG tracker (Megatron-LM semantics)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def initialize_megatron(args) -> ParallelSizes:
    """Apply the CPU compatibility layer, start torch.distributed, build parallel state and seed; return the sizes."""
    platform.apply_cpu_compat()
    initialize_distributed()
    validate_parallel_args(args, dist.get_world_size())
    sizes = ParallelSizes.from_args(args)
    initialize_model_parallel(sizes)
    set_random_seed(args.seed)
    return sizes


def destroy_megatron() -> None:
    """Tear down parallel state and the default process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
