"""Sources: where elements come from.

Every splittable source implements :meth:`Source.splits` (enumerate its splits as plain
descriptors) and :meth:`Source.read_split` (the elements of one split). Iterated without a
split provider, a source reads everything in order.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ._base import _NO_ELEMENT, UNKNOWN, IterContext, Op, annotate_user_error, callable_name
from ._fs import expand
from ._pickling import replacement
from ._stats import OpRecord, counts_itself
from .ops import _close, check_int
from .splits import (
    FileSplit,
    FileSplits,
    IndexRange,
    SplitProvider,
    default_split_size,
    index_ranges,
)
from .structure import flatten

__all__ = ["Source", "ListSource", "RangeSource", "TensorSlices", "ListFiles", "FromFiles", "FromZarr", "FromGenerator"]


class Source(Op):
    """Base class of sources. ``splittable`` says whether :meth:`splits` works."""

    is_source = True
    splittable = True
    file_based = False
    #: Type of the split descriptors this source reads.
    split_type: type = IndexRange

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        raise NotImplementedError

    def why_not(self) -> str:
        """Why this source cannot be split (sources with ``splittable = False``)."""
        raise NotImplementedError

    def read_split(self, split: Any) -> Iterator[Any]:
        raise NotImplementedError

    def iterate_all(self, ctx: IterContext) -> Iterator[Any]:
        for split in self.splits():
            yield from self.read_split(split)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        provider = ctx.split_provider
        if ctx.ignore_errors:  # a split (file) that fails is dropped from the error on
            return self._iterate_ignoring(ctx, provider)
        if provider is None:
            return self.iterate_all(ctx)
        return self._iterate_provider(provider, None if ctx.stats is None else ctx.stats.record(self))

    def _iterate_ignoring(self, ctx: IterContext,
                          provider: SplitProvider | None) -> Iterator[Any]:
        if provider is None and (not self.splittable or type(self).iterate_all is not Source.iterate_all):
            # one stream (a generator, a shuffled file list): an error ends it, since a Python
            # iterator that raised cannot go on
            try:
                yield from self.iterate_all(ctx)
            except Exception as e:
                if not ctx.ignored(e):
                    raise
            return
        for split in (provider if provider is not None else self.splits()):
            try:
                yield from self.read_split(split)
            except Exception as e:
                if not ctx.ignored(e):
                    raise

    @counts_itself
    def _iterate_provider(self, provider: SplitProvider, rec: OpRecord | None) -> Iterator[Any]:
        # with figures (rec), counted per split: a split of range() or from_list() by its
        # length hint, with no wrapper per element (the DYNAMIC hot path)
        while (split := provider.get_next()) is not None:
            if not isinstance(split, self.split_type):
                raise TypeError(
                    f"Dataset.{self.name} reads {self.split_type.__name__} splits, "
                    f"the split provider served {split!r}"
                )
            yield from (self.read_split(split) if rec is None else rec.part(self.read_split(split)))


def _user_iterable(fn: Callable[..., Any], args: tuple[Any, ...], op: str, call_context: Any,
                   element_context: Any) -> Iterator[Any]:
    """Iterate ``fn(*args)``; an error from the user's code gains a note naming ``op``, and
    the user's iterator is closed when the pipeline stops early."""
    try:
        it = iter(fn(*args))
    except Exception as e:
        annotate_user_error(e, op, fn, call_context)
        raise
    try:
        while True:
            try:
                x = next(it)
            except StopIteration:
                return
            except Exception as e:
                annotate_user_error(e, op, fn, element_context)
                raise
            yield x
    finally:
        _close(it)


class ListSource(Source):
    """Elements already in memory (the windows of ``window``/``group_by_window``)."""

    name = "from_list"

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = list(items)

    def params(self) -> tuple[Any, ...]:
        return (tuple(map(repr, self.items[:8])), len(self.items))

    def repr_args(self) -> list[str]:
        return [f"<{len(self.items)} elements>"]

    def cardinality(self) -> int:
        return len(self.items)

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        n = len(self.items)
        return index_ranges(n, split_size or default_split_size(n))

    def iterate_all(self, ctx: IterContext) -> Iterator[Any]:
        return iter(self.items)

    def read_split(self, split: IndexRange) -> Iterator[Any]:
        return iter(self.items[split.start : split.stop])


