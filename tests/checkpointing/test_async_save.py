"""--async-save on 2 gloo ranks (DP2, distributed optimizer): a background save holds what the state was when it was
taken, though training changes the live tensors and run state before its files are written, and commits a
checkpoint equal in content to a synchronous save of that state, in both formats; a process SIGKILLed while its
background write is outstanding leaves the previous checkpoint current and verified, its staging directory
uncommitted; an SFT run returns only once its background save is committed."""
import functools
import io
import json
import os

import numpy as np
import pytest
import torch

from conftest import make_model_dir
from distributed import spawn

SEQ = 16


def _gated(write, release):
    """A rank's file write that starts only once `release` is set: the test's training step runs first."""
    release.wait()
    return write()


def _killed_after(write):
    """A rank's file write after which its process is SIGKILLed, before any checksum is exchanged or committed."""
    import signal

    write()
    os.kill(os.getpid(), signal.SIGKILL)


def _trainer(hf_dir):
    """(the model setup, a training step that changes parameters and optimizer state, the checkpoint metadata)."""
    from megatron.core import parallel_state as ps

    from distributed import start_trainer
    from megatron_ais.checkpointing.config import checkpoint_metadata
    from megatron_ais.forward import split_micro_batches
    from megatron_ais.training import lm_forward_step, setup_model_and_optimizer, train_step

    trainer, hf_config, build = start_trainer("--hf-dir", hf_dir, "--seq-length", str(SEQ), "--fp32", "--lr", "1e-2",
                                              "--micro-batch-size", "2", "--use-distributed-optimizer")
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training, run_kind="test")
    tokens = torch.randint(0, build.shape.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(0))
    rows = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(4, SEQ)}

    def step():
        batches = split_micro_batches(rows, 2)
        train_step(setup.ddp_chunks, setup.optimizer, lm_forward_step, iter(batches), len(batches), SEQ, 2)

    return setup, step, checkpoint_metadata(build, hf_config, 1, ps.get_data_parallel_world_size(), True)


def _save_arguments(setup, run_state):
    from megatron.core import parallel_state as ps

    from megatron_ais.checkpointing.ranks import CheckpointRanks

    return dict(ranks=CheckpointRanks.from_parallel_state(), optimizer=setup.optimizer, run_state=run_state,
                dp_group=ps.get_data_parallel_group())


def _same_content_worker(hf_dir, root):
    import threading

    from megatron_ais.checkpointing import store
    from megatron_ais.checkpointing.background import BackgroundSaver
    from megatron_ais.checkpointing.config import RankFileWrite

    setup, step, metadata = _trainer(hf_dir)
    step()
    run_state = {"kind": "test", "step": 1, "history": [{"step": 1}]}
    for fmt in store.FORMATS.values():
        store.save_checkpoint(os.path.join(root, fmt.NAME, "sync"), 1, setup.chunks, metadata, hf_dir,
                              fmt=fmt, **_save_arguments(setup, run_state))
        staged = store.begin_save(os.path.join(root, fmt.NAME, "async"), 1, setup.chunks, metadata, hf_dir, fmt=fmt,
                                  snapshot=True, **_save_arguments(setup, run_state))
        release = threading.Event()
        staged.files = RankFileWrite(functools.partial(_gated, staged.files.write, release), staged.files.finish)
        saver = BackgroundSaver()
        saver.start(staged)
        assert saver.poll() is None and saver.outstanding == 1  # no rank has written: nothing to commit yet
        step()  # training goes on: parameters, optimizer state and run state change before the files are written
        run_state["history"].append({"step": 2})
        release.set()
        assert saver.wait() == 1 and saver.outstanding is None and saver.poll() is None
        run_state["history"].pop()
    return None


def _same(a, b) -> bool:
    """Whether two loaded checkpoint contents are equal: tensors bit for bit, containers element by element."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue()
    return a == b


def _contents(directory: str, fmt) -> dict:
    """Every rank file of a checkpoint, read back: the torch format's and the run state as data, torch_dist's
    tensors merged from every .distcp file by torch.distributed.checkpoint (its index files name the directory they
    were written in and a save id, so they are compared through what they index)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_ais.checkpointing.formats.torch import load_data

    names = sorted(json.load(open(os.path.join(directory, "checksums.json"))))
    contents = {"names": names}
    for name in names:
        if name.endswith(".pt") and name != "model/common.pt":
            contents[name] = load_data(os.path.join(directory, name))
    if fmt.NAME == "torch_dist":
        merged = os.path.join(directory + ".merged.pt")
        dcp_to_torch_save(os.path.join(directory, "model"), merged)
        contents["model"] = torch.load(merged, weights_only=False)
        contents["common"] = torch.load(os.path.join(directory, "model", "common.pt"), weights_only=False)
    return contents


