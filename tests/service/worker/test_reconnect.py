"""The reconnecting worker keeps its data-worker plugin across a scheduler restart.

A restarted scheduler sends each of its worker plugins to a worker once: in the registration
reply if it had the plugin by then, else by a broadcast when it gets it. The dispatcher of a
restarted scheduler registers the data-worker plugin only after the scheduler listens, so a
worker that comes back quickly registers first and gets the broadcast afterwards. Dask would
then tear the running plugin down (its tasks, buffers and split cursors) and start a fresh
one, whose first heartbeat does not say ``resumed``: the dispatcher counted the worker's tasks
lost and gave it a new OFF task, served from element 0 (CI saw 12,544 duplicates of 80,000 in
``test_invisible_restart.py::test_sigkill_scheduler_readers_lose_nothing[parallel_epochs]``).

Here the order is forced: the new scheduler has no plugin when the worker registers again,
and gets it afterwards. Real scheduler and worker, in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _helpers import free_port
from distributed import Scheduler
from distributed.core import Status
from distributed.protocol.pickle import dumps
from distributed.utils_test import gen_test

from dask_dataservice.service.worker import DataWorkerPlugin
from dask_dataservice.service.worker._reconnect import QuietStopWorker, ReconnectingWorker
from dask_dataservice.service.worker.plugin import PLUGIN_NAME

pytestmark = [pytest.mark.component, pytest.mark.timeout(60)]


async def _until(predicate, what: str, timeout: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _register(scheduler: Scheduler, idempotent: bool = True) -> None:
    await scheduler.register_worker_plugin(None, dumps(DataWorkerPlugin()), name=PLUGIN_NAME,
                                           idempotent=idempotent)


@contextlib.asynccontextmanager
async def _restarted_under(plugin_before_listening: bool
                           ) -> AsyncIterator[tuple[ReconnectingWorker, Any, Scheduler]]:
    """A worker running the data-worker plugin whose scheduler is replaced by a second one at
    the same address; yields (worker, its running plugin, the second scheduler) once the
    worker registered with the second. The second has the plugin before it listens (the
    registration reply carries it) or not (the order of a restarted dispatcher's start)."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    first = await Scheduler(host="127.0.0.1", port=port, dashboard_address=":0")
    await _register(first)
    async with ReconnectingWorker(address, nthreads=1, host="127.0.0.1") as w:
        await _until(lambda: PLUGIN_NAME in w.plugins, "the data-worker plugin")
        running = w.plugins[PLUGIN_NAME]
        assert w.extensions["dataservice"] is running
        await first.close()  # the worker waits for a scheduler at the same address
        second = Scheduler(host="127.0.0.1", port=port, dashboard_address=":0")
        if plugin_before_listening:
            second.worker_plugins[PLUGIN_NAME] = dumps(DataWorkerPlugin())
        await second
        try:
            await _until(lambda: w.reconnects == 1, "the worker to register again")
            yield w, running, second
        finally:
            await second.close()


@gen_test(timeout=60)
async def test_the_plugin_sent_after_registering_again_does_not_replace_the_running_one():
    async with _restarted_under(plugin_before_listening=False) as (w, running, second):
        assert PLUGIN_NAME not in second.worker_plugins  # the order under test
        await _register(second)  # the broadcast of the restarted dispatcher's start
        assert w.plugins[PLUGIN_NAME] is running, "the running plugin was replaced"
        assert w.extensions["dataservice"] is running

        # a later push is a change (a user's new version): Dask's behaviour again
        await _register(second, idempotent=False)
        assert w.plugins[PLUGIN_NAME] is not running


@gen_test(timeout=60)
async def test_a_plugin_the_restarted_scheduler_has_at_registration_is_kept_too():
    """The other order: the registration reply carries the plugin (the case handled before)."""
    async with _restarted_under(plugin_before_listening=True) as (w, running, second):
        assert w.plugins[PLUGIN_NAME] is running
        await _register(second)  # idempotent: the scheduler has it, nothing is sent
        assert w.plugins[PLUGIN_NAME] is running


class _HeldWorker(ReconnectingWorker):
    """Registers again only once ``hold`` is set: the test decides what reaches the restarted
    scheduler first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold = asyncio.Event()

    async def _wait_for_scheduler(self) -> None:
        await self.hold.wait()
        await super()._wait_for_scheduler()


@gen_test(timeout=60)
async def test_a_dask_heartbeat_in_flight_across_the_restart_does_not_close_the_worker():
    """Dask's heartbeat that is on its way when the scheduler dies (its periodic callback is
    stopped, but a run already started goes on) tries to connect until a scheduler listens
    at the address again. Reaching the restarted scheduler before the worker registered
    there, it hears "missing", and Dask closes the worker: its supervisor starts a fresh
    one, which gets a new OFF task, served from element 0, after readers read part of the
    old one (the path found to the 8,454 duplicates of 80,000 of one run of
    ``test_invisible_restart.py::test_sigkill_scheduler_readers_lose_nothing[parallel_epochs]``
    under load). Here that heartbeat is forced to arrive first."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    first = await Scheduler(host="127.0.0.1", port=port, dashboard_address=":0")
    await _register(first)
    async with _HeldWorker(address, nthreads=1, host="127.0.0.1") as w:
        await _until(lambda: PLUGIN_NAME in w.plugins, "the data-worker plugin")
        running = w.plugins[PLUGIN_NAME]
        await first.close()
        await _until(lambda: w._reconnecting is not None, "the worker to lose its scheduler")
        in_flight = asyncio.create_task(w.heartbeat())  # connecting, no scheduler there
        second = await Scheduler(host="127.0.0.1", port=port, dashboard_address=":0")
        try:
            await _register(second)
            await in_flight  # answered by the second scheduler: "missing"
            assert w.status == Status.running, "the stale heartbeat's answer closed the worker"
            w.hold.set()
            await _until(lambda: w.reconnects == 1, "the worker to register again")
            assert w.plugins[PLUGIN_NAME] is running
            assert w.address in second.workers
        finally:
            await second.close()


