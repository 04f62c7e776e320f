"""The split API: how a source is cut into pieces that the data service hands out.

A *split* is a small, picklable descriptor of one piece of a source: an index range for
``range`` / ``from_tensor_slices`` / ``from_zarr``, one file for file sources. Splits are
enumerated once, where the pipeline is defined (``Dataset.splits()``), and stored as plain
data, so whoever hands them out (the dispatcher) never runs user code. A worker iterates
the pipeline with a :class:`SplitProvider`; the source then reads only the splits served,
in the order served, and every transformation above it runs unchanged.

Repetitions: when a pipeline ends in ``repeat()``, each pass over the source is one
*repetition* of its splits. ``Repeat`` calls :meth:`SplitProvider.reset` before it restarts
its input, and a provider serves the splits of the next repetition.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "SHARD_HINT",
    "IndexRange",
    "FileSplit",
    "SplitProvider",
    "ListSplitProvider",
    "NotSplittableError",
]


class _ShardHint:
    """Placeholder for the number of shards or the shard index under HINT sharding."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "SHARD_HINT"

    def __reduce__(self):
        return (_ShardHint, ())


#: Use as ``ds.shard(SHARD_HINT, SHARD_HINT)``: under the data service's HINT sharding policy
#: each worker replaces it with ``(num_workers, worker_index)``.
SHARD_HINT = _ShardHint()


class NotSplittableError(ValueError):
    """The pipeline cannot be cut into splits (the message says why)."""


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


def index_ranges(n: int, split_size: int) -> list[IndexRange]:
    """Cut ``n`` positions into consecutive ranges of ``split_size`` (the last may be short)."""
    if split_size < 1:
        raise ValueError(f"split_size must be a positive integer, got {split_size}")
    return [IndexRange(i, min(i + split_size, n)) for i in range(0, n, split_size)]


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

    def __iter__(self):
        while (split := self.get_next()) is not None:
            yield split


class ListSplitProvider(SplitProvider):
    """Serves a fixed list of splits; every repetition serves the whole list again.

    Parameters
    ----------
    splits
        The splits, in the order to serve them.
    """

    def __init__(self, splits: Iterable[object]):
        self.splits: Sequence[object] = list(splits)
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