class RangeSource(Source):
    name = "range"

    def __init__(self, start: int, stop: int | None = None, step: int = 1) -> None:
        if stop is None:
            start, stop = 0, start
        self.start = check_int("start", start)
        self.stop = check_int("stop", stop)
        self.step = check_int("step", step)
        if self.step == 0:
            raise ValueError("step must not be zero")
        self._range = range(self.start, self.stop, self.step)

    def params(self) -> tuple[Any, ...]:
        return (self.start, self.stop, self.step)

    def repr_args(self) -> list[str]:
        args = [str(self.stop)] if self.start == 0 else [str(self.start), str(self.stop)]
        return args if self.step == 1 else [str(self.start), str(self.stop), str(self.step)]

    def cardinality(self) -> int:
        return len(self._range)

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        n = len(self._range)
        return index_ranges(n, split_size or default_split_size(n))

    def iterate_all(self, ctx: IterContext) -> Iterator[Any]:
        return iter(self._range)

    def read_split(self, split: IndexRange) -> Iterator[Any]:
        return iter(self._range[split.start : split.stop])


class TensorSlices(Source):
    name = "from_tensor_slices"

    def __init__(self, data: Any) -> None:
        self.data = _as_arrays(data)
        sizes: set[int | None] = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in flatten(self.data)}
        lengths = {s for s in sizes if s is not None}
        if len(lengths) != len(sizes):
            raise ValueError("from_tensor_slices() needs arrays with at least one dimension")
        if len(lengths) != 1:
            raise ValueError(
                f"from_tensor_slices() needs every array to have the same length on axis 0, "
                f"got lengths {sorted(lengths)}"
            )
        self.n = lengths.pop()

    def params(self) -> tuple[Any, ...]:
        return (self.data,)

    def cardinality(self) -> int:
        return self.n

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        return index_ranges(self.n, split_size or default_split_size(self.n))

    def iterate_all(self, ctx: IterContext) -> Iterator[Any]:
        chunk = self._chunk_rows()
        if chunk is None:
            return self._rows(0, self.n)
        # arrays scattered to the cluster: read a chunk at a time
        return (x for start in range(0, self.n, chunk)
                for x in self._rows(start, min(self.n, start + chunk)))

    def read_split(self, split: IndexRange) -> Iterator[Any]:
        return self._rows(split.start, split.stop)

    # -- arrays moved to the cluster at registration (data/dask_source.py) ----------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        instead = replacement(self)
        if instead is not None:  # the data, with its large arrays as ScatteredArray leaves
            state["data"] = instead
        return state

    def _chunk_rows(self) -> int | None:
        """The smallest chunk of the arrays held by the cluster, or None if there is none."""
        chunks = [leaf.chunk_rows for leaf in flatten(self.data) if not isinstance(leaf, np.ndarray)]
        return min(chunks) if chunks else None

    def _rows(self, start: int, stop: int) -> Iterator[Any]:
        data = self.data
        if self._chunk_rows() is not None:  # read rows start:stop of every array
            from .structure import map_structure

            data = map_structure(lambda leaf: leaf[start:stop] if isinstance(leaf, np.ndarray)
                                 else leaf.rows(start, stop), data)
            start, stop = 0, stop - start
        if isinstance(data, np.ndarray):
            return iter(data[start:stop])
        if isinstance(data, tuple) and not hasattr(data, "_fields") and all(
            isinstance(x, np.ndarray) for x in data
        ):
            return zip(*(x[start:stop] for x in data), strict=True)
        if isinstance(data, dict) and all(isinstance(x, np.ndarray) for x in data.values()):
            keys = list(data)
            cols = [data[k][start:stop] for k in keys]
            return (dict(zip(keys, row, strict=True)) for row in zip(*cols, strict=True))
        from .structure import map_structure

        return (map_structure(lambda leaf, i=i: leaf[i], data) for i in range(start, stop))


