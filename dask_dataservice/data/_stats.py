"""Per-op figures of one iteration of a pipeline: elements, time, buffers, the bottleneck.

How it is counted (cheap on the hot path)
------------------------------------------
- **Elements.** An op that may change the number of elements (``filter``, ``batch``, a
  source reading files...) has its iterator wrapped in a generator that only counts
  (``enumerate``; the count is read from the suspended generator's frame when someone asks,
  so nothing is written per element). An op that yields one element per input element
  (``map``, ``prefetch``, ``enumerate``) is not wrapped: it shows its input's count (minus,
  for ``prefetch``, the elements in its buffer). A C iterator (``range``, ``from_list``) is
  not wrapped either: its count is its length minus its length hint. So a pipeline such as
  ``range().map(f)`` runs with no wrapper at all.
- **Time.** A sampling thread (``dds-op-sampler``, one per process, running only while an
  iteration with figures is under way) looks at every thread's stack every
  :data:`SAMPLE_INTERVAL` seconds and charges the interval to the innermost op whose code is
  on the stack: that op's **own time** (what it did itself, its user function included, not
  what its inputs did). Nothing is timed per element; short iterations get few samples.
- **Buffers.** ``prefetch`` and parallel ``map`` show their buffer's fill (elements ready or
  calls in flight, of the most they hold), read when the figures are read.

The rule for the bottleneck
---------------------------
The **bottleneck** is the op with the largest own time (ties: the one nearest the source);
``share`` is an op's own time over the sum of every op's own time, and ``seconds_per_element``
its own time over the elements it produced. Time a ``prefetch`` consumer spends waiting on its
buffer is ``wait_seconds``, not own time (the work it waits for is charged where it runs, in
the prefetch thread). This is what tf.data's model and Ray Data's per-operator stats point at:
the stage whose own work paces the pipeline. For ``map(num_parallel_calls=n)``, the calls run
in pool threads outside any op's frame: its own time is the time the pipeline waited for their
results (the part the parallelism did not hide).

The figures are plain data (:meth:`PipelineStats.rows`) so that a data worker ships them with
the figures the dashboard polls, and :func:`merge_rows` adds up the rows of several tasks.
"""

from __future__ import annotations

import inspect
import operator
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import CodeType, FrameType
from typing import Any

#: ``{root op: the figures of its latest iteration in this process}`` (``Dataset.stats()``).
LATEST: weakref.WeakKeyDictionary[Any, PipelineStats] = weakref.WeakKeyDictionary()

__all__ = ["LATEST", "PipelineStats", "OpRecord", "DatasetStats", "merge_rows", "bottleneck",
           "format_rows", "op_label", "register_op_code", "ended_iterator", "fmt_seconds",
           "SAMPLE_INTERVAL", "ONE_TO_ONE", "counts_itself"]

#: Seconds between two samples of the threads' stacks.
SAMPLE_INTERVAL = 0.005
#: Ops whose input runs in a thread of their own: their samples are waiting.
ASYNC_OPS = frozenset({"prefetch"})
#: Ops that yield one element per input element (not wrapped: they show their input's count).
ONE_TO_ONE = frozenset({"map", "prefetch", "enumerate"})
#: Iterators counted by their length hint instead of a wrapper (C code).
_HINTED: frozenset[type] = frozenset(
    type(iter(x)) for x in (range(0), range(1 << 70), [], ()))  # type: ignore[var-annotated]
#: Code objects of generators that count their own parts (:func:`counts_itself`): not wrapped.
_SELF_COUNTED: set[CodeType] = set()
#: Ids of the code objects of ops' methods (``register_op_code``; the classes keep them
#: alive): a frame running one is that op's.
_OP_CODES: set[int] = set()


def register_op_code(cls: type) -> None:
    """Note the code of ``cls``'s methods, so a sampled frame running one is charged to the
    op (its ``self``). Called for every ``Op`` subclass."""
    for value in vars(cls).values():
        fn = getattr(value, "__wrapped__", value)
        code = getattr(fn, "__code__", None)
        if isinstance(code, CodeType) and code.co_varnames[:1] == ("self",):
            _OP_CODES.add(id(code))


