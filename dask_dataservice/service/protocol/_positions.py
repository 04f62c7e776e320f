"""Input positions of data-service jobs (issue 13, section 2): where a reader was, exactly.

A distributed dataset read with ``track_position=True`` (:func:`.client.from_dataset_id`,
:func:`.client.distribute`) runs its job in *tracking* mode:

- **Provenance, on the data workers.** The task's pipeline is rebuilt over a tagged source
  (:func:`tracked_elements`): each element's *tag* is a flat tuple of *runs*
  ``(key, start, count, length)``: ``count`` source elements from ``start`` on of split
  ``key`` (DYNAMIC: the split's index; OFF: the data worker's name), ``length`` the split's
  size when this element ends it, else -1. ``map`` keeps its input's tag, ``filter`` gives
  an element the tags of the inputs it dropped before it (the *consumed* inputs, so a split
  whose last elements are filtered out still completes), ``batch`` the runs of all its
  inputs (a batch may span splits), ``shuffle`` and ``prefetch`` move tags with their
  elements. Any other op cannot say which source elements an element came from: the job
  refuses to start, naming the op (:class:`InputPositionError`). Between the source and
  the first op that may drop or reorder elements, no tag travels: the source counts its
  splits' elements in C into a :class:`_Fifo` of segments, and the first other op (a batch,
  or a tagger) takes its inputs' runs from it in order.
- **On the wire** (issue 25, :mod:`._runs`): elements leave the worker untagged; each reply
  carries one run list for all its elements (merged runs plus per-element source counts),
  taken from a ledger as the buffer hands the elements out. A pipeline with nothing above
  the source that drops or reorders elements has no tags at all: the ledger is the fifo.
- **The position, on the reader.** :class:`PositionTracker` keeps the runs of the batch
  being handed out and the batch's cursor (its list iterator), so at any quiet point
  (after a join) the position says exactly which source elements the consumer was given,
  the element it holds included: per key, ranges of indices, and the splits (DYNAMIC) or
  workers (OFF) delivered completely. It is a small JSON value (:func:`check_position`
  says what a valid one is).
- **Restoring.** A job started from a position (``DistributedDataset.start_from``) tells its
  data workers the position; a worker skips a split that is done, and the indices already
  delivered of any other (DYNAMIC), or the indices of its own name (OFF). Positions of
  several consumers of one shared job are merged (their union) by :func:`merge_positions`.

Exactness needs a deterministic pipeline per split (the same split gives the same elements:
seeded shuffles, deterministic maps), as every replay does.
"""

from __future__ import annotations

import bisect
import collections
import copy
import hashlib
import itertools
import json
import operator
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ...data._base import IterContext, Op
from ...data.ops import Batch, Filter, Map, PaddedBatch, Prefetch, Shuffle
from ...data.sources import Source
from ...data.splits import ListSplitProvider, SplitProvider
from ...errors import InputPositionError
from ._runs import FifoLedger, Ledger, RunBatch, TagLedger, prefix_runs, source_count
from ._sharding import ShardingPolicy

__all__ = [
    "InputPositionError",
    "PositionTracker",
    "check_position",
    "job_field",
    "merge_positions",
    "tracked_elements",
]

#: Version of the position format (``position["format"]``).
FORMAT = 1
#: The policies positions exist for.
POLICIES = ("DYNAMIC", "OFF")

Ranges = list[list[int]]


# ---------------------------------------------------------------------------------------
# ranges of indices: sorted, disjoint, half-open [start, stop)
# ---------------------------------------------------------------------------------------


def add_range(ranges: Ranges, start: int, stop: int) -> None:
    """Add ``[start, stop)`` to ``ranges`` in place, merging neighbours."""
    if stop <= start:
        return
    if not ranges or ranges[-1][1] < start:  # the common case: appending
        ranges.append([start, stop])
        return
    if ranges[-1][1] == start:
        ranges[-1][1] = stop
        return
    i = bisect.bisect_left(ranges, [start, start])
    if i > 0 and ranges[i - 1][1] >= start:
        i -= 1
    j = i
    while j < len(ranges) and ranges[j][0] <= stop:
        start, stop = min(start, ranges[j][0]), max(stop, ranges[j][1])
        j += 1
    ranges[i:j] = [[start, stop]]


def _union(a: Ranges, b: Ranges) -> Ranges:
    out = [list(r) for r in a]
    for s, e in b:
        add_range(out, s, e)
    return out


