"""Loading never runs code from a checkpoint: rank files are read as data (tensors, containers, NumPy's random
state); a pickle that would call anything else is refused unrun, the file and the global named."""
import io
import json
import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import convert_checkpoint
from conftest import make_model_dir
from distributed import spawn
from megatron_ais.checkpointing import optimizer_state, store
from megatron_ais.checkpointing.formats import torch as torch_format
from megatron_ais.checkpointing.formats import torch_dist
from megatron_ais.checkpointing.ranks import CheckpointRanks
from megatron_ais.errors import CheckpointError

# one worker of `make test` runs this module: its tests share one saved checkpoint (a module fixture)
pytestmark = pytest.mark.xdist_group("checkpoint_is_data")

META = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "hf_config": {}}


class _Payload:
    """What an attacker would put in a rank file: unpickling it calls `call(*args)`."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _commit(root, iteration, state):
    """Commit a checkpoint holding `state`, checksums and all, as a crafted one would be."""
    stage = store.prepare_staging(root, iteration)
    store.write_metadata(stage, META, None)
    torch_format.write_rank_state(stage, 0, 0, 1, state)
    store.write_checksums(stage)
    store.commit_checkpoint(root, iteration)
    return os.path.join(store.iteration_dir(root, iteration), "mp_rank_00", torch_format.RANK_FILE)


@pytest.mark.parametrize("call, args, named", [
    (os.system, "touch {marker}", "posix.system"),
    (exec, "open({marker!r}, 'w').close()", "builtins.exec"),
])
def test_a_rank_file_that_would_run_code_is_refused_unrun(tmp_path, capfd, call, args, named):
    root, marker = str(tmp_path / "ckpt"), str(tmp_path / "marker")
    _commit(root, 1, {"model": {"weight": torch.ones(2)}, "run_state": {"kind": "test", "step": 1}})
    payload = _Payload(call, args.format(marker=marker))
    crafted = _commit(root, 2, {"model": {"weight": torch.zeros(2)}, "run_state": payload})
    loaded = store.load_checkpoint(root, CheckpointRanks())
    assert loaded.iteration == 1 and torch.equal(loaded.state["model"]["weight"], torch.ones(2))
    line = f"refusing checkpoint iteration 2: {crafted} is refused: its pickle calls {named} outside the checkpoint"
    assert line in capfd.readouterr().err
    with pytest.raises(CheckpointError, match=f"^{crafted} is refused: its pickle calls {named} "):
        store.load_rank_state(root, 0, 0, 1, iteration=2)  # the converter's path
    assert not os.path.exists(marker)


def test_a_checkpoint_of_the_current_writer_loads_with_its_random_states(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    saved = optimizer_state.rng_state()
    weight = torch.nn.Parameter(torch.arange(4.0))
    optimizer = torch.optim.Adam([weight])
    weight.grad = torch.ones(4)
    optimizer.step()
    store.save_checkpoint(str(tmp_path), 1, [torch.nn.ParameterList([weight])], META, None, CheckpointRanks(),
                          optimizer=optimizer, run_state={"kind": "test", "step": 1, "ais": {"ess": 0.5}})
    loaded = store.load_checkpoint(str(tmp_path), CheckpointRanks())
    rng = loaded.state["rng_state"][0]
    assert rng["random"] == saved["random"] and torch.equal(rng["torch"], saved["torch"])
    assert rng["numpy"][0] == "MT19937" and np.array_equal(rng["numpy"][1], saved["numpy"][1])
    assert loaded.state["optimizer"]["state"][0]["step"] == 1 and loaded.run_state["ais"] == {"ess": 0.5}
    assert torch.equal(loaded.state["model"]["0"], weight.detach())


def _save_torch_dist(hf_dir, root):
    from distributed import start_trainer
    from megatron_ais.training import setup_model_and_optimizer

    from megatron_ais.checkpointing.config import checkpoint_metadata

    trainer, hf_config, build = start_trainer("--hf-dir", hf_dir, "--seq-length", "16", "--fp32")
    setup = setup_model_and_optimizer(build, trainer.weights, trainer.training, run_kind="test")
    for iteration in (1, 2):  # a run's metadata: the HF export reads its layout and vocabulary padding
        store.save_checkpoint(root, iteration, setup.chunks, checkpoint_metadata(build, hf_config, iteration), hf_dir,
                              CheckpointRanks(), optimizer=setup.optimizer,
                              run_state={"kind": "test", "step": iteration}, fmt=torch_dist)


@pytest.fixture(scope="module")
def torch_dist_checkpoint(model_root, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torch_dist") / "ckpt")
    spawn(1, _save_torch_dist, make_model_dir(model_root, "qwen3"), root)
    return root


def _plant_in_metadata(model_dir, payload):
    metadata = torch_dist.read_dcp_metadata(model_dir)
    metadata.storage_meta = payload
    with open(os.path.join(model_dir, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return ".metadata", "posix.system"


def _plant_in_byte_item(model_dir, payload):
    """Append a pickled payload to rank 0's shards and point one byte item (a module's _extra_state) at it."""
    metadata = torch_dist.read_dcp_metadata(model_dir)
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
    data = io.BytesIO()
    torch.save(payload, data)
    shard = os.path.join(model_dir, info.relative_path)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(data.getvalue())
    info.offset, info.length = offset, len(data.getvalue())
    with open(os.path.join(model_dir, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return f"{info.relative_path} (item {index.fqn})", "posix.system"


def _plant_in_extra_state_bytes(model_dir, payload):
    """A layer's _extra_state item that is itself data, a uint8 tensor, holding a pickle as its bytes: TE's format,
    which TE unpickles with pickle.loads when the model loads."""
    return _plant_in_byte_item(model_dir, torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8))


def _plant_in_common_state(model_dir, payload):
    torch.save({"payload": payload}, os.path.join(model_dir, "common.pt"))
    return "common.pt", "posix.system"


@pytest.mark.slow
@pytest.mark.parametrize("plant", [_plant_in_metadata, _plant_in_byte_item, _plant_in_extra_state_bytes,
                                   _plant_in_common_state],
                         ids=["metadata", "byte-item", "extra-state-bytes", "common-state"])
def test_a_torch_dist_pickle_that_would_run_code_is_refused_unrun(torch_dist_checkpoint, tmp_path, capfd, plant):
    """torch.distributed.checkpoint reads `.metadata` with pickle.load and byte items with torch.load(weights_only=
    False): each is read as data first, so a crafted one (checksums rewritten to match) is refused unrun and the
    previous iteration loaded; the same payload read as torch reads it would have run (the marker appears)."""
    root, marker = str(tmp_path / "ckpt"), str(tmp_path / "marker")
    shutil.copytree(torch_dist_checkpoint, root)
    model_dir = os.path.join(store.iteration_dir(root, 2), "model")
    name, named = plant(model_dir, _Payload(os.system, f"touch {marker}"))
    checksums_path = os.path.join(store.iteration_dir(root, 2), store.CHECKSUMS)
    checksums = json.load(open(checksums_path))
    for file in checksums:
        checksums[file] = store.file_digest(os.path.join(store.iteration_dir(root, 2), file))
    json.dump(checksums, open(checksums_path, "w"))
    capfd.readouterr()
    loaded = store.load_checkpoint(root, CheckpointRanks())
    assert loaded.iteration == 1 and loaded.format == "torch_dist" and loaded.run_state["step"] == 1
    refused = f"refusing checkpoint iteration 2: {os.path.join(model_dir, name)} is refused: its pickle calls {named}"
    assert refused in capfd.readouterr().err
    with pytest.raises(CheckpointError, match=f"is refused: its pickle calls {named} "):
        torch_dist.check_is_data(model_dir)  # the library entry point the loads go through
    # the HF export of that iteration too (it read `.metadata` with megatron-core, i.e. pickle.load, first)
    with pytest.raises(CheckpointError, match=f"is refused: its pickle calls {named} "):
        convert_checkpoint.megatron_to_hf(root, str(tmp_path / "hf"))
    # and the command says so in one line (it had a spawned rank's traceback before)
    capfd.readouterr()
    assert convert_checkpoint.main(["megatron-to-hf", "--load", root, "--save", str(tmp_path / "hf")]) == 2
    err = capfd.readouterr().err.strip()
    assert "\n" not in err and f"is refused: its pickle calls {named}" in err, err
    assert err.startswith(f"{convert_checkpoint.build_parser().prog}: error: "), err
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "hf")
    _read_as_torch_does(model_dir, name)  # the control: the crafted file as megatron-core and torch would read it
    assert os.path.exists(marker)


def test_metadata_naming_a_function_of_the_checkpoint_modules_is_refused_unrun(tmp_path):
    """`.metadata` may name torch.distributed.checkpoint's record types only: a method of its classes (pickle
    resolves dotted names), which deletes a file here, is refused before anything runs."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    victim, model_dir = tmp_path / "victim", tmp_path / "model"
    victim.write_text("kept"), model_dir.mkdir()
    with open(model_dir / ".metadata", "wb") as f:
        pickle.dump(_Payload(FileSystem.rm_file, FileSystem(), str(victim)), f, protocol=4)
    named = "torch.distributed.checkpoint.filesystem.FileSystem.rm_file"
    with pytest.raises(CheckpointError, match=f"is refused: its pickle calls {named} outside the checkpoint"):
        torch_dist.read_dcp_metadata(str(model_dir))
    assert victim.exists()
    pickle.load(open(model_dir / ".metadata", "rb"))  # the control: read as torch reads it, the file goes
    assert not victim.exists()


def _read_as_torch_does(model_dir, name):
    if name == ".metadata":  # torch.distributed.checkpoint's FileSystemReader.read_metadata
        return pickle.load(open(os.path.join(model_dir, name), "rb"))
    if name == "common.pt":
        return torch.load(os.path.join(model_dir, name), weights_only=False)
    fqn = name.split("(item ")[1][:-1]  # DefaultLoadPlanner.load_bytes
    info = next(s for i, s in torch_dist.read_dcp_metadata(model_dir).storage_data.items() if i.fqn == fqn)
    with open(os.path.join(model_dir, info.relative_path), "rb") as f:
        f.seek(info.offset)
        item = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    if isinstance(item, torch.Tensor):  # a TE layer's extra state (megatron-core's _decode_extra_state)
        return pickle.loads(item.numpy().tobytes())
    return item
