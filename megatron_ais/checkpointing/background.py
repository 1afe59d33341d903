"""--async-save: a checkpoint written by a background thread while training goes on, at most one at a time.

The save itself (`store.begin_save` with a snapshot) runs on the main thread: the format's collectives, and a copy
of what training will change. The thread then only writes this rank's files and their sha256 (`store.write_staged`):
no collective on a group training uses, since one issued from it would interleave with training's (torch_dist gathers
the distributed optimizer's shards there, over the optimizer's gloo data-parallel group, which only checkpointing
uses). Everything collective on shared groups, the format's finalisation, the exchange of checksums and the commit
(`store.commit_staged`), runs on the main thread at points every rank reaches in the same order: `poll` at every step
boundary, `wait` before the next save and before the run ends. A crash before the commit leaves the staging directory uncommitted and the previous
checkpoint current.
"""
from __future__ import annotations

import threading

from megatron_ais.checkpointing.ranks import gather
from megatron_ais.checkpointing.store import StagedSave, commit_staged, write_staged


class BackgroundSaver:
    """The outstanding background save of this rank, if any (every rank starts and commits the same ones)."""

    def __init__(self):
        self._save: StagedSave | None = None
        self._writer: threading.Thread | None = None

    @property
    def outstanding(self) -> int | None:
        """The iteration being written, or None."""
        return None if self._save is None else self._save.iteration

    def start(self, save: StagedSave) -> None:
        """Write a staged save's files in the background; the one before must be committed (`wait`) first."""
        if self._save is not None:
            raise RuntimeError(f"checkpoint iteration {self._save.iteration} is still outstanding: wait() for it "
                               "before starting the next")
        # a daemon: a run that dies mid-write must exit, leaving the staging directory uncommitted
        self._save = save
        self._writer = threading.Thread(target=write_staged, args=(save,), name=f"checkpoint-{save.iteration}",
                                        daemon=True)
        self._writer.start()

    def poll(self) -> int | None:
        """Commit the outstanding save if every rank has written its files, and return its iteration; None while
        one is still writing or when none is outstanding. Collective while a save is outstanding."""
        if self._save is None:
            return None
        if not all(gather(not self._writer.is_alive())):
            return None
        return self.wait()

    def wait(self) -> int | None:
        """Wait for this rank's writes, then commit (collective) and return the checkpoint's iteration; None when no
        save is outstanding. Raises the CheckpointError of a save that could not be committed, on every rank."""
        if self._save is None:
            return None
        self._writer.join()
        save, self._save, self._writer = self._save, None, None
        commit_staged(save)
        return save.iteration
