"""One live run per checkpoint directory: the run lock on --save, held for the life of the run, and the refusal of
a --save or --load directory that a live run holds."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from megatron_ais.checkpointing.config import CheckpointConfig, warn
from megatron_ais.errors import CheckpointError

LOCK_FILE = "megatron_ais.lock"


def _holder(text: str) -> str:
    """The run a lock file names, in words."""
    try:
        holder = json.loads(text)
        return f"the run of pid {holder['pid']} on host {holder['host']} started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "a run that left no description"


class RunLock:
    """One live run per directory: an exclusive flock on DIR/megatron_ais.lock, held for the life of the run, the
    holder's host, pid and start time written inside. The kernel drops a flock when its holder dies, so a lock file
    that nobody holds is a dead run's and is taken over."""

    def __init__(self, directory: str, flag: str = "--save"):
        self.directory, self.flag, self.fd = directory, flag, None
        self.path = os.path.join(directory, LOCK_FILE)

    def acquire(self) -> str | None:
        """Hold the lock; return a message when a dead run's lock was taken over. Raise a CheckpointError naming the
        holder when a live run holds it."""
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise CheckpointError(f"{self.flag} {self.directory} is in use by {holder}: one run per directory; stop "
                                  f"that run or choose another {self.flag}") from None
        except OSError as err:  # a filesystem without flock: the run goes on unguarded, and says so
            os.close(fd)
            return f"{self.flag} {self.directory} cannot be locked ({err.strerror}): nothing keeps a second run out"
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return f"taking over the lock of {self.directory}: {_holder(previous)} is gone" if previous.strip() else None

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def refuse_if_in_use(directory: str, flag: str = "--load") -> None:
    """Raise a CheckpointError naming the holder when a live run holds `directory`'s lock (a --load of a directory
    another run is saving into)."""
    path = os.path.join(directory, LOCK_FILE)
    if not os.path.isfile(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        raise CheckpointError(f"{flag} {directory} is in use by {holder}; wait for it to end, or load one of its "
                              "checkpoints from a copy") from None
    except OSError:
        pass  # a filesystem without flock locks nothing
    finally:
        os.close(fd)


def refuse_directories_in_use(checkpoint: CheckpointConfig) -> None:
    """Before anything reads a checkpoint: refuse a --save or --load directory that a live run holds."""
    for option, directory in (("--save", checkpoint.save), ("--load", checkpoint.load)):
        if directory:
            refuse_if_in_use(directory, option)


def hold_save_directory(checkpoint: CheckpointConfig) -> RunLock | None:
    """Hold --save's lock for the life of the run (taking over a dead run's, with a warning)."""
    if not checkpoint.save:
        return None
    lock = RunLock(checkpoint.save)
    message = lock.acquire()
    if message:
        warn(message)
    return lock