def op_label(op: Any) -> str:
    """A readable name of an op: its method name, and its user function's name if any."""
    name = str(getattr(op, "name", type(op).__name__))
    fn = getattr(op, "fn", None) or getattr(op, "predicate", None)
    if fn is not None:
        fname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) \
            or type(fn).__name__
        return f"{name}({str(fname).rsplit('.', 1)[-1]})"
    return name


def counts_itself[F: Callable[..., Any]](fn: F) -> F:
    """Mark generator function ``fn`` as counting its own output (with :meth:`OpRecord.part`,
    per split): the iterator an op returns from it gets no per-element wrapper."""
    _SELF_COUNTED.add(fn.__code__)
    return fn


class OpRecord:
    """What one op did in one iteration."""

    __slots__ = ("op", "label", "index", "inputs", "counters", "counted", "hinted",
                 "samples", "buffer", "__weakref__")

    def __init__(self, op: Any, label: str, index: int) -> None:
        self.op = op
        self.label = label
        self.index = index
        #: Records of this op's pipeline inputs.
        self.inputs: list[OpRecord] = []
        #: Live counting generators (weakly: an abandoned iterator is collected and closed
        #: as without figures), and the elements of those that ended.
        self.counters: list[weakref.ref[Iterator[Any]]] = []
        self.counted = 0
        #: C iterators the op returned: ``[(iterator, its length then)]``.
        self.hinted: list[tuple[Iterator[Any], int]] = []
        #: Sampling intervals charged to this op.
        self.samples = 0
        #: ``() -> (elements buffered, capacity)`` for ops with a buffer.
        self.buffer: Callable[[], tuple[int, int]] | None = None

    def own_count(self) -> int | None:
        """Elements counted at this op itself (None: it shows its input's count)."""
        if not self.counters and not self.hinted and not self.counted:
            return None
        n = self.counted
        live = []
        for ref in self.counters:
            g = ref()
            frame = getattr(g, "gi_frame", None)
            if frame is None:  # ended: its finally added its count
                continue
            live.append(ref)
            n += int(frame.f_locals.get("n", 0))
        self.counters = live
        for it, length in self.hinted:
            n += length - operator.length_hint(it)
        return n

    def part(self, it: Iterable[Any]) -> Iterator[Any]:
        """``it``, one part of this op's output (a source's split), counted as :meth:`PipelineStats.wrap`
        counts a whole output; the parts that ended are folded into ``counted`` now and then,
        so a long iteration keeps a few entries, not one per split."""
        if len(self.hinted) + len(self.counters) > 8:
            self._fold()
        it = iter(it)
        if type(it) in _HINTED:
            self.hinted.append((it, operator.length_hint(it)))
            return it
        g = _counted(it, self)
        self.counters.append(weakref.ref(g))
        return g

    def _fold(self) -> None:
        # only the iterating thread calls this; a reader meanwhile may see a count off for
        # an instant, never a count lost (an entry leaves only once its count is in counted)
        done = [(it, n) for it, n in self.hinted if operator.length_hint(it) == 0]
        if done:
            gone = {id(it) for it, _ in done}
            self.hinted = [e for e in self.hinted if id(e[0]) not in gone]
            self.counted += sum(n for _, n in done)
        self.counters = [r for r in self.counters if getattr(r(), "gi_frame", None) is not None]

    def count(self) -> int:
        n = self.own_count()
        if n is not None:
            return n
        n = sum(i.count() for i in self.inputs)
        if self.buffer is not None and getattr(self.op, "name", "") == "prefetch":
            try:
                n -= self.buffer()[0]
            except Exception:  # noqa: BLE001 - the buffer went away
                pass
        return max(0, n)


