"""One variable shard on a parameter server, and the serial lane its work runs on.

Rules
-----
- A :class:`Shard` is plain state (the working copy, optimizer slots, exactly-once records)
  with synchronous methods. It takes no lock: every method that reads or changes the value
  runs on the shard's :class:`Lane`, one at a time.
- A :class:`Lane` runs a shard's work in submission order. Work goes either inline on the
  event loop (small, and the lane idle: a scalar update costs no thread hop) or to the
  plugin's compute threads (large, or queued behind earlier work), never both at once for
  one shard. Different shards run in parallel.
- The event loop never runs numpy on a large array: the plugin decides with
  ``dataservice.ps.offload-bytes`` (see ``server.ParameterServerPlugin._on_lane``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np
import zarr

from . import _kernels

__all__ = ["Lane", "Shard"]


class Lane:
    """Serial execution of one shard's work on a shared thread pool (a "strand").

    :meth:`submit` queues ``fn(*args)`` and returns a ``concurrent.futures.Future``; at most
    one job of the lane runs at a time, in submission order. :attr:`idle` is true when
    nothing is queued or running: the only moment the owner may run work inline instead.
    """

    __slots__ = ("_executor", "_lock", "_queue", "_running")

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self._queue: deque[Any] = deque()
        self._running = False

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._running

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._queue.append((fn, args, fut))
            if self._running:
                return fut
            self._running = True
        try:
            self._executor.submit(self._drain)
        except RuntimeError as e:  # the executor is shut down (teardown)
            self.close(e)
        return fut

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                fn, args, fut = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                fut.set_exception(e)

    def close(self, error: BaseException | None = None) -> None:
        """Fail every queued job (teardown); a running one finishes."""
        with self._lock:
            queued, self._queue = list(self._queue), deque()
            self._running = False
        for _, _, fut in queued:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error or RuntimeError("the parameter server is closing"))

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + self._running


class Shard:
    """One shard: the working copy, its optimizer slots and its zarr backing array.

    Every method runs on :attr:`lane` (see the module rules); none takes a lock.
    """

    __slots__ = ("key", "value", "slots", "applied", "offset", "backing", "dirty", "exported",
                 "lane")

    def __init__(self, key: str, value: np.ndarray, offset: int = 0, lane: Lane | None = None) -> None:
        self.key = key
        #: The live value (C-contiguous, owned).
        self.value = value
        #: ``{optimizer name: {slot name: ndarray}}``.
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        #: ``{function id: highest sequence number applied}`` (exactly-once updates).
        self.applied: dict[int, int] = {}
        #: First row of this shard in the whole variable.
        self.offset = offset
        self.backing: zarr.Array[Any] | None = None
        self.dirty = True
        #: True while a reply may still be sending ``value``'s buffer (zero-copy reads):
        #: the next in-place update must first move to a fresh buffer (copy on write).
        self.exported = False
        self.lane = lane

    @property
    def rows(self) -> int:
        return self.value.shape[0] if self.value.ndim else 0

    def writable(self) -> np.ndarray:
        """The value, safe to change in place (copied first if a read exported it)."""
        if self.exported:
            self.value = self.value.copy()
            self.exported = False
        return self.value

    def fresh(self, fn_id: int | None, seq: int | None) -> bool:
        """Record ``(fn_id, seq)``; False if this shard already applied it."""
        if fn_id is None or seq is None:
            return True
        if seq <= self.applied.get(fn_id, 0):
            return False
        self.applied[fn_id] = seq
        return True

    # -- reads -------------------------------------------------------------------------------
    def read(self) -> np.ndarray:
        """The live buffer, zero-copy: the next update copies first."""
        self.exported = True
        return self.value

    def gather(self, ids: np.ndarray) -> np.ndarray:
        return _kernels.take_rows(self.value, ids)  # a copy

    def gather_into(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ``ids`` into ``out`` (a reply buffer holding several shards' rows)."""
        _kernels.take_rows(self.value, ids, out)

    def read_slots(self, optimizer: str) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.slots.get(optimizer, {}).items()}

    def snapshot(self, clean: bool = False) -> tuple[np.ndarray, dict[str, Any]]:
        """Copies of the value and slots (for flush and save); ``clean`` marks it flushed."""
        if clean:
            self.dirty = False
        return self.value.copy(), {o: {k: v.copy() for k, v in d.items()}
                                   for o, d in self.slots.items()}

    # -- updates -------------------------------------------------------------------------------
    def update(self, kind: str, delta: np.ndarray, fn_id: int | None = None, seq: int | None = None) -> bool:
        """``assign`` / ``assign_add`` / ``assign_sub`` the whole shard; False if a repeat."""
        if not self.fresh(fn_id, seq):
            return False
        # copy on write in the same pass as the update when a read exported the buffer
        self.value = _kernels.update_dense(self.value, kind, delta, copy=self.exported)
        self.exported = False
        self.dirty = True
        return True

    def scatter(self, kind: str, ids: np.ndarray, rows: np.ndarray, fn_id: int | None = None, seq: int | None = None) -> bool:
        if not self.fresh(fn_id, seq):
            return False
        _kernels.scatter_rows(self.writable(), kind, ids, rows)
        self.dirty = True
        return True

    def apply(self, optimizer: dict[str, Any], grad: np.ndarray, ids: np.ndarray | None, fn_id: int | None = None,
              seq: int | None = None) -> bool:
        """One optimizer step: dense ``grad``, or rows ``ids``; False if a repeat."""
        if not self.fresh(fn_id, seq):
            return False
        slots = self.slots.get(optimizer["name"])
        if slots is None:
            slots = self.slots[optimizer["name"]] = _kernels.new_slots(optimizer, self.value)
        if ids is None:
            _kernels.apply_dense(optimizer, self.writable(), slots, grad)
        else:
            _kernels.apply_sparse(optimizer, self.writable(), slots, ids, grad)
        self.dirty = True
        return True

    def load(self, value: np.ndarray, slots: dict[str, Any]) -> None:
        """Replace the value and slots (a restore); exactly-once records start over."""
        self.writable()[...] = value
        self.slots.update(slots)
        self.applied.clear()
        self.dirty = True

    def forget(self, below: int, above: int = 0) -> int:
        """Drop exactly-once records of functions with ids in ``[above, below)``."""
        stale = [f for f in self.applied if above <= f < below]
        for f in stale:
            del self.applied[f]
        return len(stale)
