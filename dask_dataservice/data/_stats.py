"""Per-op figures of one iteration of a pipeline: elements, time, buffers, the bottleneck.

How it is counted
-----------------
Every op's iterator is wrapped (:meth:`PipelineStats.wrap`) in a generator that counts the
elements the op produced and times how long each ``next()`` of the op took: its *inclusive*
time (the op's own work plus the time its inputs took to hand it their elements). The first
:data:`EXACT` elements of every op are timed one by one; after that one element in
:data:`SAMPLE_EVERY` is timed and the total is extrapolated from the sampled mean. Counts are
kept in the generator's locals and published to the op's :class:`OpRecord` at each timed
element and when the iterator ends, so nothing is locked and nothing is sent per element:
whoever reads the figures (``Dataset.stats()``, the dashboard's poll) reads plain attributes.

The rule for the bottleneck
---------------------------
An op's *own* time is its inclusive time minus the inclusive time of its inputs that run in
the same thread. For an op whose input runs in a background thread (``prefetch``), the time
its consumer spent in ``next()`` is time spent *waiting* on that thread's buffer: it is
reported as ``wait_seconds`` and is not own time (the work it waited for is counted where it
ran). The **bottleneck** is the op with the largest own time (ties: the one nearest the
source); its ``share`` is its own time over the sum of every op's own time. This is what
tf.data's model and Ray Data's per-operator stats point at: the stage whose own work paces
the pipeline. For ``map(num_parallel_calls=n)`` own time is the time the pipeline waited for
the parallel calls' results (the part the parallelism did not hide).

The figures are plain data (:meth:`PipelineStats.rows`) so that a data worker ships them with
the figures the dashboard polls, and :func:`merge_rows` adds up the rows of several tasks.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: ``{root op: the figures of its latest iteration in this process}`` (``Dataset.stats()``).
LATEST: weakref.WeakKeyDictionary[Any, PipelineStats] = weakref.WeakKeyDictionary()

__all__ = ["LATEST", "PipelineStats", "OpRecord", "DatasetStats", "merge_rows", "bottleneck",
           "format_rows", "op_label", "EXACT", "SAMPLE_EVERY"]

#: The first elements of each op that are timed one by one.
EXACT = 32
#: After those, one element in this many is timed (a power of two).
SAMPLE_EVERY = 16
_MASK = SAMPLE_EVERY - 1
#: Iterators counted by their length hint instead of a wrapper (they are C code, whose time
#: is too small to measure per element: it counts in their consumer's own time).
_HINTED = frozenset(type(iter(x)) for x in (range(0), range(1 << 70), [], ()))
#: Ops whose input runs in a thread of their own: their ``next()`` time is waiting.
ASYNC_OPS = frozenset({"prefetch"})


def op_label(op: Any) -> str:
    """A readable name of an op: its method name, and its user function's name if any."""
    name = str(getattr(op, "name", type(op).__name__))
    fn = getattr(op, "fn", None) or getattr(op, "predicate", None)
    if fn is not None:
        fname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) \
            or type(fn).__name__
        return f"{name}({str(fname).rsplit('.', 1)[-1]})"
    return name


class OpRecord:
    """What one op did in one iteration (written by the thread running the op)."""

    __slots__ = ("op", "label", "index", "inputs", "elements", "timed", "timed_seconds",
                 "sampled", "sampled_seconds", "buffer", "owner", "is_root", "hinted",
                 "hinted_done")

    def __init__(self, op: Any, label: str, index: int, owner: PipelineStats) -> None:
        self.op = op
        self.owner = owner
        self.is_root = op is owner.root
        self.label = label
        self.index = index
        #: Records of this op's pipeline inputs (filled as they start).
        self.inputs: list[OpRecord] = []
        self.elements = 0
        #: Elements timed one by one (the first EXACT of each iterator), and their seconds.
        self.timed = 0
        self.timed_seconds = 0.0
        #: Elements timed by sampling, and their seconds.
        self.sampled = 0
        self.sampled_seconds = 0.0
        #: C iterators the op returned (range, list): ``[(iterator, its length then)]``,
        #: counted by their length hint, and the elements of those that ended.
        self.hinted: list[tuple[Iterator[Any], int]] = []
        self.hinted_done = 0
        #: ``() -> (elements buffered, capacity)`` for ops with a buffer.
        self.buffer: Callable[[], tuple[int, int]] | None = None

    def count(self) -> int:
        """Elements produced so far."""
        if self.hinted:
            live = []
            for it, n in list(self.hinted):
                left = operator.length_hint(it)
                if left == 0:
                    self.hinted_done += n
                else:
                    live.append((it, n))
            self.hinted = live
        return self.elements + self.hinted_done + sum(
            n - operator.length_hint(it) for it, n in self.hinted)

    def inclusive_seconds(self) -> float:
        """Seconds spent in this op's ``next()``, its inputs included (estimated)."""
        rest = self.elements - self.timed
        if rest <= 0 or self.sampled == 0:
            return self.timed_seconds
        return self.timed_seconds + rest * (self.sampled_seconds / self.sampled)


