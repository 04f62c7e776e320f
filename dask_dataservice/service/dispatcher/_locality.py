"""Locality-aware DYNAMIC hand-out: each data worker first gets the splits in its memory.

A dataset registered from a *persisted* Dask collection (``Dataset.from_dask``) carries a
locality hint in its metadata (``"dask_locality"``: for each split, the keys of its
partition). The dispatcher runs inside the scheduler, so it sees where every key is
(``scheduler.tasks[key].who_has``). When a task of such a DYNAMIC iteration asks for splits,
:func:`pick` answers the splits not handed out yet in this repetition whose keys the task's
worker holds, in index order; once it holds none of the remaining ones, the splits no worker
holds (lost or released partitions: nobody reads them locally), as many as asked; then one
split that another worker holds per request (so a fast worker does not take a whole batch that
another worker would read locally). The choice is journaled as ``ProduceSplits.indices`` (see :mod:`._split_order`), so a
restarted dispatcher replays it; the keys' whereabouts are only consulted, never journaled.

A dataset with an ``autocache()`` op (metadata ``"autocache"``, issue 26) is handed out the
same way, its hint made here: split ``i``'s key is a :class:`CacheKey`, held by the data
workers that reported caching split ``i`` (:class:`Cached`, volatile: a restarted dispatcher
learns it again, meanwhile splits go where they would have; a split served from a worker
without it is only recomputed). So a later epoch, job or trainer reads each split where it
is cached.

Cost: O(splits of the dataset) per request (a scan over the hint), fine for the thousands of
partitions a Dask collection has; the hint is decoded once per dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from . import _split_order

if TYPE_CHECKING:
    from .state import DispatcherState

__all__ = ["AUTOCACHE_KEY", "LOCALITY_KEY", "CacheKey", "Cached", "Hints", "ordered", "pick"]

#: Dataset metadata key of the hint (``dask_dataservice.data.dask_source.LOCALITY_KEY``).
LOCALITY_KEY = "dask_locality"


#: Dataset metadata key: the dataset has an ``autocache()`` op (its splits go first to the
#: worker that cached them).
AUTOCACHE_KEY = "autocache"


def ordered(metadata: dict[str, Any] | None) -> bool:
    """Whether a dataset's DYNAMIC splits are handed out in an explicit order."""
    return bool(metadata and (metadata.get(LOCALITY_KEY) or metadata.get(AUTOCACHE_KEY)))


class CacheKey(tuple[int, int]):
    """Split ``[1]`` of dataset ``[0]`` in a data worker's autocache (a hint's key)."""

    __slots__ = ()


class Cached:
    """Which data workers cached which splits (their ``dataservice_autocached`` reports)."""

    def __init__(self) -> None:
        #: ``{dataset_id: {split index: worker addresses}}``
        self.splits: dict[int, dict[int, set[str]]] = {}
        #: ``{address: dataset ids it reported}``, to forget a worker that left.
        self.datasets: dict[str, set[int]] = {}

    def add(self, dataset_id: int, address: str, indices: Iterable[int]) -> None:
        """O(len(indices))."""
        splits = self.splits.setdefault(dataset_id, {})
        for i in indices:
            splits.setdefault(int(i), set()).add(address)
        self.datasets.setdefault(address, set()).add(dataset_id)

    def holders(self, key: tuple[int, int]) -> set[str]:
        return self.splits.get(key[0], {}).get(key[1], set())

    def forget(self, address: str) -> None:
        """``address`` left: its caches went with it (O(splits it reported))."""
        for dataset_id in self.datasets.pop(address, ()):
            for who in self.splits.get(dataset_id, {}).values():
                who.discard(address)


class Hints(dict[int, "list[tuple[Any, ...]] | None"]):
    """``{iteration_id or -1 - dataset_id: hint or None}``: the decoded hints of one
    dispatcher core (a restarted dispatcher has a new one and decodes them again), and what
    the data workers cached (:class:`Cached`)."""

    def __init__(self) -> None:
        super().__init__()
        self.cached = Cached()


def _key(plain: Any) -> Any:
    """A Dask key from its plain (msgpack) form: lists back to tuples."""
    if isinstance(plain, list | tuple):
        return tuple(_key(k) for k in plain)
    return plain


def _hint(state: DispatcherState, hints: Hints,
          iteration_id: int) -> list[tuple[Any, ...]] | None:
    """The decoded hint of the iteration's dataset, or None (cached: one lookup per
    iteration, one decoding per dataset)."""
    if iteration_id in hints:
        return hints[iteration_id]
    dataset_id = state.job(state.iteration(iteration_id).job_id).dataset_id
    if -1 - dataset_id not in hints:  # datasets under negative keys, iterations positive
        dataset = state.dataset(dataset_id)
        raw = (dataset.metadata or {}).get(LOCALITY_KEY)
        if raw is None and (dataset.metadata or {}).get(AUTOCACHE_KEY):
            raw = [(CacheKey((dataset_id, i)),) for i in range(dataset.num_splits)]
            hints[-1 - dataset_id] = raw
        else:
            hints[-1 - dataset_id] = (
                [tuple(_key(k) for k in keys) for keys in raw]
                if isinstance(raw, list | tuple) and len(raw) == dataset.num_splits else None)
    hint = hints[iteration_id] = hints[-1 - dataset_id]
    return hint


def _holders(holders: Callable[[Any], Iterable[str]], keys: tuple[Any, ...],
             cached: Cached) -> set[str]:
    """Addresses of the workers holding any of ``keys``."""
    out: set[str] = set()
    for key in keys:
        out.update(cached.holders(key) if isinstance(key, CacheKey) else holders(key))
    return out


def pick(state: DispatcherState, hints: Hints, holders: Callable[[Any], Iterable[str]],
         iteration_id: int, task_id: int, count: int) -> tuple[int, ...]:
    """Up to ``count`` split indices for ``task_id``, or ``()`` when the iteration's dataset
    has no locality hint (then the splits go in index order, as always). ``holders(key)``:
    the addresses of the workers holding Dask key ``key`` (the scheduler's ``who_has``)."""
    if count <= 0:
        return ()
    hint = _hint(state, hints, iteration_id)
    if hint is None:
        return ()
    taken = _split_order.taken(state, iteration_id)
    address = state.task(task_id).worker_address
    local: list[int] = []
    orphans: list[int] = []  # in no worker's memory (lost, or released): no one reads them locally
    other = -1
    for i, keys in enumerate(hint):
        if i in taken:
            continue
        who = _holders(holders, keys, hints.cached)
        if address in who:
            local.append(i)
            if len(local) == count:
                break
        elif not who:
            if len(orphans) < count:
                orphans.append(i)
        elif other < 0:
            other = i
    if local:
        return tuple(local)
    if orphans:
        return tuple(orphans)
    return (other,) if other >= 0 else ()
