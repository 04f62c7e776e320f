"""Transformations beyond the per-element core set in :mod:`.ops`.

Combining datasets: ``zip``, ``concatenate`` (both splittable: see :mod:`.splits`),
``sample_from_datasets``, ``choose_from_datasets``; grouping: ``bucket_by_sequence_length``; and
the tf.data transformations users port most: ``choose_from_datasets``, ``scan``, ``window``, ``group_by_window``,
``rebatch``, ``unique``, ``ignore_errors`` and ``cache`` (in memory or in a file), with
TensorFlow's semantics. Each op follows the rules of :mod:`._base`: immutable after
``__init__``, per-iteration state in the generator it returns (``cache`` is the one op that
keeps what an iteration produced, as TF's does; the cache is not pickled with the pipeline).
"""

from __future__ import annotations

import itertools
import os
import pickle
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ._base import _NO_ELEMENT, INFINITE, UNKNOWN, IterContext, Op, annotate_user_error
from .ops import Batch, Unary, _close, call, check_bool, check_callable, check_int
from .splits import ConcatenateRouter, MixRouter, ZipTee
from .structure import pad_stack, stack, unstack

if TYPE_CHECKING:
    from .dataset import Dataset

#: The Dataset class, installed by data/dataset.py (which imports this module's ops): a window
#: element and group_by_window's reduce_func are datasets.
_DATASET: list[type[Dataset]] = []

__all__ = [
    "BucketBySequenceLength", "Cache", "ChooseFromDatasets", "Concatenate", "Zip", "GroupByWindow", "IgnoreErrors", "Rebatch", "SampleFromDatasets",
    "Scan", "Unique", "Window",
]


