"""The engine's GPU memory budget: the `gpu_memory_utilization` vLLM is given (its KV cache, its tensor-parallel
share of the weights and a fixed overhead per GPU, not vLLM's 0.92), and the refusal, with the flags to change, of
an engine that would not fit next to the trainer rank on its GPU."""
from __future__ import annotations

import os

import torch

from megatron_ais.engine.config import EngineConfig

ENGINE_OVERHEAD_BYTES = 2 << 30  # CUDA context, activations of vLLM's profile run, sampler buffers


def engine_memory_fraction(kv_cache_bytes: int, weight_bytes: int, tensor_parallel_size: int, total_bytes: int,
                           overhead_bytes: int = ENGINE_OVERHEAD_BYTES) -> float:
    """The `gpu_memory_utilization` to give vLLM for an engine whose KV cache size is set explicitly.

    vLLM then uses the fraction for one thing only: it refuses to start unless the GPU's free memory is at least
    fraction x total. Its default (0.92) can never pass on a GPU the engine shares with a trainer rank, so the engine
    asks for its own budget per GPU: its KV cache, its tensor-parallel share of the weights and a fixed overhead.
    """
    budget = kv_cache_bytes + -(-weight_bytes // tensor_parallel_size) + overhead_bytes
    if budget > total_bytes:
        raise ValueError(f"the rollout engine needs about {budget / 2**30:.1f} GiB per GPU (KV cache "
                         f"{kv_cache_bytes / 2**30:.1f} GiB from --rollout-kv-cache-gb, weights "
                         f"{weight_bytes / tensor_parallel_size / 2**30:.1f} GiB, {overhead_bytes / 2**30:.1f} GiB "
                         f"of activations and context) but a GPU has {total_bytes / 2**30:.1f} GiB: lower "
                         "--rollout-kv-cache-gb or raise --rollout-tensor-parallel-size")
    return budget / total_bytes


def engine_gpu_memory_utilization(config: EngineConfig, engine_dir: str, arena_allocated: bool) -> float:
    """`--rollout-gpu-memory-utilization`, or the engine's own budget. An engine whose first worker shares this
    trainer rank's GPU is refused here, with the flags to change, when that GPU has not that much free; the
    bridge's staging arena holds the engine's tensors once more per slot (twice double-buffered), unless it is
    already allocated (`arena_allocated`: a crashed engine restarted). On GPUs of its own vLLM checks their free memory itself."""
    if config.gpu_memory_utilization is not None:
        return config.gpu_memory_utilization
    gpu = config.gpus[0] if config.gpus else torch.cuda.current_device() if config.placement == "colocated" else 0
    total = torch.cuda.get_device_properties(gpu).total_memory
    weights = os.path.getsize(os.path.join(engine_dir, "model.safetensors"))
    fraction = engine_memory_fraction(int(config.kv_cache_gb * (1 << 30)), weights, config.tensor_parallel_size, total)
    if gpu != torch.cuda.current_device():
        return fraction
    free, _ = torch.cuda.mem_get_info()
    arena = 0 if arena_allocated else weights * config.staging_arena_gpu_copies
    if fraction * total + arena > free:
        raise RuntimeError(f"the rollout engine needs about {fraction * total / 2**30:.1f} GiB of GPU "
                           f"{torch.cuda.current_device()}, the bridge's staging arena {arena / 2**30:.1f} GiB, "
                           f"and {free / 2**30:.1f} GiB are free next to the trainer: lower --rollout-kv-cache-gb, "
                           "put the arena in host memory (--bridge-arena host) or lower the trainer's memory "
                           "(--micro-batch-size, --use-distributed-optimizer, more model parallelism)")
    return fraction
