"""Pickling a pipeline with some of its sources replaced (large inputs moved to the cluster).

While a dataset is registered, ``service/client/_scatter.py`` moves its large in-memory inputs
to the cluster and pickles the pipeline inside :func:`pickling_with`: a source whose id is in
the mapping pickles its replacement (a ``from_tensor_slices`` source's data with
``ScatteredArray`` leaves, a persisted ``FromDask``) instead of itself. The op objects, which
the user's ``Dataset`` holds, do not change. See ``data/dask_source.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = ["pickling_with", "replacement"]

#: ``{id(op): what to pickle instead}`` while a pipeline is pickled for registration.
_REPLACING: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "dask_dataservice_replacing", default=None)


@contextlib.contextmanager
def pickling_with(replacements: dict[int, Any]) -> Iterator[None]:
    """Pickle the ops whose ids are in ``replacements`` as their replacements."""
    token = _REPLACING.set(replacements)
    try:
        yield
    finally:
        _REPLACING.reset(token)


def replacement(op: object) -> Any:
    """What ``op`` pickles as in this :func:`pickling_with` block, or None."""
    replacing = _REPLACING.get()
    return None if replacing is None else replacing.get(id(op))