def _call(fn: Callable[..., Any], op: str, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:
        annotate_user_error(e, op, fn, args[-1] if args else _NO_ELEMENT)
        raise


# ----------------------------------------------------------------------------------------
# choosing between datasets
# ----------------------------------------------------------------------------------------


def _mixed(ctx: IterContext, n: int) -> list[IterContext]:
    """The contexts ``n`` mixed inputs iterate in: each reads its own splits (see
    :class:`~.splits.MixRouter`) when the pipeline reads splits."""
    if ctx.split_provider is None:
        return [ctx] * n
    router = MixRouter(ctx.split_provider, n)
    return [replace(ctx, split_provider=router.component(k)) for k in range(n)]


class SampleFromDatasets(Op):
    """Each element comes from input ``i`` with probability ``weights[i]`` (TF's semantics).

    When an input ends: with ``stop_on_empty_dataset`` the result ends; otherwise that input
    is dropped and the weights of the others are renormalised.
    """

    name = "sample_from_datasets"

    def __init__(self, inputs: tuple[Op, ...], weights: Any, seed: int | None,
                 stop_on_empty_dataset: bool, rerandomize_each_iteration: bool | None) -> None:
        if not inputs:
            raise ValueError("sample_from_datasets() needs at least one dataset")
        self.inputs = tuple(inputs)
        if weights is None:
            weights = [1.0 / len(inputs)] * len(inputs)
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (len(inputs),):
            raise ValueError(f"weights must have one entry per dataset ({len(inputs)}), got {list(weights)!r:.80}")
        if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0, got {w.tolist()}")
        self.weights = tuple(float(x) for x in w / w.sum())
        self.seed = None if seed is None else check_int("seed", seed)
        self.stop_on_empty_dataset = check_bool("stop_on_empty_dataset", stop_on_empty_dataset)
        self.rerandomize = True if rerandomize_each_iteration is None else check_bool(
            "rerandomize_each_iteration", rerandomize_each_iteration)

    def params(self) -> tuple[Any, ...]:
        return (self.weights, self.seed, self.stop_on_empty_dataset, self.rerandomize)

    def cardinality(self) -> int:
        ns = [op.cardinality() for op in self.inputs]
        if all(n == INFINITE for n in ns):
            return INFINITE
        return UNKNOWN

    def mixed_inputs(self) -> tuple[Op, ...]:
        """The inputs whose splits a split provider serves (DYNAMIC: each its own splits)."""
        return self.inputs

    def rates(self) -> tuple[float, ...]:
        """How fast each of :meth:`mixed_inputs` is drawn from (its splits' order)."""
        return self.weights

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        epoch = ctx.next_epoch(self)
        if self.seed is None:
            rng = random.Random()
        else:
            rng = random.Random(self.seed * 1_000_003 + (epoch if self.rerandomize else 0))
        its = [op.iterate(sub) for op, sub in zip(self.inputs, _mixed(ctx, len(self.inputs)),
                                                  strict=True)]
        live = list(range(len(its)))
        weights = list(self.weights)
        try:
            while live:
                if sum(weights[i] for i in live) <= 0:
                    return
                i = rng.choices(live, weights=[weights[j] for j in live])[0]
                try:
                    x = next(its[i])
                except StopIteration:
                    if self.stop_on_empty_dataset:
                        return
                    live.remove(i)
                    continue
                yield x
        finally:
            for it in its:
                _close(it)


class ChooseFromDatasets(Op):
    """Element k comes from input ``choice[k]`` (TF's ``choose_from_datasets``)."""

    name = "choose_from_datasets"

    def __init__(self, inputs: tuple[Op, ...], choice: Op, stop_on_empty_dataset: bool) -> None:
        if not inputs:
            raise ValueError("choose_from_datasets() needs at least one dataset")
        self.inputs = (choice, *inputs)
        self.stop_on_empty_dataset = check_bool("stop_on_empty_dataset", stop_on_empty_dataset)

    def params(self) -> tuple[Any, ...]:
        return (self.stop_on_empty_dataset,)

    def cardinality(self) -> int:
        return UNKNOWN if self.inputs[0].cardinality() != INFINITE else INFINITE

    def mixed_inputs(self) -> tuple[Op, ...]:
        """The inputs whose splits a split provider serves: the data inputs (the choice input
        runs whole on every worker, as in TensorFlow)."""
        return self.inputs[1:]

    def rates(self) -> tuple[float, ...]:
        return (1.0,) * (len(self.inputs) - 1)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        choice = self.inputs[0].iterate(replace(ctx, split_provider=None))
        its = [op.iterate(sub) for op, sub in zip(self.inputs[1:],
                                                  _mixed(ctx, len(self.inputs) - 1), strict=True)]
        ended = [False] * len(its)
        try:
            for c in choice:
                if isinstance(c, np.ndarray) and c.ndim == 0:
                    c = c.item()
                if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
                    raise TypeError(f"choose_from_datasets(): the choice dataset must yield integer scalars, got {c!r:.40}")
                c = int(c)
                if not 0 <= c < len(its):
                    raise ValueError(
                        f"choose_from_datasets(): choice {c} is out of range for {len(its)} datasets")
                if ended[c]:
                    continue
                try:
                    yield next(its[c])
                except StopIteration:
                    ended[c] = True
                    if self.stop_on_empty_dataset:
                        return
        finally:
            _close(choice)
            for it in its:
                _close(it)


# ----------------------------------------------------------------------------------------
# stateful and windowing transformations
# ----------------------------------------------------------------------------------------


class Scan(Unary):
    """``scan_func(state, element) -> (new_state, output)``, state starting at ``initial_state``."""

    name = "scan"

    def __init__(self, input: Op, initial_state: Any, scan_func: Callable[..., Any]) -> None:
        super().__init__(input)
        self.initial_state = initial_state
        self.fn = check_callable("scan_func", scan_func)

    def params(self) -> tuple[Any, ...]:
        return (self.initial_state, self.fn)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        state = self.initial_state
        fn = self.fn
        for x in self.input.iterate(ctx):
            out = _call(fn, self.name, state, *(x if type(x) is tuple else (x,)))
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"Dataset.scan: scan_func must return (new_state, output), got {type(out).__name__}")
            state, y = out
            yield y


def _window_structure(items: list[Any], template: Any) -> Any:
    """TF's window element: a structure of datasets, one per component of the elements."""
    from .sources import ListSource

    dataset = _DATASET[0]
    if isinstance(template, (tuple, dict)):
        def component(path: tuple[Any, ...]) -> Dataset:
            return dataset(ListSource([_get(x, path) for x in items]))
        return _map_paths(template, component)
    return dataset(ListSource(items))


def _map_paths(template: Any, fn: Callable[[tuple[Any, ...]], Any],
               path: tuple[Any, ...] = ()) -> Any:
    if isinstance(template, dict):
        return {k: _map_paths(v, fn, (*path, k)) for k, v in template.items()}
    if isinstance(template, tuple):
        return tuple(_map_paths(v, fn, (*path, i)) for i, v in enumerate(template))
    return fn(path)


