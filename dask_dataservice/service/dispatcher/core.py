"""The dispatcher's sans-I/O core: every decision of the dispatcher, as a pure object.

:class:`DispatcherCore` holds the :class:`~.state.DispatcherState` (journaled) and the
volatile bookkeeping that is not journaled (client liveness times, idle named iterations,
workers the journal knew that have not come back yet, data-worker heartbeat deadlines, the
iteration view cache, registration counts). It has one method per stimulus: each handler's
request, a worker heartbeat, a worker leaving, a GC tick, a probe's verdict, the state
replayed from a journal. Each takes ``now`` (seconds, wall clock) explicitly and returns an
:class:`Outcome`: the reply, the update records it applied (in order, already checked and
applied to the state) and the messages to push to data workers once those records are
durable. A method that raises leaves what it applied before the error in
:meth:`DispatcherCore.take_effects` (the shell journals it all the same, as before).

No I/O, no asyncio, no clock, no Dask here. What the dispatcher does not own, it asks
through :class:`ClusterView` (read-only): which workers the cluster has (resources, Dask
name) and which workers hold a Dask key (locality). The plugin
(:mod:`.plugin`) is the I/O shell: unpack a request, call the core, append the
updates to the journal, wait for durability, send the messages, reply. The simulator
(:mod:`dask_dataservice.testing.sim`) drives this same object.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable, Collection, Iterable, KeysView, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from ...errors import (
    DataServiceError,
    DatasetNotFoundError,
    IterationNotFoundError,
    JobNotFoundError,
    TaskNotFoundError,
    WorkerNotFoundError,
)
from ..protocol._job_checks import (
    check_job_token,
    check_mode,
    check_target_workers,
    require_shared_infinite,
)
from ..protocol._sharding import STATIC_POLICIES, ShardingPolicy, parse_processing_mode
from . import _drain, _equal, _gc, _handout, _locality
from ._credentials import check_reuse, credential, find_dataset
from ._deadlines import LastSeen, WorkerDeadlines
from ._quotas import Limits, Quotas, check_name, dataset_size, field_bytes
from ._shards import ShardMaps, warn_changed_worker_lists
from ._views import ViewCache, build_view
from .state import (
    AckSplits,
    AcquireIterationClient,
    ClientHeartbeat,
    CreateIteration,
    CreateJob,
    CreateTask,
    DispatcherState,
    FinishTask,
    RegisterDataset,
    RegisterWorker,
    ReleaseIterationClient,
    RemoveWorker,
    Update,
)

if TYPE_CHECKING:
    from ..protocol._messages import IterationView, TaskChanges, TaskDef
    from ._entities import Dataset, Iteration, IterationClient, Job, Task

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")

__all__ = ["ClusterView", "CoreConfig", "DispatcherCore", "Outcome", "WorkerInfo"]

#: The stream op of a task push (``._messages.TASKS_OP``; the same string, kept here so the
#: core imports no wire code).
TASKS_OP = "dataservice-tasks"


def micros(now: float) -> int:
    """``now`` (seconds) in the journal's microseconds."""
    return int(now * 1_000_000)


@dataclass(frozen=True)
class CoreConfig:
    """The dispatcher's settings (``dataservice.dispatcher.*``), as plain values."""

    #: Seconds a named job's iteration may have no clients before it is collected (and a
    #: job that never got an iteration, at least ``client_timeout`` after its creation).
    job_gc_timeout: float = 300.0
    #: Seconds a dataset never read (no iteration) may have no job until collected (None: never).
    dataset_gc_timeout: float | None = 3600.0
    #: Seconds without a heartbeat after which a client is released.
    client_timeout: float = 30.0
    #: Seconds of silence after which a data worker is dropped.
    worker_timeout: float = 10.0
    #: TF's ``gc_dynamic_sharding_jobs``: collect idle unfinished DYNAMIC named jobs too.
    gc_dynamic_sharding_jobs: bool = False
    #: The fixed worker list of static sharding (addresses or Dask names), or None.
    worker_addresses: tuple[str, ...] | None = None
    #: Workers with any of these resources run no data tasks.
    excluded_resources: tuple[str, ...] = ("ps",)
    #: Most split indices one ``get_split`` hands out (``dispatcher.split-batch-max``).
    split_batch_max: int = 1024
    #: What the dispatcher accepts and holds (issue 22; :mod:`._quotas`).
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class WorkerInfo:
    """What the cluster says of a worker (the scheduler's ``WorkerState``, as plain values)."""

    address: str
    host: str = ""
    nthreads: int = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    name: object = None


