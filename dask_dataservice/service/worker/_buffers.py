"""The buffers between a task's pipeline thread and the requests that read it.

- :class:`ElementBuffer`: a task's elements, produced by its thread and served by the event
  loop; bounded in bytes and in count (the producer blocks, the loop never does).
- :class:`RunBuffer`: the buffer of a task tracking input positions: each take also takes
  its elements' runs (issue 25, ``protocol._runs``).
- :class:`CrossTrainerWindow`: the cross-trainer cache of one task, a sliding window of recent
  elements with one cursor per trainer.
- :class:`RoundBuffer`: coordinated reads on one task: rounds of ``n`` consecutive elements,
  one per consumer.

None of them knows about Dask: the plugin (``plugin``) wires them to handlers, and
``tests/service/worker/test_buffers.py`` drives each on its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any

from ... import config
from ..._async import LoopWaker
from ...errors import DataServiceError
from ..protocol._metrics import element_size
from ..protocol._runs import Ledger, Runs
from .core import Rounds, TrainerCursors

__all__ = [
    "CrossTrainerWindow",
    "ElementBuffer",
    "RoundBuffer",
    "RunBuffer",
    "TaskCancelled",
    "element_size",
    "task_buffer",
]


class TaskCancelled(Exception):
    """Internal: the task was cancelled while its pipeline ran."""


class ElementBuffer:
    """Elements produced by a task's thread and served to consumers by the event loop.

    The producer blocks when the buffer holds ``max_bytes`` or ``max_elements``; consumers
    never block the loop: :meth:`wait` waits on an asyncio event that the producer sets
    (through a :class:`~dask_dataservice._async.LoopWaker`) only when a consumer is waiting,
    so a busy stream costs no cross-thread wake-ups.
    """

    #: Elements the producer thread hands over at once (fewer when a consumer waits).
    chunk_size = 256
    #: Whether a request queued behind another may wait to gather more elements.
    lingers = True
    #: A task tracking input positions: the ledger of its elements' runs, set by the task's
    #: thread before its pipeline produces anything (a :class:`RunBuffer` takes from it).
    ledger: Ledger | None = None
    #: The runs of what the last :meth:`take` returned (loop side): a :class:`RunBuffer`'s.
    taken_runs: Runs | None = None

    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int, max_elements: int) -> None:
        self._items: deque[Any] = deque()
        self._sizes: deque[Any] = deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._max_elements = max_elements
        #: The producer hands over at most this many elements at once: never more than the
        #: bound (a buffer of 16 elements held up to 272, and a retiring worker took that
        #: much longer to drain: issue 26).
        self.chunk_size = max(1, min(type(self).chunk_size, max_elements))
        self._cond = threading.Condition()
        self._event = asyncio.Event()
        self._waker = LoopWaker(loop, self._event.set)
        self._waiting = False
        self._closed = False
        #: Set by the producer thread when the pipeline ended (or failed).
        self.produced_all = False
        #: Set on the loop once the dispatcher knows the task finished.
        self.end_visible = False
        self.error: BaseException | None = None
        self.produced = 0
        #: Bytes (:func:`element_size`) of what the last :meth:`take` returned (loop side):
        #: the server counts a batch's bytes without sizing each element again.
        self.taken_bytes = 0

    # -- producer thread ---------------------------------------------------------------
    def put_many(self, items: list[Any], sizes: list[Any] | None = None) -> None:
        """Add elements (producer thread); blocks until :meth:`_room` says there is room.

        Raises :class:`TaskCancelled` once the buffer is closed.
        """
        if sizes is None:
            sizes = [element_size(x) for x in items]
        with self._cond:
            while not self._room() and not self._closed:
                self._cond.wait()
            if self._closed:
                raise TaskCancelled
            self._items.extend(items)
            self._sizes.extend(sizes)
            self._bytes += sum(sizes)
            self.produced += len(items)
            self._added()
            wake = self._waiting
            self._waiting = False
        if wake:
            self._waker.wake()

    def _room(self) -> bool:
        """Whether the producer may add elements now (called under the lock)."""
        return self._bytes < self._max_bytes and len(self._items) < self._max_elements

    def _added(self) -> None:
        """Hook run under the lock after elements were added."""

    @property
    def consumer_waiting(self) -> bool:
        """True while a request waits for elements (the producer should hand over at once)."""
        return self._waiting

    def finish(self, error: BaseException | None = None) -> None:
        """The pipeline ended (producer thread)."""
        with self._cond:
            self.error = error
            self.produced_all = True

    # -- event loop --------------------------------------------------------------------
    def show_end(self) -> None:
        """The dispatcher knows the task finished: consumers may now see the end."""
        self.end_visible = True
        self._event.set()

    def take(self, max_elements: int, max_bytes: int, trainer_id: str | None = None) -> list[Any]:
        """Pop up to ``max_elements`` / about ``max_bytes`` of elements (never blocks);
        ``trainer_id`` is the cross-trainer cache's (:class:`CrossTrainerWindow`)."""
        with self._cond:
            out: list[Any] = []
            taken = 0
            items, sizes = self._items, self._sizes
            while items and len(out) < max_elements and (taken < max_bytes or not out):
                size = sizes.popleft()
                out.append(items.popleft())
                taken += size
            self.taken_bytes = taken
            if out:
                self._bytes -= taken
                self._cond.notify()
            elif not self.end_visible and not self._closed:
                self._waiting = True
                self._event.clear()
            return out

    async def wait(self, timeout: float) -> None:
        """Until the producer added elements, the end became visible, or ``timeout``."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass

    def close(self) -> None:
        """Drop every element and wake the producer (which then raises TaskCancelled)."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._sizes.clear()
            self._bytes = 0
            self._cond.notify_all()
        self._waker.wake()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def empty(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


class RunBuffer(ElementBuffer):
    """The buffer of a task tracking input positions (issue 25): each :meth:`take` takes the
    runs of the elements it returns from the task's ledger (``taken_runs``), on the loop.

    The ledger gives runs in production order and the buffer hands elements out in that
    order, one take at a time on the loop: the runs taken are those of the elements taken.
    """

    def take(self, max_elements: int, max_bytes: int, trainer_id: str | None = None) -> list[Any]:
        out = super().take(max_elements, max_bytes)
        ledger = self.ledger
        self.taken_runs = ledger.take(len(out)) if out and ledger is not None else None
        return out


class CrossTrainerWindow(ElementBuffer):
    """The cross-trainer cache of one task: a window of recent elements shared by trainers.

    Every trainer (a ``trainer_id``) has its own cursor into the task's element sequence, so
    trainers with different ids all see the same elements while the pipeline produces each
    element once. Consumers with the *same* id share one cursor (they split the elements).
    The window is bounded in bytes: the oldest elements are evicted when it is full, and a
    trainer whose cursor fell out of the window skips ahead to the oldest element still
    cached, so a slow trainer never holds back a fast one. Production is driven by demand:
    the pipeline runs ahead of the fastest trainer by at most ``lookahead`` elements.
    """

    #: Elements the producer hands over at once (small: production follows demand closely).
    chunk_size = 8
    #: No lingering: a trainer's request would follow production instead of falling behind.
    lingers = False

    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int,
                 lookahead: int = 256) -> None:
        super().__init__(loop, max_bytes=max_bytes, max_elements=2**62)
        #: The trainers' positions (the worker core's logic; used under this buffer's lock).
        self.positions = TrainerCursors(lookahead)

    @property
    def skipped(self) -> int:
        """Elements trainers skipped because they fell out of the window."""
        return self.positions.skipped

    def _room(self) -> bool:
        return self.positions.has_demand(len(self._items), self._bytes, self._max_bytes,
                                         self.chunk_size)

    def _added(self) -> None:
        # the window is full: evict the oldest elements (trainers behind them skip ahead),
        # never one the fastest trainer has not read (it never skips)
        evicted = 0
        evictable = self.positions.evictable()
        while self._bytes > self._max_bytes and evicted < evictable:
            self._bytes -= self._sizes.popleft()
            self._items.popleft()
            evicted += 1
        if evicted:
            self.positions.evicted(evicted)

    def take(self, max_elements: int, max_bytes: int, trainer_id: str | None = None) -> list[Any]:
        with self._cond:
            positions = self.positions
            start = i = positions.start(trainer_id)
            out: list[Any] = []
            taken = 0
            items, sizes = self._items, self._sizes
            while i < len(items) and len(out) < max_elements and (taken < max_bytes or not out):
                out.append(items[i])
                taken += sizes[i]
                i += 1
            positions.took(trainer_id, start, len(out))
            self.taken_bytes = taken
            if out:
                self._cond.notify()  # the lead may have moved: there may be demand now
            elif not self.end_visible and not self._closed:
                self._waiting = True
                self._event.clear()
                self._cond.notify()
            return out


