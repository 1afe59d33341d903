"""Weight decay as Megatron-LM applies it: every matrix decays at --weight-decay, biases and 1-D parameters (the
norms' gains, q/k norms) not at all; one Adam step with zero gradients shows it on the weights themselves
(decoupled decay shrinks a decayed weight by lr x wd, leaves the others as they were)."""
import torch

from conftest import make_model_dir
from distributed import spawn


def _worker(hf_dir):
    from megatron_ais.training import setup_model_and_optimizer
    from distributed import start_trainer

    trainer, _, build = start_trainer("--hf-dir", hf_dir, "--seq-length", "16", "--fp32", "--weight-decay", "0.1",
                                      "--lr", "0.01")
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    named = {p: name for chunk in setup.chunks for name, p in chunk.named_parameters()}
    decays = {named[p]: group["weight_decay"] for group in setup.optimizer.param_groups for p in group["params"]}
    before = {name: p.detach().clone() for p, name in named.items()}
    for ddp in setup.ddp_chunks:
        ddp.zero_grad_buffer()
    setup.optimizer.step()
    shrunk = {name: not torch.equal(p.detach(), before[name]) for p, name in named.items()}
    shapes = {name: tuple(p.shape) for p, name in named.items()}
    return decays, shrunk, shapes


def test_norms_and_biases_do_not_decay(model_root):
    hf_dir = make_model_dir(model_root, "qwen3")
    ((decays, shrunk, shapes),) = spawn(1, _worker, hf_dir)
    assert set(decays) == set(shapes)
    one_dimensional = [name for name, shape in shapes.items() if len(shape) == 1]
    assert any("layernorm" in name for name in one_dimensional), one_dimensional
    for name, shape in shapes.items():
        assert decays[name] == (0.0 if len(shape) == 1 or name.endswith(".bias") else 0.1), name
        assert shrunk[name] == (decays[name] > 0), name