def _timed(it: Iterator[Any], rec: OpRecord) -> Iterator[Any]:
    """``it``'s elements, counted and timed into ``rec`` (see the module doc).

    A ``for`` loop over ``it`` (CPython runs a generator input without a call per element);
    a timed element's time runs from the consumer's ``next()`` (the resumption after the
    previous ``yield``) to the element's arrival in the loop.
    """
    clock = time.perf_counter
    n = 0  # elements produced by this iterator
    published = 0  # of which already added to rec.elements
    t0 = clock()
    try:
        for x in it:  # the first EXACT elements: each timed
            rec.timed_seconds += clock() - t0
            rec.timed += 1
            rec.elements += 1
            n += 1
            published = n
            yield x
            if n >= EXACT:
                break
            t0 = clock()
        else:
            rec.timed_seconds += clock() - t0  # the next() that found the end
            return
        mask = _MASK
        for x in it:  # then one in SAMPLE_EVERY
            if n & mask:
                n += 1
                yield x
            else:
                rec.elements += n - published
                published = n
                n += 1
                yield x
                t0 = clock()
                for x in it:  # noqa: B007 - one element, timed from the resumption
                    rec.sampled_seconds += clock() - t0
                    rec.sampled += 1
                    n += 1
                    yield x
                    break
    finally:
        rec.elements += n - published
        if rec.is_root:
            rec.owner.end()
        close = getattr(it, "close", None)
        if close is not None:
            close()


class PipelineStats:
    """The per-op records of one iteration (see the module doc); cheap to read any time."""

    def __init__(self, root: Any = None) -> None:
        #: The pipeline's root op (rows are ordered from its source up), if known.
        self.root = root
        self._records: dict[int, OpRecord] = {}
        self._lock = threading.Lock()  # taken once per op and iterator start, never per element
        self.started = time.time()
        self._t0 = time.perf_counter()
        self.ended: float | None = None

    def record(self, op: Any) -> OpRecord:
        rec = self._records.get(id(op))
        if rec is not None:
            return rec
        with self._lock:
            rec = self._records.get(id(op))
            if rec is None:
                rec = OpRecord(op, op_label(op), len(self._records), self)
                self._records[id(op)] = rec
                for other in self._records.values():  # link to known parents and inputs
                    if any(i is op for i in getattr(other.op, "inputs", ())):
                        other.inputs.append(rec)
                    if any(i is other.op for i in getattr(op, "inputs", ())):
                        rec.inputs.append(other)
        return rec

    def wrap(self, op: Any, it: Iterator[Any]) -> Iterator[Any]:
        """``it`` (what ``op.iterate`` returned), counted and timed as ``op``'s output."""
        rec = self.record(op)
        it = iter(it)
        if type(it) in _HINTED:  # counted by its length hint: no wrapper at all
            rec.hinted.append((it, operator.length_hint(it)))
            return it
        return _timed(it, rec)

    def watch_buffer(self, op: Any, fill: Callable[[], tuple[int, int]]) -> None:
        """Show ``op``'s buffer: ``fill()`` returns (elements buffered, capacity)."""
        self.record(op).buffer = fill

    def end(self) -> None:
        """The iteration ended (its wall time stops here)."""
        if self.ended is None and self.root is not None:
            self.ended = time.perf_counter() - self._t0

    def wall_seconds(self) -> float:
        return self.ended if self.ended is not None else time.perf_counter() - self._t0

    def rows(self) -> list[dict[str, Any]]:
        """One plain-data row per op, source first (see :func:`bottleneck` for the rule)."""
        recs = list(self._records.values())
        if self.root is not None:  # source first: the reverse of the walk from the root
            from ._base import walk

            order = {id(op): i for i, op in enumerate(reversed(list(walk(self.root))))}
            recs.sort(key=lambda r: (order.get(id(r.op), len(order)), r.index))
        out = []
        for pos, r in enumerate(recs):
            incl = r.inclusive_seconds()
            is_async = getattr(r.op, "name", "") in ASYNC_OPS
            if is_async:
                own, wait = 0.0, incl
            else:
                own = max(0.0, incl - sum(i.inclusive_seconds() for i in r.inputs))
                wait = 0.0
            fill = None
            if r.buffer is not None:
                try:
                    buffered, capacity = r.buffer()
                    fill = [int(buffered), int(capacity)]
                except Exception:  # noqa: BLE001 - a buffer that went away meanwhile
                    fill = None
            out.append({
                "index": pos, "op": r.label,
                "elements_in": sum(i.count() for i in r.inputs) if r.inputs else None,
                "elements_out": r.count(), "seconds": own, "wait_seconds": wait,
                "buffer": fill})
        return finish_rows(out)

    def snapshot(self) -> DatasetStats:
        return DatasetStats.of(self.rows(), self.wall_seconds())


