"""The split API: how a source is cut into pieces that the data service hands out.

A *split* is a small, picklable descriptor of one piece of a source: an index range for
``range`` / ``from_tensor_slices`` / ``from_zarr``, one file for file sources. Splits are
described once, where the pipeline is defined (``Dataset.splits()``), and stored as plain
data, so whoever hands them out (the dispatcher) never runs user code. Index ranges are not
enumerated: :class:`IndexRanges` computes split ``i`` on demand, so a source of any size
(``Dataset.range(2**55)``) registers in O(1); the dispatcher journals only its cursor. A worker iterates
the pipeline with a :class:`SplitProvider`; the source then reads only the splits served,
in the order served, and every transformation above it runs unchanged.

Repetitions: when a pipeline ends in ``repeat()``, each pass over the source is one
*repetition* of its splits. ``Repeat`` calls :meth:`SplitProvider.reset` before it restarts
its input, and a provider serves the splits of the next repetition.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from ..errors import NotSplittableError

__all__ = [
    "SHARD_HINT",
    "ComponentSplit",
    "MixRouter",
    "IndexRange",
    "IndexRanges",
    "FileSplit",
    "FileSplits",
    "PipelineSplits",
    "SplitProvider",
    "ListSplitProvider",
    "NotSplittableError",
]


class _ShardHint:
    """Placeholder for the number of shards or the shard index under HINT sharding."""

    _instance = None

    def __new__(cls) -> _ShardHint:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "SHARD_HINT"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ShardHint, ())


#: Use as ``ds.shard(SHARD_HINT, SHARD_HINT)``: under the data service's HINT sharding policy
#: each worker replaces it with ``(num_workers, worker_index)``.
SHARD_HINT = _ShardHint()


@dataclass(frozen=True, slots=True)
class IndexRange:
    """Elements ``start`` (inclusive) to ``stop`` (exclusive) of a source, by position."""

    start: int
    stop: int

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


@dataclass(frozen=True, slots=True)
class FileSplit:
    """One file of a file-based source."""

    path: str


class IndexRanges(Sequence[IndexRange]):
    """The splits of ``n`` positions cut into ranges of ``split_size``, computed on demand.

    A sequence of :class:`IndexRange` whose length and every item are O(1) to compute, and
    which pickles as its two numbers: registering ``Dataset.range(2**55)`` (TensorFlow's
    idiom for an endless source) costs the same as ``Dataset.range(10)``. The dispatcher
    only ever hands out indices into it (its split cursor), and a worker computes split
    ``i`` when it is served. Equal to any sequence of the same splits.
    """

    __slots__ = ("n", "split_size")

    def __init__(self, n: int, split_size: int) -> None:
        if split_size < 1:
            raise ValueError(f"split_size must be a positive integer, got {split_size}")
        self.n = max(0, n)
        self.split_size = split_size

    def __len__(self) -> int:
        return -(-self.n // self.split_size)

    @overload
    def __getitem__(self, index: int) -> IndexRange: ...

    @overload
    def __getitem__(self, index: slice) -> list[IndexRange]: ...

    def __getitem__(self, index: int | slice) -> IndexRange | list[IndexRange]:
        if isinstance(index, slice):  # a strided selection (static sharding): a plain list
            return [self[i] for i in range(len(self))[index]]
        length = len(self)
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError(f"split {index} out of range ({length} splits)")
        start = index * self.split_size
        return IndexRange(start, min(start + self.split_size, self.n))

    def __iter__(self) -> Iterator[IndexRange]:
        for start in range(0, self.n, self.split_size):
            yield IndexRange(start, min(start + self.split_size, self.n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IndexRanges):
            return len(self) == len(other) and (
                len(self) == 0 or (self.n, self.split_size) == (other.n, other.split_size))
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (IndexRanges, (self.n, self.split_size))

    def __repr__(self) -> str:
        return f"IndexRanges(n={self.n}, split_size={self.split_size})"


class FileSplits(Sequence[FileSplit]):
    """The splits of a file-based source, one per path, made on demand.

    A sequence of :class:`FileSplit` that pickles as its tuple of paths (strings pickle in
    bulk; a million ``FileSplit`` objects took seconds), so that registering a dataset of a
    million files is not bound by pickling its splits. Equal to any sequence of the same
    splits.
    """

    __slots__ = ("paths",)

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = tuple(paths)

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, index: int) -> FileSplit: ...

    @overload
    def __getitem__(self, index: slice) -> list[FileSplit]: ...

    def __getitem__(self, index: int | slice) -> FileSplit | list[FileSplit]:
        if isinstance(index, slice):  # a strided selection (static sharding): a plain list
            return [FileSplit(p) for p in self.paths[index]]
        return FileSplit(self.paths[index])

    def __iter__(self) -> Iterator[FileSplit]:
        return map(FileSplit, self.paths)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FileSplits):
            return self.paths == other.paths
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FileSplits, (self.paths,))

    def __repr__(self) -> str:
        return f"FileSplits({len(self.paths)} files)"


@dataclass(frozen=True, slots=True)
class PipelineSplits:
    """Stands for ``dataset.splits(split_size)`` of the pipeline registered with it.

    Registration sends it instead of splits the pickled pipeline already holds (the paths of
    a file-based source), so that they travel, and are journaled, once; a data worker
    resolves it after unpickling the pipeline.
    """

    split_size: int | None

    def resolve(self, dataset: Any) -> Sequence[Any]:
        splits: Sequence[Any] = dataset.splits(self.split_size)
        return splits


def index_ranges(n: int, split_size: int) -> IndexRanges:
    """Cut ``n`` positions into consecutive ranges of ``split_size`` (the last may be short),
    lazily (see :class:`IndexRanges`)."""
    return IndexRanges(n, split_size)


def default_split_size(n: int) -> int:
    """About 256 splits per source, between 1 and 65,536 elements each."""
    return max(1, min(65_536, -(-n // 256)))


class SplitProvider(abc.ABC):
    """Serves the splits a pipeline's source reads, one at a time.

    Implementations: :class:`ListSplitProvider` (local), and the data service's worker-side
    provider, which asks the dispatcher for the next split ahead of need.
    """

    @abc.abstractmethod
    def get_next(self) -> object | None:
        """The next split of the current repetition, or None when the repetition is done."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Move on to the next repetition (called by ``repeat()`` before it restarts)."""

    def __iter__(self) -> Iterator[object]:
        while (split := self.get_next()) is not None:
            yield split


