"""What the framework bridges (:mod:`.torch`, :mod:`.jax`) share: iterate a dataset with each
element converted, and stop the pipeline (its threads, its service job) when abandoned."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["convert_each"]


def convert_each(dataset: Iterable[Any], convert: Callable[[Any], Any]) -> Iterator[Any]:
    """``convert(element)`` for each element of ``dataset``."""
    it = iter(dataset)
    try:
        for element in it:
            yield convert(element)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