def _get(x: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        x = x[p]
    return x


class Window(Unary):
    """Windows of ``size`` elements, a new one every ``shift``, taking every ``stride``-th."""

    name = "window"

    def __init__(self, input: Op, size: int, shift: int | None = None, stride: int=1, drop_remainder: bool=False) -> None:
        super().__init__(input)
        self.size = check_int("size", size, minimum=1)
        self.shift = self.size if shift is None else check_int("shift", shift, minimum=1)
        self.stride = check_int("stride", stride, minimum=1)
        self.drop_remainder = check_bool("drop_remainder", drop_remainder)

    def params(self) -> tuple[Any, ...]:
        return (self.size, self.shift, self.stride, self.drop_remainder)

    def cardinality(self) -> int:
        n = self.input.cardinality()
        if n < 0:
            return n
        span = (self.size - 1) * self.stride + 1
        if self.drop_remainder:
            return 0 if n < span else (n - span) // self.shift + 1
        return -(-n // self.shift)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        span = (self.size - 1) * self.stride + 1
        buf: list[Any] = []
        it = self.input.iterate(ctx)
        try:
            end = False
            while True:
                while len(buf) < span and not end:
                    try:
                        buf.append(next(it))
                    except StopIteration:
                        end = True
                if not buf:
                    return
                window = buf[: span: self.stride]
                if len(window) < self.size and (self.drop_remainder or not window):
                    return
                if end and len(buf) < span and self.drop_remainder:
                    return
                yield _window_structure(window, window[0])
                if self.shift >= len(buf):
                    # skip the elements between this window's end and the next start
                    skip = self.shift - len(buf)
                    buf = []
                    for _ in range(skip):
                        try:
                            next(it)
                        except StopIteration:
                            end = True
                            break
                    if end:
                        return
                else:
                    buf = buf[self.shift:]
                    if end and not buf:
                        return
        finally:
            _close(it)


class GroupByWindow(Unary):
    """Group elements by ``key_func``; each full window goes through ``reduce_func``."""

    name = "group_by_window"

    def __init__(self, input: Op, key_func: Callable[..., Any], reduce_func: Callable[..., Any],
                 window_size: int | None = None,
                 window_size_func: Callable[[int], Any] | None = None) -> None:
        super().__init__(input)
        self.key_func = check_callable("key_func", key_func)
        self.reduce_func = check_callable("reduce_func", reduce_func)
        if (window_size is None) == (window_size_func is None):
            raise ValueError("group_by_window() needs exactly one of window_size and window_size_func")
        self.window_size = None if window_size is None else check_int("window_size", window_size, minimum=1)
        self.window_size_func = None if window_size_func is None else check_callable(
            "window_size_func", window_size_func)

    def params(self) -> tuple[Any, ...]:
        return (self.key_func, self.reduce_func, self.window_size, self.window_size_func)

    def cardinality(self) -> int:
        return UNKNOWN

    def _key(self, x: Any) -> int:
        k = _call(self.key_func, self.name, *(x if type(x) is tuple else (x,)))
        if isinstance(k, np.ndarray) and k.ndim == 0:
            k = k.item()
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"Dataset.group_by_window: key_func must return an integer scalar, got {k!r:.40}")
        return int(k)

    def _size(self, key: int) -> int:
        if self.window_size is not None:
            return self.window_size
        assert self.window_size_func is not None  # one of the two is set (checked in __init__)
        return check_int("window_size_func(key)", _call(self.window_size_func, self.name, key), minimum=1)

    def _reduce(self, key: int, items: list[Any]) -> Any:
        window = _window_structure(items, items[0])
        args = (key, *window) if isinstance(window, tuple) else (key, window)
        out = _call(self.reduce_func, self.name, *args)
        if not isinstance(out, _DATASET[0]):
            raise TypeError(f"Dataset.group_by_window: reduce_func must return a Dataset, got {type(out).__name__}")
        return out._op.iterate(IterContext())

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        groups: dict[int, list[Any]] = {}
        sizes: dict[int, int] = {}
        for x in self.input.iterate(ctx):
            key = self._key(x)
            group = groups.setdefault(key, [])
            if key not in sizes:
                sizes[key] = self._size(key)
            group.append(x)
            if len(group) >= sizes[key]:
                del groups[key]
                yield from self._reduce(key, group)
        for key, group in groups.items():  # the partial windows, in order of first element
            yield from self._reduce(key, group)


class Rebatch(Batch):
    """Re-cut batched elements into batches of ``batch_size`` (across input batches)."""

    name = "rebatch"

    def cardinality(self) -> int:
        return INFINITE if self.input.cardinality() == INFINITE else UNKNOWN

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        n = self.batch_size
        rows: list[Any] = []
        for batch in self.input.iterate(ctx):
            rows.extend(batch if isinstance(batch, np.ndarray) else unstack(batch))
            while len(rows) >= n:
                yield stack(rows[:n])
                del rows[:n]
        if rows and not self.drop_remainder:
            yield stack(rows)


def _hashable(x: Any, op: str) -> Any:
    if isinstance(x, np.ndarray):
        if x.ndim != 0:
            raise TypeError(f"Dataset.{op} needs scalar elements (ints or strings), got an array of shape {x.shape}")
        x = x.item()
    elif isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float):
        raise TypeError(f"Dataset.{op} needs integer or string elements (as TF), got the float {x!r}")
    if not isinstance(x, (int, str, bytes)):
        raise TypeError(f"Dataset.{op} needs integer or string elements (as TF), got {type(x).__name__}")
    return x


