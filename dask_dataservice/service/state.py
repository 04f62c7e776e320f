"""The dispatcher's state as a pure, replayable state machine.

:class:`DispatcherState` holds everything the dispatcher knows about datasets, workers, jobs,
iterations, tasks, split cursors and iteration clients. It changes in one way only:
:meth:`DispatcherState.apply` with an update record (:data:`Update`, a closed set of frozen
dataclasses). In fault-tolerant mode the dispatcher journals each update before applying it
(:func:`encode_update` gives the bytes), and on restart :func:`replay` rebuilds the same state::

    state = DispatcherState()
    update = RegisterDataset(
        dataset_id=state.next_dataset_id(), fingerprint="f00d", pipeline=b"...",
        splits=b"...", num_splits=8,
    )
    state.check(update)                 # raises if illegal; changes nothing
    journal.append(encode_update(update))
    state.apply(update)                 # cannot fail after a successful check

    restored = replay(decode_update(record) for record in journal)
    assert restored == state
"""

# Rules
# =====
#
# Rule 1: everything that changes the dispatcher's state lives in this file, and the only way in
# is ``DispatcherState.apply(update)``. Accessors hand out detached copies; mutating a copy
# changes nothing here.
#
# Rule 2: this file does no I/O, no asyncio, reads no clock and imports neither Dask nor user
# code. The scheduler never unpickles a pipeline: ``Dataset.pipeline`` and ``Dataset.splits``
# are opaque bytes.
#
# Rule 3: an update is a complete description of the change. Ids and times travel inside the
# record: the dispatcher picks ids with ``next_*_id()`` and reads the clock itself; the mutator
# sets ``counter = max(counter, id + 1)``. Replaying the same records therefore reproduces the
# same ids and the same timestamps, whatever the clock says during replay.
#
# Rule 4: check first, then mutate. ``check(update)`` raises a typed error for an illegal update
# and touches nothing; the mutators (``_register_dataset``, ...) never raise on a checked update.
# ``apply`` runs both, so an illegal update leaves the state exactly as it was. The dispatcher
# calls ``check`` before journaling, so the journal only ever holds legal records.
#
# Rule 5: update records are versioned like proto messages. Fields are only appended, each new
# field gets a default (old records decode with it), removed field names are listed in the
# record's docstring and never reused, and a record type is never renamed. The "Next field"
# note in each docstring is the number the next field gets.
#
# Rule 6: every update is O(1), except ``GarbageCollectIteration`` (O(tasks of the iteration)),
# ``RemoveWorker`` (O(active tasks of the worker + splits they hold)) and ``AckSplits``
# (O(splits acknowledged), so O(1) amortised per split produced).
#
# Theory of operation
# ===================
#
# Entities. A *dataset* is registered once per fingerprint and never removed. A *worker* is
# registered when it joins and marked departed (``registered=False``) when it leaves; it may
# register again at the same address. A *job* reads one dataset in one processing mode. A
# *named* job is shared by every client that uses its name and gets one *iteration* per
# ``repetition`` (the n-th time the clients iterate the dataset under that name); an anonymous
# job has exactly one iteration, repetition 0. An iteration has one *task* per worker that
# produces data for it, and any number of *iteration clients* (consumers).
#
# Lifecycles (the tables ``TASK_TRANSITIONS``, ``ITERATION_ACCEPTS``, ``JOB_ACCEPTS`` and
# ``WORKER_ACCEPTS`` below are the source of truth; checks consult them):
#
#   task       active --FinishTask--> finished
#              active --RemoveWorker--> lost          (its worker left; never finishes)
#              any    --GarbageCollectIteration--> removed from the state
#   iteration  running --(derived)--> finished --GarbageCollectIteration--> garbage_collected
#              finished --CreateTask--> running   (a late worker of a static-sharding job)
#              ``finished`` is recomputed by every mutator that touches a task: at least one
#              task finished and every task is finished or lost. While all tasks are lost and
#              none finished the iteration keeps running, so a new worker can take it over.
#   job        live --GC of its last live iteration--> garbage_collected (its name is freed,
#              and a new job may take it; the old job accepts no more iterations)
#   worker     registered --RemoveWorker--> departed --RegisterWorker--> registered
#
# Split cursor (DYNAMIC jobs only). The dataset's splits were enumerated by the client and are
# stored as one opaque blob; the dispatcher only hands out *indices* into it, so only counters
# are journaled, never split contents. Each DYNAMIC iteration has a cursor ``(repetition,
# next_index)``. ``repetition`` is the split provider's epoch inside a task pipeline's
# ``.repeat()``. A task asks for "the next split of repetition r". If r is older than the
# cursor, the request is stale (``StaleEpochError``: the dispatcher answers end-of-splits).
# Otherwise the dispatcher journals ``ProduceSplit(iteration, r, next_index, task, finished)``
# where ``finished = next_index == num_splits``: not finished hands split ``(r, next_index)`` to
# the task and advances ``next_index``; finished means end-of-splits for repetition r, and the
# cursor moves to ``(r + 1, 0)``.
#
# Splits in flight and lost splits. Every split handed out is remembered as held by its task
# until the task acknowledges it (``AckSplits(task, r, i)``: "done with every split up to and
# including (r, i)") or finishes. A task receives splits in increasing ``(repetition, index)``
# order, so its held splits are a sorted deque and an acknowledgement pops from its left. When
# a worker leaves, the splits its active tasks held are recorded in the iteration's lost set.
# The cursor never moves back, so a lost split is never handed out again: DYNAMIC sharding is
# exactly-once without failures and at-most-once with them.
#
# Liveness. Iteration clients carry the times of their acquisition and last heartbeat, and an
# iteration the time its last client was released. The dispatcher decides who is dead from
# those times and its own clock, then journals ``ReleaseIterationClient`` and
# ``GarbageCollectIteration``; the state only stores what the records say.
#
# Memory. Datasets, jobs and iterations stay in the state after GC (a few hundred bytes each,
# as in TensorFlow); tasks and clients are removed. ``splits_in_flight`` stays small as long as
# workers acknowledge the splits they finish.

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from dask_dataservice.service._exceptions import (
    DataServiceError,
    DatasetNotFoundError,
    IllegalUpdateError,
    IterationClientNotFoundError,
    IterationNotFoundError,
    JobNameInUseError,
    JobNotFoundError,
    StaleEpochError,
    TaskNotFoundError,
    WorkerNotFoundError,
)

__all__ = [
    "DATASET_ID_BASE",
    "ITERATION_CLIENT_ID_BASE",
    "ITERATION_ID_BASE",
    "JOB_ID_BASE",
    "PROCESSING_MODES",
    "TARGET_WORKERS",
    "TASK_ID_BASE",
    "UPDATE_TYPES",
    "AckSplits",
    "AcquireIterationClient",
    "ClientHeartbeat",
    "CreateIteration",
    "CreateJob",
    "CreateTask",
    "Dataset",
    "DispatcherState",
    "FinishTask",
    "GarbageCollectIteration",
    "Iteration",
    "IterationClient",
    "Job",
    "ProduceSplit",
    "RegisterDataset",
    "RegisterWorker",
    "ReleaseIterationClient",
    "RemoveWorker",
    "SplitCursor",
    "Task",
    "Update",
    "Worker",
    "decode_update",
    "encode_update",
    "replay",
]

#: First id of each namespace. Distinct bases make an id used in the wrong namespace stand out
#: (a "job id" of 2003 is really an iteration id). The same bases as TensorFlow's dispatcher.
DATASET_ID_BASE: Final = 1000
ITERATION_ID_BASE: Final = 2000
ITERATION_CLIENT_ID_BASE: Final = 3000
TASK_ID_BASE: Final = 4000
JOB_ID_BASE: Final = 5000

#: Canonical sharding policies (``ShardingPolicy`` names). The client maps the legacy
#: ``"parallel_epochs"`` / ``"distributed_epoch"`` to ``"OFF"`` / ``"DYNAMIC"`` before a job is
#: created; the state only accepts these.
PROCESSING_MODES: Final = frozenset({"OFF", "DYNAMIC", "FILE", "DATA", "FILE_OR_DATA", "HINT"})

#: Which workers a job's consumers read from.
TARGET_WORKERS: Final = frozenset({"AUTO", "ANY", "LOCAL"})


# ---------------------------------------------------------------------------------------------
# Update records
# ---------------------------------------------------------------------------------------------


