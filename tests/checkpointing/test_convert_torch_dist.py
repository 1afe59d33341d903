"""tools/convert_checkpoint.py between the checkpoint formats: a run's torch checkpoint (DP2; BF16 with the
distributed optimizer, FP32 with megatron's plain one) rewritten as torch_dist resumes exactly as the torch one does
(the next two steps' losses, RNG draws and parameters bit for bit); a weights-only TP2 checkpoint rewritten as
torch_dist exports to the HF model it came from bit for bit (read at TP1, the vocabulary re-padded), and so do MoE
ones at EP2; bad sources and destinations are refused naming the argument, with nothing written."""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

import convert_checkpoint
from conftest import make_model_dir
from distributed import spawn
from megatron_ais.checkpointing.config import HF_ASSETS
from megatron_ais.checkpointing.formats import torch_dist
from megatron_ais.checkpointing.store import (CHECKSUMS, METADATA, TRACKER, checkpoint_problem, committed_iterations,
                                              directory_format, iteration_dir, newest_verified_iteration)
from megatron_ais.errors import ArgumentValidationError
from test_resume_training import _worker


def _assert_verified_torch_dist(root: str, iteration: int) -> None:
    """A committed torch_dist checkpoint whose checksums.json lists every file the format wrote, each matching."""
    directory = iteration_dir(root, iteration)
    assert directory_format(directory) is torch_dist
    assert checkpoint_problem(root, iteration) is None and newest_verified_iteration(root) == iteration
    with open(os.path.join(directory, CHECKSUMS)) as f:
        listed = set(json.load(f))
    assets = {f"{HF_ASSETS}/{name}" for name in os.listdir(os.path.join(directory, HF_ASSETS))}  # the tokenizer too
    assert assets and listed == set(torch_dist.rank_files(directory)) | assets and torch_dist.RUN_STATE in listed
    assert any(name.endswith(".distcp") for name in listed)


def _hf_tensors(directory: str) -> dict:
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision,distributed_optimizer", [("bf16", True), ("fp32", False)])
def test_converted_checkpoint_resumes_as_the_torch_one_dp2(model_root, tmp_path, precision, distributed_optimizer):
    hf_dir = make_model_dir(model_root, "qwen2")
    source, converted = str(tmp_path / "torch"), str(tmp_path / "torch_dist")
    run = (hf_dir, precision, distributed_optimizer)
    uninterrupted = spawn(2, _worker, *run, source, False)  # saves a torch checkpoint at step 2
    assert convert_checkpoint.torch_to_torch_dist(source, converted) == iteration_dir(converted, 2)
    _assert_verified_torch_dist(converted, 2)
    with open(os.path.join(iteration_dir(source, 2), METADATA)) as a, \
            open(os.path.join(iteration_dir(converted, 2), METADATA)) as b:
        assert json.load(a) == json.load(b)
    from_torch = spawn(2, _worker, *run, source, True)
    from_torch_dist = spawn(2, _worker, *run, converted, True)
    for rank in range(2):
        assert from_torch_dist[rank][0] == from_torch[rank][0] == uninterrupted[rank][0], "losses differ"
        assert from_torch_dist[rank][1] == from_torch[rank][1], "RNG streams were not carried over"
        assert from_torch_dist[rank][2] == from_torch[rank][2], "parameters after the resume differ"