def _is_dask_collection(x: Any) -> bool:
    """Dask's collection protocol (``dask.is_dask_collection``) without importing Dask: a
    ``__dask_graph__`` method that returns a graph (xarray objects return None unless they
    hold Dask arrays)."""
    graph = getattr(type(x), "__dask_graph__", None)
    if not callable(graph):
        return False
    try:
        return x.__dask_graph__() is not None
    except Exception:  # noqa: BLE001 - not a working collection: let numpy judge it
        return False


def _as_arrays(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _as_arrays(v) for k, v in data.items()}
    if isinstance(data, tuple):
        items = [_as_arrays(v) for v in data]
        return type(data)(*items) if hasattr(data, "_fields") else tuple(items)
    if _is_dask_collection(data):
        # np.asarray would compute the whole collection here, on the client
        kind = f"{type(data).__module__}.{type(data).__qualname__}"
        raise TypeError(
            f"from_tensor_slices() got a Dask collection ({kind}): it will not compute it on "
            "the client. Read Dask collections with Dataset.from_dask(collection), whose "
            "partitions are computed by the data workers that read them; "
            "or pass the computed values yourself: from_tensor_slices(x.compute())"
        )
    try:
        arr = np.asarray(data)
    except ValueError as e:  # numpy 2 refuses ragged nested lists
        raise ValueError(
            "from_tensor_slices() needs tensors of one shape (a rectangular array, or a "
            f"tuple/dict of them): {e}"
        ) from None
    if arr.dtype == object:
        raise TypeError(
            "from_tensor_slices() needs numpy arrays (or tuples/dicts of them); "
            f"got data that numpy turns into an object array: {data!r:.60}"
        )
    return arr


class ListFiles(Source):
    """Filenames matching a glob pattern, found when the dataset is defined."""

    name = "list_files"
    split_type = FileSplit
    file_based = True

    def __init__(self, pattern: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 shuffle: bool = False, seed: int | None = None) -> None:
        if isinstance(pattern, (str, os.PathLike)):
            patterns = [pattern]
        elif isinstance(pattern, (list, tuple)):
            patterns = list(pattern)
        else:
            raise TypeError(
                f"file_pattern must be a string or a list of strings, got {type(pattern).__name__}"
            )
        if not patterns:
            raise ValueError("list_files() needs at least one pattern")
        for p in patterns:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"file_pattern must be a string or a list of strings, got {p!r:.60}")
        files = expand([os.fspath(p) for p in patterns], "list_files")
        self.files = tuple(files)
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__} {shuffle!r:.40}")
        self.shuffle = bool(shuffle)
        self.seed = None if seed is None else check_int("seed", seed)

    def params(self) -> tuple[Any, ...]:
        return (self.files, self.shuffle, self.seed)

    def cardinality(self) -> int:
        return len(self.files)

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        return FileSplits(self.files)

    def iterate_all(self, ctx: IterContext) -> Iterator[Any]:
        files = list(self.files)
        if self.shuffle:
            epoch = ctx.next_epoch(self)
            rng = random.Random(None if self.seed is None else self.seed * 1_000_003 + epoch)
            rng.shuffle(files)
        return iter(files)

    def read_split(self, split: FileSplit) -> Iterator[Any]:
        return iter((split.path,))


