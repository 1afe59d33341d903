"""A truncated or corrupted checkpoint is refused with the reason, and the previous good one is loaded."""
import os

import pytest
import torch

from megatron_ais.checkpointing import optimizer_state, store
from megatron_ais.checkpointing.formats import torch as torch_format
from megatron_ais.checkpointing.ranks import CheckpointRanks
from megatron_ais.errors import CheckpointError


class _Tiny(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4, 4), float(value)))


def _save(root, iteration, value, keep=None, protect=()):
    model = _Tiny(value)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model.weight.grad = torch.ones(4, 4)
    optimizer.step()
    meta = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "hf_config": {}}
    store.save_checkpoint(root, iteration, [model], meta, None, CheckpointRanks(), optimizer=optimizer,
                          run_state={"kind": "test", "step": iteration}, keep=keep, protect=protect)
    return model.weight.detach().clone()


def _rank_file(root, iteration):
    return os.path.join(store.iteration_dir(root, iteration), "mp_rank_00", torch_format.RANK_FILE)


def test_checksums_written_and_clean_load(tmp_path):
    root = str(tmp_path)
    weight = _save(root, 1, 1.0)
    loaded = store.load_checkpoint(root, CheckpointRanks())
    assert loaded.iteration == 1 and loaded.run_state == {"kind": "test", "step": 1}
    assert torch.equal(loaded.state["model"]["weight"], weight)
    assert "mp_rank_00/model_optim_rng.pt" in open(os.path.join(store.iteration_dir(root, 1), store.CHECKSUMS)).read()


def test_flipped_byte_falls_back_to_previous(tmp_path, capfd):
    """A byte flipped inside a tensor's data, which torch.load reads without noticing: only the sha256 finds it."""
    root = str(tmp_path)
    first = _save(root, 1, 1.0)
    second = _save(root, 2, 2.0)
    path = _rank_file(root, 2)
    data = bytearray(open(path, "rb").read())
    weight_bytes = second.numpy().tobytes()
    assert data.count(weight_bytes) == 1
    data[data.find(weight_bytes) + 5] ^= 0xFF
    open(path, "wb").write(bytes(data))
    unnoticed = torch.load(path, map_location="cpu", weights_only=False)["model"]["weight"]
    assert not torch.equal(unnoticed, second)  # the damage is in the values, not in the file's structure
    loaded = store.load_checkpoint(root, CheckpointRanks())
    assert loaded.iteration == 1 and torch.equal(loaded.state["model"]["weight"], first)
    err = capfd.readouterr().err
    assert f"refusing checkpoint iteration 2: {path} does not match its sha256 in {store.CHECKSUMS} (corrupted)" in err


