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
  unfinished DYNAMIC one, kept while it can be read, as in TensorFlow), jobs that never
  got an iteration (after ``job-gc-timeout``) and datasets with no job for
  ``dataset-gc-timeout`` (issue 22), and mark the tasks
  of departed workers lost (their splits in flight are never handed out again).
- Decide nothing the state cannot replay: a static job's worker list and each task's shard
  index are journaled (``CreateJob.worker_addresses``, ``CreateTask.shard_index``), so a
  restart with another config never reassigns shards.

Every decision is the sans-I/O core's (:class:`~.core.DispatcherCore`): this
plugin is its I/O shell. A handler unpacks the request, calls the core with the time, appends
the update records the core applied to the journal, sends the core's pushes once those
records are durable, and replies. Every handler goes through
:func:`~dask_dataservice._rpc.handler` (errors travel as values); the mutating ones through
:func:`_durable` as well. Replies use the wire shapes of
:mod:`._messages` (``TaskDef``, ``TaskInfo``, ``IterationView``). No user code runs here:
datasets arrive as opaque bytes with their splits described on the client, and every
handler does O(1) work, apart from heartbeats (O(tasks of the caller); a newly registered
worker: O(live iterations)) and garbage collection (O(tasks of the collected iteration)).
Its background work is the GC periodic callback, stopped in :meth:`DispatcherPlugin.close`,
the journal writer's flush, which the writer owns and ``close`` awaits, and the drains of
retiring data workers (:mod:`._retire`), which ``close`` cancels and awaits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, KeysView, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from ... import config
from ..._rpc import handler
from ...errors import DataServiceError
from ..protocol._hooks import run_dispatcher_start
from ..protocol._job_checks import worker_list
from ..protocol._messages import send_tasks
from ..protocol._start_read import start_read_handlers
from ._access import AccessGuard, limits_from_config, new_token, peer_host, redact_summary
from ._journal_fs import location
from ._liveness import WorkerLiveness
from ._metadata_handlers import metadata_handlers
from ._position_handlers import position_handlers
from ._recovery import recover
from ._retire import Retirements
from .core import CoreConfig, DispatcherCore, Outcome, WorkerInfo
from .state import DispatcherState, Update, encode_update

if TYPE_CHECKING:
    from distributed import Scheduler

    from ..protocol._messages import IterationView, TaskChanges, TaskDef
    from ._deadlines import LastSeen
    from ._entities import Task
    from ._gc import IdleQueue
    from .journal import JournalWriter

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dataservice-dispatcher"

R = TypeVar("R")


