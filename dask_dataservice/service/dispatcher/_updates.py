"""The dispatcher's update records and their journal codec (see :mod:`.state` for the rules).

Each record is a frozen dataclass describing one complete change of the
:class:`~dask_dataservice.service.dispatcher.state.DispatcherState`; :func:`encode_update` /
:func:`decode_update` turn them into msgpack bytes for the journal and back (never pickle).
Records are versioned like proto messages (the state's Rule 5). The lifecycle tables at the
end say which update each status of an entity accepts; the state's checks consult them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from ...errors import IllegalUpdateError

__all__ = [
    "DATASET_ACCEPTS",
    "ITERATION_ACCEPTS",
    "JOB_ACCEPTS",
    "TASK_TRANSITIONS",
    "UPDATE_TYPES",
    "WORKER_ACCEPTS",
    "AckSplits",
    "AcquireIterationClient",
    "ClientHeartbeat",
    "CreateIteration",
    "CreateJob",
    "CreateTask",
    "FinishTask",
    "GarbageCollectDataset",
    "GarbageCollectIteration",
    "GarbageCollectJob",
    "ProduceSplit",
    "ProduceSplits",
    "RegisterDataset",
    "RegisterWorker",
    "ReleaseIterationClient",
    "RemoveWorker",
    "Update",
    "decode_update",
    "encode_update",
]



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
    dataset_name : str or None
        Field 9. The id the user chose (TensorFlow's ``register_dataset(..., dataset_id=...)``),
        unique among datasets; readers may name the dataset by it. A named dataset is found
        by its name, not by its fingerprint: the same pipeline may be registered under two
        names, and a different pipeline under a name in use is refused by the dispatcher.
        ``None`` for a dataset registered without one (deduplicated by fingerprint).
    secret : str
        Field 10. The dataset's random secret (issue 22): its readers show it, as part of the
        string id ``register_dataset`` returns (``"<id or name>:<secret>"``). ``""`` (a
        journal written before the field existed): the dataset is read by its plain id.

    Notes
    -----
    Next field: 11. Removed fields: none.
    """

    dataset_id: int  # 1
    fingerprint: str  # 2
    pipeline: bytes  # 3
    splits: bytes  # 4
    num_splits: int  # 5
    element_spec: bytes | None = None  # 6
    metadata: dict[str, Any] = field(default_factory=dict)  # 7
    compression: str | None = None  # 8
    dataset_name: str | None = None  # 9
    secret: str = ""  # 10

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
        Field 2. ``None`` for an anonymous job. Unique among the live jobs of its dataset
        (names are scoped per dataset, as in TensorFlow).
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
    worker_addresses : tuple of str
        Field 8. Static sharding (FILE, DATA, FILE_OR_DATA, HINT): the fixed worker list the
        job shards over, as the dispatcher's config gave it when the job was created
        (addresses or Dask worker names, distinct and non-empty); a worker's position in it
        is its shard index. Empty for the other modes. Journaled so that a restart with a
        different config never reassigns the shards of an existing job.
    token : str
        Field 9. The job's capability: a random secret the dispatcher draws for the job and
        hands to its consumers and, in each task definition, to its data workers. Reading
        the job's elements and taking its splits need it. ``""`` (records written before
        the field existed) means the job has no token and is not checked.
    position : str
        Field 10. A job that tracks input positions (issue 13, :mod:`._positions`): JSON
        ``{"start": position or null, "nonce": str}``, the position its data workers resume
        from. ``""`` (and records written before the field existed): a plain job.

    Notes
    -----
    Next field: 11. Removed fields: none.
    """

    job_id: int  # 1
    job_name: str | None  # 2
    dataset_id: int  # 3
    processing_mode: str  # 4
    num_consumers: int | None = None  # 5
    target_workers: str = "AUTO"  # 6
    cross_trainer_cache: bool = False  # 7
    worker_addresses: tuple[str, ...] = ()  # 8
    token: str = ""  # 9
    position: str = ""  # 10

    def __post_init__(self) -> None:
        _check_fields(self)
        if not all(isinstance(entry, str) for entry in self.worker_addresses):
            raise TypeError(
                f"CreateJob.worker_addresses must be strings, got {self.worker_addresses!r}"
            )
        object.__setattr__(self, "worker_addresses", tuple(self.worker_addresses))


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
    shard_index : int or None
        Field 4. Static sharding: the worker's shard, its index in the job's
        ``worker_addresses`` (decided by the dispatcher when the task is created, and fixed
        from then on). ``None`` for the other modes.

    Notes
    -----
    Next field: 5. Removed fields: none.
    """

    task_id: int  # 1
    iteration_id: int  # 2
    worker_address: str  # 3
    shard_index: int | None = None  # 4


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
class ProduceSplits(_Record):
    """Hand ``count`` consecutive splits of a DYNAMIC iteration to a task, and say whether the
    repetition ended after them: one record per ``get_split`` call, however many splits it
    hands out (the journal holds the cursor's moves, not one record per split).

    :class:`ProduceSplit` is the same with ``count`` 1 (or 0 when ``finished``); journals
    written before this record existed hold those, and replay still applies them.

    Parameters
    ----------
    iteration_id : int
        Field 1. A running DYNAMIC iteration.
    repetition : int
        Field 2. The cursor's repetition; an older one is stale (:class:`StaleEpochError`).
    index : int
        Field 3. The cursor's ``next_index``: the first split handed out.
    count : int
        Field 4. Splits handed out, ``index .. index + count - 1`` (``index + count`` at most
        ``num_splits``); 0 only with ``end_of_splits``.
    task_id : int
        Field 5. The active task of this iteration that asked.
    end_of_splits : bool
        Field 6. The repetition has no split after these (``index + count == num_splits``):
        the task is told so, and the cursor moves to ``(repetition + 1, 0)``.
    indices : tuple of int
        Field 7. Empty: the splits are ``index .. index + count - 1``. Otherwise the split
        indices handed out at those cursor positions, in another order (locality-aware
        hand-out, see :mod:`._split_order`); ``count`` of them, none handed out before in
        this repetition.

    Notes
    -----
    Next field: 8. Removed fields: none.
    """

    iteration_id: int  # 1
    repetition: int  # 2
    index: int  # 3
    count: int  # 4
    task_id: int  # 5
    end_of_splits: bool = False  # 6
    indices: tuple[int, ...] = ()  # 7

    def __post_init__(self) -> None:
        _check_fields(self)
        object.__setattr__(self, "indices", tuple(self.indices))  # msgpack gives a list


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
    read_to_end : bool
        Field 3 (default False). The consumer read the iteration to its end: every task
        served it its end of sequence, so nothing is left on the workers for a consumer that
        comes back (sets ``Iteration.read_to_end``; the GC of idle DYNAMIC iterations keeps
        one until then). False in records written before the field existed.

    Notes
    -----
    Next field: 4. Removed fields: none.
    """

    iteration_client_id: int  # 1
    time_micros: int  # 2
    read_to_end: bool = False  # 3


@dataclass(frozen=True, slots=True)
class ClientHeartbeat(_Record):
    """A consumer showed it is alive.

    The dispatcher no longer journals heartbeats (liveness need not survive a restart: every
    client's timer starts again after recovery, and a heartbeat a minute per idle consumer
    made the journal grow by megabytes a day); journals written before still hold them, and
    replay applies them.

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