class _Record:
    """Base of the update records: type-checks the fields on construction.

    Don't subclass the records. ``apply`` matches on their classes and ``decode_update`` looks
    them up by class name, so a subclass would be misread.
    """

    __slots__ = ()

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True, slots=True)
class RegisterDataset(_Record):
    """A client registered a dataset whose fingerprint the dispatcher had not seen.

    Parameters
    ----------
    dataset_id : int
        Field 1. From :meth:`DispatcherState.next_dataset_id`.
    fingerprint : str
        Field 2. Identifies the pipeline; the same fingerprint always maps to the same id
        (the dispatcher looks it up with :meth:`DispatcherState.dataset_by_fingerprint`).
    pipeline : bytes
        Field 3. The cloudpickled pipeline. Opaque: the scheduler never unpickles it.
    splits : bytes
        Field 4. Opaque blob of split descriptors, enumerated on the client.
    num_splits : int
        Field 5. Number of splits in ``splits``, or -1 if the dataset is not splittable.
    element_spec : bytes or None
        Field 6. Opaque description of one element, if the client sent one.
    metadata : dict
        Field 7. Plain data (str keys; None, bool, int, float, str, bytes, lists, dicts).
        Tuples are stored as lists, so that a journal round trip gives back an equal record.
    compression : str or None
        Field 8. Element compression the workers should use, e.g. ``"AUTO"``.

    Notes
    -----
    Next field: 9. Removed fields: none.
    """

    dataset_id: int  # 1
    fingerprint: str  # 2
    pipeline: bytes  # 3
    splits: bytes  # 4
    num_splits: int  # 5
    element_spec: bytes | None = None  # 6
    metadata: dict[str, Any] = field(default_factory=dict)  # 7
    compression: str | None = None  # 8

    def __post_init__(self) -> None:
        _check_fields(self)
        object.__setattr__(self, "metadata", _plain(self.metadata, "RegisterDataset.metadata"))


@dataclass(frozen=True, slots=True)
class RegisterWorker(_Record):
    """A data worker joined (or re-joined after leaving) the service.

    Parameters
    ----------
    address : str
        Field 1. The worker's Dask address, its identity.
    host : str
        Field 2. Host name or IP, for ``target_workers="LOCAL"``.
    nthreads : int
        Field 3. Threads the worker runs tasks in.
    resources : dict of str to float
        Field 4. Dask resources of the worker (e.g. ``{"ps": 1.0}``).
    tags : tuple of str
        Field 5. Free-form worker tags.

    Notes
    -----
    Next field: 6. Removed fields: none.
    """

    address: str  # 1
    host: str  # 2
    nthreads: int  # 3
    resources: dict[str, float] = field(default_factory=dict)  # 4
    tags: tuple[str, ...] = ()  # 5

    def __post_init__(self) -> None:
        _check_fields(self)
        resources = {}
        for key, value in self.resources.items():
            if not isinstance(key, str) or isinstance(value, bool):
                raise TypeError(
                    f"RegisterWorker.resources must map str to float, got {key!r}: {value!r}"
                )
            resources[key] = float(value)
        object.__setattr__(self, "resources", resources)
        if not all(isinstance(tag, str) for tag in self.tags):
            raise TypeError(f"RegisterWorker.tags must be strings, got {self.tags!r}")
        object.__setattr__(self, "tags", tuple(self.tags))


@dataclass(frozen=True, slots=True)
class RemoveWorker(_Record):
    """A data worker left. Its active tasks become lost, and so do the splits they held.

    Parameters
    ----------
    address : str
        Field 1. A registered worker.

    Notes
    -----
    Next field: 2. Removed fields: none.
    """

    address: str  # 1


@dataclass(frozen=True, slots=True)
class CreateJob(_Record):
    """A client started reading a dataset and no live job with its name existed.

    Parameters
    ----------
    job_id : int
        Field 1. From :meth:`DispatcherState.next_job_id`.
    job_name : str or None
        Field 2. ``None`` for an anonymous job. Unique among live jobs.
    dataset_id : int
        Field 3. A registered dataset.
    processing_mode : str
        Field 4. One of :data:`PROCESSING_MODES`. ``"DYNAMIC"`` needs a splittable dataset.
    num_consumers : int or None
        Field 5. Consumers of a coordinated read, or ``None``. Needs a ``job_name``.
    target_workers : str
        Field 6. One of :data:`TARGET_WORKERS`.
    cross_trainer_cache : bool
        Field 7. Whether trainers share a sliding-window cache. Needs a ``job_name``.

    Notes
    -----
    Next field: 8. Removed fields: none.
    """

    job_id: int  # 1
    job_name: str | None  # 2
    dataset_id: int  # 3
    processing_mode: str  # 4
    num_consumers: int | None = None  # 5
    target_workers: str = "AUTO"  # 6
    cross_trainer_cache: bool = False  # 7


@dataclass(frozen=True, slots=True)
class CreateIteration(_Record):
    """A job is iterated (once more): create the iteration for ``(job_id, repetition)``.

    Parameters
    ----------
    iteration_id : int
        Field 1. From :meth:`DispatcherState.next_iteration_id`.
    job_id : int
        Field 2. A live job.
    repetition : int
        Field 3. How many times the job's clients had iterated it before; at most one iteration
        per ``(job_id, repetition)``. Always 0 for an anonymous job, which has one iteration.

    Notes
    -----
    Next field: 4. Removed fields: none.
    """

    iteration_id: int  # 1
    job_id: int  # 2
    repetition: int = 0  # 3


@dataclass(frozen=True, slots=True)
class CreateTask(_Record):
    """Assign a running iteration to a registered worker.

    Parameters
    ----------
    task_id : int
        Field 1. From :meth:`DispatcherState.next_task_id`.
    iteration_id : int
        Field 2. A running iteration.
    worker_address : str
        Field 3. A registered worker with no active task for this iteration.

    Notes
    -----
    Next field: 4. Removed fields: none.
    """

    task_id: int  # 1
    iteration_id: int  # 2
    worker_address: str  # 3


@dataclass(frozen=True, slots=True)
class FinishTask(_Record):
    """An active task's pipeline reached its end. Its splits in flight are done.

    Parameters
    ----------
    task_id : int
        Field 1. An active task.

    Notes
    -----
    Next field: 2. Removed fields: none.
    """

    task_id: int  # 1


@dataclass(frozen=True, slots=True)
class ProduceSplit(_Record):
    """Hand the next split of a DYNAMIC iteration to a task, or tell it the splits ran out.

    Parameters
    ----------
    iteration_id : int
        Field 1. A running DYNAMIC iteration.
    repetition : int
        Field 2. The cursor's repetition; an older one is stale (:class:`StaleEpochError`).
    index : int
        Field 3. The cursor's ``next_index``.
    task_id : int
        Field 4. The active task of this iteration that asked.
    finished : bool
        Field 5. True exactly when ``index == num_splits``: end of splits for ``repetition``,
        and the cursor moves to the next repetition.

    Notes
    -----
    Next field: 6. Removed fields: none.
    """

    iteration_id: int  # 1
    repetition: int  # 2
    index: int  # 3
    task_id: int  # 4
    finished: bool = False  # 5


@dataclass(frozen=True, slots=True)
class AckSplits(_Record):
    """A task is done with every split it holds up to and including ``(repetition, index)``.

    Added (not in TensorFlow) so that the splits in flight stay few: without it every split a
    task was ever given would count as in flight, and would be reported lost if its worker left.

    Parameters
    ----------
    task_id : int
        Field 1. An active task holding at least one split at or before the bound.
    repetition : int
        Field 2. Repetition of the last split acknowledged.
    index : int
        Field 3. Index of the last split acknowledged.

    Notes
    -----
    Next field: 4. Removed fields: none.
    """

    task_id: int  # 1
    repetition: int  # 2
    index: int  # 3


@dataclass(frozen=True, slots=True)
class AcquireIterationClient(_Record):
    """A consumer started reading an iteration.

    Parameters
    ----------
    iteration_client_id : int
        Field 1. From :meth:`DispatcherState.next_iteration_client_id`.
    iteration_id : int
        Field 2. An iteration that is not garbage collected.
    time_micros : int
        Field 3. Dispatcher clock at acquisition; counts as the first heartbeat.

    Notes
    -----
    Next field: 4. Removed fields: none.
    """

    iteration_client_id: int  # 1
    iteration_id: int  # 2
    time_micros: int  # 3


@dataclass(frozen=True, slots=True)
class ReleaseIterationClient(_Record):
    """A consumer stopped reading (it said so, or the dispatcher decided it is dead).

    Parameters
    ----------
    iteration_client_id : int
        Field 1. An acquired client.
    time_micros : int
        Field 2. Dispatcher clock at release; becomes the iteration's
        ``last_client_released_micros``.

    Notes
    -----
    Next field: 3. Removed fields: none.
    """

    iteration_client_id: int  # 1
    time_micros: int  # 2


@dataclass(frozen=True, slots=True)
class ClientHeartbeat(_Record):
    """A consumer showed it is alive.

    Parameters
    ----------
    iteration_client_id : int
        Field 1. An acquired client.
    time_micros : int
        Field 2. Dispatcher clock when the heartbeat arrived.

    Notes
    -----
    Next field: 3. Removed fields: none.
    """

    iteration_client_id: int  # 1
    time_micros: int  # 2


