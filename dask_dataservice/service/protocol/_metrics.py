"""Counters with a time series: rates over a window (dashboard, ``/metrics``, ``stats()``).

:class:`RateSeries` keeps samples ``(time, cumulative total)`` of one counter and turns them
into rates; the dashboard's poller feeds one per figure. :class:`ReadStats` is what one
:class:`~dask_dataservice.service.client.DistributedDataset` counts while it is read: elements
per data worker, time the consumer waited on the service and time it spent on its own work
between elements (what Ray's ``Dataset.stats()`` tells its users).
"""

from __future__ import annotations

import collections
import operator
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from typing import Any, TypeVar

import numpy as np

from ...data._stats import counts_itself
from ...data.structure import nbytes

__all__ = ["RateSeries", "ReadStats", "count_served", "element_size", "percentiles",
           "wait_history"]

T = TypeVar("T")

_SCALARS = (int, float, bool, complex)


def element_size(x: Any) -> int:
    """Bytes an element holds (8 for a scalar), for the buffers' byte bounds."""
    t = type(x)
    if t is np.ndarray:
        return int(x.nbytes)
    if t in _SCALARS or isinstance(x, np.generic):
        return 8
    return nbytes(x)


class RateSeries:
    """Samples of one cumulative counter, and the rates between them.

    >>> s = RateSeries()
    >>> s.add(0.0, 0); s.add(1.0, 10); s.add(2.0, 30)
    >>> s.rate(window=10.0)
    15.0
    >>> s.rates()
    [(1.0, 10.0), (2.0, 20.0)]
    """

    __slots__ = ("_samples",)

    def __init__(self, maxlen: int = 600) -> None:
        if maxlen < 2:
            raise ValueError(f"maxlen must be at least 2, got {maxlen}")
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=maxlen)

    def add(self, t: float, total: float) -> None:
        """Record the counter's ``total`` at time ``t`` (a counter that went down restarted:
        its samples before are dropped, so that no rate is negative)."""
        if self._samples and (t <= self._samples[-1][0] or total < self._samples[-1][1]):
            if total < self._samples[-1][1]:
                self._samples.clear()
            else:  # the same instant again: keep the newest value
                self._samples.pop()
        self._samples.append((t, float(total)))

    @property
    def total(self) -> float:
        """The last total recorded (0.0 before any)."""
        return self._samples[-1][1] if self._samples else 0.0

    def rate(self, window: float = 5.0) -> float:
        """Mean rate per second over the last ``window`` seconds (0.0 with one sample)."""
        if len(self._samples) < 2:
            return 0.0
        t1, v1 = self._samples[-1]
        t0, v0 = self._samples[-2]
        for t, v in reversed(self._samples):
            if t1 - t > window:
                break
            t0, v0 = t, v
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0

    def rates(self) -> list[tuple[float, float]]:
        """``[(time, rate since the previous sample)]`` for every sample but the first."""
        s = list(self._samples)
        return [(t1, (v1 - v0) / (t1 - t0)) for (t0, v0), (t1, v1) in zip(s, s[1:], strict=False)]


