"""The multi-process helper reports a rank that dies without a word (a segfault in a kernel, the OOM killer) at
once, with its signal, instead of waiting out its timeout; its ranks start with what the rank server preloaded
(torch, megatron-core, and vLLM's `LLM` for the tests) already imported, and with their caller's environment."""
import importlib.util
import os
import signal
import sys
import threading
import time

import pytest

from distributed import spawn
from megatron_ais.errors import CheckpointError


def _die_on_rank_one():
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()  # rank 0 never answers: only rank 1's death can end the wait before the timeout
    return "never"


def test_a_killed_rank_is_reported_with_its_signal():
    # a helper that waited for every rank would raise TimeoutError here (after 120 s), not name the dead rank
    with pytest.raises(RuntimeError, match=r"rank 1: died \(signal SIGKILL\) before reporting"):
        spawn(2, _die_on_rank_one, timeout=120)


def _refuse_on_rank_one():
    if int(os.environ["RANK"]) == 1:
        raise CheckpointError("/ckpt/iter_0000002: model/.metadata is refused")
    time.sleep(1)  # reported after the refusal: the other ranks' reports are still collected
    raise KeyError("a bug")


def _fail_with_a_bug():
    raise KeyError("a bug")


def test_a_refusal_is_raised_by_type_and_any_other_failure_with_every_traceback():
    # the converter reports a refused checkpoint as one line only when it arrives as the CheckpointError it is
    with pytest.raises(CheckpointError, match=r"^/ckpt/iter_0000002: model/.metadata is refused$") as refused:
        spawn(2, _refuse_on_rank_one, timeout=120)
    cause = str(refused.value.__cause__)
    assert "rank 0: Traceback" in cause and "KeyError: 'a bug'" in cause and "rank 1: Traceback" in cause
    with pytest.raises(RuntimeError, match=r"rank 0: Traceback(.|\n)*KeyError: 'a bug'"):
        spawn(1, _fail_with_a_bug, timeout=120)


def _imported(modules):
    return {module: module in sys.modules for module in modules}, os.environ.get("SPAWN_TEST_CALLER")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_ranks_start_with_the_preloaded_modules_and_the_callers_environment(monkeypatch):
    # the server was started with the environment of its first caller: a rank takes this caller's
    monkeypatch.setenv("SPAWN_TEST_CALLER", "this test")
    modules = ("torch", "megatron.core", "vllm.entrypoints.llm")
    (imported, caller) = spawn(1, _imported, modules)[0]
    assert imported == dict.fromkeys(modules, True)
    assert caller == "this test"