class ListSplitProvider(SplitProvider):
    """Serves a fixed list of splits; every repetition serves the whole list again.

    Parameters
    ----------
    splits
        The splits, in the order to serve them.
    """

    def __init__(self, splits: Iterable[object]) -> None:
        # a sequence (such as lazy IndexRanges) is kept as it is: split i is read on demand
        self.splits: Sequence[object] = splits if isinstance(splits, Sequence) else list(splits)
        self._pos = 0
        self.repetition = 0

    def get_next(self) -> object | None:
        if self._pos >= len(self.splits):
            return None
        split = self.splits[self._pos]
        self._pos += 1
        return split

    def reset(self) -> None:
        self._pos = 0
        self.repetition += 1

    @property
    def num_splits(self) -> int:
        return len(self.splits)


# ---------------------------------------------------------------------------------------------
# Pipelines with several sources: zip and concatenate (tf.data shards both under DYNAMIC)
# ---------------------------------------------------------------------------------------------
#
# ``concatenate(a, b)``: the splits of ``a`` tagged ``ComponentSplit(0, s)``, then those of ``b``
# tagged ``ComponentSplit(1, s)``. A worker's provider serves them in increasing order, so the
# first input reads its splits until the first split of the second input shows up, which is
# handed over to the second input (:class:`ConcatenateRouter`).
#
# ``zip(a, b, ...)``: the components *share* each split (split k of the zip is split k of every
# component: positions ``start..stop`` of each), so the zipped elements stay paired whatever
# worker reads the split. Every component therefore reads the same list of splits
# (:class:`ZipTee` hands each split to every component once).


@dataclass(frozen=True, slots=True)
class ComponentSplit:
    """A split of input ``component`` of a ``concatenate``."""

    component: int
    split: object


class _SharedProvider:
    """One provider read by several inputs of a zip/concatenate; ends once for all of them."""

    def __init__(self, parent: SplitProvider) -> None:
        self._parent = parent
        self._exhausted = False

    def component(self, k: int) -> SplitProvider:
        return _ComponentProvider(self, k)

    def _pull(self) -> object | None:
        """The parent's next split; None (and from then on always None) at its end."""
        if self._exhausted:
            return None
        split = self._parent.get_next()
        if split is None:
            self._exhausted = True
        return split

    def _next_for(self, k: int) -> object | None:
        raise NotImplementedError


class ConcatenateRouter(_SharedProvider):
    """Routes the splits of one provider to the inputs of a ``concatenate`` (see above)."""

    def __init__(self, parent: SplitProvider) -> None:
        super().__init__(parent)
        self._stash: ComponentSplit | None = None

    def _next_for(self, k: int) -> object | None:
        if self._stash is None:
            split = self._pull()
            if split is None:
                return None
            if not isinstance(split, ComponentSplit):
                raise TypeError(f"concatenate reads ComponentSplit splits, the provider served {split!r}")
            self._stash = split
        split = self._stash
        if split.component < k:
            raise ValueError(
                f"concatenate: a split of input {split.component} arrived after input {k} started "
                "(splits must be served in order)")
        if split.component > k:
            return None  # input k is done for this repetition; the stash waits for its input
        self._stash = None
        return split.split


