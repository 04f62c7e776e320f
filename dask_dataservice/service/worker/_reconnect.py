"""A Dask worker that rides out a restart of its scheduler: what makes a dispatcher restart
invisible to readers (issue 11 s1).

A plain Dask worker closes itself when it loses its scheduler (distributed removed worker
reconnection, dask/distributed#6361, because a worker's *Dask* tasks and data cannot be
reconciled with a scheduler that never heard of them). A data worker's valuable state is not
Dask's: it is the data service's tasks, their buffered elements and their split cursors, all
held by :class:`~.plugin.DataWorkerPlugin`. So :class:`ReconnectingWorker` keeps the
process, the worker object, its server (the address readers fetch elements from) and its
plugins when the scheduler goes away, waits for a scheduler at the same address, and
registers again (as a new worker does), as TensorFlow's data workers keep serving while their
dispatcher is down and re-register with their tasks. Meanwhile:

- readers keep fetching the elements already produced and buffered (the worker's server and
  their connections to it never close);
- the pipelines keep producing into the bounded buffers; a DYNAMIC task waits for its next
  split until the dispatcher answers again;
- once registered, the plugin is told (:meth:`DataWorkerPlugin.reconnected`): its first
  heartbeat reports its tasks, marked as *resumed*, and the replayed dispatcher revives them
  instead of counting them lost (see ``DispatcherPlugin._worker_heartbeat``).

It reconnects only when that is safe: the worker holds no Dask task and no Dask data (a data
worker normally holds neither); otherwise, and when it was asked to close (by a client, by
``retire_workers``, by its supervisor), it closes as a Dask worker does, and a supervisor
starts a fresh one (whose tasks are then lost, with the usual accounting).

Used by the in-process :class:`~.servers.WorkerSupervisor` and by ``dask-dataservice worker
--supervise`` (``dask worker --worker-class``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

from distributed import Worker
from distributed.batched import BatchedSend
from distributed.comm.core import Comm, connect
from distributed.core import Status

logger = logging.getLogger(__name__)

__all__ = ["QuietStopWorker", "ReconnectingWorker"]

#: Scheduler close reasons after which the scheduler process is going away (a restart may
#: follow): the worker waits for it. Any other reason to close (a client's, retirement,
#: removal) is obeyed.
_SCHEDULER_GONE = frozenset({"scheduler-close"})

#: How many times the worker had lost its scheduler when the Dask heartbeat running in this
#: context began (:meth:`ReconnectingWorker.heartbeat`).
_HEARTBEAT_AFTER: contextvars.ContextVar[int] = contextvars.ContextVar("heartbeat_after")


class QuietStopWorker(Worker):
    """A Dask worker whose stop logs no error for a heartbeat under way.

    Dask's ``Worker.close`` shuts the worker's connections while a heartbeat RPC may be in
    flight; that heartbeat then fails and Dask logs "Failed to communicate with scheduler
    during heartbeat" with a traceback, on a clean SIGTERM or Ctrl-C. :meth:`close` cancels
    the heartbeat under way first (Dask catches ``OSError`` and ``Exception``, not the
    cancellation, so it ends quietly). ``dask-dataservice worker`` runs this class unless
    ``--worker-class`` says otherwise; :class:`ReconnectingWorker` builds on it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The task of the Dask heartbeat under way, if any (:meth:`close` cancels it).
        self._heartbeat: asyncio.Task[Any] | None = None

    async def heartbeat(self) -> None:
        self._heartbeat = asyncio.current_task()
        try:
            await super().heartbeat()
        finally:
            self._heartbeat = None

    async def close(self, *args: Any, **kwargs: Any) -> str | None:  # type: ignore[override]
        heartbeat = self._heartbeat
        if heartbeat is not None and heartbeat is not asyncio.current_task():
            heartbeat.cancel()
        return await super().close(*args, **kwargs)