class ClusterView(Protocol):
    """Read-only facts the dispatcher does not own (the plugin answers them from the
    scheduler, the simulator from its world)."""

    def worker(self, address: str) -> WorkerInfo | None:
        """The worker at ``address`` if the cluster has it now, else None."""

    def holders(self, key: Any) -> Iterable[str]:
        """Addresses of the workers holding Dask key ``key`` in memory (locality)."""


@dataclass
class Outcome[R]:
    """What one stimulus did: its reply, the records applied (in order) and the pushes to
    send once those records are durable (``(worker address, TaskChanges)``)."""

    reply: R
    updates: list[Update] = field(default_factory=list)
    messages: list[tuple[str, TaskChanges]] = field(default_factory=list)


def _stimulus[R](method: Callable[..., R]) -> Callable[..., Outcome[R]]:
    """Run a stimulus and hand back its effects with its reply (see the module docstring)."""

    @functools.wraps(method)
    def wrapper(self: DispatcherCore, *args: Any, **kwargs: Any) -> Outcome[R]:
        if self._updates or self._messages:
            raise RuntimeError("the effects of the previous stimulus were not taken")
        reply = method(self, *args, **kwargs)
        out = self.take_effects()
        return Outcome(reply, out.updates, out.messages)

    return wrapper


class DispatcherCore:
    """The dispatcher's decisions (see the module docstring).

    Parameters
    ----------
    config
        The settings.
    cluster
        Read-only facts of the cluster (:class:`ClusterView`).
    now
        The time of this start (client timers start again from it).
    lineage
        Whose task and dataset ids these are (answered to worker heartbeats).
    new_token
        Draws job tokens (random by default; the simulator passes a seeded one).
    view_nonce
        The view versions' start nonce (random by default).
    """

    def __init__(self, config: CoreConfig, cluster: ClusterView, now: float, *,
                 lineage: str = "", new_token: Callable[[], str] | None = None,
                 view_nonce: str | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.state = DispatcherState()
        self.lineage = lineage
        self._new_token = new_token or (lambda: secrets.token_urlsafe(24))
        #: ``{iteration_client_id: micros}``: when each acquired client was last heard from
        #: since this start (acquired, heartbeat; this start for the journal's), oldest first.
        self.client_seen: LastSeen[int] = LastSeen()
        #: Iterations of named jobs that lost their last client (candidates for GC), since
        #: when (micros), oldest first.
        self.idle_iterations = _gc.IdleQueue()
        #: GC candidates (jobs without iteration, unread datasets without jobs); read datasets.
        self.idle_jobs, self.idle_datasets = _gc.IdleQueue(), _gc.IdleQueue()
        self.read_datasets: set[int] = set()  # and the Dask data live datasets published:
        self.published = _gc.PublishedNames()
        #: ``{address: ids of the live iterations it had a task of (any status)}``: the
        #: workers the journal knew that have not heartbeated since this start (reviving one
        #: is then O(live iterations), not a scan of every iteration's tasks).
        self.recovered: dict[str, set[int]] = {}
        self.shard_maps = ShardMaps()  # static jobs' worker lists as lookups (a cache)
        #: When this start began (micros): client and GC timers start again from it.
        self.recovered_at = micros(now)
        self.views = ViewCache(view_nonce)
        self.deadlines = WorkerDeadlines(config.worker_timeout, now)
        #: Counts the limits bound (:mod:`._quotas`).
        self.quotas = Quotas(config.limits)
        #: Set by the shell when its journal failed: every update is refused with this.
        self.refusal: str | None = None
        self.hints = _locality.Hints()
        #: Data workers being drained before they retire (issue 26, :mod:`._drain`).
        self.draining: set[str] = set()
        self.equal = _equal.EqualGroups()  # volatile: rebuilt from the consumers' reports (._equal)
        self._updates: list[Update] = []
        self._messages: list[tuple[str, TaskChanges]] = []

    # Effects
    #########
    def take_effects(self) -> Outcome[None]:
        """The records applied and the pushes queued since the last stimulus returned (the
        partial effects of one that raised)."""
        out: Outcome[None] = Outcome(None, self._updates, self._messages)
        self._updates, self._messages = [], []
        return out

    def _apply(self, update: Update) -> None:
        """Check and apply one update; the shell journals it (from the outcome)."""
        if self.refusal is not None:
            raise DataServiceError(self.refusal)
        self.state.check(update)
        self.state.apply(update, checked=True)
        self.views.updated(update)
        self._updates.append(update)
        match update:  # the liveness timers follow the state, whoever applies an update
            case AcquireIterationClient() | ClientHeartbeat():
                self.client_seen.seen(update.iteration_client_id, update.time_micros)
            case ReleaseIterationClient():
                self.client_seen.pop(update.iteration_client_id, None)
            case RegisterWorker():
                self.deadlines.watch(update.address)

    def _push(self, address: str, changes: TaskChanges) -> None:
        self._messages.append((address, changes))

    def _cancel(self, tasks: Iterable[Task]) -> None:
        """Tell the present workers of ``tasks`` to drop them (their iteration was collected)."""
        by_worker: dict[str, list[int]] = {}
        for t in tasks:
            by_worker.setdefault(t.worker_address, []).append(t.task_id)
        for address, task_ids in by_worker.items():
            if self.cluster.worker(address) is not None:
                self._push(address, cast("TaskChanges", {
                    "op": TASKS_OP, "new_tasks": [], "cancelled": task_ids}))

    @_stimulus
    def apply(self, update: Update) -> None:
        """Apply an update built outside (tests and benchmarks set up states so)."""
        self._apply(update)

    # Recovery
    ##########
    @property
    def recovered_workers(self) -> KeysView[str]:
        """The workers the journal knew that have not heartbeated since this start."""
        return self.recovered.keys()

    def restore(self, state: DispatcherState) -> None:
        """Take the state replayed from the journal (:mod:`._recovery`).

        What is not journaled is rebuilt: the workers of the previous run are pending until
        they heartbeat, idle named iterations are GC candidates again (their timers start at
        this start).
        """
        self.state = state
        self.views = ViewCache()
        self.quotas = Quotas.of(state, self.config.limits)
        self.recovered = state.iterations_by_worker(w.address for w in state.list_workers())
        self.shard_maps = ShardMaps()
        self.idle_iterations = _gc.IdleQueue()
        for it in state.list_live_iterations():  # their timers start at this start
            if not it.num_clients and it.last_client_released_micros is not None:
                self.idle_iterations.add(it.iteration_id, self.recovered_at)
        self.client_seen = LastSeen(
            (c.iteration_client_id, self.recovered_at) for c in state.list_iteration_clients())
        for address in self.recovered_workers:
            self.deadlines.watch(address)
        (self.idle_jobs, self.idle_datasets, self.read_datasets,
         self.published) = _gc.idle_queues(state, self.recovered_at)
        warn_changed_worker_lists(state, self.config.worker_addresses)

    # Datasets, jobs, iterations
    ############################
    def dataset(self, dataset_id: int | str) -> Dataset:
        """A dataset by its credential, the id ``register_dataset`` answered
        (:mod:`._credentials`; a dataset journaled before secrets: its bare id or name)."""
        return find_dataset(self.state, dataset_id, self.config.dataset_gc_timeout)

    @_stimulus
    def register_dataset(self, fingerprint: str, pipeline: bytes, splits: bytes | None,
                         num_splits: int, element_spec: bytes | None = None,
                         metadata: dict[str, Any] | None = None,
                         compression: str | None = None, dataset_id: str | None = None,
                         client_id: str | None = None, host: str | None = None,
                         now: float | None = None) -> dict[str, Any]:
        """Register a dataset; answer its credential (``DispatcherPlugin.register_dataset``;
        ``host``: the request's, for its limit; ``client_id``, a client's choice, is unused;
        ``now``: when, for its idle timer; ``None``: the next GC tick's time)."""
        limits = self.config.limits
        check_name(limits, "the fingerprint", fingerprint)
        check_name(limits, "dataset_id", dataset_id)
        metadata_bytes = field_bytes(limits, "metadata", metadata)
        field_bytes(limits, "element_spec", element_spec)
        if dataset_id is not None:
            if not isinstance(dataset_id, str) or not dataset_id:
                raise TypeError(f"dataset_id must be a non-empty string, got {dataset_id!r}")
            try:
                existing = self.state.dataset_by_name(dataset_id)
            except DatasetNotFoundError:
                existing = None
            if existing is not None:  # as TF: no new dataset (when the structure matches)
                check_reuse(existing, dataset_id, fingerprint, metadata, compression)
                return {"status": "OK", "dataset_id": credential(existing)}
        else:
            try:
                return {"status": "OK",
                        "dataset_id": credential(self.state.dataset_by_fingerprint(fingerprint))}
            except DatasetNotFoundError:
                pass
        size = dataset_size(pipeline, splits or b"", element_spec, metadata_bytes)
        self.quotas.check_dataset(host, size)
        new_id = self.state.next_dataset_id()
        self._apply(RegisterDataset(
            dataset_id=new_id, fingerprint=fingerprint, pipeline=bytes(pipeline),
            splits=bytes(splits or b""), num_splits=int(num_splits),
            element_spec=element_spec, metadata=dict(metadata or {}),
            compression=compression, dataset_name=dataset_id, secret=self._new_token(),
        ))
        self.quotas.add_dataset(host, size)
        self.published.add(new_id, metadata)
        self.idle_datasets.add(new_id, None if now is None else micros(now))  # no job yet
        return {"status": "OK", "dataset_id": credential(self.state.dataset(new_id))}

    @_stimulus
    def get_or_create_job(self, dataset_id: int | str, processing_mode: Any,
                          job_name: str | None = None, num_consumers: int | None = None,
                          target_workers: str = "AUTO", cross_trainer_cache: bool = False,
                          position: str = "", now: float | None = None) -> dict[str, Any]:
        """Find the live job named ``job_name`` of the dataset, or create one (``now``: when,
        for the timer of a job that gets no iteration; ``None``: the next GC tick's time)."""
        mode = parse_processing_mode(processing_mode)
        for what, name in (("job_name", job_name), ("the position", position)):
            check_name(self.config.limits, what, name)
        dataset = self.dataset(dataset_id)
        dataset_id = dataset.dataset_id
        worker_addresses = self.config.worker_addresses or None  # a tuple: not copied
        mode = check_mode(mode, dataset, worker_addresses)
        target_workers = str(target_workers).upper()
        check_target_workers(mode, target_workers, num_consumers)
        if num_consumers is not None:
            require_shared_infinite("coordinated reads", "need", job_name, dataset,
                                    unknown_ok=True)
        if cross_trainer_cache:
            require_shared_infinite("the cross-trainer cache", "needs", job_name, dataset)
        if job_name is not None:
            try:
                job = self.state.job_by_name(job_name, dataset_id)  # scoped per dataset (TF)
            except JobNotFoundError:
                job = None
            if job is not None:
                if job.num_consumers != num_consumers:
                    raise ValueError(
                        f"job {job_name!r} was created with num_consumers="
                        f"{job.num_consumers}, not {num_consumers}"
                    )
                if job.processing_mode != mode.name:
                    raise ValueError(
                        f"job {job_name!r} of dataset {dataset_id} already exists with "
                        f"processing mode {job.processing_mode}; it cannot be read in mode "
                        f"{mode.name}"
                    )
                if job.target_workers != target_workers:
                    raise ValueError(
                        f"job {job_name!r} is read with target_workers="
                        f"{job.target_workers!r}; all its consumers must use the same, not "
                        f"{target_workers!r}"
                    )
                return {"status": "OK", "job_id": job.job_id, "job_token": job.token}
        self.quotas.check_job()
        job_id = self.state.next_job_id()
        self._apply(CreateJob(
            job_id=job_id, job_name=job_name, dataset_id=dataset_id,
            processing_mode=mode.name, num_consumers=num_consumers,
            target_workers=target_workers,
            cross_trainer_cache=bool(cross_trainer_cache), position=position,  # issue 13
            worker_addresses=worker_addresses  # type: ignore[arg-type]  # check_mode
            if mode in STATIC_POLICIES else (),
            token=self._new_token(),
        ))
        self.quotas.live_jobs += 1
        self.idle_datasets.discard(dataset_id)
        self.idle_jobs.add(job_id, None if now is None else micros(now))  # no iteration yet
        return {"status": "OK", "job_id": job_id, "job_token": self.state.job(job_id).token}

    @_stimulus
    def get_or_create_iteration(self, job_id: int, now: float, repetition: int = 0,
                                job_token: str | None = None) -> dict[str, Any]:
        job = self.state.job(job_id)
        check_job_token(job.token, job_token, job_id, "reading")
        try:
            iteration = self.state.iteration_by_key(job_id, repetition)
        except IterationNotFoundError:
            iteration = None
        if iteration is None and job.garbage_collected:
            raise _gc.collected_job_error(job, self.config)
        if iteration is None:
            self.idle_jobs.discard(job_id)
            self.read_datasets.add(job.dataset_id)
            iteration_id = self.state.next_iteration_id()
            self._apply(CreateIteration(iteration_id=iteration_id, job_id=job_id,
                                        repetition=repetition))
            for worker in self.state.list_workers():
                self._create_task(iteration_id, worker.address, job)
        else:
            iteration_id = iteration.iteration_id
            if iteration.garbage_collected:
                raise DataServiceError(
                    f"iteration {iteration_id} of job {job_id} was garbage collected"
                )
        self.idle_iterations.discard(iteration_id)
        client_id = self.state.next_iteration_client_id()
        self._apply(AcquireIterationClient(
            iteration_client_id=client_id, iteration_id=iteration_id, time_micros=micros(now)
        ))
        return {"status": "OK", "iteration_id": iteration_id, "iteration_client_id": client_id,
                **self.iteration_view(iteration_id)}

    @_stimulus
    def client_heartbeat(self, iteration_client_id: int, now: float,
                         job_token: str | None = None,
                         view_version: str | None = None) -> dict[str, Any]:
        """A consumer is alive: remember when (not journaled); answer its iteration's view,
        or only ``unchanged`` if ``view_version`` is still current (:mod:`._views`)."""
        client = self._iteration_client(iteration_client_id, job_token, "a client heartbeat")
        self.client_seen.seen(iteration_client_id, micros(now))
        version = self.views.version
        consumers = self.state.iteration(client.iteration_id).num_clients  # who shares (22)
        reply = {"status": "OK", "view_version": version, "consumers": consumers}
        return {**reply, "unchanged": True} if view_version == version else {
            **reply, **self.iteration_view(client.iteration_id)}

    equal_sync = _stimulus(_equal.equal_sync)  # a consumer of an equal split reports

    @_stimulus
    def release_iteration_client(self, iteration_client_id: int, now: float,
                                 job_token: str | None = None,
                                 read_to_end: bool = False) -> dict[str, Any]:
        """A consumer stopped reading; ``read_to_end``: it got the end of every task (the GC
        of an idle DYNAMIC iteration waits for that: :func:`._gc.collectable`)."""
        self._iteration_client(iteration_client_id, job_token, "releasing a consumer")
        self._release_client(iteration_client_id, now, read_to_end=read_to_end)
        return {"status": "OK"}

    # Data workers
    ##############
    @_stimulus
    def get_split(self, iteration_id: int, task_id: int, repetition: int, count: int = 1,
                  job_token: str | None = None, received: int | None = None) -> dict[str, Any]:
        """Up to ``count`` next split indices of a DYNAMIC iteration for ``task_id``.

        ``end_of_splits`` says repetition ``repetition`` has no more splits (after the
        indices returned). O(count). Only the task's worker may ask, with the job's token.
        A retry says how many splits the task ``received``: any handed to it that it never
        got are answered again (:func:`._handout.undelivered`).
        """
        self._check_task_token(task_id, job_token, "taking splits", iteration_id)
        if received is not None:
            again = _handout.undelivered(self.state, iteration_id, task_id, repetition,
                                         int(received))
            if again is not None:
                return {"status": "OK", "split_indices": again[0], "end_of_splits": again[1]}
        if self.draining and self.state.task(task_id).worker_address in self.draining:
            # its worker retires: no new split; the task ends its input, and its
            # consumers read what it made (issue 26: every element still exactly once)
            return {"status": "OK", "split_indices": [], "end_of_splits": True,
                    "drained": True}
        indices, end = _handout.hand_out(self, iteration_id, task_id, repetition, count)
        return {"status": "OK", "split_indices": indices, "end_of_splits": end}

    @_stimulus
    def autocached(self, task_id: int, indices: list[int],
                   job_token: str | None = None) -> dict[str, Any]:
        """The task's worker cached these splits of its dataset (``autocache()``, issue 26):
        later iterations hand them to it first (:mod:`._locality`). O(len(indices))."""
        try:
            self._check_task_token(task_id, job_token, "reporting cached splits")
            task = self.state.task(task_id)
        except TaskNotFoundError:
            return {"status": "OK"}  # garbage collected meanwhile
        try:
            if not self.state.worker(task.worker_address).registered:
                return {"status": "OK"}  # dropped meanwhile: forgotten with its caches
        except WorkerNotFoundError:
            return {"status": "OK"}
        dataset_id = self.state.job(self.state.iteration(task.iteration_id).job_id).dataset_id
        self.hints.cached.add(dataset_id, task.worker_address, indices)
        return {"status": "OK"}

    @_stimulus
    def ack_splits(self, task_id: int, repetition: int,
                   job_token: str | None = None) -> dict[str, Any]:
        """A task is done with every split it holds of ``repetition`` and before."""
        try:
            self._check_task_token(task_id, job_token, "acknowledging splits")
            first = self.state.first_split_held(task_id)
        except TaskNotFoundError:
            return {"status": "OK"}  # garbage collected meanwhile
        if first is not None and first[0] <= repetition:
            self._apply(AckSplits(task_id=task_id, repetition=repetition, index=2**62))
        return {"status": "OK"}

    @_stimulus
    def finish_task(self, task_id: int, error: bool = False,
                    job_token: str | None = None) -> dict[str, Any]:
        try:
            self._check_task_token(task_id, job_token, "finishing a task")
            status = self.state.task_status(task_id)
        except TaskNotFoundError:
            return {"status": "OK"}  # garbage collected meanwhile
        if status == "active":
            self._apply(FinishTask(task_id=task_id))
        return {"status": "OK"}

    @_stimulus
    def worker_heartbeat(self, worker: WorkerInfo, now: float,
                         active_tasks: Iterable[int] = (), finished_tasks: Iterable[int] = (),
                         resumed: bool = False) -> TaskChanges:
        """Register a data worker if needed and tell it which tasks to start and drop.

        ``worker``: what the cluster says of it (the shell answers an empty reply to a worker
        the cluster does not have yet, and checks the worker's key). ``resumed``: it kept its
        tasks across a dispatcher restart; a worker the journal knew is then revived with them
        (:meth:`_revive`).
        """
        address = worker.address
        active_tasks, finished_tasks = list(active_tasks), list(finished_tasks)
        self.deadlines.seen(address, now)
        if address in self.recovered_workers:
            self._revive(address, resumed, active_tasks)
        try:
            known = self.state.worker(address).registered
        except WorkerNotFoundError:
            known = False
        if not known:
            self._apply(RegisterWorker(address=address, host=worker.host,
                                       nthreads=int(worker.nthreads),
                                       resources=dict(worker.resources)))
            self._hand_out(address)
        for tid in finished_tasks:
            try:
                if self.state.task_status(tid) == "active":
                    self._apply(FinishTask(task_id=tid))
            except TaskNotFoundError:
                pass
        reported = set(active_tasks) | set(finished_tasks)
        assigned = {t.task_id: t for t in self.state.tasks_for_worker(address)}
        new_tasks = [self.task_def(t) for tid, t in assigned.items()
                     if tid not in reported and t.status == "active"]
        cancelled = self._dropped_tasks(reported)
        return cast("TaskChanges", {"status": "OK", "new_tasks": new_tasks,
                                    "cancelled": cancelled, "lineage": self.lineage})

    def _hand_out(self, address: str, *, had: Collection[int] = ()) -> None:
        """A task of each live iteration that a worker joining now serves (``_serves``),
        created without a push (the heartbeat's reply carries them).

        Coordinated reads keep the task list they started with. A worker revived after a
        dispatcher restart (back with its tasks) only gets tasks of iterations created while
        it was away: the iterations it ``had`` a task of, in any status, get none (a finished
        OFF task must not run its repetition again; tests/service/test_invisible_restart.py).
        O(live iterations).
        """
        state = self.state
        for iteration in state.list_live_iterations():
            job = state.job(iteration.job_id)
            if job.num_consumers is not None or not self._serves(iteration, job):
                continue  # coordinated reads: the task list is fixed at the start
            if iteration.iteration_id in had:
                continue
            self._create_task(iteration.iteration_id, address, job, push=False)

    def _revive(self, address: str, resumed: bool, active_tasks: Iterable[int]) -> None:
        """The first heartbeat of a worker the journal knew (:mod:`._recovery`)."""
        had = self.recovered.pop(address, set())
        state = self.state
        try:
            registered = state.worker(address).registered
        except WorkerNotFoundError:
            # removed since the restart (it left, or was dropped for silence) and forgotten
            # once no task named it: it registers as a new worker (this raised, and every
            # heartbeat of the worker failed from then on; found by the simulator)
            registered = False
        if not registered:
            return
        held = sorted(t.task_id for t in state.tasks_for_worker(address) if t.status == "active")
        if resumed:
            logger.info("dataservice: data worker %s is back with its tasks %s (reported %s): "
                        "revived", address, held, sorted(active_tasks))
            self._hand_out(address, had=had)
            return
        logger.warning(
            "dataservice: data worker %s came back without its tasks (a new process); its "
            "tasks %s are lost (the splits they held are not handed out again)", address, held)
        self._apply(RemoveWorker(address=address))

    def _dropped_tasks(self, reported: Iterable[int]) -> list[int]:
        """Of the tasks a worker reports, those it must drop: unknown (collected) or lost."""
        out = []
        for task_id in reported:
            try:
                if self.state.task_status(task_id) == "lost":
                    out.append(task_id)
            except TaskNotFoundError:
                out.append(task_id)
        return out

    @_stimulus
    def drain_worker(self, address: str, held: Iterable[int] = ()) -> list[int]:
        """``address`` is about to retire (issue 26): no new task or split for it; answers
        the tasks to wait for (:func:`._drain.drain`; ``held``: the tasks it says it holds)."""
        return _drain.drain(self, address, held)

    @_stimulus
    def undrain(self, address: str) -> None:
        """The retirement of ``address`` was called off: it takes tasks and splits again."""
        self.draining.discard(address)

    def drained(self, task_ids: Iterable[int], *, finished: bool = False) -> list[int]:
        """Of ``task_ids``, those still producing (:func:`._drain.pending`)."""
        return _drain.pending(self.state, task_ids, finished=finished)

    @_stimulus
    def worker_left(self, address: str) -> None:
        """``address`` left the cluster: its tasks are lost (never handed out again)."""
        self.deadlines.forget(address)
        self.draining.discard(address)
        self.hints.cached.forget(address)
        try:
            if self.state.worker(address).registered:
                self._apply(RemoveWorker(address=address))
        except WorkerNotFoundError:
            pass

    @_stimulus
    def drop_worker(self, address: str, why: str, now: float) -> None:
        """Remove ``address`` from the state (its tasks lost), as if it had died: silent past
        its deadline, or a consumer's report confirmed by a failed probe."""
        self._drop(address, why, now)

    def _drop(self, address: str, why: str, now: float) -> None:
        state = self.state
        try:
            if not state.worker(address).registered:
                return
        except WorkerNotFoundError:
            return
        lost = [t.task_id for t in state.tasks_for_worker(address) if t.status == "active"]
        logger.warning(
            "dataservice: dropping unresponsive data worker %s: %s; its tasks %s are lost "
            "(the splits they held are not handed out again)", address, why, lost)
        self._apply(RemoveWorker(address=address))
        self.hints.cached.forget(address)
        self.deadlines.seen_at.pop(address, None)
        self.deadlines.dropped[address] = now

    # Garbage collection
    ####################
    @_stimulus
    def gc_tick(self, now: float) -> None:
        """One round: drop silent data workers, release silent clients, collect iterations
        nobody reads (anonymous ones went at once; named ones after ``job_gc_timeout``), jobs
        that never got an iteration, and datasets without jobs (:func:`._gc.collect_idle`)."""
        timeout = self.deadlines.timeout
        for address, silence in self.deadlines.silent(now):
            self._drop(address, f"no heartbeat for {silence:.1f}s "
                       f"(dataservice.dispatcher.worker-timeout={timeout:g}s)", now)
        now_us = micros(now)
        client_timeout = int(self.config.client_timeout * 1_000_000)
        # O(1 + silent clients): oldest first (after a restart every timer starts again:
        # heartbeats are not journaled)
        for client_id, seen in self.client_seen.silent(now_us, client_timeout):
            logger.info("dataservice: releasing client %s (no heartbeat for %.1fs)",
                        client_id, (now_us - seen) / 1e6)
            self._release_client(int(client_id), now)
        _gc.collect_idle(self, now)  # named iterations, jobs without one, unread datasets

    def _release_client(self, iteration_client_id: int, now: float,
                        read_to_end: bool = False) -> None:
        client = self.state.iteration_client(iteration_client_id)
        self._apply(ReleaseIterationClient(iteration_client_id=iteration_client_id,
                                           time_micros=micros(now), read_to_end=read_to_end))
        self.client_seen.pop(iteration_client_id, None)
        self.equal.left(iteration_client_id)  # an equal split's member leaving early fails it
        iteration = self.state.iteration(client.iteration_id)
        job = self.state.job(iteration.job_id)
        if iteration.num_clients == 0:
            if job.job_name is None:
                _gc.collect_iteration(self, iteration.iteration_id, now)
            else:
                self.idle_iterations.add(iteration.iteration_id, micros(now))

    # Queries and helpers
    #####################
    def iteration_view(self, iteration_id: int) -> IterationView:
        return self.views.get(iteration_id, functools.partial(build_view, self.state))

    def is_data_worker(self, address: str) -> bool:
        """Whether ``address`` may be given tasks (present, not excluded, not retiring)."""
        if address in self.draining:
            return False
        info = self.cluster.worker(address)
        return info is not None and not any(
            info.resources.get(r) for r in self.config.excluded_resources)

    def _create_task(self, iteration_id: int, address: str, job: Job, push: bool = True) -> None:
        if not self.is_data_worker(address):
            return
        index = None
        if job.worker_addresses:  # static sharding: the job's journaled list decides
            index = self.shard_maps.shard(self.state, self.cluster, iteration_id, job, address)
            if index is None:
                listed = job.worker_addresses
                logger.info(
                    "dataservice: worker %s is not in the worker list of job %s (%s): it "
                    "gets no task of it", address, job.job_id,
                    list(listed) if len(listed) <= 10 else f"{len(listed)} entries: "
                    f"{', '.join(listed[:5])}, ...")
                return
        task_id = self.state.next_task_id()
        self._apply(CreateTask(task_id=task_id, iteration_id=iteration_id, worker_address=address,
                               shard_index=index))
        if push:
            task = self.task_def(self.state.task(task_id))
            if job.processing_mode == "DYNAMIC" and not self.state.split_position(iteration_id)[0]:
                # its first split travels with it (issue 25): its first element waits for no
                # split request (a push lost with a restart: :mod:`._handout`)
                task["first_splits"] = _handout.hand_out(self, iteration_id, task_id, 0, 1)
            self._push(address, cast("TaskChanges", {
                "op": TASKS_OP, "new_tasks": [task], "cancelled": []}))

    @staticmethod
    def _serves(iteration: Iteration, job: Job) -> bool:
        """Whether a worker that joins now gets a task of this live iteration.

        A running one, yes (a static one stays running until every shard of its worker list
        finished, so a listed worker joining late gets its shard). An OFF iteration whose
        tasks all finished producing while consumers still read it, too: as in TensorFlow,
        a worker added or restarted mid-read serves a full repetition (before, a worker
        restarted mid-read never ran its task again and the read ended short). A finished
        DYNAMIC iteration has no split left to hand out.
        """
        if iteration.status == "running":
            return True
        return bool(job.processing_mode == "OFF" and iteration.num_clients > 0)

    def _iteration_client(self, iteration_client_id: int, job_token: str | None,
                          what: str) -> IterationClient:
        """A consumer, if ``job_token`` is its job's token (only the consumer may act for it)."""
        client = self.state.iteration_client(iteration_client_id)
        job = self.state.job(self.state.iteration(client.iteration_id).job_id)
        check_job_token(job.token, job_token, job.job_id, what)
        return client

    def _check_task_token(self, task_id: int, job_token: str | None, what: str,
                          iteration_id: int | None = None) -> None:
        """Refuse ``what`` on a task unless ``job_token`` is its job's token."""
        own_iteration, job_id, token = self.state.task_job_token(task_id)
        if iteration_id is not None and own_iteration != iteration_id:
            raise DataServiceError(f"task {task_id} is not a task of iteration {iteration_id}")
        check_job_token(token, job_token, job_id, what)

    def task_def(self, task: Task) -> TaskDef:
        iteration = self.state.iteration(task.iteration_id)
        job = self.state.job(iteration.job_id)
        return cast("TaskDef", {
            "task_id": task.task_id, "iteration_id": task.iteration_id, "job_id": job.job_id,
            "dataset_id": job.dataset_id,
            "processing_mode": int(ShardingPolicy[job.processing_mode]),
            "worker_index": task.shard_index,
            "num_workers": len(job.worker_addresses) if job.worker_addresses else None,
            "num_consumers": job.num_consumers,
            "cross_trainer_cache": job.cross_trainer_cache, "job_token": job.token,
            "position": job.position})