@pytest.mark.slow
def test_async_save_commits_the_state_it_was_taken_at(model_root, tmp_path):
    from megatron_ais.checkpointing import store

    hf_dir = make_model_dir(model_root, "qwen3")
    root = str(tmp_path)
    spawn(2, _same_content_worker, hf_dir, root)
    for fmt in store.FORMATS.values():
        sync, background = (os.path.join(root, fmt.NAME, kind) for kind in ("sync", "async"))
        assert store.read_tracker(background) == 1 and store.checkpoint_problem(background, 1) is None
        assert not [n for n in os.listdir(background) if n.endswith(".staging")]
        expected = _contents(store.iteration_dir(sync, 1), fmt)
        got = _contents(store.iteration_dir(background, 1), fmt)
        assert len(expected["names"]) >= 3 and _same(expected, got), fmt.NAME
        trained = _contents(store.iteration_dir(sync, 1), fmt)  # the control: a changed tensor is seen
        first = trained["model"] if fmt.NAME == "torch_dist" else trained["mp_rank_00/model_optim_rng.pt"]["model"]
        next(t for t in first.values() if torch.is_tensor(t) and t.is_floating_point()).add_(1.0)
        assert not _same(trained, got)


def _killed_worker(hf_dir, root):
    from megatron_ais.checkpointing import store
    from megatron_ais.checkpointing.background import BackgroundSaver
    from megatron_ais.checkpointing.config import RankFileWrite
    from megatron_ais.checkpointing.formats import torch_dist

    setup, step, metadata = _trainer(hf_dir)
    step()
    store.save_checkpoint(root, 1, setup.chunks, metadata, hf_dir, fmt=torch_dist,
                          **_save_arguments(setup, {"kind": "test", "step": 1}))
    step()
    staged = store.begin_save(root, 2, setup.chunks, metadata, hf_dir, fmt=torch_dist, snapshot=True,
                              **_save_arguments(setup, {"kind": "test", "step": 2}))
    staged.files = RankFileWrite(functools.partial(_killed_after, staged.files.write), staged.files.finish)
    saver = BackgroundSaver()
    saver.start(staged)
    saver.wait()  # the writer kills this process first
    return "not killed"


@pytest.mark.slow
def test_sigkill_during_async_save_keeps_the_previous_checkpoint(model_root, tmp_path):
    from megatron_ais.checkpointing import store
    from megatron_ais.checkpointing.formats import torch_dist
    from megatron_ais.checkpointing.ranks import CheckpointRanks

    hf_dir = make_model_dir(model_root, "qwen3")
    root = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="died \\(signal SIGKILL\\)"):
        spawn(2, _killed_worker, hf_dir, root)
    stage = store.staging_dir(root, 2)
    assert any(n.endswith(".distcp") for n in os.listdir(os.path.join(stage, "model")))  # written, never committed
    assert not os.path.exists(os.path.join(stage, store.CHECKSUMS))
    assert store.read_tracker(root) == 1 and store.committed_iterations(root) == [1]
    loaded = store.load_checkpoint(root, CheckpointRanks())  # every file checked against its sha256
    assert loaded.iteration == 1 and loaded.format == torch_dist.NAME and loaded.run_state["step"] == 1


def _sft_worker(argv):
    from megatron_ais.arguments import SFT_FLAGS, SFTRunConfig, build_parser
    from megatron_ais.initialize import destroy_megatron
    from megatron_ais.sft import run_sft

    run_sft(SFTRunConfig.from_args(build_parser("test", SFT_FLAGS).parse_args(argv), 2))
    destroy_megatron()


@pytest.mark.slow
def test_a_run_returns_with_its_background_save_committed(model_root, tmp_path):
    from megatron_ais.checkpointing import store

    hf_dir = make_model_dir(model_root, "qwen3")
    save = str(tmp_path / "ckpt")
    spawn(2, _sft_worker, ["--hf-dir", hf_dir, "--train-iters", "2", "--fp32", "--seq-length", "48",
                           "--micro-batch-size", "2", "--num-examples", "16", "--save", save, "--async-save",
                           "--ckpt-format", "torch_dist", "--export-hf-dir", str(tmp_path / "hf"),
                           "--output-dir", str(tmp_path / "out")])
    assert store.read_tracker(save) == 2 and store.checkpoint_problem(save, 2) is None
    assert sorted(os.listdir(save)) == ["iter_0000002", store.TRACKER, "megatron_ais.lock"]
    assert store.newest_verified_iteration(save) == 2


def test_async_save_needs_save():
    from megatron_ais.checkpointing.config import CheckpointConfig
    from megatron_ais.errors import ArgumentValidationError

    with pytest.raises(ArgumentValidationError, match="--async-save needs --save DIR"):
        CheckpointConfig(async_save=True)
