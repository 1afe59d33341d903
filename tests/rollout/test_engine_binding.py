"""A separate CPU engine bound to its cores (--rollout-cpu-core): every thread of its processes and of their children
is bound, not only vLLM's OpenMP threads (an engine core's scheduling and socket threads would otherwise run on the
trainer's cores); CPU lists are read as vLLM's VLLM_CPU_OMP_THREADS_BIND writes them."""
import os
import subprocess
import sys
import time

import pytest

from megatron_ais.engine.vllm_engine import bind_processes
from megatron_ais.engine.config import cpu_list

# a process with a second thread, whose child has one too: what an engine core and its worker look like
TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
if sys.argv[1] == "parent":
    subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]])
time.sleep(60)
"""


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _children(pid: int) -> list[int]:
    return [int(c) for t in _threads(pid) for c in open(f"/proc/{pid}/task/{t}/children").read().split()]


def test_cpu_lists_read_as_vllm_writes_them():
    assert cpu_list("1") == {1} and cpu_list("0-3") == {0, 1, 2, 3} and cpu_list("0,2-3") == {0, 2, 3}
    with pytest.raises(ValueError):
        cpu_list("one")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell a binding apart")
def test_every_thread_of_the_processes_and_their_children_is_bound():
    core = max(os.sched_getaffinity(0))
    parent = subprocess.Popen([sys.executable, "-c", TREE, "parent", TREE])
    try:
        deadline = time.time() + 30
        while not (_children(parent.pid) and len(_threads(parent.pid)) == 2
                   and len(_threads(_children(parent.pid)[0])) == 2):
            assert time.time() < deadline, "the process tree did not start"
            time.sleep(0.1)
        child = _children(parent.pid)[0]
        assert all(os.sched_getaffinity(t) != {core} for t in _threads(parent.pid))
        bind_processes([parent.pid], {core})
        assert [os.sched_getaffinity(t) for pid in (parent.pid, child) for t in _threads(pid)] == [{core}] * 4
    finally:
        for pid in _children(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()
