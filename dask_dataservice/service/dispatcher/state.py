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

A journal that holds a snapshot is replayed from it: :mod:`._state_codec` encodes the whole
state as one versioned blob (``encode_state`` / ``decode_state``) and ``restore(snapshot,
records)`` applies the records after it, reporting a record that cannot be applied as journal
corruption with its file and byte offset.
"""

# Rules
# =====
#
# Rule 1: everything that changes the dispatcher's state lives in this file (the mutators), and
# the only way in is ``DispatcherState.apply(update)``. Accessors hand out detached copies;
# mutating a copy changes nothing here. The rest of the state machine is in private modules
# with the same rules: ``_updates`` (the records, their msgpack codec and the lifecycle
# tables), ``_entities`` (the entity dataclasses), ``_state_queries`` (the read-only accessors)
# and ``_state_checks`` (lookups and the preconditions of each update), two mixins of
# DispatcherState, and ``_state_validation`` (``validate_state``, every invariant). One
# exception to "the only way in": ``_state_codec.decode_state`` builds a state from a journal
# snapshot (primary maps as encoded, indexes rebuilt); the hypothesis machine checks that a
# decoded snapshot equals the state and passes ``validate_state``.
#
# Rule 2: these files do no I/O, no asyncio, reads no clock and imports neither Dask nor user
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
# (O(runs acknowledged), so O(1) amortised per split produced).
#
# Theory of operation
# ===================
#
# Entities. A *dataset* is registered once per fingerprint (or name); once it has had no live
# job for a while the dispatcher collects it (``GarbageCollectDataset``): its bytes and its
# fingerprint or name go, its id stays as a tombstone and is never reused. A *worker* is
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
#              ``finished`` is recomputed by every mutator that touches a task: at least one
#              task finished and every task is finished or lost. While all tasks are lost and
#              none finished the iteration keeps running, so a new worker can take it over.
#              Static sharding (FILE, DATA, FILE_OR_DATA, HINT): the job journals its worker
#              list (``CreateJob.worker_addresses``) and each task its shard index in it
#              (``CreateTask.shard_index``); the iteration is finished only once a task of
#              every shard 0..n-1 finished, so a listed worker that joins late, or comes
#              back after losing its task, still gets its shard. ``finished --CreateTask-->
#              running``: the dispatcher gives a worker that joins (or comes back) while
#              consumers still read a finished OFF iteration a task, which serves a full
#              repetition, as in TensorFlow.
#   job        live --GC of its last live iteration--> garbage_collected (its name is freed,
#              and a new job may take it; the old job accepts no more iterations)
#              live --GarbageCollectJob--> garbage_collected (a job that never got an
#              iteration, the same way)
#   dataset    registered --GarbageCollectDataset--> collected (only without live jobs:
#              ``DATASET_ACCEPTS``; a collected dataset is a tombstone: its id in
#              ``_collected_datasets``, nothing else)
#   worker     registered --RemoveWorker--> departed --RegisterWorker--> registered
#
# Split cursor (DYNAMIC jobs only). The dataset's splits were enumerated by the client and are
# stored as one opaque blob; the dispatcher only hands out *indices* into it, so only counters
# are journaled, never split contents. Each DYNAMIC iteration has a cursor ``(repetition,
# next_index)``. ``repetition`` is the split provider's epoch inside a task pipeline's
# ``.repeat()``. A task asks for "the next split of repetition r". If r is older than the
# cursor, the request is stale (``StaleEpochError``: the dispatcher answers end-of-splits).
# Otherwise the dispatcher journals one ``ProduceSplits(iteration, r, next_index, count, task,
# end_of_splits)`` per request, however many splits it hands out: splits ``next_index ..
# next_index + count - 1`` go to the task and ``next_index`` advances by ``count``;
# ``end_of_splits`` (only when no split is left after them) ends repetition r, and the cursor
# moves to ``(r + 1, 0)``. ``ProduceSplit`` (one split, or the end) is the older record of the
# same move, still replayed from journals that hold it.
#
# Splits in flight and lost splits. Every split handed out is remembered as held by its task
# until the task acknowledges it (``AckSplits(task, r, i)``: "done with every split up to and
# including (r, i)") or finishes. A task receives splits in increasing ``(repetition, index)``
# order, so its held splits are a sorted deque of runs ``(r, start, stop)`` (a run grows while
# the same task gets the next indices, so one task holding a million splits is one entry) and
# an acknowledgement pops from its left. When
# a worker leaves, the splits its active tasks held are recorded in the iteration's lost set.
# The cursor never moves back, so a lost split is never handed out again: DYNAMIC sharding is
# exactly-once without failures and at-most-once with them.
#
# Liveness. Iteration clients carry the times of their acquisition and last heartbeat, and an
# iteration the time its last client was released. The dispatcher decides who is dead from
# those times and its own clock, then journals ``ReleaseIterationClient`` and
# ``GarbageCollectIteration``; the state only stores what the records say.
#
# Memory. Jobs and iterations stay in the state after GC (a few hundred bytes each, as in
# TensorFlow, plus a DYNAMIC iteration's cursor and the splits it lost, kept as the record of
# what it missed); a collected dataset leaves only its id (one int in a set: its pipeline,
# splits, spec and metadata are dropped); tasks and clients are removed with their iteration, and a
# departed worker is forgotten once no remaining task names it (so worker churn does not grow
# the state). ``splits_in_flight`` stays small as long as workers
# acknowledge the splits they finish.

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from collections.abc import Iterable
from typing import Any

from ...errors import (
    IllegalUpdateError,
)
from . import _split_order
from ._entities import (
    DATASET_ID_BASE,
    ITERATION_CLIENT_ID_BASE,
    ITERATION_ID_BASE,
    JOB_ID_BASE,
    PROCESSING_MODES,
    TARGET_WORKERS,
    TASK_ID_BASE,
    Dataset,
    Iteration,
    IterationClient,
    Job,
    SplitCursor,
    Task,
    Worker,
    derived_finished,
)
from ._state_checks import StateChecks
from ._state_queries import StateQueries
from ._state_validation import validate_state as _validate_state
from ._updates import (
    DATASET_ACCEPTS,
    ITERATION_ACCEPTS,
    JOB_ACCEPTS,
    TASK_TRANSITIONS,
    UPDATE_TYPES,
    WORKER_ACCEPTS,
    AckSplits,
    AcquireIterationClient,
    ClientHeartbeat,
    CreateIteration,
    CreateJob,
    CreateTask,
    FinishTask,
    GarbageCollectDataset,
    GarbageCollectIteration,
    GarbageCollectJob,
    ProduceSplit,
    ProduceSplits,
    RegisterDataset,
    RegisterWorker,
    ReleaseIterationClient,
    RemoveWorker,
    Update,
    decode_update,
    encode_update,
)

__all__ = [
    "DATASET_ACCEPTS",
    "DATASET_ID_BASE",
    "ITERATION_ACCEPTS",
    "ITERATION_CLIENT_ID_BASE",
    "ITERATION_ID_BASE",
    "JOB_ACCEPTS",
    "JOB_ID_BASE",
    "PROCESSING_MODES",
    "TARGET_WORKERS",
    "TASK_ID_BASE",
    "TASK_TRANSITIONS",
    "UPDATE_TYPES",
    "WORKER_ACCEPTS",
    "AckSplits",
    "AcquireIterationClient",
    "ClientHeartbeat",
    "CreateIteration",
    "CreateJob",
    "CreateTask",
    "Dataset",
    "DispatcherState",
    "FinishTask",
    "GarbageCollectDataset",
    "GarbageCollectIteration",
    "GarbageCollectJob",
    "Iteration",
    "IterationClient",
    "Job",
    "ProduceSplit",
    "ProduceSplits",
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


class DispatcherState(StateQueries, StateChecks):
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
        #: ``{dataset_name: dataset_id}`` of the datasets registered under a name of the user's.
        self._dataset_by_name: dict[str, int] = {}
        #: Ids of the datasets garbage collected (tombstones: a reader holding one is told
        #: its dataset was collected; ids are never reused).
        self._collected_datasets: set[int] = set()
        #: ``{dataset_id: live jobs}`` (no entry: none), so that a dataset's GC is O(1).
        self._live_jobs_by_dataset: dict[int, int] = {}
        #: ``{address: Worker}``, registered and departed workers.
        self._workers: dict[str, Worker] = {}
        #: ``{address: {iteration_id: task_id}}``: the active tasks of each *registered* worker.
        self._tasks_by_worker: dict[str, dict[int, int]] = {}
        #: ``{job_id: Job}``, every job ever created.
        self._jobs: dict[int, Job] = {}
        #: ``{job_name: job_id}`` of the live named jobs.
        self._jobs_by_name: dict[tuple[int, str], int] = {}
        #: ``{iteration_id: Iteration}``, every iteration ever created.
        self._iterations: dict[int, Iteration] = {}
        #: ``{(job_id, repetition): iteration_id}``, every iteration ever created.
        self._iterations_by_key: dict[tuple[int, int], int] = {}
        #: ``{iteration_id: SplitCursor}`` of the DYNAMIC iterations.
        self._split_cursors: dict[int, SplitCursor] = {}
        #: ``{iteration_id: [(repetition, start, stop)]}``: runs of splits held by tasks whose
        #: worker left (disjoint, in the order they were lost), for every DYNAMIC iteration.
        self._lost_splits: dict[int, list[tuple[int, int, int]]] = {}
        #: ``{task_id: Task}``, the tasks of iterations that are not garbage collected.
        self._tasks: dict[int, Task] = {}
        #: ``{iteration_id: {task_id: None}}`` (an ordered set) for each iteration that is not
        #: garbage collected: all its tasks, active, finished or lost.
        self._tasks_by_iteration: dict[int, dict[int, None]] = {}
        #: ``{(iteration_id, shard_index): [task_id, ...]}``: the tasks of each shard of a
        #: statically sharded iteration that is not garbage collected (any status), so that
        #: handing out a shard is O(1) and not a scan over the iteration's tasks.
        self._tasks_by_shard: dict[tuple[int, int], list[int]] = {}
        #: ``{task_id: deque[(repetition, start, stop)]}``: the splits an active task holds and
        #: has not acknowledged, as runs of consecutive indices (``start`` to ``stop - 1``),
        #: ascending, never empty, adjacent runs merged. Tasks holding none have no entry.
        self._splits_in_flight: dict[int, deque[tuple[int, int, int]]] = {}
        #: ``{iteration_id: {split: None}}``: splits handed out in an explicit order this
        #: repetition (locality-aware hand-out; see :mod:`._split_order`).
        self._split_orders: dict[int, dict[int, None]] = {}
        #: ``{iteration_id: (repetition, [split at each position])}``: the explicit order of
        #: the iteration's last ended repetition (a lost reply that ended it is answered
        #: again from it; see :mod:`._split_order`).
        self._ended_split_orders: dict[int, tuple[int, list[int]]] = {}
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
            case ProduceSplits():
                _split_order.record(self, update)  # explicit order (locality), if any
                self._produce_splits(update.iteration_id, update.repetition, update.index,
                                     update.count, update.task_id, update.end_of_splits)
            case ProduceSplit():
                self._produce_splits(update.iteration_id, update.repetition, update.index,
                                     0 if update.finished else 1, update.task_id,
                                     update.finished)
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
            case GarbageCollectJob():
                self._garbage_collect_job(update)
            case GarbageCollectDataset():
                self._garbage_collect_dataset(update)

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
            case ProduceSplits():
                self._check_produce_splits(update)
                _split_order.check(self, update)  # explicit order (locality), if any
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
            case GarbageCollectJob():
                self._check_garbage_collect_job(update)
            case GarbageCollectDataset():
                self._check_garbage_collect_dataset(update)
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
            "dataset_by_name": dict(self._dataset_by_name),
            "collected_datasets": sorted(self._collected_datasets),
            "live_jobs_by_dataset": dict(self._live_jobs_by_dataset),
            "workers": {k: dataclasses.asdict(v) for k, v in self._workers.items()},
            "tasks_by_worker": {k: dict(v) for k, v in self._tasks_by_worker.items()},
            "jobs": {k: dataclasses.asdict(v) for k, v in self._jobs.items()},
            "jobs_by_name": dict(self._jobs_by_name),
            "iterations": {k: dataclasses.asdict(v) for k, v in self._iterations.items()},
            "iterations_by_key": dict(self._iterations_by_key),
            "split_cursors": {k: dataclasses.asdict(v) for k, v in self._split_cursors.items()},
            "lost_splits": {k: sorted(v) for k, v in self._lost_splits.items()},  # runs
            "tasks": {k: dataclasses.asdict(v) for k, v in self._tasks.items()},
            "tasks_by_iteration": {k: list(v) for k, v in self._tasks_by_iteration.items()},
            "tasks_by_shard": {k: list(v) for k, v in self._tasks_by_shard.items()},
            "splits_in_flight": {k: list(v) for k, v in self._splits_in_flight.items()},
            "split_orders": {k: list(v) for k, v in self._split_orders.items()},
            "ended_split_orders": {k: [rep, list(v)]
                                   for k, (rep, v) in self._ended_split_orders.items()},
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
        _validate_state(self)

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
            dataset_name=u.dataset_name,
            secret=u.secret,
        )
        if u.dataset_name is None:
            self._dataset_by_fingerprint[u.fingerprint] = u.dataset_id
        else:
            self._dataset_by_name[u.dataset_name] = u.dataset_id
        self._next_dataset_id = max(self._next_dataset_id, u.dataset_id + 1)

    def _register_worker(self, u: RegisterWorker) -> None:
        # A departed worker coming back is replaced: its host or threads may have changed
        # (the tasks of its previous life still name it).
        previous = self._workers.get(u.address)
        self._workers[u.address] = Worker(
            address=u.address,
            host=u.host,
            nthreads=u.nthreads,
            resources=dict(u.resources),
            tags=u.tags,
            num_tasks=0 if previous is None else previous.num_tasks,
        )
        self._tasks_by_worker[u.address] = {}

    def _remove_worker(self, u: RemoveWorker) -> None:
        self._workers[u.address].registered = False
        for iteration_id, task_id in self._tasks_by_worker.pop(u.address).items():
            self._tasks[task_id].lost = True
            held = self._splits_in_flight.pop(task_id, None)
            if held:
                self._lost_splits[iteration_id].extend(held)  # O(runs), not O(splits)
            iteration = self._iterations[iteration_id]
            iteration.num_lost_tasks += 1
            iteration.finished = derived_finished(iteration)
        self._forget_if_unused(u.address)

    def _create_job(self, u: CreateJob) -> None:
        self._jobs[u.job_id] = Job(
            job_id=u.job_id,
            job_name=u.job_name,
            dataset_id=u.dataset_id,
            processing_mode=u.processing_mode,
            num_consumers=u.num_consumers,
            target_workers=u.target_workers,
            cross_trainer_cache=u.cross_trainer_cache,
            worker_addresses=u.worker_addresses,
            token=u.token,
            position=u.position,
        )
        if u.job_name is not None:
            self._jobs_by_name[(u.dataset_id, u.job_name)] = u.job_id
        self._live_jobs_by_dataset[u.dataset_id] = \
            self._live_jobs_by_dataset.get(u.dataset_id, 0) + 1
        self._next_job_id = max(self._next_job_id, u.job_id + 1)

    def _create_iteration(self, u: CreateIteration) -> None:
        job = self._jobs[u.job_id]
        self._iterations[u.iteration_id] = Iteration(
            iteration_id=u.iteration_id, job_id=u.job_id, repetition=u.repetition,
            num_shards=len(job.worker_addresses),
        )
        self._iterations_by_key[(u.job_id, u.repetition)] = u.iteration_id
        self._tasks_by_iteration[u.iteration_id] = {}
        if job.processing_mode == "DYNAMIC":
            num_splits = self._datasets[job.dataset_id].num_splits
            self._split_cursors[u.iteration_id] = SplitCursor(u.iteration_id, num_splits)
            self._lost_splits[u.iteration_id] = []
        job.num_iterations += 1
        job.num_live_iterations += 1
        self._next_iteration_id = max(self._next_iteration_id, u.iteration_id + 1)

    def _create_task(self, u: CreateTask) -> None:
        self._tasks[u.task_id] = Task(
            task_id=u.task_id, iteration_id=u.iteration_id, worker_address=u.worker_address,
            shard_index=u.shard_index,
        )
        self._tasks_by_iteration[u.iteration_id][u.task_id] = None
        if u.shard_index is not None:
            self._tasks_by_shard.setdefault((u.iteration_id, u.shard_index), []).append(u.task_id)
        self._tasks_by_worker[u.worker_address][u.iteration_id] = u.task_id
        self._workers[u.worker_address].num_tasks += 1
        iteration = self._iterations[u.iteration_id]
        iteration.num_tasks += 1
        iteration.finished = derived_finished(iteration)
        self._next_task_id = max(self._next_task_id, u.task_id + 1)

    def _finish_task(self, u: FinishTask) -> None:
        task = self._tasks[u.task_id]
        task.finished = True
        del self._tasks_by_worker[task.worker_address][task.iteration_id]
        # A finished pipeline is done with every split it was given.
        self._splits_in_flight.pop(u.task_id, None)
        iteration = self._iterations[task.iteration_id]
        iteration.num_finished_tasks += 1
        if task.shard_index is not None:
            iteration.finished_shards = iteration.finished_shards | {task.shard_index}
        iteration.finished = derived_finished(iteration)

    def _produce_splits(self, iteration_id: int, repetition: int, index: int, count: int,
                        task_id: int, end_of_splits: bool) -> None:
        cursor = self._split_cursors[iteration_id]
        if count:
            cursor.next_index = index + count
            held = self._splits_in_flight.get(task_id)
            if held is None:
                held = self._splits_in_flight[task_id] = deque()
            if held and held[-1][0] == repetition and held[-1][2] == index:
                held[-1] = (repetition, held[-1][1], index + count)  # extends the last run
            else:
                held.append((repetition, index, index + count))
        if end_of_splits:
            cursor.repetition += 1
            cursor.next_index = 0

    def _ack_splits(self, u: AckSplits) -> None:
        held = self._splits_in_flight[u.task_id]
        bound = (u.repetition, u.index)
        while held:
            repetition, start, stop = held[0]
            if (repetition, stop - 1) <= bound:
                held.popleft()
            else:
                if (repetition, start) <= bound:  # the bound falls inside this run
                    held[0] = (repetition, u.index + 1, stop)
                break
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
        iteration.read_to_end = iteration.read_to_end or u.read_to_end

    def _client_heartbeat(self, u: ClientHeartbeat) -> None:
        self._iteration_clients[u.iteration_client_id].last_seen_micros = u.time_micros

    def _garbage_collect_iteration(self, u: GarbageCollectIteration) -> None:
        self._split_orders.pop(u.iteration_id, None)
        self._ended_split_orders.pop(u.iteration_id, None)
        for task_id in self._tasks_by_iteration.pop(u.iteration_id):
            task = self._tasks.pop(task_id)
            if task.shard_index is not None:
                self._tasks_by_shard.pop((u.iteration_id, task.shard_index), None)
            if task.status == "active":
                del self._tasks_by_worker[task.worker_address][u.iteration_id]
            self._splits_in_flight.pop(task_id, None)
            self._workers[task.worker_address].num_tasks -= 1
            self._forget_if_unused(task.worker_address)
        iteration = self._iterations[u.iteration_id]
        iteration.finished = True
        iteration.garbage_collected = True
        job = self._jobs[iteration.job_id]
        job.num_live_iterations -= 1
        if job.num_live_iterations == 0:
            self._job_collected(job)

    def _garbage_collect_job(self, u: GarbageCollectJob) -> None:
        self._job_collected(self._jobs[u.job_id])

    def _job_collected(self, job: Job) -> None:
        job.garbage_collected = True
        if job.job_name is not None:
            del self._jobs_by_name[(job.dataset_id, job.job_name)]
        live = self._live_jobs_by_dataset[job.dataset_id] - 1
        if live:
            self._live_jobs_by_dataset[job.dataset_id] = live
        else:
            del self._live_jobs_by_dataset[job.dataset_id]

    def _garbage_collect_dataset(self, u: GarbageCollectDataset) -> None:
        dataset = self._datasets.pop(u.dataset_id)
        if dataset.dataset_name is None:
            del self._dataset_by_fingerprint[dataset.fingerprint]
        else:
            del self._dataset_by_name[dataset.dataset_name]
        self._collected_datasets.add(u.dataset_id)

    def _forget_if_unused(self, address: str) -> None:
        worker = self._workers[address]
        if not worker.registered and worker.num_tasks == 0:
            del self._workers[address]


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