def test_truncated_file_and_broken_metadata_are_refused(tmp_path, capfd):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    _save(root, 2, 2.0)
    _save(root, 3, 3.0)
    path = _rank_file(root, 3)
    os.truncate(path, os.path.getsize(path) // 3)
    open(os.path.join(store.iteration_dir(root, 2), store.METADATA), "w").write("{not json")
    assert store.usable_iterations(root) == [1]
    err = capfd.readouterr().err
    assert "truncated" in err and "unreadable" in err
    assert store.load_checkpoint(root, CheckpointRanks()).iteration == 1
    assert store.read_checkpoint_metadata(root)["tensor_model_parallel_size"] == 1


def test_nothing_usable_is_a_clear_error(tmp_path):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    os.truncate(_rank_file(root, 1), 10)
    with pytest.raises(CheckpointError, match="no usable checkpoint.*truncated"):
        store.load_checkpoint(root, CheckpointRanks())
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
        store.load_checkpoint(str(tmp_path / "empty"), CheckpointRanks())


def test_keep_prunes_old_iterations(tmp_path):
    root = str(tmp_path)
    for iteration in range(1, 5):
        _save(root, iteration, iteration, keep=2)
    assert store.committed_iterations(root) == [4, 3]
    # a removal that a crash interrupted is finished by the next prune, never taken for a checkpoint
    os.makedirs(os.path.join(root, "iter_0000002.deleting", "mp_rank_00"))
    _save(root, 5, 5.0, keep=2)
    assert store.committed_iterations(root) == [5, 4] and sorted(os.listdir(root)) == [
        "iter_0000004", "iter_0000005", store.TRACKER]


def test_a_kl_reference_iteration_is_kept_and_loaded_by_number(tmp_path):
    """A run that saves into its own --load directory keeps its KL reference (the iteration it started from) and
    loads exactly that one, not the newest, when it resumes."""
    from megatron_ais.grpo.state import protected_iterations

    root = str(tmp_path)
    reference = _save(root, 1, 1.0)
    source = {"load": root + "/", "iteration": 1}
    for iteration in range(2, 5):
        _save(root, iteration, iteration, keep=2, protect=protected_iterations(source, root))
    assert store.committed_iterations(root) == [4, 3, 1]
    loaded = store.load_checkpoint(root, CheckpointRanks(), iteration=1)
    assert loaded.iteration == 1 and torch.equal(loaded.state["model"]["weight"], reference)
    assert store.load_checkpoint(root, CheckpointRanks()).iteration == 4
    with pytest.raises(CheckpointError, match="no longer holds a usable iteration 2"):
        store.load_checkpoint(root, CheckpointRanks(), iteration=2)
    assert protected_iterations(source, str(tmp_path / "elsewhere")) == ()
    assert protected_iterations({"hf_dir": "/m"}, root) == ()


def test_a_kl_reference_iteration_is_never_saved_over(tmp_path):
    """GRPO from an SFT run's iteration 4 into the same directory (--replace-checkpoints) would save its step 4 over
    its KL reference, and every resume would take that policy as the reference: refused before training (naming
    --save and the fix), and the store refuses to save a protected iteration whatever its caller."""
    from megatron_ais.checkpointing.config import CheckpointConfig
    from megatron_ais.errors import ArgumentValidationError
    from megatron_ais.grpo.state import check_reference_kept

    root = str(tmp_path)
    reference = _save(root, 4, 1.0)
    source = {"load": root, "iteration": 4}
    with pytest.raises(CheckpointError, match="refusing to save iteration 4 into .*: it is protected"):
        _save(root, 4, 2.0, protect=(4,))
    loaded = store.load_checkpoint(root, CheckpointRanks(), iteration=4)
    assert torch.equal(loaded.state["model"]["weight"], reference) and not os.path.exists(store.staging_dir(root, 4))
    every_second = CheckpointConfig(save=root, save_interval=2)
    with pytest.raises(ArgumentValidationError, match=f"^--save {root} holds this run's KL reference \\(its "
                                                      "iteration 4\\), which step 4 would save over; give --save"):
        check_reference_kept(source, every_second, 1, 10)
    check_reference_kept(source, every_second, 5, 10)  # resumed past it
    check_reference_kept(source, CheckpointConfig(save=root, save_interval=3), 1, 10)  # never saved at step 4
    check_reference_kept(source, CheckpointConfig(save=str(tmp_path / "elsewhere"), save_interval=2), 1, 10)
    check_reference_kept(source, every_second, 1, 3)  # the run ends before it


def test_restore_refuses_weights_only_checkpoint(tmp_path):
    root = str(tmp_path)
    stage = store.prepare_staging(root, 1)
    store.write_metadata(stage, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}, None)
    torch_format.write_rank_state(stage, 0, 0, 1, {"model": {"weight": torch.zeros(4, 4)}, "run_state": {"kind": "x"}})
    store.write_checksums(stage)
    store.commit_checkpoint(root, 1)
    loaded = store.load_checkpoint(root, CheckpointRanks())
    with pytest.raises(CheckpointError, match="--finetune"):
        optimizer_state.restore_training_state(loaded, torch.optim.Adam(_Tiny(0).parameters()), 0)


def _unverified(root, iteration=1):
    """A committed checkpoint with no checksums.json, as another tool might write one."""
    stage = store.prepare_staging(root, iteration)
    store.write_metadata(stage, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}, None)
    torch_format.write_rank_state(stage, 0, 0, 1, {"model": {"weight": torch.full((4, 4), 5.0)}})
    store.commit_checkpoint(root, iteration)


def test_a_checkpoint_nothing_can_verify_is_refused_unless_asked(tmp_path, capfd):
    root = str(tmp_path)
    _unverified(root)
    with pytest.raises(CheckpointError, match="has no checksums.json, so nothing can verify its files .* "
                                              "--allow-unverified-checkpoint"):
        store.load_checkpoint(root, CheckpointRanks())
    capfd.readouterr()
    loaded = store.load_checkpoint(root, CheckpointRanks(), allow_unverified=True)
    assert torch.equal(loaded.state["model"]["weight"], torch.full((4, 4), 5.0))
    assert "unverified (--allow-unverified-checkpoint): it has no checksums.json" in capfd.readouterr().err


def test_a_rank_file_checksums_json_does_not_list_is_refused(tmp_path):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    extra = os.path.join(store.iteration_dir(root, 1), "mp_rank_01", torch_format.RANK_FILE)
    os.makedirs(os.path.dirname(extra))
    torch.save({"model": {}}, extra)
    with pytest.raises(CheckpointError, match="mp_rank_01/model_optim_rng.pt is not listed in checksums.json"):
        store.load_checkpoint(root, CheckpointRanks())


def test_a_corrupted_tracker_is_named_and_the_newest_verified_iteration_used(tmp_path, capfd):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    newest = _save(root, 2, 2.0)
    with open(os.path.join(root, store.TRACKER), "w") as f:
        f.write("garbage")
    loaded = store.load_checkpoint(root, CheckpointRanks())
    assert loaded.iteration == 2 and torch.equal(loaded.state["model"]["weight"], newest)
    err = capfd.readouterr().err
    assert f"{os.path.join(root, store.TRACKER)} holds 'garbage', not an iteration number (corrupted)" in err
    os.truncate(_rank_file(root, 2), 100)  # the newest is damaged too: the one before it
    assert store.load_checkpoint(root, CheckpointRanks()).iteration == 1