@pytest.mark.slow
def test_weights_only_tp2_converts_and_exports_to_the_same_hf_model(model_root, tmp_path):
    hf_dir = make_model_dir(model_root, "qwen3")
    source, converted = str(tmp_path / "torch"), str(tmp_path / "torch_dist")
    convert_checkpoint.hf_to_megatron(hf_dir, source, 2, 1)
    # a damaged shard of TP rank 1 (same size, so only its checksum tells): the conversion fails, nothing committed
    damaged = str(tmp_path / "damaged")
    shutil.copytree(source, damaged)
    shard = os.path.join(iteration_dir(damaged, 0), "mp_rank_01", "model_optim_rng.pt")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xff" * 64)
    with pytest.raises(RuntimeError, match="failed verification"):
        convert_checkpoint.torch_to_torch_dist(damaged, converted)
    assert committed_iterations(converted) == [] and not os.path.exists(os.path.join(converted, TRACKER))
    assert [n for n in os.listdir(converted) if n.startswith("iter_")] == []
    convert_checkpoint.torch_to_torch_dist(source, converted)
    _assert_verified_torch_dist(converted, 0)
    exported = convert_checkpoint.megatron_to_hf(converted, str(tmp_path / "hf"))
    original, offline = _hf_tensors(hf_dir), _hf_tensors(exported)
    assert sorted(offline) == sorted(original)
    for name, tensor in original.items():
        assert offline[name].dtype == tensor.dtype and torch.equal(offline[name], tensor), name
    with pytest.raises(ArgumentValidationError, match=f"--load {converted}: iteration 0 is a torch_dist checkpoint"):
        convert_checkpoint.torch_to_torch_dist(converted, str(tmp_path / "again"))


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,etp", [(1, 2, None), (2, 2, 1)])
def test_moe_weights_only_converts_and_exports_to_the_same_hf_model(model_root, tmp_path, tp, ep, etp):
    """A weights-only MoE checkpoint records no DP size: it is rewritten on the fewest ranks its experts fit in (EP2
    at TP1: two ranks), and every expert comes back from the torch_dist files bit for bit."""
    hf_dir = make_model_dir(model_root, "qwen3_moe", initializer_range=0.1)
    source, converted = str(tmp_path / "torch"), str(tmp_path / "torch_dist")
    convert_checkpoint.hf_to_megatron(hf_dir, source, tp, 1, ep=ep, etp=etp)
    convert_checkpoint.torch_to_torch_dist(source, converted)
    _assert_verified_torch_dist(converted, 0)
    original, offline = _hf_tensors(hf_dir), _hf_tensors(convert_checkpoint.megatron_to_hf(converted,
                                                                                           str(tmp_path / "hf")))
    assert sorted(offline) == sorted(original) and any(".experts.7." in n for n in original)
    for name, tensor in original.items():
        assert torch.equal(offline[name], tensor), name


@pytest.mark.parametrize("saved,world,flags", [
    (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2,
          use_distributed_optimizer=True), 8,
     ["--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2", "--sequence-parallel",
      "--use-distributed-optimizer"]),
    (dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=4), 4,
     ["--tensor-model-parallel-size 1", "--expert-model-parallel-size 4"]),
    (dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=1, expert_model_parallel_size=2,
          expert_tensor_parallel_size=1), 4,
     ["--expert-model-parallel-size 2", "--expert-tensor-parallel-size 1", "--sequence-parallel"])])
def test_the_saved_layout_is_rebuilt(saved, world, flags):
    metadata = {"make_vocab_size_divisible_by": 128, **saved}
    assert convert_checkpoint.saved_world_size(metadata) == world
    rebuilt = " ".join(convert_checkpoint.saved_layout_flags(metadata, "bf16")) + " "
    assert all(f"{flag} " in rebuilt for flag in flags), rebuilt


def test_bad_sources_and_destinations_are_refused_naming_the_argument(model_root, tmp_path, capsys):
    hf_dir = make_model_dir(model_root, "qwen2")
    source, taken = str(tmp_path / "torch"), str(tmp_path / "taken")
    convert_checkpoint.hf_to_megatron(hf_dir, source, 1, 1)
    convert_checkpoint.hf_to_megatron(hf_dir, taken, 1, 1)
    before = sorted(os.listdir(taken))
    cases = [(str(tmp_path / "missing"), str(tmp_path / "out"), "--load .*missing is not a directory"),
             (hf_dir, str(tmp_path / "out"), f"--load {hf_dir} has no {TRACKER}"),
             (source, taken, "--save .*taken already holds checkpoints \\(newest: iteration 0\\)"),
             (source, source, "--save .*torch is --load")]
    for load, save, refusal in cases:
        assert convert_checkpoint.main(["torch-to-torch-dist", "--load", load, "--save", save]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err  # one line
        assert re.search(refusal, err), err
    assert sorted(os.listdir(taken)) == before and not os.path.exists(tmp_path / "out")