def _durable(method: Callable[..., Any]) -> Callable[..., Any]:
    """Make a mutating handler reply only once its updates are in the journal.

    The handler runs synchronously (core → journal append, with no other handler in
    between); its reply (or its error) then waits for the journal's group commit.
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
            if self._journal_tail is not None:  # no coroutine per request without a journal
                await self._wait_durable()

    return wrapper


class _SchedulerView:
    """The core's :class:`~.core.ClusterView` of the scheduler (read only)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def worker(self, address: str) -> WorkerInfo | None:
        ws = self.scheduler.workers.get(address)
        if ws is None:
            return None
        return WorkerInfo(address=address, host=ws.host, nthreads=ws.nthreads,
                          resources=ws.resources, name=ws.name)

    def holders(self, key: Any) -> Iterable[str]:
        ts = self.scheduler.tasks.get(key)
        if ts is None:
            return ()
        return [ws.address for ws in ts.who_has or ()]


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
    worker_timeout
        Seconds of silence after which a data worker is dropped
        (default: ``dataservice.dispatcher.worker-timeout``).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, job_gc_timeout: float | None = None, client_timeout: float | None = None,
                 fault_tolerant_mode: bool | None = None, work_dir: str | None = None,
                 worker_addresses: list[str] | None = None, gc_interval: float | None = None,
                 worker_timeout: float | None = None):
        self.core: DispatcherCore | None = None
        self._settings: dict[str, float | None] = {}
        self.job_gc_timeout = job_gc_timeout
        self.client_timeout = client_timeout
        self.worker_timeout = worker_timeout
        self.fault_tolerant_mode = fault_tolerant_mode
        self.work_dir = work_dir
        self.gc_interval = gc_interval
        #: The fixed worker list of static sharding: addresses (``tcp://h:p`` or ``h:p``) or
        #: Dask worker names; a worker's index in it is its shard index.
        self.worker_addresses = worker_list(worker_addresses) if worker_addresses else None
        self._journal: JournalWriter | None = None
        self._journal_tail: asyncio.Future[Any] | None = None
        self._journal_error: BaseException | None = None
        #: Updates replayed from the journal at the last start (after its snapshot).
        self.recovered_updates = 0
        #: Seconds the last start spent reading and replaying the journal.
        self.recovery_seconds = 0.0
        #: Rounds of the periodic garbage collection run so far (tests wait on it).
        self.gc_rounds = 0
        self._closed = False

    # Timeouts: set on a started plugin (tests do), they reach its core
    def _setting(name: str) -> Any:  # type: ignore[misc]  # a property factory
        def get(self: DispatcherPlugin) -> float | None:
            return self._settings.get(name)

        def set_(self: DispatcherPlugin, value: float | None) -> None:
            self._settings[name] = value
            if self.core is not None and value is not None:
                changes: dict[str, Any] = {name: float(value)}
                self.core.config = dataclasses.replace(self.core.config, **changes)
                self.core.deadlines.timeout = self.core.config.worker_timeout

        return property(get, set_)

    job_gc_timeout = _setting("job_gc_timeout")
    client_timeout = _setting("client_timeout")
    worker_timeout = _setting("worker_timeout")
    del _setting

    # The core's state and bookkeeping, as the plugin showed them before (tests, tools)
    @property
    def state(self) -> DispatcherState:
        return self._core.state if self.core is not None else DispatcherState()

    @property
    def lineage(self) -> str:
        return self._core.lineage

    @property
    def _core(self) -> DispatcherCore:
        assert self.core is not None, "the dispatcher has not started"
        return self.core

    @property
    def _client_seen(self) -> LastSeen[int]:
        return self._core.client_seen

    @property
    def _idle_iterations(self) -> IdleQueue:
        return self._core.idle_iterations

    @property
    def _recovered_workers(self) -> KeysView[str]:
        return self._core.recovered_workers

    @property
    def _views(self) -> Any:
        return self._core.views

    def core_config(self) -> CoreConfig:
        """The core's settings from this plugin's arguments and the config."""
        assert self.client_timeout is not None and self.job_gc_timeout is not None
        worker_timeout = self.worker_timeout
        if worker_timeout is None:
            worker_timeout = config.get_seconds("dispatcher.worker-timeout")
        dataset_gc = config.get("dispatcher.dataset-gc-timeout")
        return CoreConfig(
            job_gc_timeout=float(self.job_gc_timeout),
            dataset_gc_timeout=None if dataset_gc is None
            else config.get_seconds("dispatcher.dataset-gc-timeout"),
            client_timeout=float(self.client_timeout),
            worker_timeout=float(worker_timeout),
            gc_dynamic_sharding_jobs=bool(config.get("dispatcher.gc-dynamic-sharding-jobs")),
            worker_addresses=tuple(self.worker_addresses) if self.worker_addresses else None,
            excluded_resources=tuple(config.get("dispatcher.worker-resource-excluded") or ()),
            split_batch_max=config.get_int("dispatcher.split-batch-max", minimum=1),
            limits=limits_from_config(),
        )

    # Lifecycle
    ###########
    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        if self.job_gc_timeout is None:
            self.job_gc_timeout = config.get_seconds("dispatcher.job-gc-timeout")
        if self.client_timeout is None:
            self.client_timeout = config.get_seconds("dispatcher.client-timeout")
        if self.fault_tolerant_mode is None:
            self.fault_tolerant_mode = bool(config.get("dispatcher.fault-tolerant-mode"))
        if self.work_dir is None:
            self.work_dir = config.get("dispatcher.work-dir")
        if self.worker_addresses is None and config.get("dispatcher.worker-addresses"):
            self.worker_addresses = worker_list(config.get("dispatcher.worker-addresses"))
        self._journal = None
        self._journal_tail = None
        self._journal_error = None
        self._closed = False
        #: Whose task and dataset ids these are: random per start, kept in the work dir in
        #: fault-tolerant mode (:func:`._recovery.lineage`); a worker that kept tasks of
        #: another lineage drops them (their ids may be reused here).
        self.core = DispatcherCore(self.core_config(), _SchedulerView(scheduler), time.time(),
                                   lineage=new_token(), new_token=new_token)
        #: Worker keys and registration limits (see :mod:`._access`).
        self._access = AccessGuard(scheduler)
        #: Requests of equal splits parked until their group's answer changes (by iteration).
        self._equal_events: dict[int, asyncio.Event] = {}
        if self.fault_tolerant_mode:
            if not self.work_dir:
                raise ValueError(
                    "the dispatcher's fault-tolerant mode needs a work_dir for its journal "
                    "(dataservice.dispatcher.work-dir)"
                )
            location(self.work_dir)  # a URL the journal cannot keep: a ValueError saying why
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
            "dataservice_equal_sync": self.equal_sync,
            "dataservice_get_split": self.get_split,
            "dataservice_finish_task": self.finish_task,
            "dataservice_ack_splits": self.ack_splits,
            "dataservice_autocached": self.autocached,
            "dataservice_worker_heartbeat": self.worker_heartbeat,
            "dataservice_state": self.state_summary,
            # issue 13: input positions (_position_handlers.py)
            **position_handlers(self._core.dataset),
            **metadata_handlers(self._core.dataset),  # from_dataset_id's cardinality()
            # issue 16: job and iteration in one round trip
            **start_read_handlers(self.get_or_create_job, self.get_or_create_iteration),
        }
        scheduler.handlers.update(handlers)
        self._handler_names = tuple(handlers)
        self._liveness = WorkerLiveness(self)  # data workers' heartbeat deadline
        self._liveness.install(scheduler)
        #: ``retire_workers`` drains a data worker first (issue 26)
        self.retirements = Retirements(self)
        self.retirements.install(scheduler)
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
        plugin's background work is the GC periodic callback, the journal writer's flush
        (owned and awaited by the writer) and the drains of retiring workers (cancelled
        and awaited here); pushes that wait
        for durability are callbacks on the journal's futures, dropped once it is closed.
        """
        if self._closed:
            return
        self._closed = True
        pc = self.scheduler.periodic_callbacks.pop("dataservice-gc", None)
        if pc is not None:
            pc.stop()
        retirements = getattr(self, "retirements", None)
        if retirements is not None:
            await retirements.aclose()
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
        self._run(self._core.worker_left, worker)

    # The one way to change state
    #############################
    def _run(self, stimulus: Callable[..., Outcome[R]], *args: Any, **kwargs: Any) -> R:
        """Call the core with one stimulus, journal what it applied and queue its pushes
        (sent once durable); the records of a stimulus that raised are journaled too."""
        try:
            out = stimulus(*args, **kwargs)
        except BaseException:
            self._commit(self._core.take_effects())
            raise
        self._commit(out)
        if self._core.equal.changed:  # equal splits whose answer changed: wake their waiters
            self._wake_equal()
        return out.reply

    def _wake_equal(self) -> None:
        for iteration_id in self._core.equal.take_changed():
            event = self._equal_events.pop(iteration_id, None)
            if event is not None:
                event.set()

    def _commit(self, out: Outcome[Any]) -> None:
        """Journal ``out``'s records (in fault-tolerant mode) and queue its pushes.

        The journal append only enqueues each record (its place in the journal is fixed
        now); handlers wrapped in :func:`_durable` wait for them before replying.
        """
        if self._journal is not None:
            for update in out.updates:
                tail = self._journal.append(encode_update(update))
                tail.add_done_callback(self._journal_done)
                self._journal_tail = tail
        for address, message in out.messages:
            self._send_when_durable(address, message)

    def _apply(self, update: Update) -> None:
        """Check, journal (fault-tolerant mode) and apply one update built outside the
        core (tests and benchmarks build states so)."""
        self._run(self._core.apply, update)

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
            self._core.refusal = (
                f"the dispatcher's journal failed ({exc!r}); restart the scheduler to recover "
                "from the journal")
            logger.critical("dataservice: the journal failed, refusing further updates: %r", exc)

    # Handlers: datasets, jobs, iterations
    ######################################
    @_durable
    def register_dataset(self, comm: Any = None, *, fingerprint: str, pipeline: bytes,
                         splits: bytes | None, num_splits: int,
                         element_spec: bytes | None = None,
                         metadata: dict[str, Any] | None = None, compression: str | None = None,
                         dataset_id: str | None = None, client_id: str | None = None) -> dict[str, Any]:
        """Register a dataset; answer its credential, ``"<id or name>:<secret>"``
        (:mod:`._credentials`), which its readers show.

        Without ``dataset_id`` the same pipeline (fingerprint) always gets the same
        credential. With a ``dataset_id`` of the user's (TensorFlow's explicit id) it is the
        credential's name: registering the same pipeline under it again answers the same
        credential, a *different* pipeline under it is an error.

        Limits (config, :mod:`._quotas`): every field bounded; new datasets per host of the
        connection (``comm``'s peer, not ``client_id``, which a client chooses); datasets,
        live jobs and bytes in total.
        """
        self._access.check_pipeline_size(len(pipeline) + len(splits or b""))
        return self._run(self._core.register_dataset, fingerprint, pipeline, splits,
                         num_splits, element_spec=element_spec, metadata=metadata,
                         compression=compression, dataset_id=dataset_id, client_id=client_id,
                         host=peer_host(comm), now=time.time())

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
    def get_dataset(self, dataset_id: int, address: str = "",
                    worker_key: str | None = None) -> dict[str, Any]:
        """A dataset's pipeline, for a data worker only (it shows its key)."""
        self._access.check_worker(address, worker_key,
                                  f"downloading the pipeline of dataset {dataset_id}")
        ds = self.state.dataset(int(dataset_id))  # the numeric id of a task definition
        return {"status": "OK", "pipeline": ds.pipeline, "splits": ds.splits,
                "num_splits": ds.num_splits, "compression": ds.compression}

    @_durable
    def get_or_create_job(self, dataset_id: int | str, processing_mode: Any,
                          job_name: str | None = None, num_consumers: int | None = None,
                          target_workers: str = "AUTO", cross_trainer_cache: bool = False,
                          position: str = "") -> dict[str, Any]:
        return self._run(self._core.get_or_create_job, dataset_id, processing_mode,
                         job_name=job_name, num_consumers=num_consumers,
                         target_workers=target_workers,
                         cross_trainer_cache=cross_trainer_cache, position=position,
                         now=time.time())

    @_durable
    def get_or_create_iteration(self, job_id: int, repetition: int = 0,
                                job_token: str | None = None) -> dict[str, Any]:
        return self._run(self._core.get_or_create_iteration, job_id, time.time(),
                         repetition=repetition, job_token=job_token)

    @handler
    def client_heartbeat(self, iteration_client_id: int, job_token: str | None = None,
                         view_version: str | None = None) -> dict[str, Any]:
        """A consumer is alive: remember when (not journaled: liveness need not survive a
        restart, every timer starts again after recovery); answer its iteration's view, or
        only ``unchanged`` if ``view_version`` is still current (O(1); see :mod:`._views`)."""
        return self._run(self._core.client_heartbeat, iteration_client_id, time.time(),
                         job_token=job_token, view_version=view_version)

    @handler
    async def equal_sync(self, iteration_client_id: int, consumer_index: int,
                         num_consumers: int, remainder: str, received: int,
                         ended: bool = False, need: int = 0, wait: float = 0.0,
                         job_token: str | None = None) -> dict[str, Any]:
        """A consumer of an equal split reports what it holds (:mod:`._equal`) and learns
        how many elements it may deliver. With ``wait`` (seconds), a consumer that may not
        deliver its ``need``-th element yet is answered once the group's answer changes (or
        after ``wait``): a blocked consumer costs one parked request, no polling. O(1)."""
        if self._closed:
            return {"status": "closing"}
        group = self._run(self._core.equal_sync, iteration_client_id, time.time(), job_token,
                          int(consumer_index), int(num_consumers), str(remainder),
                          int(received), bool(ended))
        if wait > 0 and group.waits(int(need), bool(ended)):
            iteration_id = self._core.equal.member_of[iteration_client_id]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + min(float(wait), 30.0)
            while group.waits(int(need), bool(ended)) and not self._closed:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                event = self._equal_events.setdefault(iteration_id, asyncio.Event())
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    break
        return group.answer()

    @_durable
    def release_iteration_client(self, iteration_client_id: int,
                                 job_token: str | None = None,
                                 read_to_end: bool = False) -> dict[str, Any]:
        """A consumer stopped reading; ``read_to_end``: it got the end of every task."""
        return self._run(self._core.release_iteration_client, iteration_client_id,
                         time.time(), job_token=job_token, read_to_end=bool(read_to_end))

    # Handlers: data workers
    ########################
    @_durable
    def get_split(self, iteration_id: int, task_id: int, repetition: int, count: int = 1,
                  job_token: str | None = None, received: int | None = None) -> dict[str, Any]:
        """Up to ``count`` next split indices of a DYNAMIC iteration for ``task_id``
        (:meth:`~.core.DispatcherCore.get_split`)."""
        return self._run(self._core.get_split, iteration_id, task_id, repetition, count=count,
                         job_token=job_token, received=received)

    @handler
    async def autocached(self, task_id: int, indices: list[int],
                         job_token: str | None = None) -> dict[str, Any]:
        """A data worker cached these splits (``autocache()``; volatile, nothing journaled)."""
        if self._closed:
            return {"status": "closing"}
        return self._run(self._core.autocached, task_id, list(indices), job_token=job_token)

    @_durable
    def ack_splits(self, task_id: int, repetition: int, job_token: str | None = None) -> dict[str, Any]:
        """A task is done with every split it holds of ``repetition`` and before."""
        return self._run(self._core.ack_splits, task_id, repetition, job_token=job_token)

    @_durable
    def finish_task(self, task_id: int, error: bool = False,
                    job_token: str | None = None) -> dict[str, Any]:
        return self._run(self._core.finish_task, task_id, error=error, job_token=job_token)

    @handler
    async def worker_heartbeat(self, address: str, host: str, nthreads: int,
                               active_tasks: list[Any] | tuple[Any, ...] = (), finished_tasks: list[Any] | tuple[Any, ...] = (),
                               worker_key: str | None = None,
                               resumed: bool = False) -> Mapping[str, Any]:
        """Register a data worker if needed and tell it which tasks to start and drop.

        ``resumed``: it kept its tasks across a scheduler restart (:mod:`._reconnect`); a
        worker the journal knew is then revived with them (:mod:`._recovery`).

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
            return cast("TaskChanges", {"status": "OK", "new_tasks": [], "cancelled": []})
        self._access.check_worker(address, worker_key, "a data worker heartbeat")
        info = WorkerInfo(address=address, host=host, nthreads=int(nthreads),
                          resources=dict(ws.resources), name=ws.name)
        return self._run(self._core.worker_heartbeat, info, time.time(),
                         active_tasks=active_tasks, finished_tasks=finished_tasks,
                         resumed=resumed)

    @handler
    def state_summary(self, job_token: str | None = None, address: str | None = None,
                      worker_key: str | None = None,
                      dataset_id: str | None = None) -> dict[str, Any]:
        """A plain-data view of the dispatcher, for tests, dashboards and debugging.

        Counts and worker addresses for anyone; a dataset's id and jobs with its credential
        (``dataset_id``), a job with its token, everything with a data worker's key (see
        :func:`._access.redact_summary`).
        """
        if address is not None or worker_key is not None:
            self._access.check_worker(address or "", worker_key, "the full dispatcher state")
            return {"status": "OK", **self.state.summary()}
        return {"status": "OK", **redact_summary(self.state, job_token, dataset_id)}

    # Internals
    ###########
    def _task_def(self, task: Task) -> TaskDef:
        return self._core.task_def(task)

    def _iteration_view(self, iteration_id: int) -> IterationView:
        return self._core.iteration_view(iteration_id)

    def _gc(self) -> None:
        """Periodic: drop silent data workers, release silent clients, collect iterations
        nobody reads (:meth:`~.core.DispatcherCore.gc_tick`); never raises."""
        try:
            self._run(self._core.gc_tick, time.time())
        except Exception:  # noqa: BLE001 - a periodic callback must not die
            logger.exception("dataservice: garbage collection failed")
        names = self._core.published.take()
        if names:  # the Dask data of collected datasets, once their collection is durable
            self._when_durable(lambda: unpublish(self.scheduler, names))
        self.gc_rounds += 1

    def _when_durable(self, action: Callable[[], None]) -> None:
        """Run ``action`` once every update applied so far is in the journal (now without
        one); never if the journal failed (the update may be undone by a restart)."""
        tail = self._journal_tail
        if tail is None or tail.done():
            if tail is None or (not tail.cancelled() and tail.exception() is None):
                action()
            return

        def run(fut: asyncio.Future[Any]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                action()

        tail.add_done_callback(run)

    async def before_close(self) -> None:
        """The scheduler is closing: unpublish the Dask data published for datasets, so
        that its keys are released before the workers go (else the scheduler logs each
        worker's chunks as "lost scattered data"; they die with the cluster anyway)."""
        ext = self.scheduler.extensions.get("publish")
        names = [n for n in getattr(ext, "datasets", {}) if isinstance(n, str)
                 and n.startswith(PUBLISHED_PREFIX)]
        unpublish(self.scheduler, names)


#: The prefix of the names ``register_dataset`` publishes Dask data under
#: (``data/dask_source.py``, ``_pin_name``).
PUBLISHED_PREFIX = "dask-dataservice-"


def unpublish(scheduler: Scheduler, names: Iterable[str]) -> None:
    """Unpublish ``names`` on the scheduler, as ``client.unpublish_dataset`` does (the publish
    extension's ``delete``, without its wait for a client's stream): drop each name and release
    its keys; a name already gone is skipped. O(keys), on the scheduler's loop, no I/O."""
    from dask.utils import stringify

    ext = scheduler.extensions.get("publish")
    if ext is None:
        return
    for name in names:
        out = ext.datasets.pop(name, None)
        if out is not None:
            logger.info("dataservice: unpublishing %s (%d keys): no dataset uses it",
                        name, len(out["keys"]))
            scheduler.client_releases_keys(list(out["keys"]), f"published-{stringify(name)}",
                                           stimulus_id=f"dataservice-unpublish-{time.time()}")