@dataclass(frozen=True, slots=True)
class GarbageCollectIteration(_Record):
    """Drop an iteration nobody reads any more: remove its tasks and mark it collected.

    Frees the job's name when this was the job's last live iteration.

    Parameters
    ----------
    iteration_id : int
        Field 1. An iteration with no clients that is not garbage collected yet.

    Notes
    -----
    Next field: 2. Removed fields: none.
    """

    iteration_id: int  # 1


#: Every kind of update, the closed set ``apply`` understands.
UPDATE_TYPES: Final[tuple[type, ...]] = (
    RegisterDataset,
    RegisterWorker,
    RemoveWorker,
    CreateJob,
    CreateIteration,
    CreateTask,
    FinishTask,
    ProduceSplit,
    AckSplits,
    AcquireIterationClient,
    ReleaseIterationClient,
    ClientHeartbeat,
    GarbageCollectIteration,
)

Update = (
    RegisterDataset
    | RegisterWorker
    | RemoveWorker
    | CreateJob
    | CreateIteration
    | CreateTask
    | FinishTask
    | ProduceSplit
    | AckSplits
    | AcquireIterationClient
    | ReleaseIterationClient
    | ClientHeartbeat
    | GarbageCollectIteration
)

_UPDATES_BY_NAME: Final[dict[str, type]] = {cls.__name__: cls for cls in UPDATE_TYPES}


def _field_spec(hint: Any) -> tuple[tuple[type, ...], bool]:
    """``(runtime types, reject bool)`` for one field annotation of an update record."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        specs = [_field_spec(arg) for arg in typing.get_args(hint)]
        kinds = tuple(t for ts, _ in specs for t in ts)
        return kinds, any(strict for _, strict in specs) and bool not in kinds
    if hint is type(None):
        return (type(None),), False
    origin = typing.get_origin(hint) or hint
    if origin is float:
        return (int, float), True
    if origin is tuple:
        return (tuple, list), False
    return (origin,), origin is int


#: ``{record class: [(field name, accepted types, reject bool)]}``.
_FIELD_SPECS: Final[dict[type, list[tuple[str, tuple[type, ...], bool]]]] = {
    cls: [
        (f.name, *_field_spec(typing.get_type_hints(cls)[f.name])) for f in dataclasses.fields(cls)
    ]
    for cls in UPDATE_TYPES
}


def _check_fields(record: Any) -> None:
    for name, kinds, strict in _FIELD_SPECS[type(record)]:
        value = getattr(record, name)
        if not isinstance(value, kinds) or (strict and isinstance(value, bool)):
            raise TypeError(
                f"{type(record).__name__}.{name} must be "
                f"{' or '.join(k.__name__ for k in kinds)}, got {value!r}"
            )


def _plain(value: Any, where: str) -> Any:
    """A copy of ``value`` made of msgpack-native types only (tuples become lists)."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{where} must have str keys, got {list(value)!r}")
        return {k: _plain(v, where) for k, v in value.items()}
    raise TypeError(f"{where} must be plain data, got {type(value).__name__}: {value!r}")


def encode_update(update: Update) -> bytes:
    """Serialise an update for the journal.

    The bytes are msgpack of ``[type_name, {field: value}]`` with plain values only, so a
    journal can be read without importing our classes and is never unpickled.

    Parameters
    ----------
    update : Update
        Any of :data:`UPDATE_TYPES`.

    Returns
    -------
    bytes

    Raises
    ------
    TypeError
        If ``update`` is not an update record.
    """
    cls = type(update)
    if _UPDATES_BY_NAME.get(cls.__name__) is not cls:
        raise TypeError(f"Not an update record: {update!r}")
    fields = {name: getattr(update, name) for name, _, _ in _FIELD_SPECS[cls]}
    return msgpack.packb([cls.__name__, fields], use_bin_type=True)


