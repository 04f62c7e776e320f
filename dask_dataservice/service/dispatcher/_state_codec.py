"""The dispatcher's state as one compact, versioned blob (a journal snapshot), and replay.

:func:`encode_state` / :func:`decode_state` turn a whole
:class:`~dask_dataservice.service.dispatcher.state.DispatcherState` into msgpack bytes and back (never
pickle); the journal stores them as a snapshot (:mod:`.journal`, "Snapshots"), so that a
restart replays the snapshot plus the records after it instead of the whole history.
:func:`restore` is that replay, and :func:`compact` what the journal writer calls, on its own
thread, to fold closed segments into a new snapshot.

Snapshot payload (msgpack map, version 1)::

    {"version": 1,
     "next_ids": [dataset, iteration, iteration_client, task, job],
     "fields": {"Dataset": [field names], "Worker": [...], ...},   # one row shape per entity
     "datasets": [[value, ...], ...],            # rows in the order of "fields"
     "workers": [...], "jobs": [...], "iterations": [...], "tasks": [...],
     "iteration_clients": [...], "split_cursors": [...],
     "lost_splits": [[iteration_id, [repetition, start, stop, ...]], ...],     # runs
     "splits_in_flight": [[task_id, [repetition, start, stop, ...]], ...],   # runs
     "split_orders": [[iteration_id, [split, ...]], ...],   # explicit orders (locality); optional
     "ended_split_orders": [[iteration_id, repetition, [split, ...]], ...],  # the last ended one; optional
     "collected_datasets": [start, stop, ...]}   # ids of collected datasets, as runs; optional

Only the primary maps are stored, in their insertion order; the secondary indexes (by
fingerprint, by name, by key, by worker, by iteration) are rebuilt from them, so a snapshot
cannot hold an index that disagrees with its entities. Entity rows are named by the
``fields`` lists (read by name, like the update records: a field added later takes its
default when an older snapshot lacks it; an unknown field is an error). Tuples travel as
lists and frozensets as sorted lists.

Rules: as the state's (pure: no I/O, no clock); these functions run on the journal's
compaction thread and on the dispatcher's recovery thread, never on the event loop.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

import msgpack

from ...errors import DataServiceError
from . import _split_order
from ._entities import Dataset, Iteration, IterationClient, Job, SplitCursor, Task, Worker
from ._journal_format import JournalCorruptedError, JournalRecord, Snapshot
from ._updates import decode_update
from .state import DispatcherState

__all__ = ["SNAPSHOT_VERSION", "compact", "decode_state", "encode_state", "next_ids",
           "restore"]

#: Version of the snapshot payload written by :func:`encode_state`.
SNAPSHOT_VERSION = 1

#: ``(key in the payload, entity class, attribute of DispatcherState)``, in rebuild order.
_TABLES: tuple[tuple[str, type, str], ...] = (
    ("datasets", Dataset, "_datasets"),
    ("workers", Worker, "_workers"),
    ("jobs", Job, "_jobs"),
    ("iterations", Iteration, "_iterations"),
    ("split_cursors", SplitCursor, "_split_cursors"),
    ("tasks", Task, "_tasks"),
    ("iteration_clients", IterationClient, "_iteration_clients"),
)
_FIELDS = {cls: [f.name for f in dataclasses.fields(cls)] for _, cls, _ in _TABLES}


def _plain(value: Any) -> Any:
    if isinstance(value, frozenset):
        return sorted(value)
    return value


def _flatten(runs: Iterable[tuple[int, int, int]]) -> list[int]:
    return [n for run in runs for n in run]


def _runs(flat: list[int]) -> list[tuple[int, int, int]]:
    if len(flat) % 3:
        raise ValueError(f"runs of splits need 3 numbers each, got {len(flat)}")
    return list(zip(flat[::3], flat[1::3], flat[2::3], strict=True))


def encode_state(state: DispatcherState) -> bytes:
    """The whole state as msgpack bytes (see the module docstring). O(size of the state).

    Parameters
    ----------
    state : DispatcherState

    Returns
    -------
    bytes
    """
    payload: dict[str, Any] = {
        "version": SNAPSHOT_VERSION,
        "next_ids": [state._next_dataset_id, state._next_iteration_id,
                     state._next_iteration_client_id, state._next_task_id, state._next_job_id],
        "fields": {cls.__name__: names for cls, names in _FIELDS.items()},
    }
    for key, cls, attr in _TABLES:
        names = _FIELDS[cls]
        payload[key] = [[_plain(getattr(entity, name)) for name in names]
                        for entity in getattr(state, attr).values()]
    payload["lost_splits"] = [[i, _flatten(runs)] for i, runs in state._lost_splits.items()]
    payload["splits_in_flight"] = [[t, _flatten(runs)]
                                   for t, runs in state._splits_in_flight.items()]
    payload["split_orders"] = _split_order.encode(state)  # locality; absent from older ones
    payload["ended_split_orders"] = _split_order.encode_ended(state)  # absent from older ones
    payload["collected_datasets"] = _id_runs(state._collected_datasets)  # absent from older ones
    data: bytes = msgpack.packb(payload, use_bin_type=True)
    return data


def _id_runs(ids: Iterable[int]) -> list[int]:
    """``[start, stop, ...]``: sorted ids as half-open runs (datasets unused since their
    registration are collected in id order, so the tombstones of a flood are one run)."""
    flat: list[int] = []
    for i in sorted(ids):
        if flat and flat[-1] == i:
            flat[-1] = i + 1
        else:
            flat += [i, i + 1]
    return flat


def _ids_of_runs(flat: list[int]) -> set[int]:
    if len(flat) % 2:
        raise ValueError(f"runs of ids need 2 numbers each, got {len(flat)}")
    return {i for start, stop in zip(flat[::2], flat[1::2], strict=True)
            for i in range(start, stop)}


def _rows(payload: dict[str, Any], key: str, cls: type) -> list[Any]:
    names = payload["fields"].get(cls.__name__)
    if names is None:
        raise ValueError(f"no field list for {cls.__name__}")
    unknown = set(names) - set(_FIELDS[cls])
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}")
    entities = []
    for row in payload[key]:
        if len(row) != len(names):
            raise ValueError(f"a {cls.__name__} row has {len(row)} values for {len(names)} fields")
        entities.append(cls(**dict(zip(names, row, strict=True))))
    return entities


def decode_state(data: bytes) -> DispatcherState:
    """A :class:`DispatcherState` from :func:`encode_state`'s bytes; indexes rebuilt.

    Parameters
    ----------
    data : bytes

    Returns
    -------
    DispatcherState

    Raises
    ------
    ValueError
        If ``data`` is not a snapshot payload this version can read.
    """
    try:
        payload = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"cannot decode the state snapshot: {e}") from e
    if not isinstance(payload, dict) or payload.get("version") != SNAPSHOT_VERSION:
        version = payload.get("version") if isinstance(payload, dict) else None
        raise ValueError(f"unsupported state snapshot version {version!r} "
                         f"(this is {SNAPSHOT_VERSION})")
    try:
        return _build(payload)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed state snapshot: {e!r}") from e


def _build(payload: dict[str, Any]) -> DispatcherState:
    state = DispatcherState()
    (state._next_dataset_id, state._next_iteration_id, state._next_iteration_client_id,
     state._next_task_id, state._next_job_id) = payload["next_ids"]
    for dataset in _rows(payload, "datasets", Dataset):
        state._datasets[dataset.dataset_id] = dataset
        if dataset.dataset_name is None:
            state._dataset_by_fingerprint[dataset.fingerprint] = dataset.dataset_id
        else:
            state._dataset_by_name[dataset.dataset_name] = dataset.dataset_id
    for worker in _rows(payload, "workers", Worker):
        worker.tags = tuple(worker.tags)
        state._workers[worker.address] = worker
        if worker.registered:
            state._tasks_by_worker[worker.address] = {}
    state._collected_datasets = _ids_of_runs(payload.get("collected_datasets", []))
    for job in _rows(payload, "jobs", Job):
        job.worker_addresses = tuple(job.worker_addresses)
        state._jobs[job.job_id] = job
        if not job.garbage_collected:
            state._live_jobs_by_dataset[job.dataset_id] = \
                state._live_jobs_by_dataset.get(job.dataset_id, 0) + 1
            if job.job_name is not None:
                state._jobs_by_name[(job.dataset_id, job.job_name)] = job.job_id
    for iteration in _rows(payload, "iterations", Iteration):
        iteration.finished_shards = frozenset(iteration.finished_shards)
        state._iterations[iteration.iteration_id] = iteration
        state._iterations_by_key[(iteration.job_id, iteration.repetition)] = \
            iteration.iteration_id
        if not iteration.garbage_collected:
            state._tasks_by_iteration[iteration.iteration_id] = {}
    for cursor in _rows(payload, "split_cursors", SplitCursor):
        state._split_cursors[cursor.iteration_id] = cursor
    for task in _rows(payload, "tasks", Task):
        state._tasks[task.task_id] = task
        state._tasks_by_iteration[task.iteration_id][task.task_id] = None
        if task.shard_index is not None:
            state._tasks_by_shard.setdefault(
                (task.iteration_id, task.shard_index), []).append(task.task_id)
        if task.status == "active":
            state._tasks_by_worker[task.worker_address][task.iteration_id] = task.task_id
    for client in _rows(payload, "iteration_clients", IterationClient):
        state._iteration_clients[client.iteration_client_id] = client
    for iteration_id, flat in payload["lost_splits"]:
        state._lost_splits[iteration_id] = _runs(flat)
    for task_id, flat in payload["splits_in_flight"]:
        state._splits_in_flight[task_id] = deque(_runs(flat))
    _split_order.decode(state, payload.get("split_orders", []))
    _split_order.decode_ended(state, payload.get("ended_split_orders", []))
    return state


def next_ids(state: DispatcherState) -> list[int]:
    """The next free id of each namespace (the journal manifest's high-water mark)."""
    return [state._next_dataset_id, state._next_iteration_id,
            state._next_iteration_client_id, state._next_task_id, state._next_job_id]


def _raise_ids(state: DispatcherState, high_water: tuple[int, ...]) -> None:
    (state._next_dataset_id, state._next_iteration_id, state._next_iteration_client_id,
     state._next_task_id, state._next_job_id) = [
        max(a, b) for a, b in itertools.zip_longest(next_ids(state), high_water[:5],
                                                    fillvalue=0)]


def restore(snapshot: Snapshot | None, records: Iterable[JournalRecord],
            high_water: tuple[int, ...] = ()) -> tuple[DispatcherState, int]:
    """Replay a journal: its snapshot (if any), then every record after it.

    Parameters
    ----------
    snapshot : Snapshot or None
        The newest snapshot (:func:`~dask_dataservice.service.dispatcher.journal.load_journal`).
    records : iterable of JournalRecord
        The records after it, in journal order.
    high_water : tuple of int
        The journal manifest's next ids (dataset, iteration, iteration client, task, job):
        the replayed state's next ids are raised to them, so that no id is handed out twice
        in a work_dir's life.

    Returns
    -------
    (DispatcherState, int)
        The state and the number of records applied after the snapshot.

    Raises
    ------
    JournalCorruptedError
        A snapshot that cannot be decoded, or a record that decodes but cannot be applied to
        the state replayed so far (a record the dispatcher could never have journaled: the
        journal is damaged, or records were lost or reordered); the error names the file and
        byte offset, with the state's own error as its cause.
    """
    if snapshot is None:
        state = DispatcherState()
    else:
        try:
            state = decode_state(snapshot.payload)
        except ValueError as e:
            raise JournalCorruptedError(snapshot.path, 0, str(e)) from e
    applied = 0
    for record in records:
        try:
            update = decode_update(record.payload)
            state.apply(update)
        except DataServiceError as e:
            raise JournalCorruptedError(
                record.path, record.offset,
                f"a record that cannot be replayed ({type(e).__name__}: {e}); it is illegal "
                f"after the {applied} record(s) before it"
                + (f" and the snapshot {snapshot.path.name}" if snapshot is not None else ""),
            ) from e
        applied += 1
    _raise_ids(state, high_water)
    return state, applied


def compact(snapshot: Snapshot | None, records: Iterable[JournalRecord]) -> bytes:
    """The journal writer's compaction callback: a new snapshot payload from the old and
    the records of the segments it folds in (:func:`restore`, then :func:`encode_state`)."""
    state, _ = restore(snapshot, records)
    return encode_state(state)
