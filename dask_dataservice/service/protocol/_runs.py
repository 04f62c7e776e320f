"""Run lists: which source elements a reply's elements came from, per reply (issue 25).

A tracking job (:mod:`._positions`) says where each element came from as *runs*
``(key, start, count, length)``: ``count`` source elements from ``start`` on of split ``key``,
``length`` the split's size when the run ends it, else -1. Until issue 25 every element
travelled as a ``(tag, element)`` pair and the reader recorded each tag: at scalar elements
that was 0.19-0.35x of the untracked rate (a tuple per element to size, pickle, unpickle and
record). Now a reply carries its elements untagged and, in the serialized batch's header,
one run list for all of them:

- ``header["runs"]``: the flat run list ``[key, start, count, length, ...]`` of the reply's
  elements in order, runs merged where one continues the previous (a reply of 10,000
  consecutive scalars of one split is one run);
- ``header["counts"]``: how many source elements each element stands for, run-length
  encoded as ``[count, repeat, ...]`` (scalars: ``[1, n]``; batches of 256: ``[256, n]``; a
  filter's kept element also stands for the inputs dropped before it).

The first ``k`` elements of a reply are then the first ``counts[:k]`` source elements of its
runs, so the reader keeps the runs of the batch being handed out and a cursor (the batch's
list iterator), and materialises a position only when asked (:class:`RunBatch`,
``PositionTracker.batch``). Lengths are recorded as soon as a batch arrives: knowing a split's
size early changes nothing (a split is done only once its elements are).

On the data worker a *ledger* gives the runs of the next ``n`` elements the pipeline
produced, in production order (a task's buffer hands its elements out in that order, and
each take takes its elements' runs with them): :class:`FifoLedger` when nothing above the
source drops or reorders elements (scalars, rows: no per-element work at all, the source's
segments are the runs), :class:`TagLedger` otherwise (each element's tag queued by the
pipeline thread, merged per take).

.. warning:: Readers and data workers must be the same version: an older worker's tagged
   pairs reach a newer reader as a batch without runs (``InputPositionError``), and a newer
   worker's untagged elements cannot be read by an older reader.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

__all__ = [
    "FifoLedger",
    "Ledger",
    "RunBatch",
    "TagLedger",
    "join_runs",
    "merge_tags",
    "prefix_runs",
    "source_count",
]

#: ``(runs, counts)``: a flat run list and run-length encoded per-element source counts.
Runs = tuple[list[Any], list[int]]


class Ledger(Protocol):
    """The runs of a tracking task's elements, in production order (data worker)."""

    def take(self, n: int) -> Runs:
        """The runs of the next ``n`` elements (the loop thread, after they were produced)."""


class RunBatch(list[Any]):
    """A reply's elements as the reader hands them out, with their runs (see the module)."""

    __slots__ = ("counts", "runs")

    def __init__(self, items: Iterable[Any], runs: list[Any], counts: list[int]) -> None:
        super().__init__(items)
        self.runs = runs
        self.counts = counts


def _append_run(out: list[Any], key: Any, start: int, count: int, length: int) -> None:
    """Append a run to the flat list ``out``, merged into the last where it continues it."""
    if out and out[-4] == key and out[-3] + out[-2] == start:
        out[-2] += count
        if length >= 0:
            out[-1] = length
    else:
        out.extend((key, start, count, length))


def _append_count(counts: list[int], count: int, repeat: int) -> None:
    if counts and counts[-2] == count:
        counts[-1] += repeat
    elif repeat:
        counts.extend((count, repeat))


def merge_tags(tags: Iterable[tuple[Any, ...]]) -> Runs:
    """The runs and counts of elements with these tags (flat run tuples), in order."""
    runs: list[Any] = []
    counts: list[int] = []
    for tag in tags:
        n = 0
        for i in range(0, len(tag), 4):
            key, start, count, length = tag[i:i + 4]
            _append_run(runs, key, start, count, length)
            n += count
        _append_count(counts, n, 1)
    return runs, counts


def join_runs(pieces: Iterable[Runs]) -> Runs:
    """The runs of consecutive takes, as one reply's."""
    runs: list[Any] = []
    counts: list[int] = []
    for r, c in pieces:
        for i in range(0, len(r), 4):
            _append_run(runs, *r[i:i + 4])
        for i in range(0, len(c), 2):
            _append_count(counts, c[i], c[i + 1])
    return runs, counts


def source_count(counts: list[int], k: int) -> int:
    """How many source elements the first ``k`` elements stand for."""
    total = 0
    for i in range(0, len(counts), 2):
        c, r = counts[i], counts[i + 1]
        if k <= r:
            return total + c * k
        total += c * r
        k -= r
    return total


def prefix_runs(runs: list[Any], n: int) -> Iterator[tuple[Any, int, int]]:
    """``(key, start, stop)`` of the first ``n`` source elements of ``runs``."""
    for i in range(0, len(runs), 4):
        if n <= 0:
            return
        key, start, count = runs[i], runs[i + 1], runs[i + 2]
        t = min(count, n)
        if t:
            yield key, start, start + t
            n -= t


# ---------------------------------------------------------------------------------------
# the data worker's ledgers
# ---------------------------------------------------------------------------------------


class FifoLedger:
    """Nothing above the source drops or reorders elements: the ``n`` next elements are the
    source's ``n`` next, whose runs its segment queue (``_positions._Fifo``) gives."""

    def __init__(self, take_runs: Callable[[int], tuple[Any, ...]]) -> None:
        self._take = take_runs

    def take(self, n: int) -> Runs:
        return list(self._take(n)), [1, n]


class TagLedger:
    """Each element's tag, queued by the pipeline thread before the element leaves it."""

    def __init__(self) -> None:
        self.tags: collections.deque[tuple[Any, ...]] = collections.deque()

    def untagged(self, tagged: Iterator[Any]) -> Iterator[Any]:
        """The elements of ``tagged`` (``_Tagged``), their tags queued here."""
        append = self.tags.append
        for t in tagged:
            append(t.tag)
            yield t.x

    def take(self, n: int) -> Runs:
        popleft = self.tags.popleft
        return merge_tags([popleft() for _ in range(n)])
