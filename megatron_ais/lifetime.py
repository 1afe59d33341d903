"""A run's processes live no longer than the process that started them: a rank exits when its launcher (torchrun)
dies, an engine process when its rank dies, so that a killed launcher leaves no run behind to race its rerun.

Linux's parent-death signal does it: `exit_with_parent` asks the kernel to SIGKILL this process when its parent
exits, and marks the environment so that the processes it starts (vLLM's engine core and workers, whose
`megatron_ais` plugin calls it too) do the same. Only what this program starts is marked: an unrelated vLLM server
that loads the plugin is left alone. The kernel sends the signal when the *thread* that started a process exits:
a thread that starts one must live as long as its process (`rollout.rows.BackgroundWorker`). What a SIGKILL
interrupts is safe by construction: checkpoints commit atomically, and shared-memory files of dead processes are
removed by the next run.

A process forked from a fork server (the test ranks, a separate CPU engine's core) takes the environment of the
process that asked for it, not the server's (`take_environment`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

EXIT_WITH_PARENT = "MEGATRON_AIS_EXIT_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def exit_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent exits (Linux; elsewhere nothing happens and False is
    returned); a parent already gone kills it now. Processes started afterwards inherit the request."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        return False
    os.environ[EXIT_WITH_PARENT] = "1"
    if os.getppid() != parent:  # the parent died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def take_environment(environ: dict[str, str]) -> None:
    """Make this process's environment `environ`: a process forked from a fork server has the server's, from when
    it started, not that of the process that asked for it. Only what differs is changed: an environment rebuilt
    whole leaves setproctitle no room for the process titles vLLM gives its engine processes."""
    for name in [name for name in os.environ if name not in environ]:
        del os.environ[name]
    os.environ.update({name: value for name, value in environ.items() if os.environ.get(name) != value})


def exit_with_parent_if_asked() -> None:
    """In a process started by a run's process (the vLLM plugin calls this): follow its request."""
    if os.environ.get(EXIT_WITH_PARENT) == "1":
        exit_with_parent()