class Unique(Unary):
    """Each distinct element once, at its first occurrence (ints and strings, as TF)."""

    name = "unique"

    def cardinality(self) -> int:
        return UNKNOWN

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        seen: set[Any] = set()
        for x in self.input.iterate(ctx):
            key = _hashable(x, self.name)
            if key not in seen:
                seen.add(key)
                yield x


class IgnoreErrors(Unary):
    """Drop the elements whose production raised, instead of failing the pipeline.

    Errors of the ops below (a ``map``/``filter``/``flat_map``/``interleave`` function, a
    reader on a file) skip that element (a reader: the rest of that file). The ops see
    ``ctx.ignore_errors`` and handle it themselves, because a Python generator that raised
    cannot be resumed.
    """

    name = "ignore_errors"

    def __init__(self, input: Op, log_warning: bool=False) -> None:
        super().__init__(input)
        self.log_warning = check_bool("log_warning", log_warning)

    def params(self) -> tuple[Any, ...]:
        return (self.log_warning,)

    def cardinality(self) -> int:
        n = self.input.cardinality()
        return n if n == INFINITE else UNKNOWN

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        return self.input.iterate(replace(ctx, ignore_errors=True, log_errors=self.log_warning))


class Cache(Unary):
    """Elements of the first complete iteration, kept in memory or in ``filename``.

    Like TF: an iteration that stops early does not fill the cache; a file cache is written
    next to a ``.complete`` marker that makes it valid (a crash mid-write leaves no marker),
    and later iterations (in this process or another) read the file instead of the input.
    The in-memory cache belongs to this pipeline object in this process; it is not pickled.
    """

    name = "cache"

    def __init__(self, input: Op, filename: str="") -> None:
        super().__init__(input)
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(f"filename must be a string, got {type(filename).__name__}")
        self.filename = os.fspath(filename)
        self._memory: list[Any] | None = None
        self._lock = threading.Lock()

    def params(self) -> tuple[Any, ...]:
        return (self.filename,)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_memory"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def split_blocker(self) -> str:
        return ("cache() after the source would replay this worker's splits of the first epoch; "
                "cache before reading from the service, or use OFF sharding")

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        if self.filename:
            return self._file(ctx)
        return self._mem(ctx)

    def _mem(self, ctx: IterContext) -> Iterator[Any]:
        cached = self._memory
        if cached is not None:
            yield from cached
            return
        items = []
        for x in self.input.iterate(ctx):
            items.append(x)
            yield x
        with self._lock:
            if self._memory is None:
                self._memory = items

    def _file(self, ctx: IterContext) -> Iterator[Any]:
        data, marker = self.filename + ".data", self.filename + ".complete"
        if os.path.exists(marker):
            with open(data, "rb") as f:
                while True:
                    try:
                        yield pickle.load(f)
                    except EOFError:
                        return
        tmp = f"{data}.{os.getpid()}.{threading.get_ident()}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(data)), exist_ok=True)
        complete = False
        try:
            with open(tmp, "wb") as f:
                for x in self.input.iterate(ctx):
                    pickle.dump(x, f, protocol=5)
                    yield x
                f.flush()
                os.fsync(f.fileno())
            complete = True
        finally:
            if complete and not os.path.exists(marker):
                os.replace(tmp, data)
                with open(marker, "w") as m:
                    m.write("ok\n")
            elif os.path.exists(tmp):
                os.remove(tmp)