def _as_ranges(values: Iterable[int]) -> Ranges:
    out: Ranges = []
    for v in sorted(values):
        add_range(out, v, v + 1)
    return out


def _covered(ranges: Ranges, index: int) -> bool:
    i = bisect.bisect_right(ranges, [index, float("inf")]) - 1
    return i >= 0 and ranges[i][0] <= index < ranges[i][1]


# ---------------------------------------------------------------------------------------
# the position value
# ---------------------------------------------------------------------------------------


def check_position(position: Any, fingerprint: str | None = None,
                   policy: str | None = None) -> dict[str, Any]:
    """``position`` checked and normalised; :class:`InputPositionError` says what is wrong.

    A position is ``{"format": 1, "policy": "DYNAMIC" or "OFF", "dataset": fingerprint,
    "done": ..., "partial": {key: [[start, stop], ...]}}``; ``done`` is ranges of split
    indices (DYNAMIC) or a list of data-worker names (OFF). With ``fingerprint`` or
    ``policy``, the position must be one of that dataset, read in that policy.
    """
    if not isinstance(position, dict):
        raise InputPositionError(
            f"an input position is a dict (from DistributedDataset.input_position()), got "
            f"{type(position).__name__} {position!r:.60}")
    missing = {"format", "policy", "dataset", "done", "partial"} - set(position)
    if missing:
        raise InputPositionError(f"not an input position: it has no {sorted(missing)} "
                                 f"(got keys {sorted(map(str, position))})")
    if position["format"] != FORMAT:
        raise InputPositionError(f"input position format {position['format']!r} is not "
                                 f"supported (this version reads format {FORMAT})")
    if position["policy"] not in POLICIES:
        raise InputPositionError(f"input position policy must be one of {POLICIES}, got "
                                 f"{position['policy']!r}")
    if fingerprint is not None and position["dataset"] != fingerprint:
        raise InputPositionError(
            "the input position is one of another dataset: it was saved for the pipeline "
            f"with fingerprint {position['dataset']!r}, this dataset's is {fingerprint!r} "
            "(a changed pipeline, split size or source)")
    if policy is not None and position["policy"] != policy:
        raise InputPositionError(f"the input position was saved reading in processing mode "
                                 f"{position['policy']}, this job reads in {policy}")
    dynamic = position["policy"] == "DYNAMIC"
    done = position["done"]
    if dynamic:
        done = _check_ranges(done, "done")
    elif not (isinstance(done, list | tuple) and all(isinstance(n, str) for n in done)):
        raise InputPositionError(f"an OFF input position's 'done' is a list of data-worker "
                                 f"names, got {done!r:.60}")
    partial = position["partial"]
    if not isinstance(partial, dict):
        raise InputPositionError(f"an input position's 'partial' is a dict, got {partial!r:.60}")
    if dynamic and not all(str(k).isdigit() for k in partial):
        raise InputPositionError(f"a DYNAMIC input position's 'partial' keys are split "
                                 f"indices, got {sorted(map(str, partial))[:5]}")
    return {"format": FORMAT, "policy": position["policy"], "dataset": position["dataset"],
            "done": done if dynamic else sorted(set(done)),
            "partial": {str(k): _check_ranges(v, f"partial[{k!r}]") for k, v in partial.items()}}


def _check_ranges(value: Any, where: str) -> Ranges:
    ok = isinstance(value, list | tuple) and all(  # tuples: after a msgpack round trip
        isinstance(r, list | tuple) and len(r) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        and 0 <= r[0] < r[1] for r in value)
    if not ok:
        raise InputPositionError(f"an input position's {where} must be a list of [start, "
                                 f"stop) index pairs with 0 <= start < stop, got {value!r:.60}")
    return _union([], [list(r) for r in value])


