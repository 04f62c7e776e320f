"""Keras variables created inside ``strategy.scope()`` remember the strategy.

The package root registers a scope hook (:mod:`dask_dataservice.ps._scope_hooks`) that, when
Keras is imported, enters :func:`recording` with the strategy's scope: a Keras
``Distribution`` whose only job is to see each variable created meanwhile (Keras asks the
active distribution for a variable's layout as it creates it) and mark it with the strategy.
It lays nothing out (every layout is None: the variable stays an ordinary local variable on
the coordinator, the copy :class:`~.model.ModelOnPS` keeps in sync). ``model.fit`` of a model
with such a variable then trains on the parameter servers (see :mod:`.fit`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._backend import keras
from .fit import install
from .model import STRATEGY_ATTR

# the base class is not exported (keras.distribution has its subclasses only)
Distribution: Any = keras.src.distribution.distribution_lib.Distribution

__all__ = ["recording"]


class _Recorder(Distribution):  # type: ignore[misc]
    def __init__(self, strategy: Any, previous: Any) -> None:
        super().__init__(device_mesh=None)
        self.strategy = strategy
        self.previous = previous

    def get_data_layout(self, data_shape: Any) -> Any:
        return self.previous.get_data_layout(data_shape) if self.previous else None

    def get_variable_layout(self, variable: Any) -> Any:
        object.__setattr__(variable, STRATEGY_ATTR, self.strategy)
        return self.previous.get_variable_layout(variable) if self.previous else None

    def get_tensor_layout(self, path: str) -> Any:
        return self.previous.get_tensor_layout(path) if self.previous else None

    def distribute_dataset(self, dataset: Any) -> Any:
        return self.previous.distribute_dataset(dataset) if self.previous else dataset


@contextlib.contextmanager
def recording(strategy: Any) -> Iterator[None]:
    """Mark the Keras variables created in this context with ``strategy``."""
    install()
    if getattr(strategy, "_client", None) is None:  # a stand-in on a worker: no placement
        yield
        return
    previous = keras.distribution.distribution()
    with _Recorder(strategy, previous).scope():
        yield