class RoundBuffer:
    """Coordinated reads on one task: round ``k`` is the task's elements ``k*n .. k*n+n-1``.

    Consumer ``c`` of ``n`` gets element ``c`` of each round, so in every round all
    consumers read from the same worker, consecutive elements of its stream (a pipeline
    that emits rounds of ``n`` similar elements keeps the replicas of a synchronous step in
    step). Rounds are formed in order from the task's buffer and dropped once every consumer
    took its element. Consumers may run ahead of the slowest by ``max_ahead`` rounds; past
    that they wait, and after ``timeout`` seconds they get an error naming the laggards,
    rather than waiting forever for a consumer that stopped. The round logic is the worker
    core's :class:`~.core.Rounds`; this class waits and forms rounds.
    """

    def __init__(self, buffer: ElementBuffer, num_consumers: int, timeout: float,
                 max_ahead: int = 64) -> None:
        self.buffer = buffer
        self.core = Rounds(num_consumers, max_ahead)
        self.n = num_consumers
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self._progress = asyncio.Event()

    @property
    def oldest(self) -> int:
        return self.core.oldest

    @property
    def rounds(self) -> dict[int, list[Any]]:
        return self.core.rounds

    async def _form_next(self) -> None:
        buf = self.buffer
        items: list[Any] = []
        while len(items) < self.n:
            got = buf.take(self.n - len(items), 2**62)
            items.extend(got)
            if len(items) < self.n:
                if buf.end_visible:
                    if buf.error is not None:
                        raise buf.error
                    raise DataServiceError(
                        "coordinated reads need an infinite dataset, and this one ended"
                    )
                if buf.closed:
                    raise DataServiceError("coordinated read: the task was cancelled")
                await buf.wait(0.5)
        self.core.formed(items)

    async def get(self, r: int, consumer: int) -> Any:
        """Consumer ``consumer``'s element of round ``r`` (waits for the round to form)."""
        core = self.core
        why = core.out_of_step(r, consumer)
        if why is not None:
            raise DataServiceError(why)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while core.too_far_ahead(r):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(
                    f"coordinated read: consumers {core.laggards()} have not read round "
                    f"{core.oldest} for {self.timeout:g}s; they stopped or fell behind, so "
                    f"consumer {consumer} cannot go on (rounds must be read in step)"
                )
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), remaining)
            except TimeoutError:
                pass
        async with self._lock:
            while core.must_form(r):
                await self._form_next()
        element, progressed = core.take(r, consumer)
        if progressed:
            self._progress.set()
        return element


def task_buffer(loop: asyncio.AbstractEventLoop, task: Any) -> ElementBuffer:
    """The buffer of a task (a ``TaskDef``): a :class:`CrossTrainerWindow` for the
    cross-trainer cache, a :class:`RunBuffer` for a job tracking input positions (issue 25),
    else an :class:`ElementBuffer`, bounded as the ``dataservice.worker`` config says."""
    if task.get("cross_trainer_cache"):
        return CrossTrainerWindow(loop, config.get_bytes("worker.cross-trainer-cache-bytes"))
    kind = RunBuffer if task.get("position") else ElementBuffer
    return kind(loop, config.get_bytes("worker.buffer-bytes"),
                int(config.get("worker.buffer-elements")))