#: Ops that may come before ``autocache()``: a source, then ops that make each element from
#: elements of the same split (so a split's output can be made, cached and served alone).
AUTOCACHE_UPSTREAM = ("map", "filter", "flat_map", "interleave", "prefetch", "ignore_errors")
AUTOCACHE_FORCE = (None, "auto", "always", "never")


class AutoCache(Unary):
    """Where the data service may cache the pipeline's output (issue 26, Cachew's autocache).

    On a data worker the service decides, per dataset and from what it measures, whether to
    keep each split's elements (in memory up to a limit, then on the worker's disk) and serve
    later reads of that split (another epoch, job or trainer) from there; the dispatcher hands
    a worker the splits it holds first. Anywhere else (a local iteration) it passes elements
    through. What comes before it must be deterministic, as for ``cache()``: a random
    augmentation belongs after it. See docs/elastic.md.
    """

    name = "autocache"

    def __init__(self, input: Op, force: str | None = None) -> None:
        super().__init__(input)
        if force not in AUTOCACHE_FORCE:
            raise ValueError(f"autocache(force=...) must be 'auto', 'always' or 'never' (or "
                             f"None: dataservice.autocache.force), got {force!r}")
        self.force = force
        op: Op = input
        while op.inputs:
            if getattr(op, "name", None) not in AUTOCACHE_UPSTREAM or len(op.inputs) != 1:
                raise ValueError(
                    f"autocache() caches each split's elements, so only a source and "
                    f"{', '.join(AUTOCACHE_UPSTREAM)} may come before it; found "
                    f"{getattr(op, 'name', type(op).__name__)}() (put it after autocache())")
            op = op.inputs[0]
        self._fingerprint: str | None = None

    def params(self) -> tuple[Any, ...]:
        return (self.force,)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fingerprint": None}

    @property
    def fingerprint(self) -> str:
        """The fingerprint of what comes before it: the cache's key."""
        if self._fingerprint is None:
            from ._fingerprint import fingerprint

            self._fingerprint = fingerprint(self.input)
        return self._fingerprint

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        if ctx.autocache is None:  # not on a data worker: nothing to cache in
            return self.input.iterate(ctx)
        return ctx.autocache.iterate(self, ctx)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------------
# zip, concatenate, bucket_by_sequence_length
# ----------------------------------------------------------------------------------------


class Zip(Op):
    name = "zip"

    def __init__(self, structure: Any) -> None:
        self.keys: tuple[Any, ...] | None
        if isinstance(structure, dict):
            self.keys = tuple(structure)
            self.inputs = tuple(d._op for d in structure.values())
        else:
            self.keys = None
            self.inputs = tuple(d._op for d in structure)
        if not self.inputs:
            raise ValueError("zip() needs at least one dataset")

    def params(self) -> tuple[Any, ...]:
        return (self.keys,)

    def cardinality(self) -> int:
        ns = [op.cardinality() for op in self.inputs]
        if UNKNOWN in ns:  # an input of unknown length may be the shortest
            return UNKNOWN
        finite = [n for n in ns if n >= 0]
        return min(finite) if finite else INFINITE

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        if ctx.split_provider is None:
            its = [op.iterate(ctx) for op in self.inputs]
        else:  # every component reads the same splits
            tee = ZipTee(ctx.split_provider, len(self.inputs))
            its = [op.iterate(replace(ctx, split_provider=tee.component(k)))
                   for k, op in enumerate(self.inputs)]
        try:
            if self.keys is None:
                yield from zip(*its, strict=False)
            else:
                keys = self.keys
                for row in zip(*its, strict=False):
                    yield dict(zip(keys, row, strict=True))
        finally:
            for it in its:
                _close(it)


