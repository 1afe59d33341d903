"""A run's saves under --save, one code path for GRPO and SFT: the checkpoint's metadata, its staged save and the
commit, in the background with --async-save (`background.BackgroundSaver`: one save outstanding at a time, a
finished one committed at the next `poll` or `wait`, which every rank reaches in the same order)."""
from __future__ import annotations

import os
from typing import Callable

from megatron_ais.checkpointing.background import BackgroundSaver
from megatron_ais.checkpointing.config import HF_ASSETS, RUN_KIND, CheckpointConfig, checkpoint_metadata
from megatron_ais.checkpointing.formats import torch_dist
from megatron_ais.checkpointing.ranks import CheckpointRanks
from megatron_ais.checkpointing.store import FORMATS, begin_save, commit_staged, iteration_dir, write_staged


class Checkpointer:
    """Saves one trainer's model, optimizer and run state (collective on every rank). `on_commit(iteration)` is called
    once each save is committed; `data_parallel` is (group, size) of the trainer's data-parallel ranks."""

    def __init__(self, config: CheckpointConfig, build, hf_config: dict, chunks: list, optimizer, assets_dir: str,
                 data_parallel: tuple, use_distributed_optimizer: bool,
                 on_commit: Callable[[int], None] = lambda iteration: None):
        self.config, self.build, self.hf_config = config, build, hf_config
        self.chunks, self.optimizer, self.assets_dir = chunks, optimizer, assets_dir
        self.dp_group, self.dp_size = data_parallel
        self.use_distributed_optimizer = use_distributed_optimizer
        self.ranks = CheckpointRanks.from_parallel_state()
        self.on_commit = on_commit
        self.saver = BackgroundSaver() if config.async_save else None
        if config.save and config.ckpt_format == torch_dist.NAME and use_distributed_optimizer:
            torch_dist.check_optimizer_saveable(optimizer)

    def saves_at(self, step: int, last_step: int) -> bool:
        return self.config.saves_at(step, last_step)

    def save(self, iteration: int, run_state: dict, protect: tuple[int, ...] = (), training_goes_on: bool = True,
             metadata: dict | None = None):
        """Save iteration `iteration`, keeping --keep-checkpoints committed ones besides `protect`; `metadata`: what the
        run adds to the checkpoint's metadata (read before any rank file). With --async-save the files are written
        in the background after the previous save is committed; `training_goes_on`: the format snapshots what
        training changes, so the weights may move while they are written."""
        self.wait()
        metadata = checkpoint_metadata(self.build, self.hf_config, iteration, self.dp_size,
                                       self.use_distributed_optimizer, **{RUN_KIND: run_state.get("kind")},
                                       **(metadata or {}))
        staged = begin_save(self.config.save, iteration, self.chunks, metadata, self.assets_dir, self.ranks,
                            optimizer=self.optimizer, run_state=run_state, dp_group=self.dp_group,
                            keep=self.config.keep_checkpoints, protect=protect, fmt=FORMATS[self.config.ckpt_format],
                            snapshot=self.saver is not None and training_goes_on)
        if self.saver is not None:
            self.saver.start(staged)
        else:
            commit_staged(write_staged(staged))
            self._committed(iteration)

    def poll(self) -> None:
        """Commit a background save that has finished writing (at a step boundary every rank reaches)."""
        if self.saver is not None:
            self._committed(self.saver.poll())

    def wait(self) -> None:
        """Commit the outstanding background save once it has finished writing."""
        if self.saver is not None:
            self._committed(self.saver.wait())

    def _committed(self, iteration: int | None) -> None:
        if iteration is not None:
            # the next saves copy the HF assets from this one: pruning never removes the newest checkpoint, while
            # the directory they came from (a resumed run's loaded checkpoint under --save) may go
            if self.assets_dir:
                self.assets_dir = os.path.join(iteration_dir(self.config.save, iteration), HF_ASSETS)
            self.on_commit(iteration)