def merge_positions(positions: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of the positions of the consumers of one job (all of one dataset)."""
    checked = [check_position(p) for p in positions]
    if not checked:
        raise InputPositionError("no input position to merge")
    first = checked[0]
    for p in checked[1:]:
        check_position(p, first["dataset"], first["policy"])
    merged: dict[str, Any] = dict(first, partial={})
    for p in checked[1:]:
        if first["policy"] == "DYNAMIC":
            merged["done"] = _union(merged["done"], p["done"])
        else:
            merged["done"] = sorted(set(merged["done"]) | set(p["done"]))
    partial: dict[str, Ranges] = {}
    for p in checked:
        for k, r in p["partial"].items():
            partial[k] = _union(partial.get(k, []), r)
    merged["partial"] = partial
    return _compact(merged, {})


def _compact(position: dict[str, Any], lengths: dict[str, int]) -> dict[str, Any]:
    """Move keys whose ranges cover their whole length into ``done``; drop done partials."""
    dynamic = position["policy"] == "DYNAMIC"
    done = position["done"]
    partial = {}
    for k, r in position["partial"].items():
        n = lengths.get(k)
        complete = n is not None and r == [[0, n]]
        if dynamic:
            if complete:
                add_range(done, int(k), int(k) + 1)
            elif not _covered(done, int(k)):
                partial[k] = r
        elif complete:
            done = sorted(set(done) | {k})
        elif k not in done:
            partial[k] = r
    return dict(position, done=done, partial=partial)


def job_field(start: dict[str, Any] | None, nonce: str = "") -> str:
    """The ``CreateJob.position`` text of a tracking job (canonical JSON)."""
    return json.dumps({"start": start, "nonce": nonce}, sort_keys=True, separators=(",", ":"))


def job_suffix(field: str) -> str:
    """What a tracking job's name ends with: tracking and plain readers never share a job,
    and a job started from a position is another job than one started from another."""
    return "#position-" + hashlib.sha256(field.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# the reader's side
# ---------------------------------------------------------------------------------------


class PositionTracker:
    """What one consumer was given of a tracking job (plus the position it started from).

    :meth:`batch` runs in the consumer's thread as it starts on each reply's elements
    (:class:`~._runs.RunBatch`); the batch's list iterator is the cursor: whatever it has
    handed out was given. :meth:`position` may run in any thread.
    """

    def __init__(self, policy: str, fingerprint: str, start: dict[str, Any] | None) -> None:
        self.policy = policy
        self.fingerprint = fingerprint
        base = start or {"format": FORMAT, "policy": policy, "dataset": fingerprint,
                         "done": [], "partial": {}}
        base = check_position(base, fingerprint, policy)
        self._done = base["done"]
        self._ranges: dict[Any, Ranges] = {}
        for k, r in base["partial"].items():
            self._ranges[int(k) if policy == "DYNAMIC" else k] = r
        self._lengths: dict[str, int] = {}
        self._lock = threading.Lock()
        #: Elements of the batches before the current one (all handed out).
        self._folded = 0
        #: The batch being handed out and its cursor (the iterator handing it out).
        self._current: RunBatch | None = None
        self._cursor: Iterator[Any] | None = None

    @property
    def elements(self) -> int:
        """Elements handed out so far."""
        with self._lock:
            return self._folded + self._taken()

    def batch(self, batch: list[Any], cursor: Iterator[Any]) -> None:
        """The consumer starts on ``batch`` (the previous one was handed out whole), whose
        elements ``cursor`` hands out (an iterator with a length hint: a list's)."""
        if not isinstance(batch, RunBatch):
            raise InputPositionError(
                "a reply of a tracking job came without its run list: the data worker runs "
                "an older version of dask_dataservice than this reader (readers and data "
                "workers tracking input positions must be the same version)")
        with self._lock:
            current = self._current
            if current is not None:
                self._add(current, len(current) - operator.length_hint(self._cursor))
            self._current, self._cursor = batch, cursor
            runs = batch.runs
            lengths = self._lengths
            for i in range(3, len(runs), 4):  # known at once: it marks nothing done early
                if runs[i] >= 0:
                    lengths[str(runs[i - 3])] = runs[i]

    def _taken(self) -> int:
        current = self._current
        return 0 if current is None else len(current) - operator.length_hint(self._cursor)

    def _add(self, batch: RunBatch, k: int, ranges: dict[Any, Ranges] | None = None) -> None:
        """Record the first ``k`` elements of ``batch`` into ``ranges`` (default: the
        tracker's own, folding the batch: it is done with)."""
        if ranges is None:
            ranges = self._ranges
            self._folded += k
        for key, start, stop in prefix_runs(batch.runs, source_count(batch.counts, k)):
            r = ranges.get(key)
            if r is None:
                ranges[key] = [[start, stop]]
            else:
                add_range(r, start, stop)  # the common case: the key's last range grows

    def position(self) -> dict[str, Any]:
        with self._lock:
            ranges = {k: [list(x) for x in r] for k, r in self._ranges.items()}
            if self._current is not None:
                self._add(self._current, self._taken(), ranges)
            partial = {str(k): r for k, r in ranges.items()}
            done = [list(x) for x in self._done] if self.policy == "DYNAMIC" else list(self._done)
            lengths = dict(self._lengths)
        return _compact({"format": FORMAT, "policy": self.policy, "dataset": self.fingerprint,
                         "done": done, "partial": partial}, lengths)


# ---------------------------------------------------------------------------------------
# the data worker's side: the pipeline over a tagged source
# ---------------------------------------------------------------------------------------


class _Tagged:
    __slots__ = ("tag", "x")

    def __init__(self, tag: tuple[Any, ...], x: Any) -> None:
        self.tag = tag
        self.x = x


class _Segment:
    """Consecutive source elements of one split, as the source produced them."""

    __slots__ = ("key", "start", "count", "taken", "closed", "length", "told")

    def __init__(self, key: Any, start: int) -> None:
        self.key = key
        self.start = start
        self.count = 0  # produced; final once closed (an open segment may have produced more)
        self.taken = 0  # attributed to outputs
        self.closed = False  # the source went on to another segment (or ended)
        self.length = -1  # the split's length, once the source reached its end
        self.told = False  # the length went out with a run


class _Fifo:
    """The source's segments in production order; outputs take their inputs' runs from it.

    Between the source and the first op that may drop or reorder elements only 1:1,
    order-keeping ops run (deterministic maps, prefetch), so the j-th element reaching
    the taker is the source's j-th: no tag travels with elements there. The source may run
    in another thread (a prefetch), and so may the taker (a :class:`~._runs.FifoLedger`
    takes on the worker's event loop, for elements the task's buffer handed out): the
    source closes a segment (its count final) before it produces anything after it, and the
    taker only attributes elements that were produced.
    """

    def __init__(self) -> None:
        self.segments: collections.deque[_Segment] = collections.deque()

    def open(self, key: Any, start: int) -> _Segment:
        if self.segments:
            self.segments[-1].closed = True
        seg = _Segment(key, start)
        self.segments.append(seg)
        return seg

    def take(self, n: int) -> tuple[Any, ...]:
        """The runs of the next ``n`` source elements."""
        out: list[Any] = []
        segments = self.segments
        while n:
            seg = segments[0]
            t = min(seg.count - seg.taken, n) if seg.closed else n
            if t > 0:
                end = seg.closed and seg.taken + t == seg.count and seg.length >= 0
                out.extend((seg.key, seg.start + seg.taken, t, seg.length if end else -1))
                seg.told = seg.told or end
                seg.taken += t
                n -= t
            if seg.closed and seg.taken == seg.count:
                segments.popleft()
                if not seg.told and seg.length > 0:  # its end came after its last element left
                    out.extend((seg.key, seg.start + seg.count, 0, seg.length))
        return tuple(out)


class _TaggedSource(Op):
    """The pipeline's source, read split by split (DYNAMIC) or whole (OFF); what the start
    position says was delivered is skipped. Elements leave it untagged: their runs go to
    the :class:`_Fifo`."""

    name = "input_position_source"

    def __init__(self, source: Op, provider: SplitProvider | None, key: str,
                 start: dict[str, Any] | None, fifo: _Fifo) -> None:
        self.source = source
        self.provider = provider
        self.key = key
        self.done: Any = (start or {}).get("done", [])
        self.partial: dict[str, Ranges] = (start or {}).get("partial", {})
        self.fifo = fifo

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        provider = self.provider
        if provider is None:  # OFF: the whole source, under this worker's name
            if self.key in self.done:
                return
            yield from _split_elements(self.source.iterate(IterContext()), self.key,
                                       self.partial.get(self.key, []), self.fifo)
            return
        while True:
            split = provider.get_next()
            if split is None:
                return
            index = getattr(provider, "last_index", None)
            if index is None:
                raise InputPositionError("the split provider does not say split indices")
            if _covered(self.done, index):
                continue
            yield from _split_elements(self._read(split), index,
                                       self.partial.get(str(index), []), self.fifo)

    def _read(self, split: Any) -> Iterator[Any]:
        """One split's elements: straight from a plain :class:`Source`'s ``read_split``
        (what its ``iterate`` yields from; a ``range()`` or list split is then an iterator
        of known length: counted with no wrapper), else through ``iterate``."""
        source = self.source
        if isinstance(source, Source) and isinstance(split, source.split_type):
            kind = type(source)
            if (kind.iterate is Source.iterate
                    and kind._iterate_provider is Source._iterate_provider):
                return source.read_split(split)
        return source.iterate(IterContext(split_provider=ListSplitProvider([split])))


#: Iterators whose length hint is their exact length (ranges, lists, tuples).
_SIZED: frozenset[type] = frozenset(
    type(iter(x)) for x in (range(0), range(1 << 70), [], ()))  # type: ignore[var-annotated]


def _split_elements(it: Iterator[Any], key: Any, skip: Ranges, fifo: _Fifo) -> Iterator[Any]:
    """One split's elements, but those in ``skip``; their runs are counted in ``fifo``."""
    if not skip and type(it) in _SIZED:  # issue 25: the count is known: no wrapper at all
        seg = fifo.open(key, 0)
        seg.count = seg.length = operator.length_hint(it)
        seg.closed = True
        yield from it
        return
    if not skip:  # the common case: counted in C, not element by element in Python
        seg = fifo.open(key, 0)
        counter = itertools.count()
        counted = map(_first, zip(it, counter, strict=False))
        # one element of look-ahead (pairwise): the split's end is known, and the segment
        # closed, before its last element leaves
        ahead = itertools.pairwise(itertools.chain(counted, _close(seg, counter)))
        yield from map(_first, ahead)
        return
    current: _Segment | None = None
    n = j = 0
    for i, x in enumerate(it):
        n = i + 1
        while j < len(skip) and skip[j][1] <= i:
            j += 1
        if j < len(skip) and skip[j][0] <= i:
            continue
        if current is None or current.start + current.count != i:
            current = fifo.open(key, i)
        current.count += 1
        yield x
    if current is not None:
        current.length = n
        current.closed = True


_first = operator.itemgetter(0)


def _close(seg: _Segment, counter: Iterator[int]) -> Iterator[Any]:
    """Runs when the split's iterator ended: the segment's count (the split's length)."""
    seg.count = seg.length = next(counter)
    seg.closed = True
    yield None  # the look-ahead's partner of the last element (never handed out)


class _FifoTag(Op):
    """Tags each element with its source run (from the :class:`_Fifo`)."""

    name = "input_position_tag"

    def __init__(self, input: Op, fifo: _Fifo) -> None:
        self.input = input
        self.inputs = (input,)
        self.fifo = fifo

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        take = self.fifo.take
        segments = self.fifo.segments
        for x in self.input.iterate(ctx):
            seg = segments[0]
            if not seg.closed or seg.taken + 1 < seg.count:  # inline: not a segment's last
                tag: tuple[Any, ...] = (seg.key, seg.start + seg.taken, 1, -1)
                seg.taken += 1
            else:
                tag = take(1)
            yield _Tagged(tag, x)


class _FifoBatch(Op):
    """``batch`` over untagged, in-order inputs: a batch's runs come from the fifo."""

    name = "batch"

    def __init__(self, input: Op, op: Batch, fifo: _Fifo) -> None:
        self.input = input
        self.inputs = (input,)
        self.op = op
        self.fifo = fifo

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        n = self.op.batch_size
        it = self.input.iterate(ctx)
        islice = itertools.islice
        while True:
            items = list(islice(it, n))
            if not items or (len(items) < n and self.op.drop_remainder):
                return
            yield _Tagged(self.fifo.take(len(items)), self.op._stack(items))
            if len(items) < n:
                return


class _TagMap:
    """A map function over tagged elements (the tag passes through)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
        self.__module__ = getattr(fn, "__module__", None) or __name__

    def __call__(self, t: _Tagged) -> _Tagged:
        x = t.x
        return _Tagged(t.tag, self.fn(*x) if type(x) is tuple else self.fn(x))


class _TaggedFilter(Op):
    name = "filter"

    def __init__(self, input: Op, op: Filter) -> None:
        self.input = input
        self.inputs = (input,)
        self.op = op

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        pred = self.op.predicate
        pending: tuple[Any, ...] = ()  # tags of the inputs dropped since the last output
        for t in self.input.iterate(ctx):
            x = t.x
            try:
                keep = pred(*x) if type(x) is tuple else pred(x)
            except Exception as e:
                if ctx.ignored(e):
                    continue
                raise
            if keep:
                yield _Tagged(pending + t.tag, x) if pending else t
                pending = ()
            else:
                pending += t.tag


class _TaggedBatch(Op):
    name = "batch"

    def __init__(self, input: Op, op: Batch) -> None:
        self.input = input
        self.inputs = (input,)
        self.op = op

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        n = self.op.batch_size
        it = self.input.iterate(ctx)
        while True:
            items = [t for _, t in zip(range(n), it, strict=False)]
            if not items or (len(items) < n and self.op.drop_remainder):
                return
            yield _Tagged(_batch_runs(items), self.op._stack([t.x for t in items]))
            if len(items) < n:
                return


def _batch_runs(items: list[_Tagged]) -> tuple[Any, ...]:
    """The runs of a batch's inputs, merged where one continues the previous (in linear
    time: a batch of 256 consecutive elements of a split is one run)."""
    out: list[Any] = []
    for t in items:
        tag = t.tag
        for i in range(0, len(tag), 4):
            key, start, count, length = tag[i:i + 4]
            if out and out[-4] == key and out[-3] + out[-2] == start:
                out[-2] += count
                if length >= 0:
                    out[-1] = length
            else:
                out.extend((key, start, count, length))
    return tuple(out)


def _rewired(op: Op, input: Op) -> Op:
    new = copy.copy(op)
    new.input = input  # type: ignore[attr-defined]  # Unary ops
    new.inputs = (input,)
    return new


def _tagged_op(op: Op, input: Op) -> Op:
    kind = type(op)
    if kind is Map:
        new = _rewired(op, input)
        new.fn = _TagMap(op.fn)  # type: ignore[attr-defined]
        return new
    if kind is Filter:
        return _TaggedFilter(input, op)  # type: ignore[arg-type]
    if kind in (Batch, PaddedBatch):
        return _TaggedBatch(input, op)  # type: ignore[arg-type]
    if kind in (Prefetch, Shuffle):
        return _rewired(op, input)
    raise InputPositionError(
        f"the input position of this pipeline cannot be tracked: Dataset.{op.name}() on the "
        "data workers does not say which source elements each of its elements came from "
        "(tracked: map, filter, batch, padded_batch, shuffle, prefetch); apply it on the "
        "consumer, after from_dataset_id, or read without track_position")


def pipeline_chain(root: Op) -> list[Op]:
    """The ops from ``root`` down to its one source; InputPositionError if not a chain."""
    chain = [root]
    while not chain[-1].is_source:
        inputs = chain[-1].inputs
        if len(inputs) != 1:
            raise InputPositionError(
                f"the input position of this pipeline cannot be tracked: Dataset."
                f"{chain[-1].name}() combines {len(inputs)} inputs")
        chain.append(inputs[0])
    return chain


def tracked_elements(root: Op, policy: ShardingPolicy, provider: SplitProvider | None,
                     field: str, worker_name: str) -> tuple[Iterator[Any], Ledger]:
    """A tracking task's elements (untagged), and the ledger that gives their runs in the
    order they were produced (see the module docstring and :mod:`._runs`)."""
    start = json.loads(field).get("start")
    chain = pipeline_chain(root)
    fifo = _Fifo()
    op: Op = _TaggedSource(chain[-1], provider if policy == ShardingPolicy.DYNAMIC else None,
                           worker_name, start, fifo)
    above = list(reversed(chain[:-1]))  # the ops, from the source up
    i = 0
    while i < len(above) and _keeps_order(above[i]):  # untouched: no tags below the taker
        op = _rewired(above[i], op)
        i += 1
    if i == len(above):  # nothing drops or reorders: the source's segments are the runs
        return op.iterate(IterContext()), FifoLedger(fifo.take)
    if type(above[i]) in (Batch, PaddedBatch):
        op = _FifoBatch(op, above[i], fifo)  # type: ignore[arg-type]
        i += 1
    else:
        op = _FifoTag(op, fifo)
    for rest in above[i:]:
        op = _tagged_op(rest, op)
    ledger = TagLedger()
    return ledger.untagged(op.iterate(IterContext())), ledger


def _keeps_order(op: Op) -> bool:
    """A 1:1 op that hands its elements on in input order."""
    return type(op) is Prefetch or (type(op) is Map and op.deterministic is not False)