def finish_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``seconds_per_element``, ``share`` and ``bottleneck`` to rows (in place)."""
    total = sum(r["seconds"] for r in rows)
    worst = bottleneck(rows)
    for r in rows:
        r["seconds_per_element"] = r["seconds"] / r["elements_out"] if r["elements_out"] else 0.0
        r["share"] = r["seconds"] / total if total > 0 else 0.0
        r["bottleneck"] = worst is not None and r["index"] == worst["index"]
    return rows


def bottleneck(rows: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The row with the largest own time (the first such, from the source); None if all 0."""
    best = None
    for r in rows:
        if r["seconds"] > 0 and (best is None or r["seconds"] > best["seconds"]):
            best = r
    return best


def merge_rows(row_lists: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Add up the rows of several iterations of the same pipeline (a job's tasks)."""
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for rows in row_lists:
        for r in rows:
            key = (int(r["index"]), str(r["op"]))
            m = merged.get(key)
            if m is None:
                merged[key] = m = {"index": key[0], "op": key[1], "elements_in": None,
                                   "elements_out": 0, "seconds": 0.0, "wait_seconds": 0.0,
                                   "buffer": None}
            if r.get("elements_in") is not None:
                m["elements_in"] = (m["elements_in"] or 0) + int(r["elements_in"])
            m["elements_out"] += int(r["elements_out"])
            m["seconds"] += float(r["seconds"])
            m["wait_seconds"] += float(r["wait_seconds"])
            if r.get("buffer") is not None:
                b = m["buffer"] or [0, 0]
                m["buffer"] = [b[0] + int(r["buffer"][0]), b[1] + int(r["buffer"][1])]
    return finish_rows([merged[k] for k in sorted(merged)])


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Text lines of a table of op rows (for ``print(ds.stats())``)."""
    head = (f"{'op':<28} {'in':>9} {'out':>9} {'time/elem':>10} {'own time':>9} "
            f"{'share':>6} {'buffer':>9}")
    lines = [head]
    for r in rows:
        buf = "" if r["buffer"] is None else f"{r['buffer'][0]}/{r['buffer'][1]}"
        ein = "" if r["elements_in"] is None else str(r["elements_in"])
        own = r["seconds"] if not r["wait_seconds"] else r["wait_seconds"]
        mark = " <- bottleneck" if r["bottleneck"] else (" (waiting)" if r["wait_seconds"] else "")
        lines.append(f"{r['op'][:28]:<28} {ein:>9} {r['elements_out']:>9} "
                     f"{_seconds(r['seconds_per_element']):>10} {_seconds(own):>9} "
                     f"{100 * r['share']:>5.0f}% {buf:>9}{mark}")
    return lines


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f}s"
    if s >= 1e-3:
        return f"{1e3 * s:.2f}ms"
    return f"{1e6 * s:.1f}us"


class DatasetStats(dict[str, Any]):
    """``Dataset.stats()``: plain data (a dict) that prints as a table, as Ray's does.

    Keys: ``ops`` (one row per op, source first: ``op``, ``elements_in``, ``elements_out``,
    ``seconds`` (own time), ``seconds_per_element``, ``share``, ``wait_seconds``, ``buffer``
    ``[buffered, capacity]`` or None, ``bottleneck``), ``bottleneck`` (the op's name or None),
    ``wall_seconds``, and for a distributed dataset the consumer's figures too.
    """

    @classmethod
    def of(cls, rows: list[dict[str, Any]], wall_seconds: float | None = None,
           **extra: Any) -> DatasetStats:
        worst = bottleneck(rows)
        out = cls(ops=rows, bottleneck=None if worst is None else worst["op"], **extra)
        if wall_seconds is not None:
            out["wall_seconds"] = wall_seconds
        return out

    def summary(self) -> str:
        lines = []
        if "wall_seconds" in self:
            lines.append(f"Last iteration: {self['wall_seconds']:.3f}s wall time")
        if "elements" in self:
            lines.append(
                f"Consumer: {self['elements']} elements in {self['passes']} passes, "
                f"{self['elements_per_second']:,.0f} elements/s, waited on the service "
                f"{100 * self['wait_fraction']:.0f}% of the time")
        for title, key in (("Local ops", "ops"), ("Service ops (all data workers)",
                                                  "service_ops")):
            rows = self.get(key)
            if rows:
                lines.append(f"{title}:")
                lines.extend("  " + line for line in format_rows(rows))
        worst = self.get("service_bottleneck") or self.get("bottleneck")
        lines.append(f"Bottleneck: {worst}" if worst else "Bottleneck: none measured yet")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
