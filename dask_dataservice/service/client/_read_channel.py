"""The channel between a reader's event loop and its consumer (see :mod:`._reader`)."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from ..._async import LoopWaker

__all__ = ["END", "Channel", "Failure"]


END = object()


class Failure:
    """The error that ended a read, in the channel."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Channel:
    """Batches from the event loop to the consumer, bounded in batches.

    The loop side awaits space (:meth:`put`); a consumer thread takes with :meth:`get` and
    wakes the loop (through a :class:`~dask_dataservice._async.LoopWaker`) only when the loop
    waits for space. A consumer on the loop itself (``async for``) uses :meth:`aget`.
    :meth:`demanded` waits until the consumer took every batch and waits for the next one
    (where TensorFlow's reader decides its end of sequence: at the consumer's next call).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._size = 0
        self._capacity = capacity
        self._space = asyncio.Event()
        self._space_waker = LoopWaker(loop, self._space.set)
        self._items = asyncio.Event()  # for aget: set on every put
        self._lock = threading.Lock()
        self._want_space = False
        self._demand = asyncio.Event()
        self._demand_waker = LoopWaker(loop, self._demand.set)
        self._want_demand = False
        #: The consumer waits on an empty channel.
        self._waiting = False
        #: Batches the consumer took so far.
        self.taken = 0

    async def put(self, item: Any) -> None:
        while True:
            with self._lock:
                if self._size < self._capacity:
                    self._size += 1
                    self._q.put(item)
                    self._items.set()
                    return
                self._want_space = True
                self._space.clear()
            await self._space.wait()

    def put_nowait(self, item: Any) -> None:
        """Put past the bound (the last item of a read: the end or an error)."""
        with self._lock:
            self._size += 1
            self._q.put(item)
            self._items.set()

    def _took(self) -> None:
        with self._lock:
            self._size -= 1
            self.taken += 1
            wake = self._want_space
            self._want_space = False
        if wake:
            self._space_waker.wake()

    @property
    def queued(self) -> int:
        """Batches waiting for the consumer."""
        return self._size

    @property
    def capacity(self) -> int:
        return self._capacity

    def get(self, timeout: float | None = None) -> Any:
        """Take a batch (consumer thread); raises ``queue.Empty`` after ``timeout``."""
        try:
            item = self._q.get_nowait()
        except queue.Empty:
            self._wait_begins()
            try:
                item = self._q.get(timeout=timeout)
            finally:
                self._waiting = False
        self._took()
        return item

    def _wait_begins(self) -> None:
        with self._lock:
            self._waiting = True
            wake = self._want_demand
            self._want_demand = False
        if wake:
            self._demand_waker.wake()

    async def demanded(self) -> None:
        """Return once the consumer took every batch put so far and waits for the next (on
        the loop; the only producer, so nothing it has not put yet can satisfy the wait)."""
        while True:
            with self._lock:
                if self._size == 0 and self._waiting:
                    return
                self._want_demand = True
                self._demand.clear()
            await self._demand.wait()

    def get_nowait(self) -> Any:
        item = self._q.get_nowait()
        self._took()
        return item

    async def aget(self) -> Any:
        """Take a batch on the loop (``async for``)."""
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                self._items.clear()
                self._waiting = True
                self._demand.set()
                try:
                    await self._items.wait()
                finally:
                    self._waiting = False
                continue
            with self._lock:
                self._size -= 1
                self.taken += 1
                self._want_space = False
            self._space.set()
            return item
