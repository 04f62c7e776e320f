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
  its first heartbeat (``DispatcherCore._dropped_tasks``), so nothing they buffered is
  ever served: no duplicates.

The deadlines and the drops are the core's decisions
(:class:`~._deadlines.WorkerDeadlines`, ``DispatcherCore.gc_tick`` and ``drop_worker``);
this module holds the handlers that need the scheduler: the probe
(``dataservice_suspect_worker``) and ``dataservice_data_workers``: why a reader sees no task (no worker, or
every worker excluded by its resources, or none registered yet), for the reader's warning.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from ... import config
from ..._rpc import handler

if TYPE_CHECKING:
    from distributed import Scheduler

    from .plugin import DispatcherPlugin
    from .state import DispatcherState

__all__ = ["WorkerLiveness", "describe_data_workers"]


class WorkerLiveness:
    """The liveness handlers of one dispatcher (see the module docstring).

    Parameters
    ----------
    plugin
        The :class:`~.plugin.DispatcherPlugin` (its core decides, its shell
        journals).
    """

    def __init__(self, plugin: DispatcherPlugin) -> None:
        self.plugin = plugin

    @property
    def timeout(self) -> float:
        """Seconds of silence after which a worker is removed."""
        return self.plugin._core.deadlines.timeout

    @property
    def dropped(self) -> dict[str, float]:
        """Workers removed for silence (address → when)."""
        return self.plugin._core.deadlines.dropped

    def install(self, scheduler: Scheduler) -> None:
        scheduler.handlers["dataservice_data_workers"] = self.data_workers
        scheduler.handlers["dataservice_suspect_worker"] = self.suspect_worker

    def drop(self, address: str, why: str) -> None:
        """Remove ``address`` from the state (its tasks lost), as if it had died."""
        plugin = self.plugin
        plugin._run(plugin._core.drop_worker, address, why, time.time())

    # Handlers
    ##########
    @handler
    def data_workers(self) -> dict[str, Any]:
        """Why readers may see no task: the workers present and how many serve data."""
        return {"status": "OK", **describe_data_workers(
            self.plugin.state, self.plugin.scheduler,
            self.plugin._core.config.excluded_resources)}

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


def describe_data_workers(state: DispatcherState, scheduler: Scheduler,
                          excluded: tuple[str, ...]) -> dict[str, Any]:
    """``{"registered": n, "present": n, "reason": str}``: the data workers of a dispatcher."""
    present = list(scheduler.workers.values())
    registered = state.list_workers()
    if not present:
        reason = "no worker is connected to the scheduler"
        departed = len(state.list_workers(include_departed=True))
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
