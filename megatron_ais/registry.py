"""Registries keyed by name, where the paper's choices (and ours) may change: adding one is adding one entry."""
from __future__ import annotations

from typing import Any, Callable


class Registry(dict):
    """Implementations keyed by the flag value that selects them; `title` names the registry in errors. A name is
    registered once: a second registration would silently replace the first, so it is refused."""

    def __init__(self, title: str, entries: dict[str, Any] | None = None):
        super().__init__()
        self.title = title
        for name, entry in (entries or {}).items():
            self[name] = entry

    def __setitem__(self, name: str, entry: Any) -> None:
        if name in self:
            raise ValueError(f"the {self.title} registry already holds {name!r}: refusing a second registration")
        super().__setitem__(name, entry)


def register(registry: Registry, name: str) -> Callable:
    """Decorator: add a function to `registry` under `name` (once)."""
    def wrap(fn):
        registry[name] = fn
        return fn
    return wrap