class _GatedHeartbeat:
    """Its heartbeat waits at ``gate`` before its RPC (Dask's heartbeat awaits
    ``get_metrics`` first): the test closes the worker while one is under way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.at_gate = asyncio.Event()

    async def get_metrics(self) -> dict[str, Any]:
        if self._heartbeat is asyncio.current_task():
            self.at_gate.set()
            await self.gate.wait()
        return await super().get_metrics()


class _GatedReconnectingWorker(_GatedHeartbeat, ReconnectingWorker):
    pass


class _GatedQuietStopWorker(_GatedHeartbeat, QuietStopWorker):
    pass


@pytest.mark.parametrize("worker_class", [_GatedReconnectingWorker, _GatedQuietStopWorker],
                         ids=["supervised", "unsupervised"])
@gen_test(timeout=60)
async def test_closing_during_a_heartbeat_logs_no_error(worker_class):
    """A worker stopped while its Dask heartbeat was under way logged "Failed to communicate
    with scheduler during heartbeat" with a "ConnectionPool closing" traceback (the close
    shut the connection pool under the heartbeat's RPC): a clean stop of a supervised worker
    failed tests/project/test_cli.py's no-traceback check once, and of an unsupervised
    ``dask-dataservice worker`` tests/dashboard/test_dashboard.py's once. The close now
    cancels the heartbeat first, and a cancelled heartbeat logs nothing."""
    from distributed.utils_test import captured_logger

    async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
        w = await worker_class(s.address, nthreads=1, host="127.0.0.1")
        beat = asyncio.create_task(w.heartbeat())
        await asyncio.wait_for(w.at_gate.wait(), 10)
        with captured_logger("distributed.worker") as log:
            await w.close()
            w.gate.set()
            await asyncio.wait({beat}, timeout=10)
        assert beat.done()
        # mid-close it was "Failed to communicate ... ConnectionPool closing", once closed
        # "Unexpected exception during heartbeat ... ConnectionPool is closed": both tracebacks
        assert "Traceback" not in log.getvalue() and "heartbeat" not in log.getvalue()
