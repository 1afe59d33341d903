"""One live run per --save: a lock another process holds refuses a second run naming the holder, the lock of a
dead run is taken over with a message, and a directory a live run saves into cannot be --loaded."""
import json
import os
import subprocess
import sys
import time

import pytest

from megatron_ais.checkpointing.config import CheckpointConfig
from megatron_ais.checkpointing.lock import RunLock, refuse_directories_in_use
from megatron_ais.errors import CheckpointError

HOLD = """
import sys, time
from megatron_ais.checkpointing.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process that holds tmp_path/run's lock, as a live run does."""
    directory = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", HOLD, directory], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield directory, proc
    proc.kill()
    proc.wait()


def test_a_held_directory_is_refused_naming_the_holder(holder):
    directory, proc = holder
    with pytest.raises(CheckpointError, match=f"--save {directory} is in use by the run of pid {proc.pid} on "
                                              f"host .* started .*: one run per directory"):
        RunLock(directory).acquire()
    checkpoint = CheckpointConfig(load=directory)
    with pytest.raises(CheckpointError, match=f"--load {directory} is in use by the run of pid {proc.pid}"):
        refuse_directories_in_use(checkpoint)


def test_a_dead_runs_lock_is_taken_over_with_a_message(holder):
    directory, proc = holder
    proc.kill()
    proc.wait()  # the kernel drops a dead process's flock; its description stays in the file
    refuse_directories_in_use(CheckpointConfig(save=directory, load=directory))
    lock = RunLock(directory)
    message = lock.acquire()
    assert message.startswith(f"taking over the lock of {directory}: the run of pid {proc.pid} on host ")
    assert message.endswith(" is gone")
    assert json.load(open(lock.path))["pid"] == os.getpid()
    with pytest.raises(CheckpointError, match=f"in use by the run of pid {os.getpid()}"):
        RunLock(directory).acquire()  # held now by this process's lock
    lock.release()
    assert RunLock(directory).acquire() is not None  # released: free again


def test_the_lock_lives_as_long_as_its_holder(tmp_path):
    """No lock without a live holder: a fresh directory is taken without a message, and a lock is free again once
    its holder process ends, however it ends."""
    directory = str(tmp_path / "fresh")
    lock = RunLock(directory)
    assert lock.acquire() is None
    lock.release()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, directory], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    proc.terminate()
    proc.wait()
    time.sleep(0.1)
    assert "is gone" in RunLock(directory).acquire()
