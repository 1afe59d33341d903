"""The CPU compatibility layer patches megatron on CPU and is a strict no-op when CUDA is available."""
import subprocess
import sys

PROBE = """
import torch
{setup}
originals = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.cuda.current_stream)
from megatron_ais import platform
active = platform.apply_cpu_compat()
import megatron.core.optimizer.optimizer as opt
changed = [a is not b for a, b in zip(originals, (torch.cuda.current_device, torch.cuda.synchronize,
                                                   torch.Tensor.cuda, torch.cuda.current_stream))]
print(active, all(changed), any(changed), type(opt.torch).__name__, platform.distributed_backend())
"""


def _probe(setup=""):
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_patches_applied_on_cpu():
    active, all_changed, _, torch_in_optimizer, backend = _probe()
    assert (active, all_changed, torch_in_optimizer, backend) == ("True", "True", "_TorchProxy", "gloo")


def test_noop_when_cuda_is_available():
    active, _, any_changed, torch_in_optimizer, backend = _probe("torch.cuda.is_available = lambda: True")
    assert (active, any_changed, torch_in_optimizer, backend) == ("False", "False", "module", "cpu:gloo,cuda:nccl")


def test_cuda_literals_become_cpu_tensors():
    out = subprocess.run([sys.executable, "-c", (
        "from megatron_ais import platform; platform.apply_cpu_compat()\n"
        "from megatron.core.transformer.utils import get_default_causal_mask\n"
        "import torch\n"
        "m = get_default_causal_mask(4)\n"
        "assert m.device.type == 'cpu' and torch.equal(m, torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))\n"
        "print('ok')")], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