@dataclass(frozen=True, slots=True)
class GarbageCollectJob(_Record):
    """Drop a live job that never got an iteration (created, then never read: issue 22).

    It is marked collected, as a job whose last iteration was collected is, and frees its
    name. A job with an iteration is collected with its last one
    (:class:`GarbageCollectIteration`), never by this record.

    Parameters
    ----------
    job_id : int
        Field 1. A live job without iterations.

    Notes
    -----
    Next field: 2. Removed fields: none.
    """

    job_id: int  # 1


@dataclass(frozen=True, slots=True)
class GarbageCollectDataset(_Record):
    """Drop a registered dataset nobody reads (issue 22): its pipeline, splits, element
    spec and metadata, and its fingerprint or name, so that registering the pipeline again
    makes a new dataset, with a new id and a new secret.

    The id stays known as collected (a tombstone of one integer), so that a reader holding
    it is told what happened; it is never handed out again (ids only grow). The dataset's
    collected jobs and iterations stay, for the record.

    Parameters
    ----------
    dataset_id : int
        Field 1. A registered dataset, not collected, without live jobs.

    Notes
    -----
    Next field: 2. Removed fields: none.
    """

    dataset_id: int  # 1


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
    ProduceSplits,
    GarbageCollectJob,
    GarbageCollectDataset,
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
    | ProduceSplits
    | GarbageCollectJob
    | GarbageCollectDataset
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