class FromFiles(Source):
    """Elements read from files by a user-supplied ``reader(path) -> iterable``."""

    name = "from_files"
    split_type = FileSplit
    file_based = True

    def __init__(self, paths: Iterable[str | os.PathLike[str]],
                 reader: Callable[[str], Iterable[Any]]) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        elif not isinstance(paths, (list, tuple)):
            raise TypeError(f"paths must be a path or a list of paths, got {type(paths).__name__}")
        for p in paths:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"paths must hold strings or os.PathLike, got {type(p).__name__} {p!r:.40}")
        self.paths = tuple(os.fspath(p) for p in paths)
        if not self.paths:
            raise ValueError("from_files() needs at least one path")
        if not callable(reader):
            raise TypeError(f"reader must be callable, got {type(reader).__name__}")
        self.reader = reader

    def params(self) -> tuple[Any, ...]:
        return (self.paths, self.reader)

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        return FileSplits(self.paths)

    def read_split(self, split: FileSplit) -> Iterator[Any]:
        # the reader's own cleanup (an open file) runs when the pipeline stops early
        return _user_iterable(self.reader, (split.path,), "from_files", split.path, split.path)


class FromZarr(Source):
    """Rows (axis 0) of a zarr array, read a split at a time."""

    name = "from_zarr"

    def __init__(self, array_or_path: Any, rows_per_split: int | None = None,
                 path: str | None = None) -> None:
        if isinstance(array_or_path, (str, os.PathLike)):
            self.store_path: str | None = os.fspath(array_or_path)
            if path is not None and not isinstance(path, str):
                raise TypeError(f"path must be a string, got {type(path).__name__}")
            self.array_path: str | None = path
            self._array = None
            arr = self._open()
        else:
            if not hasattr(array_or_path, "shape") or not hasattr(array_or_path, "chunks"):
                raise TypeError(
                    "from_zarr() needs a zarr array or the path of one, got "
                    f"{type(array_or_path).__name__}"
                )
            self.store_path = None
            self.array_path = getattr(array_or_path, "path", None)
            self._array = arr = array_or_path
        if len(arr.shape) < 1:
            raise ValueError("from_zarr() needs an array with at least one dimension")
        self.shape = tuple(arr.shape)
        self.dtype = str(arr.dtype)
        self.rows_per_split = check_int(
            "rows_per_split", rows_per_split if rows_per_split is not None else arr.chunks[0], minimum=1
        )

    def _open(self) -> Any:
        if self._array is not None:
            return self._array
        opened = self.__dict__.get("_opened")
        if opened is None:  # opened once per process (reading metadata is not free)
            import zarr

            opened = self._opened = zarr.open_array(self.store_path, path=self.array_path or "",
                                                    mode="r")
        return opened

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_opened", None)
        return state

    def params(self) -> tuple[Any, ...]:
        ident = self.store_path if self.store_path is not None else repr(getattr(self._array, "store", None))
        return (ident, self.array_path, self.shape, self.dtype, self.rows_per_split)

    def cardinality(self) -> int:
        return int(self.shape[0])

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        return index_ranges(self.shape[0], split_size or self.rows_per_split)

    def read_split(self, split: IndexRange) -> Iterator[Any]:
        block = self._open()[split.start : split.stop]
        return iter(block)


class FromGenerator(Source):
    """Elements from ``fn(*args)``, any Python iterable; not splittable."""

    name = "from_generator"
    splittable = False

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...] | list[Any] = ()) -> None:
        if not callable(fn):
            raise TypeError(f"generator must be callable, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        self.fn = fn
        self.args = tuple(args)

    def params(self) -> tuple[Any, ...]:
        return (self.fn, self.args)

    def cardinality(self) -> int:
        return UNKNOWN

    def splits(self, split_size: int | None = None) -> Sequence[Any]:
        raise NotImplementedError

    def iterate_all(self, ctx: IterContext) -> Iterator[Any]:
        # the generator's own cleanup runs when the pipeline stops early
        return _user_iterable(self.fn, self.args, "from_generator", self.args, _NO_ELEMENT)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        return self.iterate_all(ctx)

    def why_not(self) -> str:
        return (
            f"from_generator({callable_name(self.fn)}) runs arbitrary Python and has no splits; "
            "read it with OFF sharding, or start from a splittable source (range, "
            "from_tensor_slices, list_files, from_files, from_zarr)"
        )
