"""The entities of the dispatcher's state: plain mutable dataclasses owned by
:class:`~dask_dataservice.service.dispatcher.state.DispatcherState` (its accessors hand out copies), and
the constants their fields take."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "DATASET_ID_BASE",
    "ITERATION_CLIENT_ID_BASE",
    "ITERATION_ID_BASE",
    "JOB_ID_BASE",
    "PROCESSING_MODES",
    "STATIC_MODES",
    "TARGET_WORKERS",
    "TASK_ID_BASE",
    "Dataset",
    "Iteration",
    "IterationClient",
    "Job",
    "SplitCursor",
    "Task",
    "Worker",
    "derived_finished",
    "expand_runs",
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

#: Static sharding policies: a job in one of these modes shards over a fixed worker list.
STATIC_MODES: Final = frozenset({"FILE", "DATA", "FILE_OR_DATA", "HINT"})

#: Which workers a job's consumers read from.
TARGET_WORKERS: Final = frozenset({"AUTO", "ANY", "LOCAL"})




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
    dataset_name: str | None = None
    secret: str = ""

    @property
    def splittable(self) -> bool:
        """Whether the dataset has splits (and so supports DYNAMIC sharding)."""
        return self.num_splits >= 0


@dataclass(slots=True)
class Worker:
    """A data worker. ``registered`` is False after it left (its address stays known while
    a task names it)."""

    address: str
    host: str
    nthreads: int
    resources: dict[str, float]
    tags: tuple[str, ...]
    registered: bool = True
    #: Tasks in the state (of iterations not garbage collected) that name this worker. A
    #: departed worker is forgotten as soon as no task names it, so worker churn does not
    #: make the state grow.
    num_tasks: int = 0

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
    ``worker_addresses`` is the journaled worker list of a static-sharding job (else empty).
    ``token`` is the job's capability (``CreateJob.token``; ``""``: none, not checked).
    ``position`` is ``CreateJob.position`` (``""``: the job does not track input positions).
    """

    job_id: int
    job_name: str | None
    dataset_id: int
    processing_mode: str
    num_consumers: int | None
    target_workers: str
    cross_trainer_cache: bool
    worker_addresses: tuple[str, ...] = ()
    num_iterations: int = 0
    num_live_iterations: int = 0
    garbage_collected: bool = False
    token: str = ""
    position: str = ""

    @property
    def status(self) -> str:
        """``"live"`` or ``"garbage_collected"`` (see :data:`JOB_ACCEPTS`)."""
        return "garbage_collected" if self.garbage_collected else "live"


@dataclass(slots=True)
class Iteration:
    """One pass of a job's clients over its dataset (one repetition of a named job).

    ``num_tasks``, ``num_finished_tasks`` and ``num_lost_tasks`` count the iteration's tasks;
    ``finished`` is derived from them by every mutator that changes them. Under static
    sharding ``num_shards`` is the length of the job's worker list and ``finished_shards`` the
    shard indices whose task finished; the iteration is finished only once every shard is.
    ``finished`` means every task finished producing (its elements may still wait in the
    workers' buffers); ``read_to_end`` that a consumer got every task's end of sequence
    (``ReleaseIterationClient.read_to_end``), so nothing is left to read.
    After garbage collection the counts keep their last values, for the record.
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
    num_shards: int = 0
    finished_shards: frozenset[int] = frozenset()
    read_to_end: bool = False

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
    #: Static sharding: the shard (index in the job's worker list), else None.
    shard_index: int | None = None

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



def derived_finished(iteration: Iteration) -> bool:
    """``Iteration.finished`` from its tasks: a task finished and none is active, and under
    static sharding every shard of the job's worker list finished."""
    return (
        iteration.num_finished_tasks > 0
        and iteration.num_finished_tasks + iteration.num_lost_tasks == iteration.num_tasks
        and len(iteration.finished_shards) == iteration.num_shards
    )


def expand_runs(runs: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """``(repetition, index)`` of every split in runs ``(repetition, start, stop)``."""
    return [(repetition, i) for repetition, start, stop in runs for i in range(start, stop)]