#: ``{record class: frozenset of field names}`` (decode's unknown-field check, per record).
_FIELD_NAMES: Final[dict[type, frozenset[str]]] = {
    cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in UPDATE_TYPES
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
    data: bytes = msgpack.packb([cls.__name__, fields], use_bin_type=True)
    return data


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
    unknown = fields.keys() - _FIELD_NAMES[cls]
    if unknown:
        raise IllegalUpdateError(f"Cannot decode {name}: unknown fields {sorted(unknown)}")
    try:
        return cls(**fields)  # type: ignore[no-any-return]
    except TypeError as e:
        raise IllegalUpdateError(f"Cannot decode {name}: {e}") from e


# Lifecycles, as data (h11 style). Checks consult these tables, tests print and verify them.
##########################################################################################

#: ``{task status: {update type: status after}}``. An update that names a task (or, for
#: ``RemoveWorker`` and ``GarbageCollectIteration``, reaches it through its worker or
#: iteration) is illegal in a status where it is not listed. ``"removed"`` means the task is
#: deleted from the state.
TASK_TRANSITIONS: Final[dict[str, dict[type, str]]] = {
    "active": {
        ProduceSplit: "active",
        ProduceSplits: "active",
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
        {CreateTask, ProduceSplit, ProduceSplits, AcquireIterationClient,
         GarbageCollectIteration}
    ),
    # CreateTask reopens a finished iteration: a worker that joins (or comes back) while
    # consumers still read an OFF iteration serves a full repetition, as in TensorFlow. (A
    # static-sharding iteration stays running until every shard of its list finished.)
    "finished": frozenset({CreateTask, AcquireIterationClient, GarbageCollectIteration}),
    "garbage_collected": frozenset(),
}

#: ``{job status: update types it accepts}``. A job is garbage collected when its last live
#: iteration is, or (``GarbageCollectJob``) when it never got one; its name is then free for
#: a new job.
JOB_ACCEPTS: Final[dict[str, frozenset[type]]] = {
    "live": frozenset({CreateIteration, GarbageCollectJob}),
    "garbage_collected": frozenset(),
}

#: ``{dataset status: update types naming the dataset that it accepts}``. A registered
#: dataset without live jobs may be collected; a collected one is a tombstone (its id names
#: nothing any more, and is never reused).
DATASET_ACCEPTS: Final[dict[str, frozenset[type]]] = {
    "registered": frozenset({CreateJob, GarbageCollectDataset}),
    "collected": frozenset(),
}

#: ``{worker status: update types it accepts}``; ``"unknown"`` is an address never registered.
WORKER_ACCEPTS: Final[dict[str, frozenset[type]]] = {
    "unknown": frozenset({RegisterWorker}),
    "registered": frozenset({RemoveWorker, CreateTask}),
    "departed": frozenset({RegisterWorker}),
}
