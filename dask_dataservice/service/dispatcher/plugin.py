"""DispatcherPlugin: the tf.data service dispatcher as a Dask scheduler plugin.

Responsibilities
----------------
- Own the :class:`~dask_dataservice.service.dispatcher.state.DispatcherState` and change it only by
  building update records: validate → (journal, in fault-tolerant mode) → apply.
- Serve the ``dataservice_*`` RPC handlers: dataset registration, jobs and iterations,
  the DYNAMIC split cursor, task reconciliation with data workers, client heartbeats.
- Push task assignments to data workers (stream op ``dataservice-tasks``) as soon as they
  exist, and reconcile on every worker heartbeat so that a lost message is repaired.
- Liveness: release clients that stopped sending heartbeats (kept in memory, not journaled:
  every timer starts again after a restart), garbage-collect iterations
  with no clients (anonymous ones at once, named ones after ``job-gc-timeout``, except an
  unfinished DYNAMIC one, kept while it can be read, as in TensorFlow), and mark the tasks
  of departed workers lost (their splits in flight are never handed out again).
- Decide nothing the state cannot replay: a static job's worker list and each task's shard
  index are journaled (``CreateJob.worker_addresses``, ``CreateTask.shard_index``), so a
  restart with another config never reassigns shards.

Every handler goes through :func:`~dask_dataservice._rpc.handler` (errors travel as
values); the mutating ones through :func:`_durable` as well. Replies use the wire shapes of
:mod:`._messages` (``TaskDef``, ``TaskInfo``, ``IterationView``). No user code runs here:
datasets arrive as opaque bytes with their splits described on the client, and every
handler does O(1) work, apart from heartbeats (O(tasks of the caller); a newly registered
worker: O(live iterations)) and garbage collection (O(tasks of the collected iteration)).
The plugin starts no task of its own: its background work is the GC periodic callback,
stopped in :meth:`DispatcherPlugin.close`, and the journal writer's flush, which the
writer owns and ``close`` awaits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from ... import config
from ..._rpc import handler
from ...errors import (
    DataServiceError,
    DatasetNotFoundError,
    IterationNotFoundError,
    JobNotFoundError,
    TaskNotFoundError,
    WorkerNotFoundError,
)
from ..protocol._hooks import run_dispatcher_start
from ..protocol._job_checks import (
    check_job_token,
    check_mode,
    check_target_workers,
    require_shared_infinite,
    shard_index,
    worker_list,
)
from ..protocol._messages import TASKS_OP, IterationView, TaskChanges, TaskDef, send_tasks
from ..protocol._sharding import STATIC_POLICIES, ShardingPolicy, parse_processing_mode
from ..protocol._start_read import start_read_handlers
from . import _locality
from ._access import AccessGuard, new_token, redact_summary
from ._gc import collect
from ._liveness import WorkerLiveness
from ._position_handlers import position_handlers
from ._recovery import recover, revive, undelivered
from ._views import ViewCache, build_view
from .state import (
    AckSplits,
    AcquireIterationClient,
    CreateIteration,
    CreateJob,
    CreateTask,
    DispatcherState,
    FinishTask,
    GarbageCollectIteration,
    ProduceSplits,
    RegisterDataset,
    RegisterWorker,
    ReleaseIterationClient,
    RemoveWorker,
    Update,
    encode_update,
)

if TYPE_CHECKING:
    from distributed import Scheduler

    from ._entities import Dataset as DatasetEntity
    from ._entities import Iteration, IterationClient, Job, Task

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dataservice-dispatcher"



def _durable(method: Callable[..., Any]) -> Callable[..., Any]:
    """Make a mutating handler reply only once its updates are in the journal.

    The handler runs synchronously (validate → journal append → apply, with no other
    handler in between); its reply (or its error) then waits for the journal's group commit.
    Records are made durable in order, so waiting for the newest covers every update the
    reply can depend on: no client ever sees an effect that a crash could undo. Errors
    travel as values (:func:`~dask_dataservice._rpc.handler`).
    """

    @handler
    @functools.wraps(method)
    async def wrapper(self: DispatcherPlugin, *args: Any, **kwargs: Any) -> Any:
        if self._closed:  # shutting down: callers retry against the next dispatcher
            return {"status": "closing"}
        try:
            return method(self, *args, **kwargs)
        finally:
            await self._wait_durable()

    return wrapper


def _now_micros() -> int:
    return int(time.time() * 1_000_000)


class DispatcherPlugin(SchedulerPlugin):
    """The dispatcher (see the module docstring).

    Parameters
    ----------
    job_gc_timeout
        Seconds a named job's iteration may have no clients before it is removed
        (default: config ``dataservice.dispatcher.job-gc-timeout``).
    client_timeout
        Seconds without a heartbeat after which a client is released
        (default: ``dataservice.dispatcher.client-timeout``).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, job_gc_timeout: float | None = None, client_timeout: float | None = None,
                 fault_tolerant_mode: bool | None = None, work_dir: str | None = None,
                 worker_addresses: list[str] | None = None, gc_interval: float | None = None):
        self.job_gc_timeout = job_gc_timeout
        self.client_timeout = client_timeout
        self.fault_tolerant_mode = fault_tolerant_mode
        self.work_dir = work_dir
        self.gc_interval = gc_interval
        #: The fixed worker list of static sharding: addresses (``tcp://h:p`` or ``h:p``) or
        #: Dask worker names; a worker's index in it is its shard index.
        self.worker_addresses = worker_list(worker_addresses) if worker_addresses else None
        self.state = DispatcherState()
        self._journal = None
        self._journal_tail = None
        self._journal_error: BaseException | None = None
        #: Updates replayed from the journal at the last start (after its snapshot).
        self.recovered_updates = 0
        #: Seconds the last start spent reading and replaying the journal.
        self.recovery_seconds = 0.0
        self._client_seen: dict[int, int] = {}
        #: Iteration views, built once per view epoch (:mod:`._views`).
        self._views = ViewCache()
        self._closed = False

    # Lifecycle
    ###########
    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.state = DispatcherState()
        if self.job_gc_timeout is None:
            self.job_gc_timeout = config.get_seconds("dispatcher.job-gc-timeout")
        if self.client_timeout is None:
            self.client_timeout = config.get_seconds("dispatcher.client-timeout")
        self._excluded_resources = tuple(config.get("dispatcher.worker-resource-excluded") or ())
        if self.fault_tolerant_mode is None:
            self.fault_tolerant_mode = bool(config.get("dispatcher.fault-tolerant-mode"))
        if self.work_dir is None:
            self.work_dir = config.get("dispatcher.work-dir")
        self._gc_dynamic_jobs = bool(config.get("dispatcher.gc-dynamic-sharding-jobs"))
        if self.worker_addresses is None and config.get("dispatcher.worker-addresses"):
            self.worker_addresses = worker_list(config.get("dispatcher.worker-addresses"))
        self._journal = None
        self._journal_tail = None
        self._journal_error = None
        self._closed = False
        self._recovered_at = _now_micros()
        #: Whose task and dataset ids these are: random per start, kept in the work dir in
        #: fault-tolerant mode (:func:`._recovery.lineage`); a worker that kept tasks of
        #: another lineage drops them (their ids may be reused here).
        self.lineage = new_token()
        #: ``{iteration_client_id: micros}``: the last heartbeat of each client heard since
        #: this start (liveness is not journaled; see ``client_heartbeat``).
        self._client_seen = {}
        self._views = ViewCache()
        #: Worker keys and registration limits (see :mod:`._access`).
        self._access = AccessGuard(scheduler)
        #: Iterations of named jobs that lost their last client (candidates for GC).
        self._idle_iterations: set[int] = set()
        #: Workers the journal knew that have not heartbeated since this start: revived
        #: with their tasks if they come back resumed, dropped after ``worker-timeout``.
        self._recovered_workers: set[str] = set()
        if self.fault_tolerant_mode:
            if not self.work_dir:
                raise ValueError(
                    "the dispatcher's fault-tolerant mode needs a work_dir for its journal "
                    "(dataservice.dispatcher.work-dir)"
                )
            await self._recover()
        else:
            logger.info(
                "dataservice dispatcher started without fault-tolerant mode: its state will not "
                "survive a restart of the scheduler"
            )
        handlers: dict[str, Callable[..., Any]] = {
            "dataservice_register_dataset": self.register_dataset,
            "dataservice_get_dataset": self.get_dataset,
            "dataservice_worker_key": self.worker_key,
            "dataservice_get_or_create_job": self.get_or_create_job,
            "dataservice_get_or_create_iteration": self.get_or_create_iteration,
            "dataservice_client_heartbeat": self.client_heartbeat,
            "dataservice_release_iteration_client": self.release_iteration_client,
            "dataservice_get_split": self.get_split,
            "dataservice_finish_task": self.finish_task,
            "dataservice_ack_splits": self.ack_splits,
            "dataservice_worker_heartbeat": self.worker_heartbeat,
            "dataservice_state": self.state_summary,
            **position_handlers(self),  # issue 13: input positions (_position_handlers.py)
            **start_read_handlers(self),  # issue 16: job and iteration in one round trip
        }
        scheduler.handlers.update(handlers)
        self._handler_names = tuple(handlers)
        self._liveness = WorkerLiveness(self)  # data workers' heartbeat deadline
        self._liveness.install(scheduler)
        scheduler.extensions["dataservice"] = self
        interval_ms = (self.gc_interval or config.get_seconds("dispatcher.gc-interval")) * 1000
        pc = PeriodicCallback(self._gc, interval_ms)
        scheduler.periodic_callbacks["dataservice-gc"] = pc
        pc.start()
        # Installed from above (protocol/_hooks.py): every worker that joins gets the
        # data-worker half (as P2P does for its plugin; dask_dataservice.service), then the
        # dashboard's pages, /dataservice/status.json and /metrics (issue 14; the package root).
        await run_dispatcher_start(scheduler)

    async def _recover(self) -> None:
        """Replay the journal before any handler is served (see :func:`._recovery.recover`)."""
        await recover(self)

    async def close(self) -> None:
        """Stop the GC and close the journal (every queued record made durable first).

        Idempotent (the scheduler calls it at shutdown, tests may call it before). The
        plugin starts no task of its own: its background work is the GC periodic callback
        and the journal writer's flush (owned and awaited by the writer); pushes that wait
        for durability are callbacks on the journal's futures, dropped once it is closed.
        """
        if self._closed:
            return
        self._closed = True
        pc = self.scheduler.periodic_callbacks.pop("dataservice-gc", None)
        if pc is not None:
            pc.stop()
        journal, self._journal = self._journal, None
        if journal is not None:
            try:
                await journal.aclose()
            except Exception as e:  # noqa: BLE001 - closing anyway
                logger.warning("dataservice: closing the journal failed: %r", e)
        # Handlers stay installed: requests still in flight get answers, not "unknown op".
        self.scheduler.extensions.pop("dataservice", None)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self._access.forget_worker(worker)
        if self._closed:  # the scheduler is shutting down: leave the journal as it is
            return
        self._liveness.forget(worker)
        try:
            if self.state.worker(worker).registered:
                self._apply(RemoveWorker(address=worker))
        except WorkerNotFoundError:
            pass

    # The one way to change state
    #############################
    def _apply(self, update: Update) -> None:
        """Validate, journal (fault-tolerant mode) and apply one update.

        The journal append only enqueues the record (its place in the journal is fixed now);
        handlers wrapped in :func:`_durable` wait for it before replying.
        """
        if self._journal_error is not None:
            raise DataServiceError(
                f"the dispatcher's journal failed ({self._journal_error!r}); restart the "
                "scheduler to recover from the journal"
            )
        self.state.check(update)
        if self._journal is not None:
            tail = self._journal.append(encode_update(update))
            tail.add_done_callback(self._journal_done)
            self._journal_tail = tail
        self.state.apply(update, checked=True)
        self._views.updated(update)

    def _send_when_durable(self, address: str, msg: Mapping[str, Any]) -> None:
        """Tell a worker about a change only once the change is in the journal.

        A worker acting on a task (or a cancellation) that a crash could undo would break
        the promise that no one sees an effect the journal does not hold.
        """
        message = cast(dict[str, Any], msg)  # a TaskChanges
        tail = self._journal_tail
        if tail is None or tail.done():
            if tail is None or (not tail.cancelled() and tail.exception() is None):
                send_tasks(self.scheduler, address, message)  # new tasks leave at once
            return

        def send(fut: asyncio.Future[Any]) -> None:
            if not fut.cancelled() and fut.exception() is None and address in self.scheduler.workers:
                send_tasks(self.scheduler, address, message)

        tail.add_done_callback(send)

    async def _wait_durable(self) -> None:
        """Wait until every update applied so far is in the journal (no-op without one)."""
        tail = self._journal_tail
        if tail is None:
            return
        try:
            await asyncio.shield(tail)
        except Exception as e:  # noqa: BLE001 - reported to the caller as a service error
            raise DataServiceError(f"the dispatcher's journal failed: {e!r}") from e

    def _journal_done(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None and self._journal_error is None:
            self._journal_error = exc
            logger.critical("dataservice: the journal failed, refusing further updates: %r", exc)

    # Handlers: datasets, jobs, iterations
    ######################################
    @_durable
    def register_dataset(self, fingerprint: str, pipeline: bytes, splits: bytes | None,
                         num_splits: int, element_spec: bytes | None = None,
                         metadata: dict[str, Any] | None = None, compression: str | None = None,
                         dataset_id: str | None = None, client_id: str | None = None) -> dict[str, Any]:
        """Register a dataset; answer its id.

        Without ``dataset_id`` the same pipeline (fingerprint) always gets the same numeric
        id. With a ``dataset_id`` of the user's (TensorFlow's explicit id) the answer is that
        string: registering the same pipeline under it again returns it, a *different*
        pipeline under it is an error (readers of that id would get the wrong data).

        Limits (config): a pipeline and its splits together at most
        ``dispatcher.max-pipeline-bytes``; at most ``dispatcher.max-datasets-per-client``
        new datasets per client (``client_id``, the registering Dask client's id).
        """
        self._access.check_pipeline_size(len(pipeline) + len(splits or b""))
        if dataset_id is not None:
            if not isinstance(dataset_id, str) or not dataset_id:
                raise TypeError(f"dataset_id must be a non-empty string, got {dataset_id!r}")
            try:
                existing = self.state.dataset_by_name(dataset_id)
            except DatasetNotFoundError:
                existing = None
            if existing is not None:
                if existing.fingerprint != fingerprint:
                    raise ValueError(
                        f"dataset_id {dataset_id!r} is already registered for a different "
                        "dataset; register this one under another id (or without one)")
                return {"status": "OK", "dataset_id": dataset_id}
        else:
            try:
                return {"status": "OK",
                        "dataset_id": self.state.dataset_by_fingerprint(fingerprint).dataset_id}
            except DatasetNotFoundError:
                pass
        self._access.count_registration(client_id)
        new_id = self.state.next_dataset_id()
        self._apply(RegisterDataset(
            dataset_id=new_id, fingerprint=fingerprint, pipeline=bytes(pipeline),
            splits=bytes(splits or b""), num_splits=int(num_splits),
            element_spec=element_spec, metadata=dict(metadata or {}),
            compression=compression, dataset_name=dataset_id,
        ))
        return {"status": "OK", "dataset_id": new_id if dataset_id is None else dataset_id}

    def _dataset(self, dataset_id: int | str) -> DatasetEntity:
        """A dataset by its numeric id or by the id its user chose."""
        if isinstance(dataset_id, str):
            return self.state.dataset_by_name(dataset_id)
        return self.state.dataset(dataset_id)

    @handler
    def worker_key(self, address: str) -> dict[str, Any]:
        """Send worker ``address`` its key, over the scheduler's stream to that worker.

        The key never travels in a reply: whoever asks, only the worker registered at
        ``address`` (the process holding the scheduler's stream to it) receives it, so a
        request that shows it comes from that worker.
        """
        self._access.send_key(address)
        return {"status": "OK"}

    @handler
    def get_dataset(self, dataset_id: int | str, address: str = "",
                    worker_key: str | None = None) -> dict[str, Any]:
        """A dataset's pipeline, for a data worker only (it shows its key)."""
        self._access.check_worker(address, worker_key,
                                  f"downloading the pipeline of dataset {dataset_id}")
        ds = self._dataset(dataset_id)
        return {"status": "OK", "pipeline": ds.pipeline, "splits": ds.splits,
                "num_splits": ds.num_splits, "compression": ds.compression}

    @_durable
    def get_or_create_job(self, dataset_id: int | str, processing_mode: Any,
                          job_name: str | None = None, num_consumers: int | None = None,
                          target_workers: str = "AUTO", cross_trainer_cache: bool = False,
                          position: str = "") -> dict[str, Any]:
        mode = parse_processing_mode(processing_mode)
        dataset = self._dataset(dataset_id)
        dataset_id = dataset.dataset_id
        mode = self._check_mode(mode, dataset)
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
        job_id = self.state.next_job_id()
        self._apply(CreateJob(
            job_id=job_id, job_name=job_name, dataset_id=dataset_id,
            processing_mode=mode.name, num_consumers=num_consumers,
            target_workers=target_workers,
            cross_trainer_cache=bool(cross_trainer_cache), position=position,  # issue 13
            worker_addresses=tuple(self.worker_addresses)  # type: ignore[arg-type]  # _check_mode
            if mode in STATIC_POLICIES else (),
            token=new_token(),
        ))
        return {"status": "OK", "job_id": job_id, "job_token": self.state.job(job_id).token}

    @_durable
    def get_or_create_iteration(self, job_id: int, repetition: int = 0,
                                job_token: str | None = None) -> dict[str, Any]:
        job = self.state.job(job_id)
        check_job_token(job.token, job_token, job_id, "reading")
        try:
            iteration = self.state.iteration_by_key(job_id, repetition)
        except IterationNotFoundError:
            iteration = None
        if iteration is None:
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
        self._idle_iterations.discard(iteration_id)
        client_id = self.state.next_iteration_client_id()
        self._apply(AcquireIterationClient(
            iteration_client_id=client_id, iteration_id=iteration_id, time_micros=_now_micros()
        ))
        return {"status": "OK", "iteration_id": iteration_id, "iteration_client_id": client_id,
                **self._iteration_view(iteration_id)}

    @handler
    def client_heartbeat(self, iteration_client_id: int, job_token: str | None = None,
                         view_version: str | None = None) -> dict[str, Any]:
        """A consumer is alive: remember when (not journaled: liveness need not survive a
        restart, every timer starts again after recovery); answer its iteration's view, or
        only ``unchanged`` if ``view_version`` is still current (O(1); see :mod:`._views`)."""
        client = self._iteration_client(iteration_client_id, job_token, "a client heartbeat")
        self._client_seen[iteration_client_id] = _now_micros()
        version = self._views.version
        if view_version == version:
            return {"status": "OK", "unchanged": True, "view_version": version}
        return {"status": "OK", "view_version": version,
                **self._iteration_view(client.iteration_id)}

    @_durable
    def release_iteration_client(self, iteration_client_id: int,
                                 job_token: str | None = None) -> dict[str, Any]:
        self._iteration_client(iteration_client_id, job_token, "releasing a consumer")
        self._release_client(iteration_client_id)
        return {"status": "OK"}

    # Handlers: data workers
    ########################
    @_durable
    def get_split(self, iteration_id: int, task_id: int, repetition: int, count: int = 1,
                  job_token: str | None = None, received: int | None = None) -> dict[str, Any]:
        """Up to ``count`` next split indices of a DYNAMIC iteration for ``task_id``.

        ``end_of_splits`` says repetition ``repetition`` has no more splits (after the
        indices returned). O(count). Only the task's worker may ask, with the job's token.
        A retry says how many splits the task ``received``: any handed to it that it never
        got are answered again (:func:`._recovery.undelivered`).
        """
        self._check_task_token(task_id, job_token, "taking splits", iteration_id)
        if received is not None:
            again = undelivered(self.state, iteration_id, task_id, repetition, int(received))
            if again is not None:
                return {"status": "OK", "split_indices": again[0], "end_of_splits": again[1]}
        current, index, num_splits = self.state.split_position(iteration_id)
        if self.state.task_status(task_id) != "active" or repetition < current:
            return {"status": "OK", "split_indices": [], "end_of_splits": True}
        if repetition > current:
            raise DataServiceError(
                f"task {task_id} asked for repetition {repetition} of iteration "
                f"{iteration_id}, which is only at repetition {current}"
            )
        left, it = num_splits - index, self.state.iteration(iteration_id)
        count = min(max(1, int(count)), 1024, left)
        # locality hint (persisted Dask collection): the worker's own splits first
        indices = _locality.pick(self, iteration_id, task_id, count)
        active = max(1, it.num_tasks - it.num_finished_tasks - it.num_lost_tasks)
        # else at most half of a fair share of what is left (one task: all of it): big
        # batches for fine splits, and the last splits still spread over the workers
        count = len(indices) if indices else min(
            count, left if active == 1 else max(1, left // (2 * active)))
        end = count == num_splits - index  # nothing after these: say so now
        if index == num_splits:
            count, end = 0, True
        # One record for the whole call, however many splits it hands out.
        self._apply(ProduceSplits(iteration_id=iteration_id, repetition=repetition, index=index,
                                  count=count, task_id=task_id, end_of_splits=end,
                                  indices=indices))
        return {"status": "OK", "split_indices": list(indices or range(index, index + count)),
                "end_of_splits": end}

    @_durable
    def ack_splits(self, task_id: int, repetition: int, job_token: str | None = None) -> dict[str, Any]:
        """A task is done with every split it holds of ``repetition`` and before."""
        try:
            self._check_task_token(task_id, job_token, "acknowledging splits")
            first = self.state.first_split_held(task_id)
        except TaskNotFoundError:
            return {"status": "OK"}  # garbage collected meanwhile
        if first is not None and first[0] <= repetition:
            self._apply(AckSplits(task_id=task_id, repetition=repetition, index=2**62))
        return {"status": "OK"}

    @_durable
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

    @handler
    async def worker_heartbeat(self, address: str, host: str, nthreads: int,
                               active_tasks: list[Any] | tuple[Any, ...] = (), finished_tasks: list[Any] | tuple[Any, ...] = (),
                               worker_key: str | None = None,
                               resumed: bool = False) -> Mapping[str, Any]:
        """Register a data worker if needed and tell it which tasks to start and drop.

        ``resumed``: it kept its tasks across a scheduler restart (:mod:`._reconnect`); a
        worker the journal knew is then revived with them (:func:`._recovery.revive`).

        Only the worker itself may (it shows its key): the reply carries task definitions,
        and so job tokens. Durable as the other mutating handlers, but a heartbeat that
        changed nothing and tells nothing new (the steady state) answers without waiting for
        the journal's next group commit: its reply shows no effect a crash could undo.
        """
        if self._closed:
            return {"status": "closing"}
        tail = self._journal_tail
        try:
            reply = self._worker_heartbeat(address, host, nthreads, active_tasks,
                                           finished_tasks, worker_key, resumed)
        except BaseException:
            await self._wait_durable()
            raise
        if (self._journal_tail is not tail or reply.get("new_tasks") or reply.get("cancelled")
                or self._heartbeat_waits_always):
            await self._wait_durable()
        return reply

    #: Benchmarks only: every heartbeat waits for the journal (the behaviour before).
    _heartbeat_waits_always = False

    def _worker_heartbeat(self, address: str, host: str, nthreads: int,
                          active_tasks: list[Any] | tuple[Any, ...], finished_tasks: list[Any] | tuple[Any, ...],
                          worker_key: str | None, resumed: bool) -> TaskChanges:
        ws = self.scheduler.workers.get(address)
        if ws is None:  # not (yet) registered with the scheduler: nothing to tell it
            return TaskChanges(status="OK", new_tasks=[], cancelled=[])
        self._access.check_worker(address, worker_key, "a data worker heartbeat")
        self._liveness.seen(address)
        if address in self._recovered_workers:
            revive(self, address, resumed, active_tasks)
        try:
            known = self.state.worker(address).registered
        except WorkerNotFoundError:
            known = False
        if not known:
            self._apply(RegisterWorker(address=address, host=host, nthreads=int(nthreads),
                                       resources=dict(ws.resources)))
            for iteration in self.state.list_live_iterations():
                job = self.state.job(iteration.job_id)
                if job.num_consumers is not None:
                    continue  # coordinated reads: the task list is fixed at the start
                if self._serves(iteration, job):
                    self._create_task(iteration.iteration_id, address, job, push=False)
        for tid in finished_tasks:
            try:
                if self.state.task_status(tid) == "active":
                    self._apply(FinishTask(task_id=tid))
            except TaskNotFoundError:
                pass
        reported = set(active_tasks) | set(finished_tasks)
        assigned = {t.task_id: t for t in self.state.tasks_for_worker(address)}
        new_tasks = [self._task_def(t) for tid, t in assigned.items()
                     if tid not in reported and t.status == "active"]
        cancelled = self._liveness.dropped_tasks(reported)
        return TaskChanges(status="OK", new_tasks=new_tasks, cancelled=cancelled,
                           lineage=self.lineage)

    @handler
    def state_summary(self, job_token: str | None = None, address: str | None = None,
                      worker_key: str | None = None) -> dict[str, Any]:
        """A plain-data view of the dispatcher, for tests, dashboards and debugging.

        Names and counts for anyone; the tasks and lost splits of a job only with its token,
        of every job with a data worker's key (see :func:`._access.redact_summary`).
        """
        if address is not None or worker_key is not None:
            self._access.check_worker(address or "", worker_key, "the full dispatcher state")
            return {"status": "OK", **self.state.summary()}
        return {"status": "OK", **redact_summary(self.state, job_token)}

    # Internals
    ###########
    def _is_data_worker(self, address: str) -> bool:
        ws = self.scheduler.workers.get(address)
        return ws is not None and not any(ws.resources.get(r) for r in self._excluded_resources)

    def _create_task(self, iteration_id: int, address: str, job: Job, push: bool = True) -> None:
        if not self._is_data_worker(address):
            return
        shard_index = None
        if job.worker_addresses:  # static sharding: the job's journaled list decides
            shard_index = self._shard_index(job.worker_addresses, address)
            if shard_index is None:
                logger.info(
                    "dataservice: worker %s is not in the worker list of job %s (%s): it "
                    "gets no task of it", address, job.job_id, list(job.worker_addresses))
                return
        task_id = self.state.next_task_id()
        self._apply(CreateTask(task_id=task_id, iteration_id=iteration_id, worker_address=address,
                               shard_index=shard_index))
        if push:
            self._send_when_durable(address, TaskChanges(
                op=TASKS_OP, new_tasks=[self._task_def(self.state.task(task_id))], cancelled=[]))

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
        task = self.state.task(task_id)
        if iteration_id is not None and task.iteration_id != iteration_id:
            raise DataServiceError(f"task {task_id} is not a task of iteration {iteration_id}")
        job = self.state.job(self.state.iteration(task.iteration_id).job_id)
        check_job_token(job.token, job_token, job.job_id, what)

    def _task_def(self, task: Task) -> TaskDef:
        iteration = self.state.iteration(task.iteration_id)
        job = self.state.job(iteration.job_id)
        return TaskDef(task_id=task.task_id, iteration_id=task.iteration_id, job_id=job.job_id,
                       dataset_id=job.dataset_id,
                       processing_mode=int(ShardingPolicy[job.processing_mode]),
                       worker_index=task.shard_index,
                       num_workers=len(job.worker_addresses) if job.worker_addresses else None,
                       num_consumers=job.num_consumers,
                       cross_trainer_cache=job.cross_trainer_cache, job_token=job.token,
                       position=job.position)

    def _check_mode(self, mode: ShardingPolicy, dataset: DatasetEntity) -> ShardingPolicy:
        return check_mode(mode, dataset, self.worker_addresses)

    def _shard_index(self, entries: tuple[str, ...], address: str) -> int | None:
        """A worker's position in a job's worker list (by address, host:port, or Dask name)."""
        ws = self.scheduler.workers.get(address)
        return shard_index(entries, address, None if ws is None else ws.name)

    def _task_exists(self, task_id: int) -> bool:
        try:
            self.state.task(task_id)
            return True
        except TaskNotFoundError:
            return False

    def _iteration_view(self, iteration_id: int) -> IterationView:
        return self._views.get(iteration_id, functools.partial(build_view, self.state))

    def _release_client(self, iteration_client_id: int) -> None:
        client = self.state.iteration_client(iteration_client_id)
        self._apply(ReleaseIterationClient(iteration_client_id=iteration_client_id,
                                           time_micros=_now_micros()))
        self._client_seen.pop(iteration_client_id, None)
        iteration = self.state.iteration(client.iteration_id)
        job = self.state.job(iteration.job_id)
        if iteration.num_clients == 0:
            if job.job_name is None:
                self._garbage_collect(iteration.iteration_id)
            else:
                self._idle_iterations.add(iteration.iteration_id)

    def _garbage_collect(self, iteration_id: int) -> None:
        self._idle_iterations.discard(iteration_id)
        tasks = self.state.tasks_for_iteration(iteration_id)
        self._apply(GarbageCollectIteration(iteration_id=iteration_id))
        by_worker: dict[str, list[int]] = {}
        for t in tasks:
            by_worker.setdefault(t.worker_address, []).append(t.task_id)
        for address, task_ids in by_worker.items():
            if address in self.scheduler.workers:
                self._send_when_durable(
                    address, TaskChanges(op=TASKS_OP, new_tasks=[], cancelled=task_ids))

    def _gc(self) -> None:
        """Periodic: release silent clients, collect iterations nobody reads (:mod:`._gc`)."""
        collect(self)
