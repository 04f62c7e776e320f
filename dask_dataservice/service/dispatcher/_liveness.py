"""Liveness of data workers, on the dispatcher's side.

A data worker that is frozen (SIGSTOP, a hung process, a VM paused), not dead, keeps its
Dask comms open: the scheduler notices nothing before ``distributed.scheduler.worker-ttl``
(minutes), and a consumer waiting on it would wait as long. So the dispatcher enforces its
own deadline:

- every data-worker heartbeat (``dataservice_worker_heartbeat``, every
  ``dataservice.worker.heartbeat-interval``) is remembered here (in memory, not journaled:
  after a restart every timer starts again);
- the dispatcher's periodic GC calls :meth:`WorkerLiveness.check`: a registered worker silent
  for longer than ``dataservice.dispatcher.worker-timeout`` is removed from the state with
  ``RemoveWorker``, the same accounting as a worker that died: its tasks become ``lost``,
  the splits they held are lost and never handed out again (at-most-once visitation), and
  readers stop waiting on it (they see the task ``lost`` in their next heartbeat);
- a consumer whose request to a worker went unanswered for ``client.request-timeout`` asks
  the dispatcher to check that worker now (``dataservice_suspect_worker``): the dispatcher
  probes it, and removes it if the probe gets no answer within the probe timeout;
- a removed worker that wakes up later re-registers like a new worker (it may get tasks of
  live iterations, with new splits), and the tasks of its previous life are cancelled on
  its first heartbeat (:meth:`WorkerLiveness.dropped_tasks`), so nothing they buffered is
  ever served: no duplicates.

It also answers ``dataservice_data_workers``: why a reader sees no task (no worker, or
every worker excluded by its resources, or none registered yet), for the reader's warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ... import config
from ..._rpc import handler
from ...errors import TaskNotFoundError, WorkerNotFoundError
from .state import RemoveWorker

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

__all__ = ["WorkerLiveness", "describe_data_workers"]


class WorkerLiveness:
    """Heartbeat deadlines of the data workers of one dispatcher (see the module docstring).

    Parameters
    ----------
    plugin
        The :class:`~.plugin.DispatcherPlugin` (its ``state``, ``scheduler`` and
        ``_apply``: the one way to change the state).
    timeout
        Seconds of silence after which a worker is removed (default: config
        ``dataservice.dispatcher.worker-timeout``; ``plugin.worker_timeout`` if set).
    """

    def __init__(self, plugin: Any, timeout: float | None = None) -> None:
        self.plugin = plugin
        if timeout is None:
            timeout = getattr(plugin, "worker_timeout", None)
        if timeout is None:
            timeout = config.get_seconds("dispatcher.worker-timeout")
        self.timeout = float(timeout)
        #: ``{address: monotonic time of its last heartbeat}``.
        self._seen: dict[str, float] = {}
        self._last_check = time.monotonic()
        #: Workers removed for silence (address → when), for the log when they come back.
        self.dropped: dict[str, float] = {}

    def install(self, scheduler: Scheduler) -> None:
        scheduler.handlers["dataservice_data_workers"] = self.data_workers
        scheduler.handlers["dataservice_suspect_worker"] = self.suspect_worker

    def seen(self, address: str) -> None:
        """A heartbeat of ``address`` arrived."""
        self._seen[address] = time.monotonic()
        since = self.dropped.pop(address, None)
        if since is not None:
            logger.warning(
                "dataservice: data worker %s answers again %.1fs after it was dropped for "
                "silence; the tasks of its previous life stay lost (it gets new ones)",
                address, time.monotonic() - since)

    def forget(self, address: str) -> None:
        """``address`` left the cluster."""
        self._seen.pop(address, None)
        self.dropped.pop(address, None)

    def check(self) -> None:
        """Remove every registered data worker silent for longer than the timeout."""
        now = time.monotonic()
        last_check, self._last_check = self._last_check, now
        if now - last_check > self.timeout / 2:
            # The dispatcher's own loop did not run for a while (blocked, or the process was
            # stopped): the silence is ours, not the workers'. Start every timer again.
            self._seen = dict.fromkeys(self._seen, now)
            return
        for worker in self.plugin.state.list_workers():
            last = self._seen.setdefault(worker.address, now)  # a timer starts at first sight
            if now - last > self.timeout:
                self.drop(worker.address, f"no heartbeat for {now - last:.1f}s "
                          f"(dataservice.dispatcher.worker-timeout={self.timeout:g}s)")

    def drop(self, address: str, why: str) -> None:
        """Remove ``address`` from the state (its tasks lost), as if it had died."""
        state = self.plugin.state
        try:
            if not state.worker(address).registered:
                return
        except WorkerNotFoundError:
            return
        lost = [t.task_id for t in state.tasks_for_worker(address) if t.status == "active"]
        logger.warning(
            "dataservice: dropping unresponsive data worker %s: %s; its tasks %s are lost "
            "(the splits they held are not handed out again)", address, why, lost)
        self.plugin._apply(RemoveWorker(address=address))
        self._seen.pop(address, None)
        self.dropped[address] = time.monotonic()

    def dropped_tasks(self, reported: Iterable[int]) -> list[int]:
        """Of the tasks a worker reports, those it must drop: unknown (collected) or lost."""
        state = self.plugin.state
        out = []
        for task_id in reported:
            try:
                if state.task_status(task_id) == "lost":
                    out.append(task_id)
            except TaskNotFoundError:
                out.append(task_id)
        return out

    # Handlers
    ##########
    @handler
    def data_workers(self) -> dict[str, Any]:
        """Why readers may see no task: the workers present and how many serve data."""
        return {"status": "OK", **describe_data_workers(self.plugin)}

    @handler
    async def suspect_worker(self, address: str) -> dict[str, Any]:
        """A consumer got no answer from ``address``: probe it, drop it if it is silent too."""
        if address not in self.plugin.scheduler.workers:
            return {"status": "OK", "dropped": False}
        timeout = config.get_seconds("dispatcher.worker-probe-timeout")
        try:
            await asyncio.wait_for(
                self.plugin.scheduler.rpc(address).dataservice_worker_state(), timeout)
            return {"status": "OK", "dropped": False}
        except TimeoutError:
            self.drop(address, f"a consumer's request went unanswered, and so did the "
                      f"dispatcher's probe for {timeout:g}s")
        except OSError as e:
            self.drop(address, f"a consumer's request went unanswered, and the dispatcher's "
                      f"probe failed: {e!r}")
        return {"status": "OK", "dropped": True}


def describe_data_workers(plugin: Any) -> dict[str, Any]:
    """``{"registered": n, "present": n, "reason": str}``: the data workers of a dispatcher."""
    scheduler = plugin.scheduler
    excluded = tuple(config.get("dispatcher.worker-resource-excluded") or ())
    present = list(scheduler.workers.values())
    registered = plugin.state.list_workers()
    if not present:
        reason = "no worker is connected to the scheduler"
        departed = len(plugin.state.list_workers(include_departed=True))
        if departed:
            # e.g. a fault-tolerant dispatcher came back and its workers did not: plain
            # workers exit with their scheduler (distributed does not reconnect them)
            reason += (f"; the {departed} data workers it knew did not come back (if the "
                       "scheduler restarted: plain Dask workers exit with their scheduler; "
                       "run them supervised, e.g. `dask-dataservice worker --supervise`)")
    elif registered:
        reason = f"{len(registered)} data workers registered"
    else:
        data = [ws for ws in present if not any(ws.resources.get(r) for r in excluded)]
        if not data:
            held = sorted({r for ws in present for r in excluded if ws.resources.get(r)})
            reason = (f"{len(present)} workers present, all with resource "
                      f"{' or '.join(held)} (dataservice.dispatcher.worker-resource-excluded: "
                      "they run no data tasks)")
        else:
            reason = (f"{len(present)} workers present, none registered as a data worker "
                      "(is the data-worker plugin installed, e.g. --preload dask_dataservice?)")
    return {"registered": len(registered), "present": len(present), "reason": reason}