class ReconnectingWorker(QuietStopWorker):
    """A Dask worker that registers again with a restarted scheduler (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: How many times this worker registered again after losing its scheduler.
        self.reconnects = 0
        #: How many times it lost its scheduler (and set out to wait for it).
        self.losses = 0
        self._reconnecting: asyncio.Task[Any] | None = None
        #: Plugins this worker ran when it lost its scheduler, whose first push by the new
        #: scheduler is a re-send, not a change (:meth:`plugin_add`).
        self._plugins_to_keep: set[str] = set()
        self.stream_handlers["close"] = self._close_from_scheduler

    async def _close_from_scheduler(self, reason: str = "scheduler-close", **kwargs: Any) -> None:
        """Stream op ``close``: a scheduler that shuts down says so to every worker first;
        that one is waited out (its stream breaks next, and the worker reconnects)."""
        if reason in _SCHEDULER_GONE:
            logger.info("dataservice: the scheduler is closing (%s); this worker waits for it "
                        "to come back", reason)
            return
        await self.close(reason=reason, **kwargs)

    async def handle_scheduler(self, comm: Comm) -> None:
        try:
            await self.handle_stream(comm)
        finally:
            if not await self._try_reconnect():
                await self.close(reason="worker-handle-scheduler-connection-broken")

    async def _try_reconnect(self) -> bool:
        if self.status not in (Status.running, Status.paused):
            return False
        if self.data or self.state.tasks:
            logger.warning(
                "dataservice: worker %s lost its scheduler while it holds Dask tasks or data "
                "(%d tasks); it cannot reconnect and closes", self.address,
                len(self.state.tasks))
            return False
        logger.warning("dataservice: worker %s lost its scheduler; it keeps serving its data "
                       "tasks and waits for the scheduler to come back", self.address)
        # Dask's own heartbeat would reach the new scheduler before this worker registered
        # there, hear "missing" and close the worker: registering starts it again.
        for name in ("heartbeat", "keep-alive"):
            self.periodic_callbacks[name].stop()
        self.losses += 1
        self._reconnecting = asyncio.current_task()
        try:
            await self._wait_for_scheduler()
            if self.status not in (Status.running, Status.paused):
                return False
            self.batched_stream.abort()
            self.batched_stream = BatchedSend(interval="2ms", loop=self.loop)
            self._plugins_to_keep = set(self.plugins)
            await self._register_with_scheduler()
        except asyncio.CancelledError:
            return False
        except Exception as e:  # noqa: BLE001 - close as a Dask worker would
            logger.warning("dataservice: worker %s could not register again: %r",
                           self.address, e)
            return False
        finally:
            self._reconnecting = None
        self.reconnects += 1
        logger.info("dataservice: worker %s registered again with %s (reconnect %d)",
                    self.address, self.scheduler.address, self.reconnects)
        plugin = self.extensions.get("dataservice")
        if plugin is not None:
            plugin.reconnected()
        return True

    async def plugin_add(self, plugin: Any, name: str | None = None,
                         catch_errors: bool = True) -> Any:
        """Keep the plugins this worker runs when the new scheduler sends them again.

        Dask would tear a plugin of the same name down and set up the one sent afresh: the
        data worker's tasks and buffers would go with it. The new scheduler sends each of its
        worker plugins once: in the registration's reply if it had it by then, else by a
        broadcast when it gets it. Its dispatcher registers the data-worker plugin only once
        the scheduler listens, so a worker quick to come back registers first and gets the
        broadcast later (then its tasks were torn down and served again from 0: duplicates,
        ``tests/service/worker/test_reconnect.py``). So the first push of each plugin the
        worker ran when it lost its scheduler is taken as the re-send it is; any later one
        (a user's new version) replaces the plugin as Dask does.
        """
        if name is not None and name in self._plugins_to_keep and name in self.plugins:
            self._plugins_to_keep.discard(name)
            logger.info("dataservice: worker %s keeps its running plugin %r (the restarted "
                        "scheduler sent it again)", self.address, name)
            return {"status": "OK"}
        return await super().plugin_add(plugin, name=name, catch_errors=catch_errors)

    async def heartbeat(self) -> None:
        """Dask's heartbeat, marked with the number of scheduler losses when it began.

        Stopping its periodic callback (:meth:`_try_reconnect`) does not stop a run already
        under way: its RPC connects again and again until a scheduler listens at the address.
        A restarted scheduler the worker has not registered with yet answers "missing", and
        Dask closes the worker. A supervisor then started a fresh one: the tasks were lost,
        and a new OFF task served its copy again from element 0, after readers had read part
        of the old one (duplicates). :meth:`close` ignores that answer (see there).
        """
        token = _HEARTBEAT_AFTER.set(self.losses)
        try:
            await super().heartbeat()
        finally:
            _HEARTBEAT_AFTER.reset(token)

    async def _wait_for_scheduler(self) -> None:
        """Until the scheduler's address accepts a connection (or this worker closes)."""
        delay = 0.05
        while self.status in (Status.running, Status.paused):
            try:
                comm = await connect(self.scheduler.address, timeout=5,
                                     **self.connection_args)
            except OSError:
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.25)
                continue
            comm.abort()
            return

    async def close(self, *args: Any, **kwargs: Any) -> str | None:  # type: ignore[override]
        if kwargs.get("reason") == "worker-heartbeat-missing" and (
                self._reconnecting is not None
                or _HEARTBEAT_AFTER.get(self.losses) != self.losses):
            # a heartbeat under way across the loss of the scheduler, answered by the
            # restarted one before this worker registered there: not that scheduler's word
            # that it removed this worker (:meth:`heartbeat`)
            logger.info("dataservice: worker %s ignores the answer \"missing\" to a heartbeat "
                        "sent before it lost its scheduler", self.address)
            return None
        reconnecting = self._reconnecting
        if reconnecting is not None and reconnecting is not asyncio.current_task():
            reconnecting.cancel()
        return await super().close(*args, **kwargs)  # cancels a heartbeat under way