def _counted(it: Iterator[Any], rec: OpRecord) -> Iterator[Any]:
    """``it``'s elements, counted (``n`` is read from this frame by :meth:`OpRecord.own_count`)."""
    n = 0
    try:
        for n, x in enumerate(it, 1):  # noqa: B007 - n is read from the frame
            yield x
    finally:
        rec.counted += n
        n = 0
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
        self._t0 = time.perf_counter()
        self.ended: float | None = None
        #: The root op's iterator calls :meth:`started` and :meth:`finished` itself
        #: (:meth:`take_ends`), so :func:`ended_iterator` adds nothing around it.
        self.self_ending = False
        #: :meth:`finished` ends these figures (else the caller ends them: it only unwatches).
        self.ends_own = True

    def record(self, op: Any) -> OpRecord:
        rec = self._records.get(id(op))
        if rec is not None and rec.op is op:
            return rec
        with self._lock:
            rec = self._records.get(id(op))
            if rec is None or rec.op is not op:
                rec = OpRecord(op, op_label(op), len(self._records))
                self._records[id(op)] = rec
                for other in self._records.values():  # link to known parents and inputs
                    if any(i is op for i in getattr(other.op, "inputs", ())):
                        other.inputs.append(rec)
                    if any(i is other.op for i in getattr(op, "inputs", ())):
                        rec.inputs.append(other)
        _Sampler.owner(op, self)
        return rec

    def wrap(self, op: Any, it: Iterator[Any]) -> Iterator[Any]:
        """``it`` (what ``op.iterate`` returned), counted as ``op``'s output."""
        rec = self.record(op)
        if getattr(op, "name", "") in ONE_TO_ONE or getattr(it, "gi_code", None) in _SELF_COUNTED:
            return it
        it = iter(it)
        if type(it) in _HINTED:  # counted by its length hint: no wrapper at all
            rec.hinted.append((it, operator.length_hint(it)))
            return it
        g = _counted(it, rec)
        rec.counters.append(weakref.ref(g))
        return g

    def watch_buffer(self, op: Any, fill: Callable[[], tuple[int, int]]) -> None:
        """Show ``op``'s buffer: ``fill()`` returns (elements buffered, capacity). A bound
        method is held weakly (its object must go when the iteration is abandoned)."""
        if inspect.ismethod(fill):
            method = weakref.WeakMethod(fill)

            def weak_fill() -> tuple[int, int]:
                f = method()
                return f() if f is not None else (0, 0)

            self.record(op).buffer = weak_fill
        else:
            self.record(op).buffer = fill

    def take_ends(self, op: Any) -> bool:
        """Whether ``op``, starting its iterator, is this iteration's root and so is to call
        :meth:`started` at its first element and :meth:`finished` when it ends or closes
        (it then does; :func:`ended_iterator` adds no generator of its own)."""
        if self.root is not op:
            return False
        self.self_ending = True
        return True

    def started(self) -> None:
        """The iteration's first element is asked for: the sampler watches it."""
        _Sampler.watch(self)

    def finished(self) -> None:
        """The iteration ended or was closed: end the figures (or, for figures a caller
        ends, stop sampling them)."""
        if self.ends_own:
            self.end()
        else:
            _Sampler.unwatch(self)

    def end(self) -> None:
        """The iteration ended: its wall time stops, the sampler stops watching it."""
        if self.ended is None:
            self.ended = time.perf_counter() - self._t0
        _Sampler.unwatch(self)

    def wall_seconds(self) -> float:
        return self.ended if self.ended is not None else time.perf_counter() - self._t0

    def rows(self) -> list[dict[str, Any]]:
        """One plain-data row per op, source first (see the module doc for the rule)."""
        recs = list(self._records.values())
        if self.root is not None:  # source first: the reverse of the walk from the root
            order = {id(op): i for i, op in enumerate(reversed(list(_walk(self.root))))}
            recs.sort(key=lambda r: (order.get(id(r.op), len(order)), r.index))
        out = []
        for pos, r in enumerate(recs):
            seconds = r.samples * SAMPLE_INTERVAL
            is_async = getattr(r.op, "name", "") in ASYNC_OPS
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
                "elements_out": r.count(),
                "seconds": 0.0 if is_async else seconds,
                "wait_seconds": seconds if is_async else 0.0,
                "buffer": fill})
        return finish_rows(out)

    def snapshot(self) -> DatasetStats:
        return DatasetStats.of(self.rows(), self.wall_seconds())


