"""Checkpoints are committed atomically: a crash mid-save leaves the previous checkpoint loadable."""
import os
import shutil

import pytest
import torch

from megatron_ais.checkpointing import optimizer_state, preflight, store
from megatron_ais.checkpointing.formats import torch as torch_format
from megatron_ais.errors import CheckpointError


def _save(root, iteration, value):
    stage = store.prepare_staging(root, iteration)
    store.write_metadata(stage, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                 "hf_config": {}}, None)
    torch_format.write_rank_state(stage, 0, 0, 1, {"model": {"w": torch.full((2,), value)}})
    store.write_checksums(stage)
    return store.commit_checkpoint(root, iteration)


def test_crash_before_commit_keeps_last_good_checkpoint(tmp_path):
    root = str(tmp_path)
    _save(root, 1, 1.0)
    # a crashed save of iteration 2: staging written, never committed
    stage = store.prepare_staging(root, 2)
    torch_format.write_rank_state(stage, 0, 0, 1, {"model": {"w": torch.full((2,), float("nan"))}})
    assert store.read_tracker(root) == 1
    assert torch.equal(store.load_rank_state(root, 0, 0, 1)["model"]["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match="has no megatron_ais.json"):
        store.commit_checkpoint(root, 2)  # an incomplete staging directory is never committed
    # the next save of the same iteration starts from a clean staging directory and commits
    _save(root, 2, 2.0)
    assert store.read_tracker(root) == 2 and not os.path.exists(store.staging_dir(root, 2))
    assert torch.equal(store.load_rank_state(root, 0, 0, 1)["model"]["w"], torch.full((2,), 2.0))
    # re-saving an existing iteration replaces it
    _save(root, 2, 3.0)
    assert torch.equal(store.load_rank_state(root, 0, 0, 1)["model"]["w"], torch.full((2,), 3.0))


def test_pruning_after_a_fallback_keeps_the_run_its_checkpoints(tmp_path):
    """Iteration 200 was refused at load and the run went on from 100: the iterations it saves count towards
    --keep-checkpoints, 200 (newer than the tracker) neither counts nor is removed."""
    root = str(tmp_path)
    for iteration in (100, 200, 110, 120):
        _save(root, iteration, float(iteration))
        store.prune_checkpoints(root, keep=2)
    assert store.read_tracker(root) == 120 and store.committed_iterations(root) == [200, 120, 110]


def test_exchange_paths_swaps_two_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from_a").write_text("a")
    (tmp_path / "b").mkdir()
    if not store.exchange_paths(str(tmp_path / "a"), str(tmp_path / "b")):
        pytest.skip("this filesystem cannot exchange paths atomically (the two-rename fallback is tested below)")
    assert os.listdir(tmp_path / "b") == ["from_a"] and os.listdir(tmp_path / "a") == []


@pytest.mark.parametrize("atomic_exchange", [True, False])
def test_resave_replaces_the_copy_and_leaves_nothing_behind(tmp_path, monkeypatch, atomic_exchange):
    root = str(tmp_path)
    if not atomic_exchange:  # a filesystem without renameat2(RENAME_EXCHANGE): two renames
        monkeypatch.setattr(store, "exchange_paths", lambda a, b: False)
    _save(root, 2, 2.0)
    _save(root, 2, 3.0)
    assert torch.equal(store.load_rank_state(root, 0, 0, 1)["model"]["w"], torch.full((2,), 3.0))
    assert sorted(os.listdir(root)) == ["iter_0000002", store.TRACKER]


def test_crash_inside_a_two_rename_resave_keeps_the_old_copy(tmp_path):
    """Without an atomic exchange, re-saving iteration N moves iter_N aside before the new copy takes its place: a
    crash between the two renames (only iter_N.old and the staging copy left) must not lose the checkpoint; the
    run's next start or save puts it back, and an iter_N.old left beside a committed iter_N is removed."""
    root = str(tmp_path)
    _save(root, 1, 1.0)
    _save(root, 2, 2.0)
    stage = store.prepare_staging(root, 2)
    store.write_metadata(stage, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                 "hf_config": {}}, None)
    torch_format.write_rank_state(stage, 0, 0, 1, {"model": {"w": torch.full((2,), 3.0)}})
    store.write_checksums(stage)
    os.replace(store.iteration_dir(root, 2), store.iteration_dir(root, 2) + ".old")  # the crash point
    assert store.usable_iterations(root)[0] == 1  # a plain reader changes nothing and sees the older copy
    store.restore_interrupted_resave(root)  # what read_model_config, load_checkpoint and prepare_staging do first
    assert store.usable_iterations(root)[0] == 2
    assert torch.equal(store.load_rank_state(root, 0, 0, 1)["model"]["w"], torch.full((2,), 2.0))
    shutil.copytree(store.iteration_dir(root, 1), store.iteration_dir(root, 2) + ".old")  # a stale leftover
    _save(root, 2, 3.0)
    assert torch.equal(store.load_rank_state(root, 0, 0, 1)["model"]["w"], torch.full((2,), 3.0))
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", store.TRACKER]


def test_layout_mismatch_names_flags_and_fix(tmp_path):
    from megatron_ais.parallel import ParallelLayout

    meta = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    with pytest.raises(CheckpointError, match="--tensor-model-parallel-size 1 .*convert_checkpoint.py"):
        preflight.check_layout(meta, ParallelLayout(), str(tmp_path))
    # saved before expert-TP was recorded: not checked on it
    preflight.check_layout(meta, ParallelLayout(tensor=2, expert_tensor=1), str(tmp_path))
    moe = {**meta, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}
    preflight.check_layout(moe, ParallelLayout(tensor=2, expert=2, expert_tensor=1), str(tmp_path))
    with pytest.raises(CheckpointError, match="x expert-TP1 .*--expert-tensor-parallel-size 2"):
        preflight.check_layout(moe, ParallelLayout(tensor=2, expert=2), str(tmp_path))


def test_rank_directory_names_follow_megatron_lm():
    assert torch_format.rank_dir_name(1, 0, 1) == "mp_rank_01"
    assert torch_format.rank_dir_name(1, 2, 4) == "mp_rank_01_002"


def test_optimizer_layout_mismatch_names_flags_and_fix(tmp_path):
    root = str(tmp_path)
    distributed_dp2 = {"use_distributed_optimizer": True, "data_parallel_size": 2}
    optimizer_state.check_optimizer_layout(distributed_dp2, True, 2, root)
    optimizer_state.check_optimizer_layout({}, True, 4, root)  # saved before these were recorded: not checked
    optimizer_state.check_optimizer_layout({"use_distributed_optimizer": False, "data_parallel_size": 2}, False, 4,
                                           root)
    with pytest.raises(CheckpointError, match="shards of 2 data-parallel ranks, this run has 4: resume with "
                                              "world size = TP x PP x 2, or .* --finetune"):
        optimizer_state.check_optimizer_layout(distributed_dp2, True, 4, root)
    with pytest.raises(CheckpointError, match="saved with --use-distributed-optimizer; resume with it"):
        optimizer_state.check_optimizer_layout(distributed_dp2, False, 2, root)


def test_layout_change_is_refused_before_any_rank_file_is_read(model_root, tmp_path):
    import convert_checkpoint
    from conftest import make_model_dir
    from distributed import trainer_config
    from megatron_ais.training import read_model_config

    def read(*argv, world_size=1):
        trainer = trainer_config(*argv, world_size=world_size)
        return read_model_config(trainer.model, trainer.layout, trainer.checkpoint.load)

    hf_dir = make_model_dir(model_root, "qwen3", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    load = str(tmp_path / "tp1")
    convert_checkpoint.hf_to_megatron(hf_dir, load, 1, 1)
    with pytest.raises(CheckpointError, match="saved at TP1 x PP1 .* --tensor-model-parallel-size 2"):
        read("--load", load, "--tensor-model-parallel-size", "2", world_size=2)
    with pytest.raises(CheckpointError, match="padded to 384 rows, this run pads to 512 .* "
                                              "--make-vocab-size-divisible-by 128"):
        read("--load", load, "--make-vocab-size-divisible-by", "256")
    assert read("--load", load)["model_type"] == "qwen3"


def test_files_the_committer_cannot_see_block_the_commit(tmp_path):
    root = str(tmp_path)
    stage = store.prepare_staging(root, 3)
    torch_format.write_rank_state(stage, 0, 0, 1, {"model": {"w": torch.ones(2)}})
    own = store.file_digest(os.path.join(stage, "mp_rank_00", torch_format.RANK_FILE))
    assert store.staging_problem(stage, {"mp_rank_00/" + torch_format.RANK_FILE: own}) is None
    # another node's rank wrote into a --save directory this node does not share
    other = {"mp_rank_00/" + torch_format.RANK_FILE: own, "mp_rank_01/" + torch_format.RANK_FILE: own}
    assert "1 rank file(s) are missing or short" in store.staging_problem(stage, other)
    short = {"mp_rank_00/" + torch_format.RANK_FILE: {**own, "size": own["size"] + 1}}
    assert "mp_rank_00/" in store.staging_problem(stage, short)
