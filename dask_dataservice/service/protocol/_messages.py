"""The wire protocol of the data service: every message shape in one place.

Request/response handlers answer dicts (``{"status": "OK", ...}``, see :mod:`dask_dataservice._rpc`);
the shapes of those that carry structure are the TypedDicts below, so the dispatcher, the data
workers and the readers agree on field names instead of list positions.

- :class:`TaskDef`: what a data worker needs to run a task (dispatcher → worker, pushed with the
  stream op ``dataservice-tasks`` and answered to heartbeats).
- :class:`TaskChanges`: which tasks a data worker starts and drops (the stream op
  ``dataservice-tasks`` and the reply to its heartbeat carry the same two lists).
- :class:`TaskInfo` / :class:`IterationView`: what a reader sees of an iteration (dispatcher →
  client, in replies to ``get_or_create_iteration`` and client heartbeats).
- :class:`ElementBatch`: a list of elements: one pickle (protocol 5) of the list, with every numpy
  buffer out of band: small ones packed into one frame, big ones a zero-copy frame each, maybe
  compressed (see :mod:`._frames`); a tracking job's run list in the header (:mod:`._runs`).
"""

from __future__ import annotations

import pickle
from typing import Any, NotRequired, TypedDict

from distributed.protocol.serialize import dask_deserialize, dask_serialize

from ..._rpc import raise_for_status as _raise_for_status
from ...errors import DispatcherUnavailableError
from ._frames import pack_buffers, pack_threshold, unpack_buffers, writable_frames
from ._runs import RunBatch, Runs

__all__ = [
    "TASKS_OP",
    "WORKER_KEY_OP",
    "ElementBatch",
    "IterationView",
    "TaskChanges",
    "TaskDef",
    "TaskInfo",
    "raise_for_status",
    "send_tasks",
]

#: The stream op the dispatcher pushes task changes to a data worker with.
TASKS_OP = "dataservice-tasks"
#: The stream op that brings a data worker its key (only the scheduler's stream carries it).
WORKER_KEY_OP = "dataservice-worker-key"


class TaskDef(TypedDict):
    """A task as a data worker runs it."""

    task_id: int
    iteration_id: int
    job_id: int
    dataset_id: int
    #: ``int(ShardingPolicy)``; FILE_OR_DATA is already resolved to FILE or DATA.
    processing_mode: int
    #: Static sharding: this worker's shard (its index in the job's worker list), else None.
    worker_index: int | None
    #: Static sharding: the number of shards (workers in the job's list), else None.
    num_workers: int | None
    #: Coordinated reads: the number of consumers, else None.
    num_consumers: int | None
    #: Whether the job uses the cross-trainer cache.
    cross_trainer_cache: bool
    #: The job's capability (``CreateJob.token``): consumers must show it to read the task's
    #: elements, and the worker shows it to take, acknowledge and finish the task's splits.
    job_token: str
    #: A job tracking input positions: ``CreateJob.position`` (:mod:`._positions`), else "".
    position: NotRequired[str]
    #: DYNAMIC, pushed as its iteration starts: its first split indices and whether the
    #: repetition ends after them (issue 25: no split request before the first element).
    first_splits: NotRequired[tuple[list[int], bool]]


class TaskChanges(TypedDict, total=False):
    """Tasks a data worker starts and drops (a push, or the reply to its heartbeat)."""

    #: ``TASKS_OP`` on a push; absent from a heartbeat reply.
    op: str
    #: ``"OK"`` in a heartbeat reply; absent from a push.
    status: str
    new_tasks: list[TaskDef]
    #: Ids of tasks to stop and forget (their iteration was collected, or is unknown).
    cancelled: list[int]
    #: Heartbeat reply only: whose ids these are (random per dispatcher start, kept across
    #: restarts in fault-tolerant mode). A worker that holds tasks of another lineage (the
    #: dispatcher restarted without its journal) drops them and forgets their task and
    #: dataset ids, which may be reused.
    lineage: str


class TaskInfo(TypedDict):
    """One task of an iteration, as a reader sees it."""

    task_id: int
    worker_address: str
    #: ``"active"``, ``"finished"`` or ``"lost"``.
    status: str


class IterationView(TypedDict, total=False):
    """What a reader knows of an iteration."""

    tasks: list[TaskInfo]
    finished: bool
    garbage_collected: bool
    processing_mode: str
    num_consumers: int | None
    #: Static sharding: listed workers that have no task yet (they have not joined).
    pending_shards: int


class ElementBatch:
    """A list of elements on the wire (see the module docstring); ``runs``: a tracking
    job's run list of the elements (issue 25, :mod:`._runs`), in the header as ``"runs"``
    and ``"counts"``; the reader's ``items`` are then a :class:`~._runs.RunBatch`."""

    __slots__ = ("items", "runs")

    def __init__(self, items: list[Any], runs: Runs | None = None) -> None:
        self.items = items
        self.runs = runs

    def __len__(self) -> int:
        return len(self.items)


@dask_serialize.register(ElementBatch)  # type: ignore[untyped-decorator]  # dask's Dispatch
def _serialize_batch(batch: ElementBatch) -> tuple[dict[str, Any], list[Any]]:
    buffers: list[Any] = []
    data = pickle.dumps(batch.items, protocol=5, buffer_callback=buffers.append)
    header, frames = pack_buffers([b.raw() for b in buffers], pack_threshold())
    header["buffers"] = len(buffers)
    if batch.runs is not None:
        header["runs"], header["counts"] = batch.runs
    frames.insert(0, data)
    return header, frames


@dask_deserialize.register(ElementBatch)  # type: ignore[untyped-decorator]
def _deserialize_batch(header: dict[str, Any], frames: list[Any]) -> ElementBatch:
    buffers = unpack_buffers(header, writable_frames(frames[1:]))
    items = pickle.loads(frames[0], buffers=buffers)
    runs = header.get("runs")
    if runs is None:
        return ElementBatch(items)
    return ElementBatch(RunBatch(items, list(runs), list(header["counts"])))


def send_tasks(scheduler: Any, address: str, message: dict[str, Any]) -> None:
    """Push task changes to a data worker on its stream; new tasks leave at once.

    The scheduler's stream to a worker batches messages sent within 5 ms of the previous
    batch: a task created right after the previous read's cancellations would wait those
    5 ms, the largest part of the time to the first element (issue 16, target 7). New tasks
    are rare (one per worker per iteration), so their batch goes now.
    """
    scheduler.worker_send(address, message)
    if not message.get("new_tasks"):
        return
    stream = scheduler.stream_comms.get(address)
    waker = getattr(stream, "waker", None)
    if waker is not None and hasattr(stream, "next_deadline"):  # distributed's BatchedSend
        stream.next_deadline = None
        waker.set()


def raise_for_status(response: Any, what: str = "request") -> dict[str, Any]:
    """:func:`dask_dataservice._rpc.raise_for_status` with the data service's errors."""
    return _raise_for_status(
        response, what,
        missing=("is dask_dataservice installed on this cluster? (dds.install(client), or start "
                 "the scheduler and workers with --preload dask_dataservice)"),
        closing_error=DispatcherUnavailableError)