class ReadStats:
    """What one distributed dataset saw while being read (thread-safe; see ``stats()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_worker: dict[str, list[int]] = {}
        self.elements = 0
        self.passes = 0
        self.wait_seconds = 0.0
        self.compute_seconds = 0.0
        self._first: float | None = None
        self._last: float | None = None
        #: The iteration the latest pass reads (its job's per-op figures, from the scheduler).
        self.iteration_id: int | None = None
        #: Seconds the consumer waited for each of its latest batches.
        self._waits: collections.deque[float] = collections.deque(maxlen=1024)
        #: ``(time, wait_seconds, compute_seconds)`` samples, at most one per HISTORY_STEP.
        self._history: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=600)

    def received(self, address: str, elements: int, nbytes: int = 0) -> None:
        """The reader got ``elements`` (``nbytes``) from the data worker at ``address``."""
        with self._lock:
            counts = self._by_worker.setdefault(address, [0, 0, 0])
            counts[0] += elements
            counts[1] += nbytes
            counts[2] += 1

    # counts per batch (``counted``) and, as the root, starts and ends its figures: the figures
    # put no generator on the consumer's elements (two cost a scalar read 10-15%)
    @counts_itself
    def wrap(self, batches: Iterator[list[T]], progress: Any = None,
             counted: Any = None, figures: Any = None,
             on_batch: Callable[[list[T], Iterator[T]], None] | None = None) -> Iterator[T]:
        """The elements of ``batches`` (lists, as the reader takes them from its channel),
        timing how long each ``next(batches)`` waited (the service) and how long the consumer
        took over a batch's elements before asking for the next (its own work).

        Timed and counted per batch, not per element: two clock reads and one lock round per
        batch, and none per element, so that a scalar element costs the consumer what a
        list's element costs (issue 22: per-element timing had cut one consumer's scalar
        throughput in half). The element count of the batch being read grows when the
        consumer asks for the next batch or stops (the elements it took, the one it holds
        included). ``progress``: a tqdm-like bar, updated per batch and closed at the end.
        ``counted``: the pass's per-op record (``data._stats.OpRecord``), whose ``counted``
        grows per batch too (so no counting wrapper sits on the elements). ``figures``: the
        pass's ``data._stats.PipelineStats`` when this pass is its root, started at the
        first element and finished at the end (so no generator more sits on them either).
        ``on_batch(batch, elements)``: called as the consumer starts on a batch, with the
        iterator that hands its elements out (a tracking read's cursor, issue 25).
        """
        clock = time.perf_counter
        with self._lock:
            self.passes += 1
        if figures is not None:
            figures.started()
        try:
            while True:
                t0 = clock()
                try:
                    batch = next(batches)
                except StopIteration:
                    self._account(t0, clock(), 0.0, 0)
                    return
                t1 = clock()
                elements = iter(batch)
                if on_batch is not None:
                    on_batch(batch, elements)
                try:
                    yield from elements
                finally:  # the consumer had the batch until now (also when it stops here)
                    n = len(batch) - operator.length_hint(elements)
                    self._account(t0, t1, clock() - t1, n)
                    if counted is not None:
                        counted.counted += n
                    if progress is not None:
                        progress.update(n)
        finally:  # a consumer that stops early closes the read (it releases its job)
            if figures is not None:
                figures.finished()
            if progress is not None:
                progress.close()
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    async def awrap(self, batches: AsyncIterator[list[T]],
                    on_batch: Callable[[list[T], Iterator[T]], None] | None = None,
                    ) -> AsyncIterator[T]:
        """:meth:`wrap` for ``async for``."""
        clock = time.perf_counter
        with self._lock:
            self.passes += 1
        try:
            while True:
                t0 = clock()
                try:
                    batch = await anext(batches)
                except StopAsyncIteration:
                    self._account(t0, clock(), 0.0, 0)
                    return
                t1 = clock()
                taken = 0
                elements = iter(batch)
                if on_batch is not None:
                    on_batch(batch, elements)
                try:
                    for x in elements:
                        taken += 1
                        yield x
                finally:
                    self._account(t0, t1, clock() - t1, taken)
        finally:
            aclose = getattr(batches, "aclose", None)
            if aclose is not None:
                await aclose()

    def _account(self, t0: float, t1: float, computing: float, n: int) -> None:
        with self._lock:
            self.wait_seconds += t1 - t0
            if n:
                self._waits.append(t1 - t0)
            if not self._history or t1 - self._history[-1][0] >= HISTORY_STEP:
                self._history.append((t1, self.wait_seconds, self.compute_seconds + computing))
            self.compute_seconds += computing
            self.elements += n
            if self._first is None:
                self._first = t0
            self._last = t1 + computing

    def snapshot(self) -> dict[str, Any]:
        """Plain data: totals, throughput, wait vs compute, and counts per data worker."""
        with self._lock:
            elapsed = (self._last - self._first) if self._first is not None and \
                self._last is not None else 0.0
            busy = self.wait_seconds + self.compute_seconds
            return {
                "elements": self.elements,
                "passes": self.passes,
                "elapsed_seconds": elapsed,
                "elements_per_second": self.elements / elapsed if elapsed > 0 else 0.0,
                "wait_seconds": self.wait_seconds,
                "compute_seconds": self.compute_seconds,
                "wait_fraction": self.wait_seconds / busy if busy > 0 else 0.0,
                "workers": {a: {"elements": c[0], "bytes": c[1], "batches": c[2]}
                            for a, c in sorted(self._by_worker.items())},
                "wait_per_batch_seconds": percentiles(self._waits),
                "wait_fraction_history": wait_history(list(self._history)),
            }


#: Seconds between two samples of the consumer's wait/compute history.
HISTORY_STEP = 0.5


def percentiles(values: Collection[float]) -> dict[str, float] | None:
    """p50, p90, p99 and the count of a sample (None when empty)."""
    ordered = sorted(values)
    if not ordered:
        return None

    def pick(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "count": len(ordered)}


def wait_history(samples: list[tuple[float, float, float]]) -> dict[str, list[float]]:
    """The consumer's input-bound share per interval between samples ``(time, cumulative
    wait, cumulative compute)``: ``{"time": [...], "wait_fraction": [...]}`` (times in
    seconds since the first sample)."""
    times, fractions = [], []
    for (_t0, w0, c0), (t1, w1, c1) in zip(samples, samples[1:], strict=False):
        busy = (w1 - w0) + (c1 - c0)
        times.append(t1 - samples[0][0])
        fractions.append((w1 - w0) / busy if busy > 0 else 0.0)
    return {"time": times, "wait_fraction": fractions}


def count_served(stats: dict[str, int], by_task: dict[int, list[int]],
                 live: Collection[int], task_id: int, elements: int, nbytes: int) -> None:
    """A data worker served ``elements`` elements of task ``task_id``, ``nbytes`` bytes (their
    :func:`element_size`, which the buffer knows: no pass over the elements here): count them
    for the worker (``stats``) and per task (``by_task``, ``{task_id: [elements, bytes]}``;
    tasks not in ``live`` are forgotten once it grows past a bound)."""
    stats["elements_served"] = stats.get("elements_served", 0) + elements
    stats["bytes_served"] = stats.get("bytes_served", 0) + nbytes
    counts = by_task.setdefault(task_id, [0, 0])
    counts[0] += elements
    counts[1] += nbytes
    if len(by_task) > 4 * (len(live) + 16):  # forget tasks that are gone
        for tid in [t for t in by_task if t not in live]:
            del by_task[tid]
