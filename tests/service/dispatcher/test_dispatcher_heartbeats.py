"""Worker heartbeats of a fault-tolerant dispatcher answer without the journal when they can.

A heartbeat that journals nothing and tells the worker nothing new (the steady state of every
data worker, every ``worker.heartbeat-interval``) used to wait for the journal's next group
commit like any mutating request: behind every record other handlers had in flight. Here the
journal's write is really held (its file lock, taken by the test), so a record stays in
flight: the idle heartbeat answers anyway, a heartbeat whose reply depends on state (a new
task) still waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib

import dask
import pytest
from _helpers import free_port, poll
from distributed import Scheduler, Worker
from distributed.utils_test import gen_test
from test_dispatcher_plugin import ok, register

import dask_dataservice as dds
from dask_dataservice.service.dispatcher._credentials import credential
from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin
from dask_dataservice.service.worker import PLUGIN_NAME as WORKER_PLUGIN

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


@contextlib.asynccontextmanager
async def _journaled(tmp_path):
    plugin = DispatcherPlugin(fault_tolerant_mode=True, work_dir=str(tmp_path))
    async with Scheduler(dashboard_address=":0", port=0) as s:
        s.add_plugin(plugin)
        await plugin.start(s)
        try:
            async with Worker(s.address, nthreads=1) as w:
                await poll(lambda: plugin.state.list_workers(), what="the worker to register")
                yield plugin, w
        finally:
            await plugin.close()


def _heartbeat(plugin, w, key, active=()):
    return plugin.worker_heartbeat(address=w.address, host="127.0.0.1", nthreads=1,
                                   active_tasks=list(active), finished_tasks=[], worker_key=key)


@gen_test(timeout=60)
async def test_idle_heartbeat_does_not_wait_for_records_in_flight(tmp_path):
    async with _journaled(tmp_path) as (plugin, w):
        key = await w.plugins[WORKER_PLUGIN]._key.get()
        ok(await _heartbeat(plugin, w, key))
        journal = plugin._journal
        # (the journal thread may be writing the worker's registration: wait for it)
        assert await asyncio.to_thread(journal._file_lock.acquire, True, 10)
        try:
            # a registration is journaled: its record stays in flight while the lock is held
            pending = asyncio.ensure_future(register(plugin, dds.Dataset.range(5)))
            await poll(lambda: plugin.state.list_datasets(), what="the registration to apply")
            assert not plugin._journal_tail.done()
            # the steady-state heartbeat answers at once
            reply = ok(await asyncio.wait_for(_heartbeat(plugin, w, key), 5))
            assert reply["new_tasks"] == [] and reply["cancelled"] == []
            # a heartbeat that hands out a task still waits for the journal
            dataset_id = credential(plugin.state.list_datasets()[0])
            job = plugin.get_or_create_job(dataset_id=dataset_id, processing_mode="OFF")
            creating = asyncio.ensure_future(job)
            await poll(lambda: plugin.state.list_jobs(), what="the job to apply")
            job_id = plugin.state.list_jobs()[0].job_id
            it = asyncio.ensure_future(plugin.get_or_create_iteration(
                job_id=job_id, job_token=plugin.state.job(job_id).token))
            await poll(lambda: plugin.state.list_live_iterations(), what="the iteration")
            waiting = asyncio.ensure_future(_heartbeat(plugin, w, key))
            await asyncio.sleep(0.2)  # a window in which it must not answer
            assert not waiting.done() and not pending.done()
        finally:
            journal._file_lock.release()
        reply = ok(await asyncio.wait_for(waiting, 10))
        [task] = reply["new_tasks"]
        assert task["job_id"] == job_id
        ok(await creating)
        ok(await it)
        await pending


@pytest.mark.parametrize("resumed", [True, False])
@gen_test(timeout=60)
async def test_a_replayed_worker_is_revived_only_if_it_kept_its_tasks(tmp_path, resumed):
    """After a restart, a worker of the journal is pending: its first heartbeat revives its
    tasks if it says ``resumed`` (it kept them), else they are lost (a new process)."""
    from test_dispatcher_plugin import dispatcher

    port = free_port()
    async with dispatcher(fault_tolerant_mode=True, work_dir=str(tmp_path)) as (plugin, s):
        async with Worker(s.address, nthreads=1, port=port) as w:
            address = w.address
            await poll(lambda: plugin.state.list_workers(), what="the worker to register")
            dataset_id = await register(plugin, dds.Dataset.range(10**6))
            job_id = ok(await plugin.get_or_create_job(
                dataset_id=dataset_id, processing_mode="OFF"))["job_id"]
            ok(await plugin.get_or_create_iteration(
                job_id=job_id, job_token=plugin.state.job(job_id).token))
            [task] = plugin.state.tasks_for_worker(address)
            await plugin.close()  # the crash: nothing more is journaled (not the departure)
    async with dispatcher(fault_tolerant_mode=True, work_dir=str(tmp_path)) as (plugin, s):
        assert plugin._recovered_workers == {address}
        assert plugin.state.task_status(task.task_id) == "active"  # pending, not lost
        # the worker of the same address sends no heartbeat of its own (an excluded resource
        # keeps its plugin quiet): the test sends the one whose ``resumed`` is decided here
        with dask.config.set({"dataservice.dispatcher.worker-resource-excluded": ["quiet"]}):
            w = await Worker(s.address, nthreads=1, port=port, resources={"quiet": 1})
        async with w:
            assert w.address == address
            key = await w.plugins[WORKER_PLUGIN]._key.get()
            reply = ok(await plugin.worker_heartbeat(
                address=address, host="127.0.0.1", nthreads=1, active_tasks=[task.task_id],
                finished_tasks=[], worker_key=key, resumed=resumed))
            assert address not in plugin._recovered_workers
            if resumed:
                assert plugin.state.task_status(task.task_id) == "active"
                assert reply["cancelled"] == [] and reply["new_tasks"] == []
            else:
                assert plugin.state.task_status(task.task_id) == "lost"
                assert reply["cancelled"] == [task.task_id]
                assert plugin.state.worker(address).registered  # registered again, afresh
            await plugin.close()


@gen_test(timeout=60)
async def test_a_retried_split_request_gets_the_splits_of_a_lost_reply(tmp_path):
    """A ``get_split`` journaled whose reply never arrived (the dispatcher crashed after the
    fsync): the worker's retry says how many splits it received, and gets those again, once,
    with no new record; a retry that lost nothing gets new splits; across the end of the
    repetition too."""
    from test_snapshots import W, ft_dispatcher

    from dask_dataservice.service.dispatcher.state import CreateTask, RegisterWorker

    async with ft_dispatcher(tmp_path) as plugin:
        dataset_id = ok(await plugin.register_dataset(
            fingerprint="fp", pipeline=b"p", splits=b"s", num_splits=100))["dataset_id"]
        job_id = ok(await plugin.get_or_create_job(
            dataset_id=dataset_id, processing_mode="DYNAMIC"))["job_id"]
        token = plugin.state.job(job_id).token
        view = ok(await plugin.get_or_create_iteration(job_id=job_id, job_token=token))
        it = view["iteration_id"]
        plugin._apply(RegisterWorker(W, "10.0.0.1", 1))
        plugin._apply(CreateTask(plugin.state.next_task_id(), it, W))
        [task] = plugin.state.tasks_for_iteration(it)

        async def get(count, received=None):
            kwargs = {} if received is None else {"received": received}
            return ok(await plugin.get_split(iteration_id=it, task_id=task.task_id,
                                             repetition=0, count=count, job_token=token,
                                             **kwargs))

        assert (await get(10))["split_indices"] == list(range(10))
        lost = await get(20)  # this reply is "lost": the worker received 10 splits only
        assert lost["split_indices"] == list(range(10, 30))
        records = plugin._journal.metrics.records_written
        again = await get(20, received=10)
        assert again == lost  # the same splits, to the same task, no new record
        assert plugin._journal.metrics.records_written == records
        # nothing lost: a retry gets new splits
        assert (await get(20, received=30))["split_indices"] == list(range(30, 50))
        # the lost reply ended the repetition: the retry says so too
        last = await get(64)
        assert last["split_indices"] == list(range(50, 100)) and last["end_of_splits"]
        assert await get(64, received=50) == last
        assert plugin.state.task_splits(task.task_id) == tuple((0, i) for i in range(100))
        ok(await plugin.release_iteration_client(
            iteration_client_id=view["iteration_client_id"], job_token=token))
