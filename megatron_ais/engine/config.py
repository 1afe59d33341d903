"""The rollout engine's flags (`EngineConfig`): precision, KV cache, placement, weight feed, memory and length
limits. Below every other engine module (they and the trainer's argument parsing read it; it starts nothing)."""
from __future__ import annotations

import argparse
import dataclasses

from megatron_ais.flags import FlagConfig, flag

PRECISIONS = ("bf16", "fp8", "nvfp4", "mxfp4", "fp32")
LOG_LEVELS = ("error", "warning", "info", "debug")
WEIGHT_FEEDS = ("shm", "broadcast")
PLACEMENTS = ("colocated", "separate")


def cpu_list(spec: str) -> set[int]:
    """The cores of a CPU list as VLLM_CPU_OMP_THREADS_BIND writes them ("1", "0-3", "0,2-3")."""
    cores = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


@dataclasses.dataclass(frozen=True)
class EngineConfig(FlagConfig):
    """How the engine is built and fed: precision, KV cache, placement, memory and length limits. `model_dir` (its
    initial weights), `seed` and whether the bridge's staging arena shares its GPU are set by the run."""

    model_dir: str = ""
    precision: str = flag("fp8", "fp8: blockwise FP8 linear layers (128x128, weight_scale_inv) fed by the bridge; "
                                 "nvfp4 / mxfp4: 4-bit weight-only linear layers (W4A16; NVFP4 as ModelOpt writes "
                                 "it, MXFP4 as compressed-tensors does; MoE experts too); bf16; fp32 (exact "
                                 "comparisons with the trainer).", name="--rollout-precision",
                          choices=PRECISIONS)
    fp8_activations: str = flag(
        "none", "emulate: the CPU engine's FP8 linear layers quantize their inputs per token in 1x128 e4m3 groups, "
                "as vLLM does on an H100 (W8A8), and multiply in fp32 — H100's FP8 numerics for studying the "
                "mismatch, at CPU speed (an fp32 copy of the weights; not a speed path); none: W8A16 (the CPU "
                "kernel's BF16 activations). GPUs run W8A8 natively.", name="--rollout-fp8-activations",
        choices=("none", "emulate"))
    kv_cache_dtype: str = flag("auto", "KV-cache dtype of the engine (fp8 = e4m3, with per-layer K/V scales "
                                       "recalibrated by the trainer at every weight sync).",
                               name="--rollout-kv-cache-dtype", choices=("auto", "fp8"))
    placement: str = flag("separate", "colocated: an engine inside every trainer process (vLLM's external_launcher "
                                      "on the trainer's world; rollout TP 1; an engine failure is the rank's); "
                                      "separate: engine processes fed through shared memory, driven by the first "
                                      "--rollout-engines-per-node ranks of every node.", name="--rollout-placement",
                          choices=PLACEMENTS)
    tensor_parallel_size: int = flag(1, "vLLM tensor-parallel size of the engine (its own ranks, independent of the "
                                        "trainer's TP; separate placement). Blockwise FP8 needs q/k/MLP sizes per rank "
                                        "divisible by 128.", name="--rollout-tensor-parallel-size", at_least=1)
    weight_feed: str = flag("shm", "How a separate engine's workers get each verified sync: shm = they map the "
                                   "bridge's shared-memory staging arena (same node); broadcast = the engine's rank "
                                   "sends it over a process group of its own (gloo on CPU, NCCL on GPU) and every "
                                   "worker verifies it.", name="--rollout-weight-feed", choices=WEIGHT_FEEDS)
    kv_cache_gb: float = flag(1.0, "KV-cache memory of the engine (GiB; per GPU on CUDA).",
                              name="--rollout-kv-cache-gb")
    gpu_memory_utilization: float | None = flag(
        None, "vLLM's gpu_memory_utilization (CUDA only). With an explicit KV-cache size vLLM uses it only to refuse "
              "to start below that fraction of free memory; default: the engine's own budget (KV cache + its share of "
              "the weights + 2 GiB), so that it can share a GPU with a trainer rank (vLLM's 0.92 never could).",
        name="--rollout-gpu-memory-utilization", type=float,
        above=0, at_most=1, bound_note="or left out: the engine then asks vLLM for its own budget")
    enforce_eager: bool = flag(
        True, "Run the engine eagerly (default). --no-rollout-enforce-eager lets vLLM compile and capture CUDA graphs "
              "(faster decoding on GPU; vLLM's layer-wise reload copies updates into the captured storage). The refit "
              "check's per-layer diagnosis uses forward hooks, which graph replays skip, and the MoE routing probe has "
              "not been tried under graphs.", name="--rollout-enforce-eager", action=argparse.BooleanOptionalAction)
    call_timeout_s: float = flag(
        600.0, "Longest a separate engine may leave a call unanswered (a weight sync, KV-cache scales, a refit probe, "
               "a routing pass); past it the engine is wedged: its processes are killed and it is restarted like one "
               "that died. Generation has --rollout-generation-timeout-s.", name="--rollout-engine-call-timeout-s",
        above=0)
    max_num_seqs: int = flag(64, "Sequences the engine batches at once.", name="--rollout-max-num-seqs")
    max_model_len: int = flag(512, "Longest prompt + response the engine serves.", name="--rollout-max-model-len")
    log_level: str = flag("error", "What vLLM prints (its processes too): error keeps the console to our lines; "
                                   "warning adds its warnings; info adds its per-call progress bars and per-sync "
                                   "lines.", name="--rollout-log-level", choices=LOG_LEVELS)
    seed: int = 0
    block_size: int = 128
    quantization_exclude: tuple[str, ...] = ()  # the bridge policy's --bridge-fp8-exclude: what the engine's model
    # directory keeps in BF16 (its weights and quantization_config), as every sync then sends it
    cpu_core: str | None = flag(None, "CPU, one engine on a node: the cores its processes are bound to (vLLM's "
                                      "VLLM_CPU_OMP_THREADS_BIND syntax: 1, 2-3, 0,2), away from the trainer's; "
                                      "a node running several binds each to one core of its own. Default: vLLM's "
                                      "binding of its workers.", name="--rollout-cpu-core", type=str)
    gpus: tuple[int, ...] | None = None  # GPU: its workers' GPUs (vLLM's device_ids, among the visible ones);
    # None: vLLM's default, from GPU 0
    staging_arena_gpu_copies: int = 0  # copies of its tensors the bridge's staging arena allocates on its first GPU
    # (one per slot: 2 when double-buffered; 0: the arena is elsewhere)

    def quantizes_activations(self, on_gpu: bool) -> bool:
        """Whether the engine's FP8 linear layers quantize their inputs (W8A8): on a GPU always, on a CPU when
        emulated."""
        return self.precision == "fp8" and (on_gpu or self.fp8_activations == "emulate")

    def __post_init__(self):
        super().__post_init__()
        if self.precision not in PRECISIONS:
            raise ValueError(f"--rollout-precision {self.precision!r} must be one of {PRECISIONS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--rollout-placement {self.placement!r} must be one of {PLACEMENTS}")
        if self.weight_feed not in WEIGHT_FEEDS:
            raise ValueError(f"--rollout-weight-feed {self.weight_feed!r} must be one of {WEIGHT_FEEDS}")
        if self.placement == "colocated" and self.tensor_parallel_size > 1:
            raise ValueError("--rollout-tensor-parallel-size > 1 needs --rollout-placement separate (vLLM's own "
                             "worker processes form the engine's tensor-parallel group)")
        if self.fp8_activations == "emulate" and self.precision != "fp8":
            raise ValueError(f"--rollout-fp8-activations emulate quantizes the inputs of FP8 linear layers; "
                             f"--rollout-precision {self.precision} has none: use --rollout-precision fp8")
        if self.cpu_core is not None:
            try:
                cpu_list(self.cpu_core)
            except ValueError:
                raise ValueError(f"--rollout-cpu-core {self.cpu_core!r} is not a CPU list (write 1, 2-3 or "
                                 "0,2)") from None
        if self.placement == "colocated" and self.weight_feed == "broadcast":
            raise ValueError("--rollout-weight-feed broadcast feeds a separate engine's workers; a colocated engine "
                             "takes the arena's tensors in process: drop the flag or use --rollout-placement separate")
