"""Retiring a data worker loses nothing: drain it first (issue 26).

Dask retires a worker through the scheduler's ``retire_workers`` handler, whoever asks:
``Adaptive`` scaling down, ``cluster.scale(n)`` on a SpecCluster (LocalCluster included),
``client.retire_workers(...)``. This module wraps that handler so that a data worker is
*drained* before Dask moves its keys away and closes it:

1. The dispatcher core marks the worker draining (:meth:`~.core.DispatcherCore.drain_worker`):
   it gets no new task, and its DYNAMIC tasks are handed no new split. Each such task's
   pipeline makes the splits it already holds, then ends (an endless ``repeat()`` too), and
   tells the dispatcher it finished.
2. The consumers read what the task made, to its end of sequence. The splits nobody took yet
   go to the other workers' tasks: every element of a DYNAMIC epoch is still seen exactly
   once.
3. Once each drained task's buffer is empty, its end was shown and its consumers
   acknowledged every reply with elements (a reply still on its way would be lost with the
   worker, and a consumer sends a lost one's request again; the worker's
   ``dataservice_worker_state``), the retirement goes on as Dask's own.

The drain waits at most ``dataservice.dispatcher.drain-timeout``; past it the retirement goes
on and a warning names the tasks still producing (their held splits are then lost with the
worker, the at-most-once rule of a worker that dies). OFF and statically sharded tasks, and
coordinated reads, are not drained: as in TensorFlow, such a task is its worker's share of
the data, and it ends with the worker. A retirement that did not remove a worker (Dask keeps
a worker holding the only copy of a key it cannot move) calls its drain off: it takes tasks
and splits again.

The waiting runs on the scheduler's event loop as awaits (a short poll of the core's state
and one small request to the worker), never a blocking call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ... import config
from ...errors import WorkerNotFoundError

if TYPE_CHECKING:
    from distributed import Scheduler

    from .plugin import DispatcherPlugin

__all__ = ["Retirements"]

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")

#: How often a drain looks again (seconds; each look past the dispatcher's part is one small
#: request to the worker).
POLL = 0.2
#: The parameters of ``Scheduler.workers_to_close`` that ``retire_workers`` passes on.
_TO_CLOSE = ("memory_ratio", "n", "key", "minimum", "target", "attribute")


class Retirements:
    """The drain-first ``retire_workers`` handler of one dispatcher (see the module doc)."""

    def __init__(self, plugin: DispatcherPlugin) -> None:
        self.plugin = plugin
        self._scheduler: Scheduler | None = None
        self._original: Any = None
        #: Drains under way: ``{address: the task that drains it}`` (one per worker).
        self._drains: dict[str, asyncio.Task[None]] = {}
        #: Drains done, for the dashboard and tests: ``{address: seconds it took}``.
        self.drained: dict[str, float] = {}

    def install(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._original = scheduler.handlers.get("retire_workers")
        if self._original is not None:
            scheduler.handlers["retire_workers"] = self.retire_workers
        scheduler.handlers["dataservice_workers_to_close"] = self.workers_to_close

    async def aclose(self) -> None:
        """Give Dask its handler back; cancel the drains under way and wait for them."""
        s = self._scheduler
        if s is not None and self._original is not None \
                and s.handlers.get("retire_workers") == self.retire_workers:
            s.handlers["retire_workers"] = self._original
        drains = list(self._drains.values())
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)

    def workers_to_close(self, target: int, attribute: str = "name") -> list[Any]:
        """The data workers to retire to leave ``target`` workers in all (issue 26's
        ``DemandAdaptive``): never one excluded by its resources (a parameter server), nor
        one already retiring; first those running no Dask task, then those with the
        fewest data-service tasks, then the least memory. Answers their ``attribute``
        (``name``, as ``Adaptive`` retires by name, or ``address``). O(workers)."""
        s = self._scheduler
        assert s is not None
        core = self.plugin._core
        n = len(s.workers) - int(target)
        if n <= 0:
            return []
        active: dict[str, int] = {}
        for a in s.workers:
            if core.is_data_worker(a):
                try:
                    active[a] = sum(1 for t in core.state.tasks_for_worker(a)
                                    if t.status == "active")
                except WorkerNotFoundError:  # not registered yet: no task
                    active[a] = 0
        order = sorted(active, key=lambda a: (bool(s.workers[a].processing), active[a],
                                              s.workers[a].nbytes, a))
        return [getattr(s.workers[a], attribute) for a in order[:n]]

    async def retire_workers(self, workers: list[str] | None = None, *,
                             names: list[Any] | None = None, **kwargs: Any) -> Any:
        """Dask's ``retire_workers``, with the data workers among them drained first."""
        s = self._scheduler
        assert s is not None and self._original is not None
        if names is not None and workers is not None:
            return await self._original(workers=workers, names=names, **kwargs)
        if names is not None:
            wanted = {str(n) for n in names}
            addresses = [a for a, ws in s.workers.items() if str(ws.name) in wanted]
        elif workers is not None:
            # SpecCluster (LocalCluster's ``scale``) passes its worker *names* here
            by_name = {str(ws.name): a for a, ws in s.workers.items()}
            addresses = [a if a in s.workers else by_name[str(a)] for a in workers
                         if a in s.workers or str(a) in by_name]
        else:  # Dask picks them: pick now, so the drained ones are the retired ones
            to_close = {k: kwargs.pop(k) for k in _TO_CLOSE if k in kwargs}
            to_close["attribute"] = "address"
            addresses = s.workers_to_close(**to_close)
            workers = list(addresses)
        core = self.plugin._core
        staying = [a for a in s.workers if a not in addresses and core.is_data_worker(a)]
        if staying:
            await asyncio.gather(*(self.drain(a) for a in addresses))
        elif any(core.is_data_worker(a) for a in addresses):
            # no data worker would be left to take the splits (a cluster closing: scale(0))
            logger.info("dataservice: retiring every data worker (%s): no drain, their tasks "
                        "end with them", ", ".join(addresses))
        retired: Any = None
        try:
            retired = await self._original(workers=workers, names=names, **kwargs)
            return retired
        finally:
            # A worker Dask kept (it holds the only copy of a key it could not move, or the
            # call failed) takes tasks and splits again. Not one SpecCluster named: Dask
            # retires nobody for names given as addresses, and the cluster closes it next.
            kept = [a for a in addresses if a in core.draining and a in s.workers
                    and a not in (retired or {}) and (workers is None or a in workers)]
            for a in kept:
                logger.info("dataservice: data worker %s was not retired: it takes tasks "
                            "and splits again", a)
                self.plugin._run(core.undrain, a)

    async def drain(self, address: str) -> None:
        """Drain one data worker (shared by concurrent retirements of the same worker)."""
        task = self._drains.get(address)
        if task is None:
            task = self._drains[address] = asyncio.ensure_future(self._drain(address))
            task.add_done_callback(lambda _: self._drains.pop(address, None))
        await asyncio.shield(task)

    async def _drain(self, address: str) -> None:
        plugin, s = self.plugin, self._scheduler
        assert s is not None
        if plugin._closed or not plugin._core.is_data_worker(address) \
                and address not in plugin._core.draining:
            return
        held = await self._held(address)
        tasks = plugin._run(plugin._core.drain_worker, address, held)
        if not tasks:
            return
        timeout = config.get_seconds("dispatcher.drain-timeout")
        logger.info("dataservice: draining data worker %s before it retires: its DYNAMIC "
                    "tasks %s take no new split and end once their consumers read what they "
                    "made (up to dataservice.dispatcher.drain-timeout=%gs)", address, tasks,
                    timeout)
        start = time.monotonic()
        deadline = start + timeout
        pending = list(tasks)
        while pending and time.monotonic() < deadline and address in s.workers:
            pending = plugin._core.drained(pending)  # still producing at the dispatcher
            if not pending:  # all made: what the consumers have not taken yet
                pending = await self._undelivered(
                    address, plugin._core.drained(tasks, finished=True))
            if pending:
                await asyncio.sleep(POLL)
        took = time.monotonic() - start
        if pending and address in s.workers:
            logger.warning(
                "dataservice: data worker %s did not drain within dataservice.dispatcher."
                "drain-timeout=%gs: retiring it anyway; what its tasks %s still hold is lost "
                "with it (the splits they hold are not handed out again)", address, timeout,
                pending)
        else:
            self.drained[address] = took
            logger.info("dataservice: data worker %s drained in %.2fs", address, took)

    async def _worker_tasks(self, address: str) -> dict[Any, Any] | None:
        """The worker's tasks as it reports them (``dataservice_worker_state``), or None
        when it does not answer."""
        s = self._scheduler
        assert s is not None
        try:
            reply = await asyncio.wait_for(s.rpc(address).dataservice_worker_state(), 5.0)
        except (OSError, TimeoutError):
            return None
        return reply.get("tasks", {}) if isinstance(reply, dict) else {}

    async def _held(self, address: str) -> list[int]:
        """The tasks the worker holds, finished ones included."""
        return [int(t) for t in (await self._worker_tasks(address) or {})]

    async def _undelivered(self, address: str, tasks: list[int]) -> list[int]:
        """Of ``tasks`` (finished at the dispatcher), those whose worker still holds
        elements its consumers have not taken, or whose end it has not shown yet."""
        s = self._scheduler
        assert s is not None
        held = await self._worker_tasks(address)
        if held is None:
            return list(tasks) if address in s.workers else []
        out = []
        for tid in tasks:
            t = held.get(tid, held.get(str(tid)))
            if t is not None and not (t["produced_all"] and t["buffered"] == 0
                                      and t["end_visible"] and not t["unacknowledged"]):
                out.append(tid)
        return out