def _walk(op: Any) -> Iterator[Any]:
    """Every op of the pipeline rooted at ``op``, parents first (as ``_base.walk``)."""
    stack = [op]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(getattr(node, "inputs", ())))


def ended_iterator(it: Iterator[Any], stats: PipelineStats, end: bool = True) -> Iterator[Any]:
    """``it``, sampled for ``stats`` from its first element until it ends or is closed, then
    ending ``stats`` (``end``: the iteration's own figures) or only no longer sampled (figures
    a caller ends). The sampler watches only iterations under way: one that fails to start,
    or is created and never iterated, leaves no thread behind.

    A root op whose iterator does this itself (:meth:`PipelineStats.take_ends`: a read from
    the service, which sees every batch start and end) is returned as it is: no generator
    more between the consumer and its elements."""
    stats.ends_own = end
    if stats.self_ending:  # taken by the iterator just created: reset for a later iteration
        stats.self_ending = False
        return it
    return _ended(it, stats)


def _ended(it: Iterator[Any], stats: PipelineStats) -> Iterator[Any]:
    stats.started()
    try:
        yield from it
    finally:
        stats.finished()
        close = getattr(it, "close", None)
        if close is not None:
            close()


class _Sampler:
    """The process's sampling thread: charges each interval to the innermost op on each
    thread's stack (see the module doc). It runs while some iteration is watched and exits
    within an interval once none is."""

    _lock = threading.Lock()
    _watched: weakref.WeakSet[PipelineStats] = weakref.WeakSet()
    #: ``{id(op): the iteration it belongs to}`` (the latest to start it).
    _owners: weakref.WeakValueDictionary[int, PipelineStats] = weakref.WeakValueDictionary()
    _thread: threading.Thread | None = None

    @classmethod
    def watch(cls, stats: PipelineStats) -> None:
        with cls._lock:
            cls._watched.add(stats)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="dds-op-sampler",
                                               daemon=True)
                cls._thread.start()

    @classmethod
    def unwatch(cls, stats: PipelineStats) -> None:
        with cls._lock:
            cls._watched.discard(stats)

    @classmethod
    def owner(cls, op: Any, stats: PipelineStats) -> None:
        cls._owners[id(op)] = stats

    @classmethod
    def _run(cls) -> None:
        me = threading.get_ident()
        while True:
            time.sleep(SAMPLE_INTERVAL)  # the sampling clock itself, not a synchronisation
            with cls._lock:
                if not cls._watched:
                    cls._thread = None
                    return
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    _charge(frame, cls._owners)


def _charge(frame: FrameType | None, owners: Any) -> None:
    """Charge one interval to the innermost op frame of a stack (if it is watched)."""
    depth = 0
    while frame is not None and depth < 64:
        if id(frame.f_code) in _OP_CODES:
            op = frame.f_locals.get("self")
            stats = owners.get(id(op)) if op is not None else None
            if stats is not None:
                rec = stats._records.get(id(op))
                if rec is not None and rec.op is op:
                    rec.samples += 1
                    return
        frame = frame.f_back
        depth += 1


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


def fmt_seconds(s: float, sep: str = "") -> str:
    """``s`` seconds in s, ms or us (``sep`` between number and unit)."""
    if s >= 1:
        return f"{s:.2f}{sep}s"
    if s >= 1e-3:
        return f"{1e3 * s:.2f}{sep}ms"
    return f"{1e6 * s:.1f}{sep}us"


_seconds = fmt_seconds


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
