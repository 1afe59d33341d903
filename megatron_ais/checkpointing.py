"""Megatron checkpoints in Megatron-LM's per-rank layout, written atomically.

    ROOT/latest_checkpointed_iteration.txt              "N", replaced atomically after the directory is complete
    ROOT/iter_000000N/megatron_ais.json                 layout and the HF config of the model
    ROOT/iter_000000N/hf_assets/                        tokenizer and generation config, for export
    ROOT/iter_000000N/mp_rank_TT[_PPP]/model_optim_rng.pt

Every rank writes into ROOT/iter_000000N.staging; once all ranks are done, one rank renames it into place and
only then moves the tracker. A crash at any point leaves the previous checkpoint and tracker untouched.
Parameter names are stored with local-spec names and stage-local layer indices, as Megatron-LM stores them.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "megatron_ais.json"
HF_ASSETS = "hf_assets"
RANK_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
# files of a HF model directory that are not weights and travel with a checkpoint
HF_ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the requested layout."""


def iteration_dir(root: str, iteration: int) -> str:
    """Return the directory of one iteration's checkpoint."""
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int) -> str:
    """Return the directory ranks write into before the checkpoint is committed."""
    return iteration_dir(root, iteration) + ".staging"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Return Megatron-LM's per-rank directory name (`mp_rank_TT` or `mp_rank_TT_PPP` under PP)."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")


def read_tracker(root: str) -> int:
    """Return the latest committed iteration under root."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise CheckpointError(f"--load {root} has no {TRACKER}: it is not a megatron-ais checkpoint directory "
                              "(convert a HF model with tools/convert_checkpoint.py hf-to-megatron)")
    with open(path) as f:
        return int(f.read().strip())


def read_checkpoint_metadata(root: str, iteration: int | None = None) -> dict[str, Any]:
    """Return the layout / HF-config metadata of a checkpoint (the latest one by default)."""
    iteration = read_tracker(root) if iteration is None else iteration
    path = os.path.join(iteration_dir(root, iteration), METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {iteration_dir(root, iteration)} has no {METADATA}; it is incomplete")
    with open(path) as f:
        return json.load(f)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_state(stage: str, tp_rank: int, pp_rank: int, pp_size: int, state: dict) -> None:
    """Write one rank's state file into a staging directory."""
    directory = os.path.join(stage, rank_dir_name(tp_rank, pp_rank, pp_size))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RANK_FILE)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def copy_hf_assets(src_dir: str, dst_dir: str) -> None:
    """Copy the non-weight files of a HF model directory (tokenizer, chat template, generation config)."""
    os.makedirs(dst_dir, exist_ok=True)
    for name in HF_ASSET_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst_dir, name))


def write_metadata(stage: str, metadata: dict[str, Any], hf_assets_from: str | None) -> None:
    """Write the metadata and copy the HF tokenizer / generation config into a staging directory."""
    os.makedirs(stage, exist_ok=True)
    _atomic_write_text(os.path.join(stage, METADATA), json.dumps(metadata, indent=2))
    if hf_assets_from:
        copy_hf_assets(hf_assets_from, os.path.join(stage, HF_ASSETS))


def prepare_staging(root: str, iteration: int) -> str:
    """Create an empty staging directory for an iteration (removing a crashed attempt) and return it."""
    stage = staging_dir(root, iteration)
    if os.path.isdir(stage):
        shutil.rmtree(stage)
    os.makedirs(stage)
    return stage


def commit_checkpoint(root: str, iteration: int) -> str:
    """Move a complete staging directory into place, then point the tracker at it; return the final path."""
    stage, final = staging_dir(root, iteration), iteration_dir(root, iteration)
    if not os.path.isfile(os.path.join(stage, METADATA)):
        raise CheckpointError(f"refusing to commit {stage}: it has no {METADATA}")
    if os.path.isdir(final):
        # re-saving an iteration: keep the old copy until the new one is in place
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(stage, final)
        shutil.rmtree(old)
    else:
        os.replace(stage, final)
    _atomic_write_text(os.path.join(root, TRACKER), str(iteration))
    return final


def load_rank_state(root: str, tp_rank: int, pp_rank: int, pp_size: int, iteration: int | None = None) -> dict:
    """Return one rank's saved state."""
    iteration = read_tracker(root) if iteration is None else iteration
    path = os.path.join(iteration_dir(root, iteration), rank_dir_name(tp_rank, pp_rank, pp_size), RANK_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    return torch.load(path, map_location="cpu", weights_only=False)


def check_layout(metadata: dict[str, Any], tp: int, pp: int, root: str) -> None:
    """Raise a CheckpointError naming the flags when a checkpoint was saved at another TP / PP layout."""
    saved_tp, saved_pp = metadata["tensor_model_parallel_size"], metadata["pipeline_model_parallel_size"]
    if (saved_tp, saved_pp) != (tp, pp):
        raise CheckpointError(
            f"--load {root} was saved at TP{saved_tp} x PP{saved_pp} but the run uses "
            f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}; use the saved sizes, or "
            f"reshard: tools/convert_checkpoint.py megatron-to-hf then hf-to-megatron with the new sizes")


def _model_keys(num_chunks: int) -> list[str]:
    # Megatron-LM's convention: "model", or "model0", "model1", ... with virtual pipeline chunks
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def model_state(chunks: list) -> dict[str, dict[str, torch.Tensor]]:
    """Return this rank's parameters keyed by local-spec name (TE names canonicalised), per model chunk."""
    from megatron_ais.mapping.rules import canonical_name
    from megatron_ais.model import unwrap_model

    return {key: {canonical_name(n): p.detach().clone() for n, p in unwrap_model(chunk).named_parameters()}
            for key, chunk in zip(_model_keys(len(chunks)), chunks)}


@torch.no_grad()
def load_model_state(chunks: list, state: dict) -> None:
    """Copy saved parameters into this rank's chunks; every parameter must be present with the right shape."""
    from megatron_ais.mapping.rules import canonical_name
    from megatron_ais.model import unwrap_model

    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        if key not in state:
            raise CheckpointError(f"checkpoint has no {key!r} entry (saved with another virtual pipeline size?)")
        saved = dict(state[key])
        for name, param in unwrap_model(chunk).named_parameters():
            tensor = saved.pop(canonical_name(name), None)
            if tensor is None:
                raise CheckpointError(f"checkpoint is missing parameter {canonical_name(name)!r}")
            if tensor.shape != param.shape:
                raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            param.copy_(tensor)
        if saved:
            raise CheckpointError(f"checkpoint has parameters the model lacks: {sorted(saved)[:5]}")


def save_model_checkpoint(root: str, iteration: int, chunks: list, metadata: dict[str, Any],
                          hf_assets_from: str | None, tp_rank: int, pp_rank: int, pp_size: int,
                          is_writer: bool, is_committer: bool, barrier) -> str:
    """Save model parameters atomically from a distributed run; `barrier()` synchronises all ranks.

    `is_writer`: this rank writes its shard (DP rank 0 of each TP x PP position); `is_committer`: exactly one rank.
    """
    stage = staging_dir(root, iteration)
    if is_committer:
        prepare_staging(root, iteration)
        write_metadata(stage, metadata, hf_assets_from)
    barrier()
    if is_writer:
        write_rank_state(stage, tp_rank, pp_rank, pp_size,
                         {**model_state(chunks), "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION})
    barrier()
    if is_committer:
        commit_checkpoint(root, iteration)
    barrier()
    return iteration_dir(root, iteration)