class _ComponentProvider(SplitProvider):
    """The provider one input of a zip/concatenate reads: its owner decides what it gets."""

    def __init__(self, owner: _SharedProvider, k: int) -> None:
        self._owner = owner
        self._k = k

    def get_next(self) -> object | None:
        return self._owner._next_for(self._k)


class ZipTee(_SharedProvider):
    """Hands every split of one provider to each of ``n`` zip components, once each."""

    def __init__(self, parent: SplitProvider, n: int) -> None:
        from collections import deque

        super().__init__(parent)
        self._buffer: deque[Any] = deque()
        self._base = 0  # position of self._buffer[0]
        self._pos = [0] * n

    def _next_for(self, k: int) -> object | None:
        i = self._pos[k]
        if i - self._base < len(self._buffer):
            split = self._buffer[i - self._base]
        else:
            split = self._pull()
            if split is None:
                return None
            self._buffer.append(split)
        self._pos[k] = i + 1
        while self._buffer and min(self._pos) > self._base:
            self._buffer.popleft()
            self._base += 1
        return split  # type: ignore[no-any-return]


# ``sample_from_datasets`` / ``choose_from_datasets``: each data input reads splits of its own
# (``ComponentSplit(k, s)``), in whatever order the sampling asks for them (TensorFlow hands
# out each input's splits from a provider of its own). The splits of all inputs are listed in
# one sequence (:func:`mixed_splits`: each input's spread over it at the rate the sampling
# draws from it), and a worker's :class:`MixRouter` keeps a split of another input than the
# one asking in that input's queue until it asks. The choice input of
# ``choose_from_datasets`` is not split: every worker runs it whole, as TensorFlow does.


class MixRouter(_SharedProvider):
    """Routes the splits of one provider to the inputs of a sample/choose, in any order."""

    def __init__(self, parent: SplitProvider, n: int) -> None:
        import threading
        from collections import deque

        super().__init__(parent)
        self._queues: list[deque[object]] = [deque() for _ in range(n)]
        self._lock = threading.Lock()  # an input may read in a prefetch thread of its own

    def _next_for(self, k: int) -> object | None:
        with self._lock:
            queue = self._queues[k]
            while not queue:
                split = self._pull()
                if split is None:
                    return None
                if not isinstance(split, ComponentSplit) or not 0 <= split.component < len(
                        self._queues):
                    raise TypeError(f"{len(self._queues)} mixed inputs read ComponentSplit "
                                    f"splits of inputs 0..{len(self._queues) - 1}, the "
                                    f"provider served {split!r}")
                self._queues[split.component].append(split.split)
            return queue.popleft()


def mixed_splits(parts: Sequence[Sequence[Any]], rates: Sequence[float],
                 sizes: Sequence[int]) -> list[ComponentSplit]:
    """The splits of inputs ``parts`` in one list, each input's spread over it by the time the
    sampling needs them: split ``j`` of input ``k`` (about ``sizes[k]`` elements in all, or a
    negative size: unknown, counted as one element per split) at ``(j + 1/2) * elements per
    split / rates[k]``; an input of rate 0 last."""
    keyed: list[tuple[float, int, int]] = []
    for k, (part, rate) in enumerate(zip(parts, rates, strict=True)):
        per_split = sizes[k] / len(part) if sizes[k] > 0 and len(part) else 1.0
        for j in range(len(part)):
            key = (j + 0.5) * per_split / rate if rate > 0 else float("inf")
            keyed.append((key, k, j))
    keyed.sort()
    return [ComponentSplit(k, parts[k][j]) for _, k, j in keyed]


def shared_splits(lists: list[Sequence[Any]], length: int, split_size: int | None,
                  enumerate_with: Callable[[int], Sequence[Any]]) -> Sequence[Any] | str:
    """The splits the components of a zip share, or the reason they cannot share any.

    ``lists`` are the components' own splits. When they differ only because each index-range
    source picked a split size for its own length, the components are cut again with one size
    (``split_size``, or the default for the shortest ``length``) and clipped to that length:
    ``enumerate_with(size)`` returns the components' lists cut with ``size``.
    """
    if all(lst == lists[0] for lst in lists):
        return lists[0]
    if length >= 0 and all(isinstance(s, IndexRange) for lst in lists for s in lst):
        size = split_size or default_split_size(length)
        clipped = [[IndexRange(s.start, min(s.stop, length)) for s in lst if s.start < length]
                   for lst in enumerate_with(size)]
        if all(lst == clipped[0] for lst in clipped):
            return clipped[0]
    return ("zip() with dynamic or file sharding needs components that share their splits "
            "(index-range sources such as range/from_tensor_slices cut with one split size, or "
            "the same files); these components are cut differently")
