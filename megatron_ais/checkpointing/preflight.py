"""The checks a run makes before any process group starts, each refusing with the flag to change: --save can be
written, has room for a checkpoint and holds no other run's checkpoints; a checkpoint's parallel layout and vocabulary
padding match the run's."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from megatron_ais.checkpointing.config import RUN_KIND
from megatron_ais.checkpointing.store import committed_iterations, read_checkpoint_metadata
from megatron_ais.errors import CheckpointError
from megatron_ais.model import ModelShape


def checkpoint_bytes(build) -> int:
    """About how many bytes one checkpoint of a model takes: its weights, and Adam's two fp32 moments (with BF16,
    the fp32 main weights too)."""
    per_parameter = 2 + 4 + 8 if build.precision == "bf16" else 4 + 8
    return build.shape.num_parameters(build.padded_vocab_size) * per_parameter


def nearest_existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable(path: str, flag: str) -> None:
    """Refuse a directory that cannot be written (or created), naming the flag; the probe file is removed at once."""
    base = nearest_existing(path)
    if not os.path.isdir(base):
        raise CheckpointError(f"{flag} {path}: {base} is not a directory; choose another {flag}")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".megatron-ais-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise CheckpointError(f"{flag} {path} cannot be written ({err.strerror} in {base}); choose a directory this "
                              "user can write") from None


def check_room(path: str, nbytes: int, flag: str) -> None:
    """Refuse a directory on a filesystem with less than `nbytes` free (a checkpoint's size), naming the flag."""
    free = shutil.disk_usage(nearest_existing(path)).free
    if free < nbytes:
        raise CheckpointError(f"{flag} {path}: one checkpoint of this model takes about {nbytes / 1e9:.2f} GB and "
                              f"{free / 1e9:.2f} GB are free there; free some space or choose another {flag}")


def check_save_holds_no_other_run(save: str, load: str | None, replace: bool, run_kind: str | None = None,
                                  finetune: bool = False) -> None:
    """Refuse a --save that holds committed checkpoints when the run does not resume from it: the run would save its
    own iterations over them and prune the rest, unless `replace` says it may. It resumes from --load when --load is
    --save, unless it starts afresh from there all the same: `finetune`, or checkpoints that say they are another
    kind of run's than `run_kind` (None: not known)."""
    committed = committed_iterations(save)
    if not committed or replace:
        return
    if load and os.path.realpath(load) == os.path.realpath(save):
        saved_kind = read_checkpoint_metadata(save, committed[0]).get(RUN_KIND)
        fresh = ("--finetune" if finetune else f"they are a {saved_kind} run's, this is a {run_kind} run"
                 if run_kind and saved_kind and saved_kind != run_kind else None)
        if fresh is None:
            return
        raise CheckpointError(f"--save {save} is --load too, but this run starts afresh from it ({fresh}), so its "
                              f"saves would replace that run's checkpoints (newest: iteration {committed[0]}); choose "
                              "another --save, or pass --replace-checkpoints")
    raise CheckpointError(f"--save {save} holds another run's checkpoints (newest: iteration {committed[0]}) and this "
                          f"run does not resume from it ({'--load ' + load if load else 'no --load'}); pass --load "
                          f"{save} to resume that run, or --replace-checkpoints to replace its checkpoints")


def check_layout(metadata: dict[str, Any], layout, root: str, reshards: bool = False) -> None:
    """Raise a CheckpointError naming the flags when a checkpoint was saved at another TP / PP / EP / expert-TP
    layout than the ParallelLayout `layout` (checkpoints that predate the expert-TP record are not checked on it),
    unless it `reshards` on load (torch_dist)."""
    if reshards:
        return
    tp, pp, ep, etp = layout.tensor, layout.pipeline, layout.expert, layout.expert_tensor_size
    saved = (metadata["tensor_model_parallel_size"], metadata["pipeline_model_parallel_size"],
             metadata.get("expert_model_parallel_size", 1), metadata.get("expert_tensor_parallel_size") or etp)
    if saved != (tp, pp, ep, etp):
        raise CheckpointError(
            f"--load {root} was saved at TP{saved[0]} x PP{saved[1]} x EP{saved[2]} x expert-TP{saved[3]} but the run "
            f"uses --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} --expert-model-parallel-size "
            f"{ep} --expert-tensor-parallel-size {etp}; use the saved sizes, or reshard: "
            "tools/convert_checkpoint.py megatron-to-hf then hf-to-megatron with the new sizes (torch_dist "
            "checkpoints, --ckpt-format torch_dist, reshard on load)")


def check_vocab_padding(metadata: dict[str, Any], divisible_by: int, tp: int, root: str) -> None:
    """Raise a CheckpointError naming the flag when this run would pad the vocabulary to another size than the
    checkpoint's (checkpoints that predate the record are not checked)."""
    saved = metadata.get("padded_vocab_size")
    if saved is None:
        return
    padded = ModelShape.from_hf_config(metadata["hf_config"]).padded_vocab_size(divisible_by, tp)
    if padded != saved:
        raise CheckpointError(f"--load {root} holds a vocabulary padded to {saved} rows, this run pads to {padded} "
                              f"(--make-vocab-size-divisible-by {divisible_by}); use the saved run's "
                              f"--make-vocab-size-divisible-by "
                              f"{metadata.get('make_vocab_size_divisible_by', '(see its megatron_ais.json)')}")
