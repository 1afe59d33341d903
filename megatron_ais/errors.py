"""The errors every layer raises, in one place: each names what is wrong and, where a person can fix it, how.

The entry points report the first four as one line (no traceback): they describe a run that cannot start. The
others stop a run that has started; every rank raises the same one (`distributed.share`)."""
import contextlib


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


class GenerationTimeoutError(RolloutError):
    """An engine's generate call ran past --rollout-generation-timeout-s (the engine is then restarted)."""


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
