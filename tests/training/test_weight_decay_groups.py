"""Weight decay as Megatron-LM applies it: every matrix decays at --weight-decay, biases and 1-D parameters (the
norms' gains, q/k norms) not at all; one Adam step with zero gradients shows it on the weights themselves
(decoupled decay shrinks a decayed weight by lr x wd, leaves the others as they were)."""
import pytest
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


def _resume_worker(hf_dir, save_dir, fmt, flags, resume, updates=1):
    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.checkpointing.config import checkpoint_metadata
    from megatron_ais.checkpointing.ranks import CheckpointRanks
    from megatron_ais.checkpointing.store import FORMATS, save_checkpoint
    from megatron_ais.training import setup_model_and_optimizer

    trainer, hf_config, build = start_trainer("--hf-dir", hf_dir, "--seq-length", "16", *flags,
                                              *(["--load", save_dir] if resume else []))
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training, run_kind="test")
    for _ in range(updates if resume else 1 if updates else 0):  # zero-gradient steps
        for ddp in setup.ddp_chunks:
            ddp.zero_grad_buffer()
        setup.optimizer.step()
    if not resume:
        distributed = trainer.training.use_distributed_optimizer
        save_checkpoint(save_dir, 1, setup.chunks, checkpoint_metadata(build, hf_config, 1, 1, distributed), hf_dir,
                        CheckpointRanks.from_parallel_state(), optimizer=setup.optimizer,
                        run_state={"kind": "test", "step": 1}, dp_group=ps.get_data_parallel_group(),
                        fmt=FORMATS[fmt])
    return setup.run_state is not None, [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["wd_mult"])
                                         for g in setup.optimizer.param_groups]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_resumed_run_trains_with_its_own_optimizer_flags(model_root, tmp_path, fmt):
    # loading the optimizer's state brought back the saved run's learning rate, betas and epsilon (its weight decay
    # was set again): a run resumed with another --lr trained on at the old one
    hf_dir = make_model_dir(model_root, "qwen3")
    save = str(tmp_path / "ckpt")
    spawn(1, _resume_worker, hf_dir, save, fmt, ["--fp32", "--lr", "0.01", "--weight-decay", "0.1"], False)
    ((resumed, groups),) = spawn(1, _resume_worker, hf_dir, save, fmt,
                                 ["--fp32", "--lr", "1e-4", "--weight-decay", "0.2", "--adam-beta1", "0.8",
                                  "--adam-beta2", "0.95", "--adam-eps", "1e-6"], True, 0)
    assert resumed and len(groups) >= 2
    for lr, betas, eps, weight_decay, wd_mult in groups:
        assert (lr, betas, eps, weight_decay) == (1e-4, (0.8, 0.95), 1e-6, 0.2 * wd_mult)


@pytest.mark.parametrize("fmt,flags", [("torch", ["--bf16", "--use-distributed-optimizer"]), ("torch_dist", ["--fp32"]),
                                       ("torch_dist", ["--bf16"]),
                                       ("torch_dist", ["--bf16", "--use-distributed-optimizer"])])
def test_a_checkpoint_saved_before_the_first_update_resumes(model_root, tmp_path, fmt, flags):
    # a GRPO run whose first steps were all skipped saves an optimizer that never stepped: the distributed optimizer
    # could not save it, and torch_dist could not load it (no Adam moments; megatron-core keeps no step 0)
    hf_dir = make_model_dir(model_root, "qwen3")
    save = str(tmp_path / "ckpt")
    spawn(1, _resume_worker, hf_dir, save, fmt, flags, False, 0)
    ((resumed, _),) = spawn(1, _resume_worker, hf_dir, save, fmt, flags, True, 1)  # and the resumed run steps
    assert resumed
