"""The errors every layer raises, in one place: each names what is wrong and, where a person can fix it, how.

The entry points report the first four as one line (no traceback): they describe a run that cannot start. The
others stop a run that has started; every rank raises the same one (`distributed.share`)."""
import contextlib
import os
import sys
import traceback


class ArgumentValidationError(ValueError):
    """A flag (or a flag together with the model config) describes an impossible run."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the requested layout."""


class TaskError(ValueError):
    """The task flags describe an impossible task (the message names the flag and the fix)."""


class PromptFileError(TaskError):
    """A prompt file has a malformed record (the message names the file and line)."""


class SyncError(RuntimeError):
    """A weight sync was refused; the engine keeps its previous weights."""


class RefitVerificationError(RuntimeError):
    """The engine's log-probs disagree with the trainer's after a weight sync."""


class RolloutError(RuntimeError):
    """The engine could not produce a step's rollouts (it failed, or died again after a restart)."""


class EngineTimeoutError(RolloutError):
    """A separate engine did not answer in time (the engine is then restarted)."""


class GenerationTimeoutError(EngineTimeoutError):
    """An engine's generate call ran past --rollout-generation-timeout-s, or another call past
    --rollout-engine-call-timeout-s."""


class EngineCallTimeoutError(EngineTimeoutError):
    """A separate engine left a call (a weight sync, KV-cache scales, a probe) unanswered past
    --rollout-engine-call-timeout-s: it is wedged, and was killed."""


class EngineRetiredError(RolloutError):
    """An engine died more often than --rollout-max-engine-restarts allows: it serves no more."""


class NonFiniteInputError(FloatingPointError):
    """An AIS entry point was given NaN/Inf log-probs, advantages or statistics (the message names which)."""


class RoutingReplayError(ValueError):
    """Routed expert ids to replay do not fit the trainer's MoE layers (the message names the layer)."""


# what a person fixes before starting again: reported as one line by the entry points
@contextlib.contextmanager
def as_sync_error(prefix: str = "", passing: tuple[type, ...] = ()):
    """Re-raise any error but a SyncError (or one of `passing`) as a SyncError: every rank must learn that a sync
    failed, whatever raised it (the engine raises many kinds)."""
    try:
        yield
    except (SyncError, *passing):
        raise
    except Exception as err:
        raise SyncError(f"{prefix}{type(err).__name__}: {err}") from err


USAGE_ERRORS = (ArgumentValidationError, CheckpointError, TaskError)
# what every rank re-raises by type when the rank that met it shares it
SHARED_ERRORS = USAGE_ERRORS + (SyncError, RefitVerificationError, RolloutError, FloatingPointError)


# set by tools/torchrun.py for the ranks it launches: where an error that ends a rank is written as one line
ERROR_FILE_ENV = "MEGATRON_AIS_ERROR_FILE"


def one_line(prog: str, err: BaseException) -> str:
    """'prog: error: message' on one line (a usage error without its type: the message names the flag and the fix)."""
    message = " ".join(str(err).split())
    kind = "" if isinstance(err, USAGE_ERRORS) else f"{type(err).__name__}: "
    return f"{prog}: error: {kind}{message}"


@contextlib.contextmanager
def reported_as_one_line(prog: str, parser):
    """An entry point's body. Launched by tools/torchrun.py (ERROR_FILE_ENV set), an error that ends this rank is
    appended to that file as one line (`one_line`, prefixed with the rank) and its traceback goes to stderr, which
    the launcher keeps in the run's log: the user sees the line, not every rank's traceback and torchrun's report.
    Otherwise a usage error is the parser's error (usage and message, exit 2) and any other error propagates.
    Launched so, the ranks print into one pipe, unbuffered: each line goes to it in one write (print's pieces and
    newline are several otherwise), so two ranks' lines never mix."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=False)
    try:
        yield
    except USAGE_ERRORS as err:
        if not path:
            parser.error(str(err))
        _record(path, one_line(prog, err))
        raise SystemExit(2) from None
    except Exception as err:
        if not path:
            raise
        _record(path, one_line(prog, err))
        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1) from None


def _record(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(f"{os.environ.get('RANK', '0')}\t{line}\n")