class Concatenate(Op):
    name = "concatenate"

    def __init__(self, first: Op, second: Op) -> None:
        self.inputs = (first, second)

    def cardinality(self) -> int:
        a, b = (op.cardinality() for op in self.inputs)
        if INFINITE in (a, b):
            return INFINITE
        if UNKNOWN in (a, b):
            return UNKNOWN
        return a + b

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        router = None if ctx.split_provider is None else ConcatenateRouter(ctx.split_provider)
        for k, op in enumerate(self.inputs):
            sub = ctx if router is None else replace(ctx, split_provider=router.component(k))
            it = op.iterate(sub)
            try:
                yield from it
            finally:
                _close(it)


class BucketBySequenceLength(Unary):
    name = "bucket_by_sequence_length"

    def __init__(self, input: Op, element_length_func: Callable[..., Any],
                 bucket_boundaries: list[int], bucket_batch_sizes: list[int],
                 padded_shapes: Any = None, padding_values: Any = None, pad_to_bucket_boundary: bool=False,
                 no_padding: bool=False, drop_remainder: bool=False) -> None:
        super().__init__(input)
        self.length_fn = check_callable("element_length_func", element_length_func)
        for arg, value in (("bucket_boundaries", bucket_boundaries),
                           ("bucket_batch_sizes", bucket_batch_sizes)):
            if not isinstance(value, (list, tuple, np.ndarray)):
                raise TypeError(f"{arg} must be a list of integers, got {type(value).__name__}")
        bounds = [check_int(f"bucket_boundaries[{i}]", b, minimum=1)
                  for i, b in enumerate(bucket_boundaries)]
        if any(b2 <= b1 for b1, b2 in itertools.pairwise(bounds)):
            raise ValueError(f"bucket_boundaries must be strictly increasing, got {bounds}")
        sizes = [check_int(f"bucket_batch_sizes[{i}]", s, minimum=1)
                 for i, s in enumerate(bucket_batch_sizes)]
        if len(sizes) != len(bounds) + 1:
            raise ValueError(
                f"bucket_batch_sizes must have len(bucket_boundaries) + 1 = {len(bounds) + 1} "
                f"entries, got {len(sizes)}"
            )
        self.bounds = tuple(bounds)
        self.sizes = tuple(sizes)
        self.padded_shapes = padded_shapes
        self.padding_values = padding_values
        self.pad_to_bucket_boundary = check_bool("pad_to_bucket_boundary", pad_to_bucket_boundary)
        self.no_padding = check_bool("no_padding", no_padding)
        self.drop_remainder = check_bool("drop_remainder", drop_remainder)

    def params(self) -> tuple[Any, ...]:
        return (self.length_fn, self.bounds, self.sizes, self.padded_shapes, self.padding_values,
                self.pad_to_bucket_boundary, self.no_padding, self.drop_remainder)

    def cardinality(self) -> int:
        n = self.input.cardinality()
        return n if n == INFINITE else UNKNOWN

    def _bucket(self, length: int) -> int:
        for i, b in enumerate(self.bounds):
            if length < b:
                return i
        return len(self.bounds)

    def _emit(self, bucket: int, items: list[Any]) -> Any:
        if self.no_padding:
            return stack(items)
        shapes = self.padded_shapes
        if self.pad_to_bucket_boundary:
            if bucket == len(self.bounds):
                raise ValueError(
                    "bucket_by_sequence_length(pad_to_bucket_boundary=True): an element is "
                    f"longer than the last boundary {self.bounds[-1] - 1}"
                )
            shapes = _leading_dim_shapes(items[0], self.bounds[bucket] - 1)
        return pad_stack(items, shapes, self.padding_values)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        buckets: list[list[Any]] = [[] for _ in self.sizes]
        fn = self.length_fn
        for x in self.input.iterate(ctx):
            try:
                length = int(call(fn, x))
            except Exception as e:
                annotate_user_error(e, self.name, fn, x)
                raise
            b = self._bucket(length)
            buckets[b].append(x)
            if len(buckets[b]) == self.sizes[b]:
                yield self._emit(b, buckets[b])
                buckets[b] = []
        if not self.drop_remainder:
            for b, items in enumerate(buckets):
                if items:
                    yield self._emit(b, items)


def _leading_dim_shapes(element: Any, length: int) -> Any:
    from .structure import map_structure

    return map_structure(lambda leaf: [length, *np.shape(leaf)[1:]] if np.ndim(leaf) else [], element)

