"""A run resumed from a checkpoint under its own --save keeps the HF assets (tokenizer) in every later checkpoint,
after pruning removes the one it resumed from: each save copies them from the run's newest checkpoint. They are
listed in checksums.json: a checkpoint whose tokenizer was truncated is refused, and the one before it used."""
import os

from conftest import make_model_dir
from distributed import spawn


def _worker(hf_dir, root):
    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.checkpointing import store
    from megatron_ais.checkpointing.checkpointer import Checkpointer
    from megatron_ais.checkpointing.config import HF_ASSETS, CheckpointConfig, checkpoint_metadata
    from megatron_ais.checkpointing.ranks import CheckpointRanks
    from megatron_ais.training import setup_model_and_optimizer

    trainer, hf_config, build = start_trainer("--hf-dir", hf_dir, "--seq-length", "16", "--fp32")
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training)
    store.save_checkpoint(root, 1, setup.chunks, checkpoint_metadata(build, hf_config, 1), hf_dir,
                          CheckpointRanks.from_parallel_state())
    # the resumed run: its assets are the loaded checkpoint's, which --keep-checkpoints 1 prunes at its first save
    resumed = Checkpointer(CheckpointConfig(save=root, keep_checkpoints=1, ckpt_format="torch"), build, hf_config,
                           setup.chunks, setup.optimizer, os.path.join(store.iteration_dir(root, 1), HF_ASSETS),
                           (ps.get_data_parallel_group(), ps.get_data_parallel_world_size()), False)
    for iteration in (2, 3):
        resumed.save(iteration, {"kind": "test", "step": iteration})
    committed = store.committed_iterations(root)
    assets = sorted(os.listdir(os.path.join(store.iteration_dir(root, 3), HF_ASSETS)))
    # a save whose tokenizer a power loss left empty (the rank files intact) is refused, the one before it used
    resumed.config = CheckpointConfig(save=root, keep_checkpoints=2, ckpt_format="torch")
    resumed.save(4, {"kind": "test", "step": 4})
    open(os.path.join(store.iteration_dir(root, 4), HF_ASSETS, "tokenizer.json"), "w").close()
    return committed, assets, store.usable_iterations(root)


def test_every_save_after_a_resume_keeps_the_tokenizer(model_root, tmp_path):
    hf_dir = make_model_dir(model_root, "qwen3")
    ((committed, assets, usable),) = spawn(1, _worker, hf_dir, str(tmp_path / "ckpt"))
    assert committed == [3] and usable == [3]
    assert "tokenizer.json" in assets and assets == sorted(n for n in os.listdir(hf_dir) if n in assets), assets
