"""Elements on the data workers' element ports (issue 25, target 1): the reads of a tcp://
cluster go through them, lose and repeat nothing when their connections break, fall back to
distributed's comms where a port cannot be reached, and a stranger on a port gets nothing.

Clusters are in-process (``gen_cluster``, tcp between the servers); the element ports are
real listening sockets of the workers.
"""

from __future__ import annotations

import asyncio
import collections
import time
import traceback

import dask
import numpy as np
import pytest
from _helpers import distribute, free_port, poll, read, wait

import dask_dataservice as dds
from dask_dataservice import _wire
from dask_dataservice.dashboard._worker import FIGURES_READY
from dask_dataservice.errors import JobAccessDeniedError
from dask_dataservice.service.client import _data_plane, _install_async
from dask_dataservice.service.worker._element_port import ElementPort
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


def _server(worker) -> _wire.StreamServer:
    server = worker.extensions["dataservice"]._port.server
    assert server is not None, f"{worker.address} has no element port"
    return server


def _row(i: int) -> np.ndarray:
    return np.full(256, i, np.int64)


@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_a_tcp_clusters_elements_travel_on_the_element_ports(c, s, a, b):
    ds = await distribute(dds.Dataset.range(3000).map(_row), "distributed_epoch", c)
    out = await read(ds)
    assert sorted(int(x[0]) for x in out) == list(range(3000))
    assert all(x.shape == (256,) and x.flags.writeable for x in out)
    for w in (a, b):  # both workers served elements, every request through the port
        served = w.extensions["dataservice"].stats["batches_served"]
        assert served and _server(w).answered >= served
    # the dashboard's figures say so (once it polls the workers: their figures are ready)
    await poll(lambda: all(s.workers[w.address].metrics.get(FIGURES_READY) for w in (a, b)),
               what="the workers' dashboard figures")
    status = await dds.status(c)
    for w in (a, b):
        port = status["workers"][w.address]["element_port"]
        assert port["port"] == _server(w).port and port["requests"] == _server(w).answered


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_without_the_fast_path_reads_keep_distributeds_comms(c, s, a):
    await _install_async(c)
    before = _server(a).answered
    with dask.config.set({"dataservice.client.fast-path": False}):
        ds = await distribute(dds.Dataset.range(500), "parallel_epochs", c)
        assert sorted(await read(ds)) == list(range(500))
    assert _server(a).answered == before


@gen_cluster(client=True, nthreads=[("", 1)] * 2,
             config={"dataservice.client.request-elements": 40})
async def test_broken_element_connections_lose_and_repeat_nothing(c, s, a, b):
    """Every 150 elements the consumer takes, both workers drop every connection of their
    element ports: the fetches reconnect and send their requests again with their ``seq``,
    and the workers answer with the replies they kept (``data_service_ft_test``'s
    ``testWorkerRestart`` semantics, for a connection instead of a process)."""
    ds = await distribute(dds.Dataset.range(4000).map(_row), "distributed_epoch", c)
    loop = asyncio.get_running_loop()

    def drop() -> None:
        for w in (a, b):
            _server(w).drop_connections()

    def consume() -> list[int]:
        out = []
        for i, x in enumerate(ds):
            out.append(int(x[0]))
            if i % 150 == 149:
                loop.call_soon_threadsafe(drop)
        return out

    out = await asyncio.to_thread(consume)
    assert collections.Counter(out) == collections.Counter(range(4000))  # once each
    assert sum(_server(w).connections for w in (a, b)) >= 4  # it did reconnect


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_an_unreachable_element_port_falls_back_to_the_comms(c, s, a):
    """Only Dask's ports may be open: a worker whose element port cannot be reached is read
    through distributed's comms, and is not tried again at each read."""
    await _install_async(c)
    closed = free_port()  # nothing listens there
    a.handlers["dataservice_element_port"] = lambda: {"status": "OK", "port": closed}
    _data_plane._PORTS.pop(a.address, None)
    try:
        for _ in range(2):
            ds = await distribute(dds.Dataset.range(300), "distributed_epoch", c)
            assert sorted(await read(ds)) == list(range(300))
        until, where = _data_plane._PORTS[a.address]
        assert where is None and until > time.monotonic()
        assert _server(a).answered == 0
    finally:
        _data_plane._PORTS.pop(a.address, None)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_a_stranger_on_an_element_port_gets_nothing(c, s, a):
    """A request without the job's token is refused with the error the comms give; a stream
    that announces a huge message is closed before anything is allocated; the worker goes on
    serving its consumers."""
    ds = await distribute(dds.Dataset.range(10**9), "distributed_epoch", c)
    it = iter(ds)
    try:
        assert await asyncio.to_thread(next, it) == 0  # the task is live while `it` reads
        host, port = _data_plane._PORTS[a.address][1]
        [runner] = a.extensions["dataservice"].tasks.values()
        stream = await _data_plane.ElementStream.connect(a.address, (host, port), 5)
        try:
            with pytest.raises(JobAccessDeniedError):
                await stream.request(task_id=runner.task_id, max_elements=10, wait=0.1,
                                     job_token="not-the-token")
        finally:
            stream.close()
    finally:
        await asyncio.to_thread(it.close)

    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_wire.PREFIX.pack(2**31, 1))
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the worker
    writer.close()

    ds = await distribute(dds.Dataset.range(200), "distributed_epoch", c)
    assert sorted(await read(ds)) == list(range(200))


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_a_user_error_reaches_the_consumer_through_the_element_port(c, s, a):
    def boom(x):
        if x == 7:
            raise ZeroDivisionError(f"element {x} is bad")
        return x

    ds = await distribute(dds.Dataset.range(50).map(boom), "distributed_epoch", c)
    with pytest.raises(ZeroDivisionError, match="element 7 is bad") as info:
        await read(ds)
    assert "boom" in "".join(traceback.format_exception(info.value))  # the remote frame
    assert _server(a).answered > 0


def test_a_worker_off_tcp_has_no_element_port():
    """In-process clusters (and TLS ones, ``tests/service/test_tls.py``) keep the comms."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        dds.install(client)
        ports = client.run(lambda dask_worker: dask_worker.extensions["dataservice"]._port.port)
        assert list(ports.values()) == [None]
        assert all(a.startswith("inproc://") for a in ports)
        wait(lambda: dds.status(client)["workers"], what="the dashboard's first figures")
        assert [w["element_port"] for w in dds.status(client)["workers"].values()] == [None]
        ds = dds.Dataset.range(100).apply(dds.distribute("distributed_epoch", client))
        assert sorted(ds) == list(range(100))


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_a_worker_whose_element_port_moved_is_asked_again(c, s, a):
    """A worker restarted at its address listens on another element port: the next read
    asks it where, instead of taking the remembered port for an unreachable one."""
    ds = await distribute(dds.Dataset.range(100), "distributed_epoch", c)
    assert sorted(await read(ds)) == list(range(100))
    plugin = a.extensions["dataservice"]
    old = _data_plane._PORTS[a.address][1]
    await plugin._port.close()  # what a restart at the same address does to the port
    plugin._port = await ElementPort.open(a)
    assert plugin._port.port != old[1]
    assert sorted(await read(ds)) == list(range(100))
    assert _data_plane._PORTS[a.address][1] == (old[0], plugin._port.port)
    assert _server(a).answered > 0
