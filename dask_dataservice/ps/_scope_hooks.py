"""Context managers entered with every ``strategy.scope()``, installed from above.

An adapter that must see what is created inside a strategy's scope (the Keras adapter marks
the Keras variables created there) cannot be imported by ``ps`` (adapters import ``ps``,
never the reverse): the package root registers a hook here, ``hook(strategy)``, which
returns a context manager to enter with the scope, or None. This module imports nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["enter", "register"]

_HOOKS: dict[str, Callable[[Any], AbstractContextManager[Any] | None]] = {}


def register(name: str, hook: Callable[[Any], AbstractContextManager[Any] | None]) -> None:
    """Enter ``hook(strategy)`` (when not None) with every strategy scope."""
    _HOOKS[name] = hook


def enter(strategy: Any, stack: contextlib.ExitStack) -> None:
    """Enter every registered hook's context for ``strategy`` on ``stack``."""
    for hook in list(_HOOKS.values()):
        cm = hook(strategy)
        if cm is not None:
            stack.enter_context(cm)
