"""Registries keyed by name, where the paper's choices (and ours) may change: adding one is adding one entry."""
from __future__ import annotations

from typing import Callable


def register(registry: dict, name: str) -> Callable:
    """Decorator: add a function to `registry` under `name`."""
    def wrap(fn):
        registry[name] = fn
        return fn
    return wrap
