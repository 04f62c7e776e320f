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

Cost: O(splits of the dataset) per request (a scan over the hint), fine for the thousands of
partitions a Dask collection has; the hint is decoded once per dataset.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import _split_order

__all__ = ["LOCALITY_KEY", "pick"]

#: Dataset metadata key of the hint (``dask_dataservice.data.dask_source.LOCALITY_KEY``).
LOCALITY_KEY = "dask_locality"

#: ``{dispatcher: {iteration_id or -1 - dataset_id: hint or None}}``: decoded hints, per
#: dispatcher instance (a restarted dispatcher is a new instance and decodes them again).
_HINTS: weakref.WeakKeyDictionary[Any, dict[int, list[tuple[Any, ...]] | None]] = \
    weakref.WeakKeyDictionary()


def _key(plain: Any) -> Any:
    """A Dask key from its plain (msgpack) form: lists back to tuples."""
    if isinstance(plain, list | tuple):
        return tuple(_key(k) for k in plain)
    return plain


def _hint(dispatcher: Any, iteration_id: int) -> list[tuple[Any, ...]] | None:
    """The decoded hint of the iteration's dataset, or None (cached: one lookup per
    iteration, one decoding per dataset)."""
    hints = _HINTS.setdefault(dispatcher, {})
    if iteration_id in hints:
        return hints[iteration_id]
    state = dispatcher.state
    dataset_id = state.job(state.iteration(iteration_id).job_id).dataset_id
    if -1 - dataset_id not in hints:  # datasets under negative keys, iterations positive
        dataset = state.dataset(dataset_id)
        raw = (dataset.metadata or {}).get(LOCALITY_KEY)
        hints[-1 - dataset_id] = (
            [tuple(_key(k) for k in keys) for keys in raw]
            if isinstance(raw, list | tuple) and len(raw) == dataset.num_splits else None)
    hint = hints[iteration_id] = hints[-1 - dataset_id]
    return hint


def _holders(tasks: Any, keys: tuple[Any, ...]) -> set[str]:
    """Addresses of the workers holding any of ``keys``."""
    out: set[str] = set()
    for key in keys:
        ts = tasks.get(key)
        if ts is not None:
            out.update(ws.address for ws in ts.who_has or ())
    return out


def pick(dispatcher: Any, iteration_id: int, task_id: int, count: int) -> tuple[int, ...]:
    """Up to ``count`` split indices for ``task_id``, or ``()`` when the iteration's dataset
    has no locality hint (then the splits go in index order, as always)."""
    if count <= 0:
        return ()
    hint = _hint(dispatcher, iteration_id)
    if hint is None:
        return ()
    taken = _split_order.taken(dispatcher.state, iteration_id)
    address = dispatcher.state.task(task_id).worker_address
    tasks = dispatcher.scheduler.tasks
    local: list[int] = []
    orphans: list[int] = []  # in no worker's memory (lost, or released): no one reads them locally
    other = -1
    for i, keys in enumerate(hint):
        if i in taken:
            continue
        holders = _holders(tasks, keys)
        if address in holders:
            local.append(i)
            if len(local) == count:
                break
        elif not holders:
            if len(orphans) < count:
                orphans.append(i)
        elif other < 0:
            other = i
    if local:
        return tuple(local)
    if orphans:
        return tuple(orphans)
    return (other,) if other >= 0 else ()
