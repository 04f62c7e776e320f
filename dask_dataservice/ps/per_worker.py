"""Per-worker variables: ``Variable(..., per_worker_variable=True)`` under the strategy's scope.

TensorFlow 2.15 added variables that are *not* synchronised: each training worker has a copy
of its own, and a function scheduled on a worker reads and updates that worker's copy. Here:

- on the coordinator, the variable is a local value (TensorFlow's "coordinator instance"):
  reads and updates there act on it;
- inside a scheduled function, the first use on a training worker makes that worker's copy
  from the initial value, kept by the worker's runner plugin for the life of the worker (a
  restarted worker starts again from the initial value, as TensorFlow re-creates its
  per-worker resources);
- :meth:`PerWorkerVariable.read_all` reads every training worker's copy, in worker-index
  order (``coordinator_context.get_current_worker_index``); a worker that never used it
  answers the initial value.

Like any update in a scheduled function, per-worker updates run at least once: a function
re-run after its worker died updates the copy of the worker it re-runs on.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _routing
from ._runner_plugin import RUNNER_NAME
from ._types import Call, unwire
from .variables import Variable, current_strategy

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["PerWorkerVariable", "RUNNER_VALUES"]

#: The attribute of the training worker's runner plugin holding ``{uid: Variable}``.
RUNNER_VALUES = "per_worker_variables"


def _local(initial_value: Any, name: str, dtype: Any, shape: Any) -> Variable:
    """A plain local Variable, whatever scope is active."""
    token = current_strategy.set(None)
    try:
        return Variable(initial_value, trainable=False, name=name, dtype=dtype, shape=shape)
    finally:
        current_strategy.reset(token)


class PerWorkerVariable(Variable):
    """A variable with one copy per training worker (``per_worker_variable=True``).

    It is a :class:`Variable` everywhere: inside a scheduled function it is the copy of the
    worker running the function, on the coordinator its coordinator copy. It is never
    trainable (TensorFlow's rule) and never on a parameter server.
    """

    _uid: str
    _init: np.ndarray
    _here: Variable | None

    @classmethod
    def _create(cls, strategy: Any, initial_value: Any, name: str | None, dtype: Any,
                shape: Any) -> PerWorkerVariable:
        here = _local(initial_value, name or "Variable", dtype, shape)
        self = object.__new__(cls)
        self._init_handle(here.name, here.shape, here.dtype, False, address=None, key=None,
                          ps_index=None)
        self._uid = secrets.token_hex(8)
        self._init = here.read_value()
        self._here = here
        self._local = None
        self._lock = None
        self._owner = getattr(strategy, "_uid", None)
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_per_worker_handle, (self._uid, self._name, self._init, self._owner))

    # -- which copy --------------------------------------------------------------------------
    def _copy(self) -> Variable:
        """The copy this call acts on: the worker's in a scheduled function, else the
        coordinator's."""
        worker = getattr(_routing._thread, "worker", None)
        if worker is not None and getattr(_routing._thread, "fn", None) is not None:
            values: dict[str, Variable] = getattr(worker.extensions[RUNNER_NAME], RUNNER_VALUES)
            var = values.get(self._uid)
            if var is None:
                var = values[self._uid] = _local(self._init, self._name, None, None)
            return var
        if self._here is None:
            raise RuntimeError(
                f"per-worker variable {self._name!r} is used outside a scheduled function on "
                "a worker: use it inside functions given to ClusterCoordinator.schedule (each "
                "training worker has its copy), or read every copy with read_all()")
        return self._here

    def read_value(self) -> np.ndarray:
        return self._copy().read_value()

    def _update(self, kind: str, value: Any) -> None:
        self._copy()._update(kind, value)

    def _parts(self) -> tuple[list[Variable], list[int]]:
        return self._copy()._parts()

    def _client_uid(self) -> tuple[Client | None, str | None]:
        return None, None

    @property
    def uid(self) -> str:
        return self._uid

    @property
    def device(self) -> str:
        return ""

    def __repr__(self) -> str:
        return (f"<dds.PerWorkerVariable {self._name!r} shape={self._shape} "
                f"dtype={self._dtype}>")

    # -- every worker's copy -------------------------------------------------------------------
    def read_all(self) -> list[np.ndarray]:
        """Every training worker's copy, in worker-index order (on the coordinator)."""
        strategy = _routing.owner(self._owner)
        if strategy is None or strategy.client is None:
            raise RuntimeError(f"read_all() of per-worker variable {self._name!r} is called on "
                               "the coordinator, while its strategy is alive")
        workers = strategy._workers_by_index()
        replies = _routing.call_many(
            [Call(a, "ps_per_worker_read", {"key": self._uid}) for a in workers],
            strategy.client, self._owner)
        return [self._init.copy() if r.get("value") is None else np.asarray(unwire(r["value"]))
                for r in replies]


def _per_worker_handle(uid: str, name: str, init: np.ndarray, owner: str | None) -> Variable:
    live = _routing.owner(owner)
    if live is not None:  # back on the coordinator: the live variable
        found = live._per_worker.get(uid)
        if found is not None:
            return found  # type: ignore[no-any-return]
    self = object.__new__(PerWorkerVariable)
    self._init_handle(name, init.shape, init.dtype, False, address=None, key=None, ps_index=None)
    self._uid, self._init, self._here = uid, init, None
    self._local = None
    self._lock = None
    self._owner = owner
    return self
