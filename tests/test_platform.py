"""The CPU compatibility layer patches megatron on CPU and is a strict no-op when CUDA is available (each probe in a
process of its own: the patches are process-wide)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from distributed import spawn
from megatron_ais.errors import ArgumentValidationError


def _probe(pretend_cuda):
    if pretend_cuda:
        torch.cuda.is_available = lambda: True
    originals = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.cuda.current_stream)
    from megatron_ais import platform

    active = platform.apply_cpu_compat()
    import megatron.core.optimizer.optimizer as opt

    changed = [a is not b for a, b in zip(originals, (torch.cuda.current_device, torch.cuda.synchronize,
                                                       torch.Tensor.cuda, torch.cuda.current_stream))]
    return active, all(changed), any(changed), type(opt.torch).__name__, platform.distributed_backend()


def test_patches_applied_on_cpu():
    ((active, all_changed, _, torch_in_optimizer, backend),) = spawn(1, _probe, False)
    assert (active, all_changed, torch_in_optimizer, backend) == (True, True, "_TorchProxy", "gloo")


def test_noop_when_cuda_is_available():
    ((active, _, any_changed, torch_in_optimizer, backend),) = spawn(1, _probe, True)
    assert (active, any_changed, torch_in_optimizer, backend) == (False, False, "module", "cpu:gloo,cuda:nccl")


def _causal_mask():
    from megatron.core.transformer.utils import get_default_causal_mask

    from megatron_ais import platform

    platform.apply_cpu_compat()
    return get_default_causal_mask(4)


def test_cuda_literals_become_cpu_tensors():
    (mask,) = spawn(1, _causal_mask)
    assert mask.device.type == "cpu" and torch.equal(mask, torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))


def _bf16_products(path: str):
    """With MEGATRON_AIS_CPU_BF16=`path`: the installed path, and BF16 products (mm, addmm, bmm, baddbmm, a linear
    layer's output and gradients) beside the same products in FP32 rounded to BF16 once."""
    import os

    from megatron_ais import platform

    os.environ[platform.CPU_BF16_ENV] = path
    installed = platform.install_bf16_matmul()
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((33, 256), (256, 65), (65,)))
    x, y = torch.randn(3, 17, 128, generator=g).bfloat16(), torch.randn(3, 128, 40, generator=g).bfloat16()
    z = torch.randn(3, 17, 40, generator=g).bfloat16()
    rounded = lambda t: t.to(torch.bfloat16)  # noqa: E731
    pairs = [(a @ b, rounded(a.float() @ b.float())),
             (torch.addmm(c, a, b, beta=0.5, alpha=2.0), rounded(torch.addmm(c.float(), a.float(), b.float(),
                                                                             beta=0.5, alpha=2.0))),
             (torch.bmm(x, y), rounded(torch.bmm(x.float(), y.float()))),
             (torch.baddbmm(z, x, y, beta=0.0, alpha=0.25), rounded(torch.baddbmm(z.float(), x.float(), y.float(),
                                                                                  beta=0.0, alpha=0.25)))]
    weight = torch.randn(64, 128, generator=g).bfloat16().requires_grad_()
    inputs = torch.randn(5, 7, 128, generator=g).bfloat16().requires_grad_()
    out = torch.nn.functional.linear(inputs, weight)
    grad = torch.randn(out.shape, generator=g).bfloat16()
    out.backward(grad)
    pairs += [(out, rounded(inputs.float() @ weight.float().t())),
              (inputs.grad, rounded(grad.float() @ weight.float())),
              (weight.grad, rounded(grad.float().reshape(-1, 64).t() @ inputs.float().reshape(-1, 128)))]
    fp32 = torch.randn(8, 8, generator=g)
    pairs.append((fp32 @ fp32, torch.mm(fp32, fp32, out=torch.empty(8, 8))))  # other dtypes: torch's own kernel
    equal = [bool(torch.equal(got, want)) for got, want in pairs]
    platform.uninstall_bf16_matmul()
    return installed, equal, bool(torch.equal(a @ b, pairs[0][0]))


