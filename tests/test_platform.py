"""The CPU compatibility layer patches megatron on CPU and is a strict no-op when CUDA is available (each probe in a
process of its own: the patches are process-wide)."""
import torch

from distributed import spawn


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
