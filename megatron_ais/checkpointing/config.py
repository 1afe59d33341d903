"""The checkpoint flags and the small types the checkpoint modules and their users share: what a load gives one
rank, the metadata every checkpoint carries, where its HF files go, the warning line. Imports nothing of the
checkpoint package."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag

HF_ASSETS = "hf_assets"  # the directory of a checkpoint that holds the HF model's tokenizer and generation config
RUN_KIND = "run_kind"  # the metadata key naming the kind of run that saved a checkpoint (its run state's "kind")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(FlagConfig):
    """Where a run starts from and where it saves."""

    load: str | None = flag(None, "Megatron checkpoint directory to start from (written by "
                                  "tools/convert_checkpoint.py or a previous run). Overrides the weights of --hf-dir.",
                            type=str)
    save: str | None = flag(None, "Directory to write checkpoints to (model, optimizer, RNG states, run state; "
                                  "atomic, with a checksum per file). Point --load at it to resume.", type=str)
    save_interval: int | None = flag(None, "Save a checkpoint every this many steps.", type=int, at_least=1)
    keep_checkpoints: int = flag(2, "Committed iterations kept under --save (older ones are removed); more than one "
                                    "lets a corrupted newest checkpoint fall back to the previous one.", at_least=1)
    ckpt_format: str = flag("torch_dist", "How --save lays out tensors: torch_dist (megatron-core dist_checkpointing, "
                                          "Megatron-LM's default; model and optimizer reshard on load to another "
                                          "TP / PP / EP / DP layout) or torch (Megatron-LM's legacy per-rank files; "
                                          "resumes at the saved layout only). --load reads either, told by the "
                                          "checkpoint's files.", choices=("torch_dist", "torch"))
    async_save: bool = flag(False, "Write each checkpoint in the background while training goes on: the save takes a "
                                   "copy of the state in memory (as much again as the model and optimizer state) and "
                                   "returns; the checkpoint is committed once every rank's files are written and "
                                   "checksummed, at a later step or at the latest before the next save and at exit. "
                                   "A crash before then leaves the previous checkpoint current.")
    finetune: bool = flag(False, "Take only the weights of --load: fresh optimizer, RNG and step counter (like "
                                 "Megatron-LM). Implied for weights-only checkpoints (converted from HF or written by "
                                 "SFT runs).")
    replace_checkpoints: bool = flag(
        False, "Let a run that does not resume from --save (its --load is elsewhere or absent) write over and prune the "
               "checkpoints already there. Without it such a run is refused before it writes anything.")
    allow_unverified_checkpoint: bool = flag(
        False, "Load a --load (or --ref-load) checkpoint that has no checksums.json, i.e. one whose files nobody can "
               "verify (written by another tool); the log says so. Without it such a checkpoint is refused.")

    def __post_init__(self):
        super().__post_init__()
        if self.save_interval is not None and not self.save:
            raise ArgumentValidationError("--save-interval needs --save DIR")
        if self.async_save and not self.save:
            raise ArgumentValidationError("--async-save needs --save DIR (it writes --save's checkpoints in the "
                                          "background)")

    def saves_at(self, step: int, last_step: int) -> bool:
        """Whether the run saves after `step`: every --save-interval steps and after its last step."""
        return bool(self.save) and (step == last_step or bool(self.save_interval and step % self.save_interval == 0))


@dataclasses.dataclass(frozen=True)
class RankFileWrite:
    """A rank's part of a save once the format's collectives have run and, for a background save, the state is
    copied: `write` writes this rank's files into the staging directory and returns their names (no collective on a group
    training uses, so a background thread may run it), `finish` completes the format's files once every rank has written (collective,
    on the main thread) and returns the names it wrote on this rank."""

    write: Callable[[], list[str]]
    finish: Callable[[], list[str]] = list


@dataclasses.dataclass
class LoadedCheckpoint:
    """What --load gives one rank: the iteration used (and its directory), its metadata, the shard state and
    optimizer shard."""

    root: str
    iteration: int
    directory: str
    metadata: dict[str, Any]
    state: dict
    distrib_optim: list | None
    format: str = "torch"  # the format its files were written in (formats/: torch, torch_dist)

    @property
    def assets_dir(self) -> str:
        return os.path.join(self.directory, HF_ASSETS)

    @property
    def run_state(self) -> dict | None:
        return self.state.get("run_state")


def checkpoint_metadata(build, hf_config: dict, iteration: int, data_parallel_size: int | None = None,
                        use_distributed_optimizer: bool | None = None, **extra) -> dict[str, Any]:
    """Return the metadata every checkpoint carries: HF config, parallel layout (with the data-parallel size and
    optimizer kind, which the distributed optimizer's shards depend on; None for weights-only checkpoints),
    vocabulary padding, iteration, and `extra` (a converted checkpoint's source)."""
    layout = build.layout
    return {"hf_config": hf_config, "tensor_model_parallel_size": layout.tensor,
            "data_parallel_size": data_parallel_size, "use_distributed_optimizer": use_distributed_optimizer,
            "pipeline_model_parallel_size": layout.pipeline, "expert_model_parallel_size": layout.expert,
            "expert_tensor_parallel_size": layout.expert_tensor_size,
            "make_vocab_size_divisible_by": build.make_vocab_size_divisible_by,
            "padded_vocab_size": build.padded_vocab_size, "iteration": iteration, **extra}


def warn(message: str) -> None:
    """Print a warning line on rank 0 (from the launcher's environment: also before torch.distributed starts)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"WARNING: {message}", file=sys.stderr, flush=True)
