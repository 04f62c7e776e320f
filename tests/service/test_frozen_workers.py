"""A data worker that is frozen (SIGSTOP), not dead, must not block its consumers forever.

Real processes: the workers are Nannies, the victim is stopped with ``os.kill(pid, SIGSTOP)``.
Its Dask comms stay open, so only the data service's own liveness can notice it: the
dispatcher's heartbeat deadline (``dispatcher.worker-timeout``) or a consumer's request
timeout (``client.request-timeout``, then the dispatcher's probe). Either way the victim is
dropped with the accounting of a dead worker: the read ends, no element twice, and every
missing element belongs to a split the victim held. Woken up (SIGCONT), it gets its old task
cancelled and serves nothing of it.

This is the real-process test of a frozen worker, detected the consumer's way (request
timeout, then the probe). The heartbeat-deadline way, with the same checks, is the
simulator's: ``test_frozen_worker_dropped_by_heartbeat_deadline`` in tests/testing/test_sim.py
(and its seeds' ``freeze_worker`` faults).
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time

import pytest
from _helpers import poll, read
from distributed import Nanny

import dask_dataservice as dds
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120), pytest.mark.slow]

N = 20_000

#: How a frozen worker is noticed, alone (the dispatcher's heartbeat deadline out of reach).
DETECTIONS = {
    "consumer-request-timeout": {
        "dataservice.dispatcher.worker-timeout": "300s",
        "dataservice.client.request-timeout": "2s",
        "dataservice.dispatcher.worker-probe-timeout": "2s",
    },
}


def _frozen_worker_test(detection: str):
    @gen_cluster(client=True, Worker=Nanny, nthreads=[("", 1)], timeout=100,
                 config={"distributed.scheduler.allowed-failures": 0, **DETECTIONS[detection]})
    async def test(c, s, a):
        victim_pid = a.process.process.pid
        victim = a.worker_address

        def slow_in_victim(x):  # pickled by value for the worker processes
            import os
            import time

            if os.getpid() == victim_pid:
                time.sleep(0.005)  # the victim is always mid-split when it is frozen
            return x

        dataset_id = await asyncio.to_thread(
            dds.register_dataset, c, dds.Dataset.range(N).map(slow_in_victim))
        splits = await asyncio.to_thread(dds.Dataset.range(N).splits)
        ds = dds.from_dataset_id("distributed_epoch", c, dataset_id)
        reading = asyncio.ensure_future(read(ds))
        plugin = s.plugins[PLUGIN_NAME]

        def victim_tasks():
            return [t for it in plugin.state.list_iterations()
                    for t in plugin.state.tasks_for_iteration(it.iteration_id)
                    if t.worker_address == victim]

        await poll(lambda: any(plugin.state.task_splits(t.task_id) for t in victim_tasks()),
                   what="the victim to hold a split")
        (old_task,) = [t.task_id for t in victim_tasks()]
        async with Nanny(s.address, nthreads=1):
            await poll(lambda: len(s.workers) == 2, what="the second worker")
            os.kill(victim_pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                out = await asyncio.wait_for(reading, 60)
                took = time.monotonic() - frozen_at
                assert victim in s.workers, "Dask itself must not have noticed (worker-ttl)"
            finally:
                os.kill(victim_pid, signal.SIGCONT)
            print(f"[{detection}] the read ended {took:.1f}s after the freeze")  # figure for the docs
            assert took < 30, f"the read took {took:.1f}s after the freeze"
            counts = collections.Counter(out)
            assert max(counts.values()) == 1, "an element arrived twice"
            missing = set(range(N)) - set(out)
            assert missing, "the victim was frozen mid-split: that split is lost"
            (it,) = plugin.state.list_iterations()
            lost = plugin.state.lost_splits(it.iteration_id)
            lost_elements = set()
            for _, index in lost:
                lost_elements.update(range(splits[index].start, splits[index].stop))
            assert missing <= lost_elements, "a missing element not of a split the victim held"

            # Woken up: it heartbeats again, and its old task is cancelled, not served.
            await poll(lambda: victim not in plugin._liveness.dropped, 30,
                       "the victim to heartbeat again")

            async def old_task_cancelled():
                state = await c.rpc(victim).dataservice_worker_state()
                return old_task not in state["tasks"] and old_task in state["finished_tasks"]

            deadline = time.monotonic() + 30
            while not await old_task_cancelled():
                assert time.monotonic() < deadline, "the victim kept its dropped task"
                await asyncio.sleep(0.05)
            resp = await c.rpc(victim).dataservice_get_elements(task_id=old_task, wait=0.1)
            assert resp["elements"] is None and resp["end_of_sequence"], resp

    return test


test_frozen_worker_dropped_after_consumer_request_timeout = _frozen_worker_test(
    "consumer-request-timeout")
