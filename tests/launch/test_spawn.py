"""The multi-process helper reports a rank that dies without a word (a segfault in a kernel, the OOM killer) at
once, with its signal, instead of waiting out its timeout."""
import os
import signal
import time

import pytest

from distributed import spawn


def _die_on_rank_one():
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)  # rank 0 is still busy when rank 1 dies
    return "late"


def test_a_killed_rank_is_reported_with_its_signal():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1: died \(signal SIGKILL\) before reporting"):
        spawn(2, _die_on_rank_one, timeout=120)
    assert time.monotonic() - start < 25  # well before rank 0 would have answered, far before the timeout