def test_bf16_products_in_fp32_equal_an_fp32_product_rounded_to_bf16_once():
    """Forced on any machine (as on a CPU without AVX512-BF16 or AMX): each BF16 product, forward and backward,
    is the FP32 product rounded once, bit for bit; FP32 products are untouched."""
    ((installed, equal, _),) = spawn(1, _bf16_products, "fp32")
    assert installed == "fp32" and all(equal), equal


def test_native_bf16_products_are_torchs_own_kernels():
    """Forced native (what a CPU with BF16 hardware runs): nothing is overridden — torch's BF16 kernel, which on a
    CPU without BF16 hardware rounds differently from the FP32 product (accumulation in BF16 steps)."""
    ((installed, equal, _),) = spawn(1, _bf16_products, "native")
    assert installed == "native" and equal[-1]


def _paths_chosen(bf16_env, fp8_env, kernel_built):
    from megatron_ais import platform

    for name, value in ((platform.CPU_BF16_ENV, bf16_env), (platform.CPU_FP8_ENV, fp8_env)):
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    try:
        return platform.bf16_matmul_path(), platform.cpu_fp8_path(kernel_built), platform.cpu_has_native_bf16()
    except ArgumentValidationError as err:
        return str(err)


def test_paths_follow_the_cpu_unless_forced_and_a_bad_value_is_one_clear_line():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    results = spawn(1, _paths_chosen, None, None, True) + spawn(1, _paths_chosen, None, None, False) + \
        spawn(1, _paths_chosen, "fp32", "torch", True) + spawn(1, _paths_chosen, "native", "kernel", False) + \
        spawn(1, _paths_chosen, "fast", None, True)
    auto_built, auto_not_built, forced, kernel_not_built, bad = results
    assert auto_built == (("native", "kernel", True) if native else ("fp32", "torch", False))
    assert auto_not_built[1] == "torch"
    assert forced[:2] == ("fp32", "torch")
    assert "MEGATRON_AIS_CPU_FP8=kernel" in kernel_not_built and "set it to torch" in kernel_not_built
    assert bad == "MEGATRON_AIS_CPU_BF16=fast: expected one of auto, native, fp32 (or leave it unset)"


@pytest.mark.parametrize("name, value, expected", [
    ("MEGATRON_AIS_CPU_KERNELS", "off", "MEGATRON_AIS_CPU_KERNELS=off: expected 1 (the CPU kernels) or 0"),
    ("MEGATRON_AIS_CPU_BF16", "FP32", "MEGATRON_AIS_CPU_BF16=FP32: expected one of auto, native, fp32"),
    ("MEGATRON_AIS_CPU_FP8", "yes", "MEGATRON_AIS_CPU_FP8=yes: expected one of auto, kernel, torch"),
])
def test_a_bad_path_variable_is_refused_with_the_flags(monkeypatch, name, value, expected):
    # 'off' used the kernels (only '0' disabled them); a bad BF16 value was refused only once megatron started,
    # after --save was locked
    from megatron_ais.arguments import TrainerConfig, build_parser

    monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentValidationError, match=re.escape(expected)):
        TrainerConfig.from_args(build_parser("test").parse_args(["--hf-dir", "unused"]), 1)


def test_a_forced_kernel_build_that_fails_is_an_error(tmp_path):
    code = ("from kernels import cpu_library\ntry:\n    cpu_library.library()\nexcept RuntimeError as err:\n"
            "    assert 'were asked for' in str(err), err\n    print('ok')\n")
    env = {**os.environ, "MEGATRON_AIS_CPU_ARCH": "no-such-cpu", "MEGATRON_AIS_KERNEL_CACHE": str(tmp_path),
           "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "ok", out.stderr
