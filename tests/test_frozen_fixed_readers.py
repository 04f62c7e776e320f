"""Coordinated reads and the cross-trainer cache with a frozen (SIGSTOP) data worker.

Both read a fixed list of tasks: every round (turn) needs every task. A frozen worker keeps
its Dask comms open, so without a request deadline the read waited forever. Now their
requests have the DYNAMIC reader's deadline: after ``client.request-timeout`` the consumer
reports the worker, the dispatcher's probe gets no answer and drops it, and the read ends
with an error naming the task and the worker, within seconds (the dispatcher's own
heartbeat deadline is set out of reach, so only the consumer's path can notice).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import pytest
from _helpers import poll
from distributed import Nanny

import dask_dataservice as dds
from dask_dataservice.errors import DataServiceError
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

CONFIG = {
    "distributed.scheduler.allowed-failures": 0,
    "dataservice.dispatcher.worker-timeout": "300s",
    "dataservice.client.request-timeout": "2s",
    "dataservice.dispatcher.worker-probe-timeout": "2s",
}

READS = {
    "coordinated": dict(job_name="coordinated", consumer_index=0, num_consumers=1),
    "cross-trainer": dict(job_name="cached", cross_trainer_cache=dds.CrossTrainerCache("t1")),
}


@pytest.mark.parametrize("kind", sorted(READS))
def test_a_frozen_worker_ends_the_read_with_an_error(kind):
    @gen_cluster(client=True, Worker=Nanny, nthreads=[("", 1), ("", 1)], timeout=100,
                 config=CONFIG)
    async def test(c, s, a, b):
        victim_pid = a.process.process.pid
        victim = a.worker_address
        dataset_id = await asyncio.to_thread(
            dds.register_dataset, c, dds.Dataset.range(10**6).repeat())
        ds = dds.from_dataset_id("distributed_epoch", c, dataset_id, **READS[kind])
        plugin = s.plugins[PLUGIN_NAME]
        it = iter(ds)
        try:
            first = await asyncio.to_thread(lambda: list(itertools.islice(it, 100)))
            assert len(first) == 100
            await poll(lambda: len([t for i in plugin.state.list_iterations()
                                    for t in plugin.state.tasks_for_iteration(i.iteration_id)])
                       == 2, what="a task on each worker")
            os.kill(victim_pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                with pytest.raises(DataServiceError, match=r"stopped answering") as info:
                    await asyncio.wait_for(asyncio.to_thread(lambda: list(it)), 60)
                took = time.monotonic() - frozen_at
            finally:
                os.kill(victim_pid, signal.SIGCONT)
            assert victim in str(info.value)
            assert victim in plugin._liveness.dropped or victim not in [
                w.address for w in plugin.state.list_workers()]
            print(f"[{kind}] the read failed {took:.1f}s after the freeze")
            assert took < 30, f"the read took {took:.1f}s to fail after the freeze"
        finally:
            await asyncio.to_thread(it.close)

    test()
