"""Who uses an engine's host's engine, and when: one generation at a time (the background worker's ahead of the
trainer, or the main thread's), and a weight sync only while no generation runs, or while the running one has
stepped aside. With --partial-rollouts a sync asks the running generation to step aside between two decode steps
(`RolloutEngine.generate` aborts its unfinished requests and parks), applies the new weights, and lets it resume
them on those weights; otherwise the sync waits for it to end. The threads meet here only: nothing collective runs
in a generation."""
from __future__ import annotations

import contextlib
import threading


class EngineTurns:
    def __init__(self):
        self._changed = threading.Condition()
        self._generating = False  # a generation holds the engine
        self._parked = False  # ... and has stepped aside for a sync
        self._sync_asked = False
        self.weights_version = 0  # the trainer step whose weights the engine holds (set by each sync)

    @contextlib.contextmanager
    def generation(self):
        """Hold the engine for one generation (rows of a step, an evaluation); waits for a sync or another
        generation to end."""
        with self._changed:
            self._changed.wait_for(lambda: not self._generating and not self._sync_asked)
            self._generating = True
        try:
            yield self
        finally:
            with self._changed:
                self._generating = False
                self._changed.notify_all()

    @contextlib.contextmanager
    def sync(self):
        """Hold the engine for a weight sync: once no generation runs, or the running one has parked (it resumes
        when this ends)."""
        with self._changed:
            self._sync_asked = True
            self._changed.wait_for(lambda: not self._generating or self._parked)
        try:
            yield self
        finally:
            with self._changed:
                self._sync_asked = False
                self._changed.notify_all()

    def sync_asked(self) -> bool:
        """Whether a sync waits for the running generation (polled between decode steps)."""
        return self._sync_asked

    def park(self) -> int:
        """Step aside for the sync that asked (the generation's requests are aborted) until it ends; return the
        version of the weights the engine holds then."""
        with self._changed:
            self._parked = True
            self._changed.notify_all()
            self._changed.wait_for(lambda: not self._sync_asked)
            self._parked = False
            return self.weights_version
