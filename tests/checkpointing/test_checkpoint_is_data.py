"""Loading never runs code from a checkpoint: rank files are read as data (tensors, containers, NumPy's random
state); a pickle that would call anything else is refused unrun, the file and the global named."""
import os
import random

import numpy as np
import pytest
import torch

from megatron_ais.checkpointing import optimizer_state, store
from megatron_ais.checkpointing.formats import torch as torch_format
from megatron_ais.checkpointing.ranks import CheckpointRanks
from megatron_ais.errors import CheckpointError

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
