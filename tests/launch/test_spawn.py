"""The multi-process helper reports a rank that dies without a word (a segfault in a kernel, the OOM killer) at
once, with its signal, instead of waiting out its timeout."""
import os
import signal
import threading

import pytest

from distributed import spawn


def _die_on_rank_one():
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()  # rank 0 never answers: only rank 1's death can end the wait before the timeout
    return "never"


def test_a_killed_rank_is_reported_with_its_signal():
    # a helper that waited for every rank would raise TimeoutError here (after 120 s), not name the dead rank
    with pytest.raises(RuntimeError, match=r"rank 1: died \(signal SIGKILL\) before reporting"):
        spawn(2, _die_on_rank_one, timeout=120)