def decode_update(data: bytes) -> Update:
    """Read back an update written by :func:`encode_update`.

    Fields missing from ``data`` take their default (records written before the field was
    added); a missing field without a default, an unknown field, an unknown record type or a
    field of the wrong type is an error: the record cannot be applied faithfully.

    Parameters
    ----------
    data : bytes

    Returns
    -------
    Update

    Raises
    ------
    IllegalUpdateError
        If ``data`` is not a well-formed update record.
    """
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, TypeError) as e:
        raise IllegalUpdateError(f"Cannot decode update: {e}") from e
    if not (
        isinstance(obj, list)
        and len(obj) == 2
        and isinstance(obj[0], str)
        and isinstance(obj[1], dict)
    ):
        raise IllegalUpdateError(f"Cannot decode update: expected [type_name, fields], got {obj!r}")
    name, fields = obj
    cls = _UPDATES_BY_NAME.get(name)
    if cls is None:
        raise IllegalUpdateError(f"Cannot decode update: unknown update type {name!r}")
    unknown = fields.keys() - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise IllegalUpdateError(f"Cannot decode {name}: unknown fields {sorted(unknown)}")
    try:
        return cls(**fields)
    except TypeError as e:
        raise IllegalUpdateError(f"Cannot decode {name}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Lifecycles, as data (h11 style). Checks consult these tables, tests print and verify them.
# ---------------------------------------------------------------------------------------------

#: ``{task status: {update type: status after}}``. An update that names a task (or, for
#: ``RemoveWorker`` and ``GarbageCollectIteration``, reaches it through its worker or
#: iteration) is illegal in a status where it is not listed. ``"removed"`` means the task is
#: deleted from the state.
TASK_TRANSITIONS: Final[dict[str, dict[type, str]]] = {
    "active": {
        ProduceSplit: "active",
        AckSplits: "active",
        FinishTask: "finished",
        RemoveWorker: "lost",
        GarbageCollectIteration: "removed",
    },
    "finished": {GarbageCollectIteration: "removed"},
    "lost": {GarbageCollectIteration: "removed"},
}

#: ``{iteration status: update types naming the iteration that it accepts}``. (Updates that
#: name one of its tasks are governed by ``TASK_TRANSITIONS``; an active task implies a running
#: iteration.) ``running -> finished`` is derived from the tasks (see the theory of operation);
#: ``-> garbage_collected`` is GarbageCollectIteration.
ITERATION_ACCEPTS: Final[dict[str, frozenset[type]]] = {
    "running": frozenset(
        {CreateTask, ProduceSplit, AcquireIterationClient, GarbageCollectIteration}
    ),
    # CreateTask reopens a finished iteration: under static sharding an iteration is only
    # done once every listed worker ran its shard, and a listed worker may join late.
    "finished": frozenset({CreateTask, AcquireIterationClient, GarbageCollectIteration}),
    "garbage_collected": frozenset(),
}

#: ``{job status: update types it accepts}``. A job is garbage collected when its last live
#: iteration is; its name is then free for a new job.
JOB_ACCEPTS: Final[dict[str, frozenset[type]]] = {
    "live": frozenset({CreateIteration}),
    "garbage_collected": frozenset(),
}

#: ``{worker status: update types it accepts}``; ``"unknown"`` is an address never registered.
WORKER_ACCEPTS: Final[dict[str, frozenset[type]]] = {
    "unknown": frozenset({RegisterWorker}),
    "registered": frozenset({RemoveWorker, CreateTask}),
    "departed": frozenset({RegisterWorker}),
}


# ---------------------------------------------------------------------------------------------
# Entities. Plain mutable dataclasses, owned by DispatcherState; accessors return copies.
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Dataset:
    """A registered dataset. Fields as in :class:`RegisterDataset`."""

    dataset_id: int
    fingerprint: str
    pipeline: bytes
    splits: bytes
    num_splits: int
    element_spec: bytes | None
    metadata: dict[str, Any]
    compression: str | None

    @property
    def splittable(self) -> bool:
        """Whether the dataset has splits (and so supports DYNAMIC sharding)."""
        return self.num_splits >= 0


@dataclass(slots=True)
class Worker:
    """A data worker. ``registered`` is False after it left (its address stays known)."""

    address: str
    host: str
    nthreads: int
    resources: dict[str, float]
    tags: tuple[str, ...]
    registered: bool = True

    @property
    def status(self) -> str:
        """``"registered"`` or ``"departed"`` (see :data:`WORKER_ACCEPTS`)."""
        return "registered" if self.registered else "departed"


@dataclass(slots=True)
class Job:
    """A job: a dataset read in one processing mode, named or anonymous.

    ``num_iterations`` counts the iterations ever created for the job and
    ``num_live_iterations`` those not garbage collected. ``garbage_collected`` becomes True
    when the last live iteration is collected, and the name is freed then.
    """

    job_id: int
    job_name: str | None
    dataset_id: int
    processing_mode: str
    num_consumers: int | None
    target_workers: str
    cross_trainer_cache: bool
    num_iterations: int = 0
    num_live_iterations: int = 0
    garbage_collected: bool = False

    @property
    def status(self) -> str:
        """``"live"`` or ``"garbage_collected"`` (see :data:`JOB_ACCEPTS`)."""
        return "garbage_collected" if self.garbage_collected else "live"


@dataclass(slots=True)
class Iteration:
    """One pass of a job's clients over its dataset (one repetition of a named job).

    ``num_tasks``, ``num_finished_tasks`` and ``num_lost_tasks`` count the iteration's tasks;
    ``finished`` is derived from them by every mutator that changes them. After garbage
    collection the counts keep their last values, for the record.
    """

    iteration_id: int
    job_id: int
    repetition: int
    finished: bool = False
    num_clients: int = 0
    garbage_collected: bool = False
    last_client_released_micros: int | None = None
    num_tasks: int = 0
    num_finished_tasks: int = 0
    num_lost_tasks: int = 0

    @property
    def status(self) -> str:
        """``"running"``, ``"finished"`` or ``"garbage_collected"`` (see :data:`ITERATION_ACCEPTS`)."""
        if self.garbage_collected:
            return "garbage_collected"
        return "finished" if self.finished else "running"


@dataclass(slots=True)
class SplitCursor:
    """Where a DYNAMIC iteration is in its dataset's splits.

    The next split to hand out is ``(repetition, next_index)``; when ``next_index ==
    num_splits`` the next :class:`ProduceSplit` is end-of-splits for this repetition.
    """

    iteration_id: int
    num_splits: int
    repetition: int = 0
    next_index: int = 0


@dataclass(slots=True)
class Task:
    """An iteration's work on one worker. At most one of ``finished``/``lost`` is True."""

    task_id: int
    iteration_id: int
    worker_address: str
    finished: bool = False
    lost: bool = False

    @property
    def status(self) -> str:
        """``"active"``, ``"finished"`` or ``"lost"`` (see :data:`TASK_TRANSITIONS`)."""
        if self.finished:
            return "finished"
        return "lost" if self.lost else "active"


@dataclass(slots=True)
class IterationClient:
    """A consumer of an iteration, with the times the dispatcher last heard from it."""

    iteration_client_id: int
    iteration_id: int
    acquired_micros: int
    last_seen_micros: int


# ---------------------------------------------------------------------------------------------
# The state
# ---------------------------------------------------------------------------------------------


class DispatcherState:
    """Everything the dispatcher knows, changed only through :meth:`apply`.

    The attributes are heavily correlated with each other (primary maps and the secondary
    indexes built from them). **Do not** modify them directly, **ever**; build an update
    instead. Accessors return detached copies of entities. Not thread-safe: the dispatcher
    calls it from its event loop only.

    Examples
    --------
    >>> state = DispatcherState()
    >>> state.apply(RegisterDataset(dataset_id=state.next_dataset_id(), fingerprint="f",
    ...                             pipeline=b"p", splits=b"s", num_splits=2))
    >>> state.dataset_by_fingerprint("f").dataset_id
    1000
    """

    def __init__(self) -> None:
        #: Next free id of each namespace; always greater than every id used in it.
        self._next_dataset_id = DATASET_ID_BASE
        self._next_iteration_id = ITERATION_ID_BASE
        self._next_iteration_client_id = ITERATION_CLIENT_ID_BASE
        self._next_task_id = TASK_ID_BASE
        self._next_job_id = JOB_ID_BASE
        #: ``{dataset_id: Dataset}``, every dataset ever registered.
        self._datasets: dict[int, Dataset] = {}
        #: ``{fingerprint: dataset_id}``.
        self._dataset_by_fingerprint: dict[str, int] = {}
        #: ``{address: Worker}``, registered and departed workers.
        self._workers: dict[str, Worker] = {}
        #: ``{address: {iteration_id: task_id}}``: the active tasks of each *registered* worker.
        self._tasks_by_worker: dict[str, dict[int, int]] = {}
        #: ``{job_id: Job}``, every job ever created.
        self._jobs: dict[int, Job] = {}
        #: ``{job_name: job_id}`` of the live named jobs.
        self._jobs_by_name: dict[str, int] = {}
        #: ``{iteration_id: Iteration}``, every iteration ever created.
        self._iterations: dict[int, Iteration] = {}
        #: ``{(job_id, repetition): iteration_id}``, every iteration ever created.
        self._iterations_by_key: dict[tuple[int, int], int] = {}
        #: ``{iteration_id: SplitCursor}`` of the DYNAMIC iterations.
        self._split_cursors: dict[int, SplitCursor] = {}
        #: ``{iteration_id: {(repetition, index)}}``: splits held by tasks whose worker left,
        #: for every DYNAMIC iteration.
        self._lost_splits: dict[int, set[tuple[int, int]]] = {}
        #: ``{task_id: Task}``, the tasks of iterations that are not garbage collected.
        self._tasks: dict[int, Task] = {}
        #: ``{iteration_id: {task_id: None}}`` (an ordered set) for each iteration that is not
        #: garbage collected: all its tasks, active, finished or lost.
        self._tasks_by_iteration: dict[int, dict[int, None]] = {}
        #: ``{task_id: deque[(repetition, index)]}``, ascending: the splits an active task holds
        #: and has not acknowledged. Tasks holding none have no entry.
        self._splits_in_flight: dict[int, deque[tuple[int, int]]] = {}
        #: ``{iteration_client_id: IterationClient}``, the acquired clients.
        self._iteration_clients: dict[int, IterationClient] = {}

    def __repr__(self) -> str:
        return (
            f"<DispatcherState: {len(self._datasets)} datasets, "
            f"{len(self._tasks_by_worker)} workers, {len(self._jobs_by_name)} named jobs, "
            f"{len(self._iterations)} iterations, {len(self._tasks)} tasks, "
            f"{len(self._iteration_clients)} clients>"
        )

    # -- the one way in ---------------------------------------------------------------------

    def apply(self, update: Update, *, checked: bool = False) -> None:
        """Apply one update: check its preconditions, then mutate.

        Parameters
        ----------
        update : Update
            Any of :data:`UPDATE_TYPES`.
        checked : bool
            The caller ran :meth:`check` on this update against the current state just
            before (with nothing applied in between): skip the second check. The dispatcher
            does this on its hot path (check -> journal -> apply).

        Raises
        ------
        DataServiceError
            A subclass saying why the update is illegal (see :meth:`check`). The state is
            then exactly as it was before the call.
        """
        if not checked:
            self.check(update)
        match update:
            case ProduceSplit():
                self._produce_split(update)
            case AckSplits():
                self._ack_splits(update)
            case ClientHeartbeat():
                self._client_heartbeat(update)
            case FinishTask():
                self._finish_task(update)
            case CreateTask():
                self._create_task(update)
            case AcquireIterationClient():
                self._acquire_iteration_client(update)
            case ReleaseIterationClient():
                self._release_iteration_client(update)
            case CreateIteration():
                self._create_iteration(update)
            case CreateJob():
                self._create_job(update)
            case RegisterDataset():
                self._register_dataset(update)
            case RegisterWorker():
                self._register_worker(update)
            case RemoveWorker():
                self._remove_worker(update)
            case GarbageCollectIteration():
                self._garbage_collect_iteration(update)

    def check(self, update: Update) -> None:
        """Raise if ``update`` is illegal in the current state; never change anything.

        The dispatcher calls this before journaling an update, so that only legal updates
        reach the journal; :meth:`apply` calls it again.

        Parameters
        ----------
        update : Update

        Raises
        ------
        DatasetNotFoundError, WorkerNotFoundError, JobNotFoundError, IterationNotFoundError, TaskNotFoundError, IterationClientNotFoundError
            The update names an unknown id.
        JobNameInUseError
            :class:`CreateJob` with the name of a live job.
        StaleEpochError
            :class:`ProduceSplit` for a repetition the split cursor has moved past.
        IllegalUpdateError
            Any other broken precondition, or not an update at all.
        """
        match update:
            case ProduceSplit():
                self._check_produce_split(update)
            case AckSplits():
                self._check_ack_splits(update)
            case ClientHeartbeat():
                self._check_client_heartbeat(update)
            case FinishTask():
                self._check_finish_task(update)
            case CreateTask():
                self._check_create_task(update)
            case AcquireIterationClient():
                self._check_acquire_iteration_client(update)
            case ReleaseIterationClient():
                self._check_release_iteration_client(update)
            case CreateIteration():
                self._check_create_iteration(update)
            case CreateJob():
                self._check_create_job(update)
            case RegisterDataset():
                self._check_register_dataset(update)
            case RegisterWorker():
                self._check_register_worker(update)
            case RemoveWorker():
                self._check_remove_worker(update)
            case GarbageCollectIteration():
                self._check_garbage_collect_iteration(update)
            case _:
                raise IllegalUpdateError(f"Unknown update type {type(update).__name__!r}")

    # -- next ids ---------------------------------------------------------------------------

    def next_dataset_id(self) -> int:
        """The id to put in the next :class:`RegisterDataset`."""
        return self._next_dataset_id

    def next_job_id(self) -> int:
        """The id to put in the next :class:`CreateJob`."""
        return self._next_job_id

    def next_iteration_id(self) -> int:
        """The id to put in the next :class:`CreateIteration`."""
        return self._next_iteration_id

    def next_iteration_client_id(self) -> int:
        """The id to put in the next :class:`AcquireIterationClient`."""
        return self._next_iteration_client_id

    def next_task_id(self) -> int:
        """The id to put in the next :class:`CreateTask`."""
        return self._next_task_id

    # -- accessors (read-only: each returns a detached copy) ---------------------------------

    def dataset(self, dataset_id: int) -> Dataset:
        """The dataset with this id.

        Raises
        ------
        DatasetNotFoundError
        """
        dataset = self._get_dataset(dataset_id)
        return dataclasses.replace(dataset, metadata=copy.deepcopy(dataset.metadata))

    def dataset_by_fingerprint(self, fingerprint: str) -> Dataset:
        """The dataset registered with this fingerprint.

        Raises
        ------
        DatasetNotFoundError
        """
        dataset_id = self._dataset_by_fingerprint.get(fingerprint)
        if dataset_id is None:
            raise DatasetNotFoundError(f"Dataset with fingerprint {fingerprint!r} not found")
        return self.dataset(dataset_id)

    def list_datasets(self) -> list[Dataset]:
        """All datasets, in registration order."""
        return [self.dataset(dataset_id) for dataset_id in self._datasets]

    def worker(self, address: str) -> Worker:
        """The worker at this address, registered or departed (see ``Worker.registered``).

        Raises
        ------
        WorkerNotFoundError
            No worker ever registered at ``address``.
        """
        worker = self._get_worker(address)
        return dataclasses.replace(worker, resources=dict(worker.resources))

    def list_workers(self, *, include_departed: bool = False) -> list[Worker]:
        """The registered workers (and the departed ones if ``include_departed``)."""
        return [
            self.worker(address)
            for address, worker in self._workers.items()
            if include_departed or worker.registered
        ]

    def job(self, job_id: int) -> Job:
        """The job with this id, live or garbage collected.

        Raises
        ------
        JobNotFoundError
        """
        return copy.copy(self._get_job(job_id))

    def job_by_name(self, job_name: str) -> Job:
        """The live job with this name.

        Raises
        ------
        JobNotFoundError
            No live job has this name (there may be garbage-collected ones).
        """
        job_id = self._jobs_by_name.get(job_name)
        if job_id is None:
            raise JobNotFoundError(f"Job named {job_name!r} not found")
        return self.job(job_id)

    def list_jobs(self) -> list[Job]:
        """All jobs ever created, in creation order."""
        return [copy.copy(job) for job in self._jobs.values()]

    def iteration(self, iteration_id: int) -> Iteration:
        """The iteration with this id, including garbage-collected ones.

        Raises
        ------
        IterationNotFoundError
        """
        return copy.copy(self._get_iteration(iteration_id))

    def iteration_by_key(self, job_id: int, repetition: int) -> Iteration:
        """The iteration of ``job_id`` for ``repetition``.

        Raises
        ------
        IterationNotFoundError
        """
        iteration_id = self._iterations_by_key.get((job_id, repetition))
        if iteration_id is None:
            raise IterationNotFoundError(
                f"Iteration of job {job_id} for repetition {repetition} not found"
            )
        return self.iteration(iteration_id)

    def list_iterations(self) -> list[Iteration]:
        """All iterations ever created, in creation order."""
        return [copy.copy(iteration) for iteration in self._iterations.values()]

    def task(self, task_id: int) -> Task:
        """The task with this id.

        Raises
        ------
        TaskNotFoundError
            Unknown id, or its iteration was garbage collected.
        """
        return copy.copy(self._get_task(task_id))

    def tasks_for_iteration(self, iteration_id: int) -> list[Task]:
        """All tasks of an iteration (active, finished and lost); none once collected.

        Raises
        ------
        IterationNotFoundError
        """
        self._get_iteration(iteration_id)
        return [
            copy.copy(self._tasks[task_id])
            for task_id in self._tasks_by_iteration.get(iteration_id, ())
        ]

    def tasks_for_worker(self, address: str) -> list[Task]:
        """The active tasks of a worker (none if it departed), in creation order.

        Raises
        ------
        WorkerNotFoundError
        """
        self._get_worker(address)
        task_ids = sorted(self._tasks_by_worker.get(address, {}).values())
        return [copy.copy(self._tasks[task_id]) for task_id in task_ids]

    def iteration_client(self, iteration_client_id: int) -> IterationClient:
        """An acquired iteration client.

        Raises
        ------
        IterationClientNotFoundError
            Unknown id, or the client was released.
        """
        return copy.copy(self._get_iteration_client(iteration_client_id))

    def list_iteration_clients(self) -> list[IterationClient]:
        """All acquired clients, in acquisition order (the dispatcher scans them for liveness)."""
        return [copy.copy(client) for client in self._iteration_clients.values()]

    def split_cursor(self, iteration_id: int) -> SplitCursor:
        """The split cursor of a DYNAMIC iteration.

        Raises
        ------
        IterationNotFoundError
        DataServiceError
            The iteration's job is not DYNAMIC, so it has no cursor.
        """
        iteration = self._get_iteration(iteration_id)
        cursor = self._split_cursors.get(iteration_id)
        if cursor is None:
            mode = self._jobs[iteration.job_id].processing_mode
            raise DataServiceError(
                f"Iteration {iteration_id} has no split cursor: its processing mode is {mode!r}"
            )
        return copy.copy(cursor)

    def split_position(self, iteration_id: int) -> tuple[int, int, int]:
        """``(repetition, next_index, num_splits)`` of a DYNAMIC iteration's cursor.

        The same facts as :meth:`split_cursor` without building a copy (the dispatcher's
        per-request path).
        """
        cursor = self._split_cursors.get(iteration_id)
        if cursor is None:
            self.split_cursor(iteration_id)  # raises the typed error (unknown, or not DYNAMIC)
        return cursor.repetition, cursor.next_index, cursor.num_splits

    def task_status(self, task_id: int) -> str:
        """``"active"``, ``"finished"`` or ``"lost"`` (:meth:`task` without the copy).

        Raises
        ------
        TaskNotFoundError
        """
        return self._get_task(task_id).status

    def splits_in_flight(self, iteration_id: int) -> dict[tuple[int, int], int]:
        """``{(repetition, index): task_id}``: the splits an iteration's tasks hold, unacknowledged.

        Raises
        ------
        IterationNotFoundError
        """
        self._get_iteration(iteration_id)
        return {
            split: task_id
            for task_id in self._tasks_by_iteration.get(iteration_id, ())
            for split in self._splits_in_flight.get(task_id, ())
        }

    def task_splits(self, task_id: int) -> tuple[tuple[int, int], ...]:
        """The ``(repetition, index)`` splits a task holds, unacknowledged, ascending.

        Raises
        ------
        TaskNotFoundError
        """
        self._get_task(task_id)
        return tuple(self._splits_in_flight.get(task_id, ()))

    def lost_splits(self, iteration_id: int) -> tuple[tuple[int, int], ...]:
        """The ``(repetition, index)`` splits lost with departed workers, sorted.

        They were handed out once and will never be handed out again (at-most-once).

        Raises
        ------
        IterationNotFoundError
        """
        self._get_iteration(iteration_id)
        return tuple(sorted(self._lost_splits.get(iteration_id, ())))

    # -- whole-state views --------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain data (dicts, lists, tuples, scalars), detached from it.

        Two states are equal when their snapshots are; ``replay(updates) == state`` compares
        these. Secondary indexes are included, so an index that drifted also shows.
        """
        return {
            "next_ids": {
                "dataset": self._next_dataset_id,
                "iteration": self._next_iteration_id,
                "iteration_client": self._next_iteration_client_id,
                "task": self._next_task_id,
                "job": self._next_job_id,
            },
            "datasets": {k: dataclasses.asdict(v) for k, v in self._datasets.items()},
            "dataset_by_fingerprint": dict(self._dataset_by_fingerprint),
            "workers": {k: dataclasses.asdict(v) for k, v in self._workers.items()},
            "tasks_by_worker": {k: dict(v) for k, v in self._tasks_by_worker.items()},
            "jobs": {k: dataclasses.asdict(v) for k, v in self._jobs.items()},
            "jobs_by_name": dict(self._jobs_by_name),
            "iterations": {k: dataclasses.asdict(v) for k, v in self._iterations.items()},
            "iterations_by_key": dict(self._iterations_by_key),
            "split_cursors": {k: dataclasses.asdict(v) for k, v in self._split_cursors.items()},
            "lost_splits": {k: sorted(v) for k, v in self._lost_splits.items()},
            "tasks": {k: dataclasses.asdict(v) for k, v in self._tasks.items()},
            "tasks_by_iteration": {k: list(v) for k, v in self._tasks_by_iteration.items()},
            "splits_in_flight": {k: list(v) for k, v in self._splits_in_flight.items()},
            "iteration_clients": {
                k: dataclasses.asdict(v) for k, v in self._iteration_clients.items()
            },
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DispatcherState):
            return NotImplemented
        return self.snapshot() == other.snapshot()

    __hash__ = None  # type: ignore[assignment]

    def validate_state(self) -> None:
        """Check every invariant of the state; O(size of the state). For tests.

        Raises
        ------
        AssertionError
            Naming the first invariant that does not hold.
        """
        for name, counter, base, ids in (
            ("dataset", self._next_dataset_id, DATASET_ID_BASE, self._datasets),
            ("iteration", self._next_iteration_id, ITERATION_ID_BASE, self._iterations),
            (
                "iteration client",
                self._next_iteration_client_id,
                ITERATION_CLIENT_ID_BASE,
                self._iteration_clients,
            ),
            ("task", self._next_task_id, TASK_ID_BASE, self._tasks),
            ("job", self._next_job_id, JOB_ID_BASE, self._jobs),
        ):
            _invariant(counter >= base, f"next {name} id {counter} below its base {base}")
            for used in ids:
                _invariant(base <= used < counter, f"{name} id {used} outside [{base}, {counter})")

        # Datasets and the fingerprint index are a bijection.
        for dataset_id, dataset in self._datasets.items():
            _invariant(
                dataset.dataset_id == dataset_id, f"dataset {dataset_id} stored under another id"
            )
            _invariant(
                dataset.num_splits >= -1,
                f"dataset {dataset_id} has num_splits {dataset.num_splits}",
            )
            _invariant(
                self._dataset_by_fingerprint.get(dataset.fingerprint) == dataset_id,
                f"dataset {dataset_id} missing from the fingerprint index",
            )
        _invariant(
            len(self._dataset_by_fingerprint) == len(self._datasets),
            "fingerprint index has entries for unknown datasets",
        )

        # Workers: tasks_by_worker has exactly the registered ones.
        for address, worker in self._workers.items():
            _invariant(
                worker.address == address, f"worker {address!r} stored under another address"
            )
            _invariant(
                (address in self._tasks_by_worker) == worker.registered,
                f"worker {address!r}: registered={worker.registered} but index disagrees",
            )
        _invariant(
            self._tasks_by_worker.keys() <= self._workers.keys(),
            "tasks_by_worker has unknown workers",
        )
        for address, by_iteration in self._tasks_by_worker.items():
            for iteration_id, task_id in by_iteration.items():
                task = self._tasks.get(task_id)
                _invariant(task is not None, f"worker {address!r} lists unknown task {task_id}")
                _invariant(
                    task.status == "active"
                    and task.worker_address == address
                    and task.iteration_id == iteration_id,
                    f"worker {address!r} lists task {task_id} wrongly: {task}",
                )

        # Jobs and the name index.
        for job_id, job in self._jobs.items():
            _invariant(job.job_id == job_id, f"job {job_id} stored under another id")
            _invariant(job.dataset_id in self._datasets, f"job {job_id} reads unknown dataset")
            _invariant(job.processing_mode in PROCESSING_MODES, f"job {job_id} has a bad mode")
            _invariant(job.target_workers in TARGET_WORKERS, f"job {job_id} has bad target_workers")
            if job.processing_mode == "DYNAMIC":
                _invariant(
                    self._datasets[job.dataset_id].splittable,
                    f"DYNAMIC job {job_id} reads a dataset without splits",
                )
            _invariant(
                job.garbage_collected == (job.num_iterations > 0 and job.num_live_iterations == 0),
                f"job {job_id}: garbage_collected flag disagrees with its iteration counts",
            )
            if job.job_name is None:
                _invariant(
                    job.num_iterations <= 1, f"anonymous job {job_id} has several iterations"
                )
            else:
                _invariant(
                    (self._jobs_by_name.get(job.job_name) == job_id) != job.garbage_collected,
                    f"job {job_id}: name index disagrees with garbage_collected={job.garbage_collected}",
                )
        for job_name, job_id in self._jobs_by_name.items():
            job = self._jobs.get(job_id)
            _invariant(
                job is not None and job.job_name == job_name and not job.garbage_collected,
                f"job name {job_name!r} indexes job {job_id} wrongly",
            )

        # Iterations, their keys, their counts and derived flags.
        num_iterations = dict.fromkeys(self._jobs, 0)
        num_live = dict.fromkeys(self._jobs, 0)
        num_clients = dict.fromkeys(self._iterations, 0)
        for client_id, client in self._iteration_clients.items():
            _invariant(
                client.iteration_client_id == client_id,
                f"client {client_id} stored under another id",
            )
            iteration = self._iterations.get(client.iteration_id)
            _invariant(
                iteration is not None and not iteration.garbage_collected,
                f"client {client_id} reads unknown or collected iteration {client.iteration_id}",
            )
            num_clients[client.iteration_id] += 1
        for iteration_id, iteration in self._iterations.items():
            _invariant(
                iteration.iteration_id == iteration_id,
                f"iteration {iteration_id} stored under another id",
            )
            job = self._jobs.get(iteration.job_id)
            _invariant(
                job is not None, f"iteration {iteration_id} of unknown job {iteration.job_id}"
            )
            num_iterations[iteration.job_id] += 1
            num_live[iteration.job_id] += not iteration.garbage_collected
            _invariant(
                self._iterations_by_key.get((iteration.job_id, iteration.repetition))
                == iteration_id,
                f"iteration {iteration_id} missing from the key index",
            )
            if job.job_name is None:
                _invariant(iteration.repetition == 0, f"anonymous iteration {iteration_id} repeats")
            _invariant(
                iteration.num_clients == num_clients[iteration_id],
                f"iteration {iteration_id} counts {iteration.num_clients} clients, "
                f"has {num_clients[iteration_id]}",
            )
            dynamic = job.processing_mode == "DYNAMIC"
            _invariant(
                (iteration_id in self._split_cursors) == dynamic
                and (iteration_id in self._lost_splits) == dynamic,
                f"iteration {iteration_id}: split cursor present iff DYNAMIC",
            )
            if iteration.garbage_collected:
                _invariant(iteration.finished, f"collected iteration {iteration_id} not finished")
                _invariant(
                    iteration_id not in self._tasks_by_iteration,
                    f"collected iteration {iteration_id} still has tasks",
                )
                continue
            task_ids = self._tasks_by_iteration.get(iteration_id)
            _invariant(task_ids is not None, f"iteration {iteration_id} has no task index")
            statuses = [self._tasks[task_id].status for task_id in task_ids]
            _invariant(
                (iteration.num_tasks, iteration.num_finished_tasks, iteration.num_lost_tasks)
                == (len(statuses), statuses.count("finished"), statuses.count("lost")),
                f"iteration {iteration_id}: task counts disagree with its tasks",
            )
            _invariant(
                iteration.finished == _derived_finished(iteration),
                f"iteration {iteration_id}: finished={iteration.finished} disagrees with its tasks",
            )
        _invariant(
            len(self._iterations_by_key) == len(self._iterations),
            "key index has unknown iterations",
        )
        for job_id, job in self._jobs.items():
            _invariant(
                (job.num_iterations, job.num_live_iterations)
                == (num_iterations[job_id], num_live[job_id]),
                f"job {job_id}: iteration counts disagree with its iterations",
            )
        _invariant(
            self._split_cursors.keys() <= self._iterations.keys()
            and self._lost_splits.keys() <= self._iterations.keys(),
            "split cursors of unknown iterations",
        )

        # Tasks and their iteration index.
        for iteration_id, task_ids in self._tasks_by_iteration.items():
            _invariant(
                iteration_id in self._iterations, f"task index of unknown iteration {iteration_id}"
            )
            for task_id in task_ids:
                task = self._tasks.get(task_id)
                _invariant(
                    task is not None and task.iteration_id == iteration_id,
                    f"iteration {iteration_id} lists task {task_id} wrongly",
                )
        for task_id, task in self._tasks.items():
            _invariant(task.task_id == task_id, f"task {task_id} stored under another id")
            _invariant(not (task.finished and task.lost), f"task {task_id} is finished and lost")
            _invariant(
                task_id in self._tasks_by_iteration.get(task.iteration_id, ()),
                f"task {task_id} missing from its iteration's index",
            )
            _invariant(task.worker_address in self._workers, f"task {task_id} on unknown worker")
            if task.status == "active":
                _invariant(
                    self._tasks_by_worker.get(task.worker_address, {}).get(task.iteration_id)
                    == task_id,
                    f"active task {task_id} missing from its worker's index",
                )

        # Splits: each handed out at most once, in flight only on active tasks, behind the
        # cursor, ascending per task, and never both in flight and lost.
        seen: dict[int, set[tuple[int, int]]] = {i: set(s) for i, s in self._lost_splits.items()}
        for iteration_id, cursor in self._split_cursors.items():
            _invariant(cursor.iteration_id == iteration_id, f"cursor {iteration_id} stored wrongly")
            job = self._jobs[self._iterations[iteration_id].job_id]
            _invariant(
                cursor.num_splits == self._datasets[job.dataset_id].num_splits
                and 0 <= cursor.next_index <= cursor.num_splits
                and cursor.repetition >= 0,
                f"cursor of iteration {iteration_id} out of range: {cursor}",
            )
            for split in self._lost_splits[iteration_id]:
                _invariant(
                    split < (cursor.repetition, cursor.next_index),
                    f"lost split {split} of iteration {iteration_id} is not behind the cursor",
                )
        for task_id, held in self._splits_in_flight.items():
            task = self._tasks.get(task_id)
            _invariant(
                task is not None and task.status == "active",
                f"task {task_id} holds splits but is not active",
            )
            _invariant(len(held) > 0, f"task {task_id} has an empty in-flight entry")
            _invariant(list(held) == sorted(set(held)), f"task {task_id}'s splits not ascending")
            cursor = self._split_cursors.get(task.iteration_id)
            _invariant(
                cursor is not None, f"task {task_id} holds splits of a non-DYNAMIC iteration"
            )
            _invariant(
                held[-1] < (cursor.repetition, cursor.next_index),
                f"task {task_id} holds a split that was not handed out yet",
            )
            handed_out = seen[task.iteration_id]
            _invariant(
                not handed_out.intersection(held), f"task {task_id} holds a split twice handed out"
            )
            handed_out.update(held)

    # -- lookups that raise the typed errors --------------------------------------------------

    def _get_dataset(self, dataset_id: int) -> Dataset:
        try:
            return self._datasets[dataset_id]
        except KeyError:
            raise DatasetNotFoundError(f"Dataset {dataset_id} not found") from None

    def _get_worker(self, address: str) -> Worker:
        try:
            return self._workers[address]
        except KeyError:
            raise WorkerNotFoundError(f"Worker {address!r} not found") from None

    def _get_job(self, job_id: int) -> Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise JobNotFoundError(f"Job {job_id} not found") from None

    def _get_iteration(self, iteration_id: int) -> Iteration:
        try:
            return self._iterations[iteration_id]
        except KeyError:
            raise IterationNotFoundError(f"Iteration {iteration_id} not found") from None

    def _get_task(self, task_id: int) -> Task:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise TaskNotFoundError(f"Task {task_id} not found") from None

    def _get_iteration_client(self, iteration_client_id: int) -> IterationClient:
        try:
            return self._iteration_clients[iteration_client_id]
        except KeyError:
            raise IterationClientNotFoundError(
                f"Iteration client {iteration_client_id} not found"
            ) from None

    # -- checks: raise on an illegal update, never mutate -------------------------------------

    @staticmethod
    def _check_fresh(update: Update, kind: str, new_id: int, next_id: int) -> None:
        if new_id < next_id:
            _illegal(update, f"{kind} id {new_id} is not fresh (the next {kind} id is {next_id})")

    @staticmethod
    def _check_time(update: Update, time_micros: int) -> None:
        if time_micros < 0:
            _illegal(update, f"time_micros must be >= 0, got {time_micros}")

    @staticmethod
    def _require_task(task: Task, update: Update) -> None:
        if type(update) not in TASK_TRANSITIONS[task.status]:
            _illegal(update, f"task {task.task_id} is {task.status}")

    @staticmethod
    def _require_iteration(iteration: Iteration, update: Update) -> None:
        if type(update) not in ITERATION_ACCEPTS[iteration.status]:
            _illegal(update, f"iteration {iteration.iteration_id} is {iteration.status}")

    def _require_worker(self, address: str, update: Update) -> None:
        worker = self._workers.get(address)
        status = "unknown" if worker is None else worker.status
        if type(update) not in WORKER_ACCEPTS[status]:
            if status == "unknown":
                self._get_worker(address)  # raises WorkerNotFoundError
            _illegal(update, f"worker {address!r} is {status}")

    def _check_register_dataset(self, u: RegisterDataset) -> None:
        self._check_fresh(u, "dataset", u.dataset_id, self._next_dataset_id)
        existing = self._dataset_by_fingerprint.get(u.fingerprint)
        if existing is not None:
            _illegal(
                u, f"fingerprint {u.fingerprint!r} is already registered as dataset {existing}"
            )
        if u.num_splits < -1:
            _illegal(u, f"num_splits must be >= 0, or -1 if not splittable; got {u.num_splits}")

    def _check_register_worker(self, u: RegisterWorker) -> None:
        self._require_worker(u.address, u)

    def _check_remove_worker(self, u: RemoveWorker) -> None:
        self._require_worker(u.address, u)

    def _check_create_job(self, u: CreateJob) -> None:
        self._check_fresh(u, "job", u.job_id, self._next_job_id)
        dataset = self._get_dataset(u.dataset_id)
        if u.processing_mode not in PROCESSING_MODES:
            _illegal(
                u,
                f"processing_mode must be one of {sorted(PROCESSING_MODES)}, got {u.processing_mode!r}",
            )
        if u.target_workers not in TARGET_WORKERS:
            _illegal(
                u,
                f"target_workers must be one of {sorted(TARGET_WORKERS)}, got {u.target_workers!r}",
            )
        if u.processing_mode == "DYNAMIC" and not dataset.splittable:
            _illegal(u, f"DYNAMIC sharding needs splits, and dataset {u.dataset_id} has none")
        if u.num_consumers is not None and u.num_consumers < 1:
            _illegal(u, f"num_consumers must be >= 1 or None, got {u.num_consumers}")
        if u.job_name is None:
            if u.num_consumers is not None:
                _illegal(u, "coordinated reads (num_consumers) need a job_name")
            if u.cross_trainer_cache:
                _illegal(u, "cross_trainer_cache needs a job_name")
        elif not u.job_name:
            _illegal(u, "job_name must be a non-empty string or None")
        elif u.job_name in self._jobs_by_name:
            raise JobNameInUseError(
                f"Job name {u.job_name!r} is in use by job {self._jobs_by_name[u.job_name]}"
            )

    def _check_create_iteration(self, u: CreateIteration) -> None:
        self._check_fresh(u, "iteration", u.iteration_id, self._next_iteration_id)
        job = self._get_job(u.job_id)
        if type(u) not in JOB_ACCEPTS[job.status]:
            _illegal(u, f"job {u.job_id} is {job.status}")
        if u.repetition < 0:
            _illegal(u, f"repetition must be >= 0, got {u.repetition}")
        if job.job_name is None and (u.repetition != 0 or job.num_iterations):
            _illegal(u, f"anonymous job {u.job_id} has exactly one iteration, with repetition 0")
        existing = self._iterations_by_key.get((u.job_id, u.repetition))
        if existing is not None:
            _illegal(
                u, f"job {u.job_id} already has iteration {existing} for repetition {u.repetition}"
            )

    def _check_create_task(self, u: CreateTask) -> None:
        self._check_fresh(u, "task", u.task_id, self._next_task_id)
        self._require_iteration(self._get_iteration(u.iteration_id), u)
        self._require_worker(u.worker_address, u)
        existing = self._tasks_by_worker[u.worker_address].get(u.iteration_id)
        if existing is not None:
            _illegal(
                u,
                f"worker {u.worker_address!r} already runs task {existing} "
                f"of iteration {u.iteration_id}",
            )

    def _check_finish_task(self, u: FinishTask) -> None:
        self._require_task(self._get_task(u.task_id), u)

    def _check_produce_split(self, u: ProduceSplit) -> None:
        self._require_iteration(self._get_iteration(u.iteration_id), u)
        cursor = self._split_cursors.get(u.iteration_id)
        if cursor is None:
            _illegal(u, f"iteration {u.iteration_id} is not DYNAMIC and has no split cursor")
        task = self._get_task(u.task_id)
        if task.iteration_id != u.iteration_id:
            _illegal(
                u,
                f"task {u.task_id} belongs to iteration {task.iteration_id}, not {u.iteration_id}",
            )
        self._require_task(task, u)
        if u.repetition < cursor.repetition:
            raise StaleEpochError(
                f"ProduceSplit: repetition {u.repetition} of iteration {u.iteration_id} is stale; "
                f"the split cursor is at repetition {cursor.repetition}"
            )
        if u.repetition > cursor.repetition:
            _illegal(
                u,
                f"repetition {u.repetition} is ahead of the split cursor of iteration "
                f"{u.iteration_id} (repetition {cursor.repetition})",
            )
        if u.index != cursor.next_index:
            _illegal(u, f"split index {u.index} is not the next index {cursor.next_index}")
        at_end = cursor.next_index == cursor.num_splits
        if u.finished and not at_end:
            _illegal(
                u,
                f"finished=True but {cursor.num_splits - cursor.next_index} of "
                f"{cursor.num_splits} splits of repetition {cursor.repetition} remain",
            )
        if at_end and not u.finished:
            _illegal(u, f"all {cursor.num_splits} splits were handed out; finished must be True")

    def _check_ack_splits(self, u: AckSplits) -> None:
        self._require_task(self._get_task(u.task_id), u)
        held = self._splits_in_flight.get(u.task_id)
        if not held or held[0] > (u.repetition, u.index):
            _illegal(u, f"task {u.task_id} holds no split at or before ({u.repetition}, {u.index})")

    def _check_acquire_iteration_client(self, u: AcquireIterationClient) -> None:
        self._check_fresh(
            u, "iteration client", u.iteration_client_id, self._next_iteration_client_id
        )
        self._check_time(u, u.time_micros)
        self._require_iteration(self._get_iteration(u.iteration_id), u)

    def _check_release_iteration_client(self, u: ReleaseIterationClient) -> None:
        self._get_iteration_client(u.iteration_client_id)
        self._check_time(u, u.time_micros)

    def _check_client_heartbeat(self, u: ClientHeartbeat) -> None:
        self._get_iteration_client(u.iteration_client_id)
        self._check_time(u, u.time_micros)

    def _check_garbage_collect_iteration(self, u: GarbageCollectIteration) -> None:
        iteration = self._get_iteration(u.iteration_id)
        self._require_iteration(iteration, u)
        if iteration.num_clients:
            _illegal(u, f"iteration {u.iteration_id} still has {iteration.num_clients} client(s)")

    # -- mutators: called only after the matching check passed; never raise -------------------

    def _register_dataset(self, u: RegisterDataset) -> None:
        self._datasets[u.dataset_id] = Dataset(
            dataset_id=u.dataset_id,
            fingerprint=u.fingerprint,
            pipeline=u.pipeline,
            splits=u.splits,
            num_splits=u.num_splits,
            element_spec=u.element_spec,
            metadata=copy.deepcopy(u.metadata),
            compression=u.compression,
        )
        self._dataset_by_fingerprint[u.fingerprint] = u.dataset_id
        self._next_dataset_id = max(self._next_dataset_id, u.dataset_id + 1)

    def _register_worker(self, u: RegisterWorker) -> None:
        # A departed worker coming back is replaced: its host or threads may have changed.
        self._workers[u.address] = Worker(
            address=u.address,
            host=u.host,
            nthreads=u.nthreads,
            resources=dict(u.resources),
            tags=u.tags,
        )
        self._tasks_by_worker[u.address] = {}

    def _remove_worker(self, u: RemoveWorker) -> None:
        self._workers[u.address].registered = False
        for iteration_id, task_id in self._tasks_by_worker.pop(u.address).items():
            self._tasks[task_id].lost = True
            held = self._splits_in_flight.pop(task_id, None)
            if held:
                self._lost_splits[iteration_id].update(held)
            iteration = self._iterations[iteration_id]
            iteration.num_lost_tasks += 1
            iteration.finished = _derived_finished(iteration)

    def _create_job(self, u: CreateJob) -> None:
        self._jobs[u.job_id] = Job(
            job_id=u.job_id,
            job_name=u.job_name,
            dataset_id=u.dataset_id,
            processing_mode=u.processing_mode,
            num_consumers=u.num_consumers,
            target_workers=u.target_workers,
            cross_trainer_cache=u.cross_trainer_cache,
        )
        if u.job_name is not None:
            self._jobs_by_name[u.job_name] = u.job_id
        self._next_job_id = max(self._next_job_id, u.job_id + 1)

    def _create_iteration(self, u: CreateIteration) -> None:
        job = self._jobs[u.job_id]
        self._iterations[u.iteration_id] = Iteration(
            iteration_id=u.iteration_id, job_id=u.job_id, repetition=u.repetition
        )
        self._iterations_by_key[(u.job_id, u.repetition)] = u.iteration_id
        self._tasks_by_iteration[u.iteration_id] = {}
        if job.processing_mode == "DYNAMIC":
            num_splits = self._datasets[job.dataset_id].num_splits
            self._split_cursors[u.iteration_id] = SplitCursor(u.iteration_id, num_splits)
            self._lost_splits[u.iteration_id] = set()
        job.num_iterations += 1
        job.num_live_iterations += 1
        self._next_iteration_id = max(self._next_iteration_id, u.iteration_id + 1)

    def _create_task(self, u: CreateTask) -> None:
        self._tasks[u.task_id] = Task(
            task_id=u.task_id, iteration_id=u.iteration_id, worker_address=u.worker_address
        )
        self._tasks_by_iteration[u.iteration_id][u.task_id] = None
        self._tasks_by_worker[u.worker_address][u.iteration_id] = u.task_id
        iteration = self._iterations[u.iteration_id]
        iteration.num_tasks += 1
        iteration.finished = _derived_finished(iteration)
        self._next_task_id = max(self._next_task_id, u.task_id + 1)

    def _finish_task(self, u: FinishTask) -> None:
        task = self._tasks[u.task_id]
        task.finished = True
        del self._tasks_by_worker[task.worker_address][task.iteration_id]
        # A finished pipeline is done with every split it was given.
        self._splits_in_flight.pop(u.task_id, None)
        iteration = self._iterations[task.iteration_id]
        iteration.num_finished_tasks += 1
        iteration.finished = _derived_finished(iteration)

    def _produce_split(self, u: ProduceSplit) -> None:
        cursor = self._split_cursors[u.iteration_id]
        if u.finished:
            cursor.repetition += 1
            cursor.next_index = 0
            return
        cursor.next_index += 1
        held = self._splits_in_flight.get(u.task_id)
        if held is None:
            held = self._splits_in_flight[u.task_id] = deque()
        held.append((u.repetition, u.index))

    def _ack_splits(self, u: AckSplits) -> None:
        held = self._splits_in_flight[u.task_id]
        bound = (u.repetition, u.index)
        while held and held[0] <= bound:
            held.popleft()
        if not held:
            del self._splits_in_flight[u.task_id]

    def _acquire_iteration_client(self, u: AcquireIterationClient) -> None:
        self._iteration_clients[u.iteration_client_id] = IterationClient(
            iteration_client_id=u.iteration_client_id,
            iteration_id=u.iteration_id,
            acquired_micros=u.time_micros,
            last_seen_micros=u.time_micros,
        )
        self._iterations[u.iteration_id].num_clients += 1
        self._next_iteration_client_id = max(
            self._next_iteration_client_id, u.iteration_client_id + 1
        )

    def _release_iteration_client(self, u: ReleaseIterationClient) -> None:
        client = self._iteration_clients.pop(u.iteration_client_id)
        iteration = self._iterations[client.iteration_id]
        iteration.num_clients -= 1
        iteration.last_client_released_micros = u.time_micros

    def _client_heartbeat(self, u: ClientHeartbeat) -> None:
        self._iteration_clients[u.iteration_client_id].last_seen_micros = u.time_micros

    def _garbage_collect_iteration(self, u: GarbageCollectIteration) -> None:
        for task_id in self._tasks_by_iteration.pop(u.iteration_id):
            task = self._tasks.pop(task_id)
            if task.status == "active":
                del self._tasks_by_worker[task.worker_address][u.iteration_id]
            self._splits_in_flight.pop(task_id, None)
        iteration = self._iterations[u.iteration_id]
        iteration.finished = True
        iteration.garbage_collected = True
        job = self._jobs[iteration.job_id]
        job.num_live_iterations -= 1
        if job.num_live_iterations == 0:
            job.garbage_collected = True
            if job.job_name is not None:
                del self._jobs_by_name[job.job_name]


def replay(updates: Iterable[Update]) -> DispatcherState:
    """A fresh :class:`DispatcherState` with ``updates`` applied in order.

    Parameters
    ----------
    updates : iterable of Update
        For example the decoded records of a journal.

    Returns
    -------
    DispatcherState

    Raises
    ------
    DataServiceError
        If an update is illegal at its position (a corrupt or reordered journal).
    """
    state = DispatcherState()
    for update in updates:
        state.apply(update)
    return state


def _derived_finished(iteration: Iteration) -> bool:
    """``Iteration.finished`` from its task counts: a task finished and none is active."""
    return (
        iteration.num_finished_tasks > 0
        and iteration.num_finished_tasks + iteration.num_lost_tasks == iteration.num_tasks
    )


def _illegal(update: Update, message: str) -> typing.NoReturn:
    raise IllegalUpdateError(f"{type(update).__name__}: {message}")


def _invariant(condition: bool, message: str) -> None:
    # An explicit raise rather than ``assert``, so that ``python -O`` still validates.
    if not condition:
        raise AssertionError(f"DispatcherState invariant broken: {message}")
