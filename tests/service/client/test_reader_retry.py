"""A broken connection between a reader and a live data worker loses no element (issue 12).

The worker keeps each reply until the reader acknowledges it; a request whose connection
broke is sent again with its number and answered with the same elements. Before, the reader
took any failed request for a dead worker and ended that task's read silently, with its
elements missing (found through torch's SIGCHLD handler raising into the event loop)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _helpers import distribute, read

from dask_dataservice.data import Dataset
from dask_dataservice.service.client import _install_async
from dask_dataservice.testing import gen_cluster

pytestmark = pytest.mark.cluster


def _work(i: int) -> int:
    np.linalg.svd(np.ones((24, 24)))  # a pipeline slower than its reader: requests wait
    return i


def _lose_some_replies(worker) -> None:
    """Every fifth reply of ``worker``'s element port is made (and kept) but lost on its way:
    the port's connections are dropped before it is written (a deterministic loss: a
    connection broken from outside mostly breaks between replies)."""
    real = worker.handlers["dataservice_get_elements"]
    server = worker.extensions["dataservice"]._port.server
    calls = 0

    async def lossy(**kwargs):
        nonlocal calls
        reply = await real(**kwargs)
        calls += 1
        if calls % 5 == 0:
            server.drop_connections()
        return reply

    worker.handlers["dataservice_get_elements"] = lossy


@pytest.mark.parametrize("path", ["comms", "element-port"])
def test_broken_connections_to_live_data_workers_lose_no_element(path):
    """Both transports: distributed's comms (``client.fast-path`` false) and the workers'
    element ports (issue 25), each connection broken often while a request is in flight."""

    @gen_cluster(client=True, nthreads=[("", 1)] * 2, timeout=120,
                 config={"dataservice.client.request-elements": 8,
                         "dataservice.client.fast-path": path == "element-port"})
    async def run(c, s, a, b):
        n = 2000
        if path == "element-port":
            await _install_async(c)
            for w in (a, b):
                _lose_some_replies(w)
        ds = await distribute(Dataset.range(n).map(_work), "distributed_epoch", c)

        def replayed() -> int:
            return sum(w.extensions["dataservice"].stats["requests_replayed"] for w in (a, b))

        def break_all() -> int:
            broken = 0
            for w in (a, b):
                if path == "comms":
                    for comm in list(c.rpc.occupied.get(w.address, ())):
                        comm.abort()
                        broken += 1
                else:
                    server = w.extensions["dataservice"]._port.server
                    broken += len(server._protocols)
                    server.drop_connections()
            return broken

        reading = asyncio.ensure_future(read(ds))
        broken = 0
        while not reading.done():  # break every connection with a request in flight, often
            broken += break_all()
            await asyncio.wait([reading], timeout=0.005)
        got = await reading
        assert sorted(got) == list(range(n))  # none lost, none twice
        assert broken > 0
        assert replayed() > 0  # some replies were lost on the way and answered again

    run()


# The turn/keep/replay decisions themselves: tests/service/worker/test_worker_core.py
# (test_kept_replies_replay_until_acknowledged).


@pytest.mark.parametrize("ack", [None, -1])
@gen_cluster(client=True, nthreads=[("", 1)])
async def test_replies_are_kept_only_for_readers_that_acknowledge(c, s, a, ack):
    ds = await distribute(Dataset.range(10**9), "distributed_epoch", c)
    it = iter(ds)
    try:
        assert await asyncio.to_thread(next, it) == 0  # the task is live while `it` reads
        plugin = a.extensions["dataservice"]
        [runner] = plugin.tasks.values()
        # `it` reads the same task meanwhile: a request may find its buffer empty ("nothing
        # yet" after the long poll, a reply never kept) or take fewer than 3 elements (seen
        # in a CI run on a loaded machine). Ask again until a reply has elements.
        deadline = a.loop.time() + 60
        for seq in range(10**6):
            resp = await a.rpc(a.address).dataservice_get_elements(
                task_id=runner.task_id, consumer=99, seq=seq, ack=ack, max_elements=3,
                job_token=runner.task.get("job_token"))
            assert resp["status"] == "OK" and not resp["end_of_sequence"], resp
            if resp["elements"] is not None:
                break
            assert a.loop.time() < deadline, "no element for consumer 99 within 60 s"
        assert 1 <= len(resp["elements"].items) <= 3
        # a reader that sends no ack (an older version) gets nothing kept for it
        assert plugin.core.replies_kept((runner.task_id, 99)) == (0 if ack is None else 1)
    finally:
        await asyncio.to_thread(it.close)
