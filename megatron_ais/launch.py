"""Run a function on N local gloo processes, for tests and CPU benchmarks: each rank forks from one server process
that imported torch and megatron-core once (5-6 s of imports a rank otherwise, on every world started), and whatever
else its caller asked to preload (`preload_in_ranks`)."""
from __future__ import annotations

import math
import os
import queue as queue_module
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ais.distributed import free_port
from megatron_ais.errors import SHARED_ERRORS
from megatron_ais.lifetime import take_environment

RESULT_WAIT_S = 120.0
_preloaded_modules = ["torch", "megatron.core"]


def preload_in_ranks(*modules: str) -> None:
    """Have the rank server import `modules` too. It starts at this process's first `spawn` and is reused after, so
    call this before then: for callers whose ranks mostly import something heavy (vLLM's `LLM`: 7 s a rank). A
    module that is not installed is skipped."""
    _preloaded_modules.extend(module for module in modules if module not in _preloaded_modules)


def _rank_context():
    """A forkserver context whose server imports the preloaded modules (started at its first use, then reused)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_preloaded_modules)
    return context


def _worker(rank: int, world_size: int, port: int, environ: dict, target, target_args, queue, received) -> None:
    take_environment(environ)  # the caller's, not the server's (started by an earlier caller)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", target(*target_args)))
    except SHARED_ERRORS as err:  # a refusal the caller re-raises by type (rebuilt: only its message travels)
        queue.put((rank, "error", (traceback.format_exc(), type(err)(str(err)))))
    except BaseException:  # report every other failure to the parent with its traceback
        queue.put((rank, "error", (traceback.format_exc(), None)))
    finally:
        _teardown_distributed()
        # tensors in a result travel as file descriptors this process must still hold when the parent unpickles
        # them: stay alive until it has
        received.wait(RESULT_WAIT_S)


def _teardown_distributed() -> None:

    if "vllm.distributed.parallel_state" in sys.modules:
        # a colocated vLLM engine owns the process group: let vLLM tear down its own groups first, or its exit
        # handler fails on groups that are already gone
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


def _record(rank: int, status: str, value, results: dict, errors: list) -> None:
    """Keep a rank's result, or its failure as (rank, traceback, the shared error it raised or None)."""
    if status == "ok":
        results[rank] = value
    else:
        errors.append((rank, *value))


def _failure(errors: list) -> BaseException:
    """Every failed rank's traceback as one RuntimeError, or, where a rank raised one of `SHARED_ERRORS`, the first
    such error, by type, caused by that RuntimeError: a caller reports it as the refusal it is."""
    report = RuntimeError("distributed worker failed:\n" + "\n".join(
        f"rank {rank}: {text}" for rank, text, _ in errors))
    shared = next((err for _, _, err in sorted(errors, key=lambda e: e[0]) if err is not None), None)
    if shared is None:
        return report
    shared.__cause__ = report
    return shared


def _drain(queue, results: dict, errors: list) -> None:
    while True:
        try:
            _record(*queue.get(timeout=0.5), results, errors)
        except queue_module.Empty:
            return


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal has no name
        return f"signal {-code}"


def spawn(world_size: int, target, *args, timeout: float | None = 600.0) -> list:
    """Run `target(*args)` on `world_size` local ranks (env set as torchrun does); return results in rank order.

    Raises with the failing rank's traceback if any rank fails, naming the signal if one died without a word (a
    segfault in a kernel, the OOM killer), and after `timeout` seconds without every result (None: no limit). A
    rank's `SHARED_ERRORS` (a refused checkpoint, a usage error) is raised as itself, its traceback as the cause.
    """
    ctx = _rank_context()
    queue, received = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, dict(os.environ), target, args, queue, received))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline, timed_out = time.monotonic() + (math.inf if timeout is None else timeout), False
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if dead:
                    # a rank may have reported just before it died (e.g. in its teardown): take what arrived first
                    _drain(queue, results, errors)
                    errors += [(r, f"died ({_exit_reason(procs[r].exitcode)}) before reporting", None)
                               for r in dead if r not in results]
                if not errors and time.monotonic() > deadline:
                    timed_out = True
                    raise TimeoutError(f"no result from ranks {sorted(set(range(world_size)) - set(results))} "
                                       f"after {timeout:.0f} s") from None
                continue
            _record(rank, status, value, results, errors)
    finally:
        received.set()
        for p in procs:
            p.join(timeout=5 if errors or timed_out else 60)
            if p.is_alive():
                p.terminate()
    if errors:
        _drain(queue, results, errors)  # what the other ranks reported while they stopped
        raise _failure(errors)
    return [results[r] for r in range(world_size)]
