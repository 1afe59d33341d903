"""What a run's console shows of the libraries: their Python warnings on rank 0 only, once per subject, on one line
(ours on every rank), and without CUDA not megatron's expected notice that TE and Apex are missing; vLLM held to its log level from import; the rotary embedding's reload warning dropped, vLLM's
other reload warnings kept."""
import logging
import warnings

import torch

from megatron_ais.logging import apply_vllm_log_level, quiet_libraries
from megatron_ais.engine.vllm_plugin import derived_buffers_are_not_weights


def _warn(message: str, module: str) -> None:
    warnings.warn_explicit(message, UserWarning, f"/site-packages/{module.replace('.', '/')}.py", 7, module=module)


def _console(rank: int) -> list[str]:
    """The lines a rank shows for four library warnings (two of one subject; one megatron's notice that it runs
    without Transformer Engine) and one of ours."""
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: shown.append(
            warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"))
        quiet_libraries(rank)
        _warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
              "megatron.core.optimizer")
        _warn("full scope is deprecated. Use selective.", "megatron.core.transformer.transformer_config")
        _warn("full scope is deprecated. Use none.", "megatron.core.transformer.enums")
        _warn("a fallback of ours", "megatron_ais.bridge.sync")
    return shown


def test_library_warnings_once_per_subject_on_rank_zero_only():
    without_te = ["UserWarning: Transformer Engine and Apex are not installed. Falling back to Torch optimizers. "
                  "(optimizer.py:7)"] if torch.cuda.is_available() else []
    assert _console(0) == [*without_te, "UserWarning: full scope is deprecated. Use selective. (transformer_config.py:7)",
                           "UserWarning: a fallback of ours (sync.py:7)"]
    assert _console(1) == ["UserWarning: a fallback of ours (sync.py:7)"]
    assert logging.getLogger("megatron.core.rerun_state_machine").getEffectiveLevel() == logging.ERROR


def test_vllm_held_to_its_level_before_it_configures_logging(monkeypatch):
    vllm = logging.getLogger("vllm")
    monkeypatch.setattr(vllm, "level", logging.NOTSET)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "error")
    apply_vllm_log_level()
    assert not logging.getLogger("vllm.triton_utils.importing").isEnabledFor(logging.WARNING)
    assert logging.getLogger("vllm.triton_utils.importing").isEnabledFor(logging.ERROR)


def _reload_warning(layer: str) -> logging.LogRecord:
    return logging.LogRecord("vllm.model_executor.model_loader.reload.layerwise", logging.WARNING, "layerwise.py", 266,
                             "%s: Failed to load weights", (layer,), None)


def test_only_the_rotary_embeddings_reload_warning_is_dropped():
    assert not derived_buffers_are_not_weights(_reload_warning("RotaryEmbedding"))
    assert not derived_buffers_are_not_weights(_reload_warning("Llama3RotaryEmbedding"))
    assert derived_buffers_are_not_weights(_reload_warning("QKVParallelLinear"))
    assert derived_buffers_are_not_weights(logging.LogRecord("vllm", logging.WARNING, "x.py", 1, "other", (), None))
