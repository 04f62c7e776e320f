"""Waits that used to be silent: each warns within seconds and fails after a configurable
timeout with an error that says why; plus a registration that rides out a dispatcher restart
and an element that cannot travel."""

from __future__ import annotations

import logging
import threading

import pytest
from _helpers import PS, distribute, read
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.errors import DataServiceError
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

#: Holds the hung generator (module level: gen_cluster workers are in-process).
GATE = threading.Event()

FAST_NO_WORKERS = {"dataservice.client.no-workers-warning": "300ms",
                   "dataservice.client.no-workers-timeout": "2s"}


@gen_cluster(client=True, nthreads=[PS], config=FAST_NO_WORKERS)
async def test_only_parameter_servers_warns_then_fails_saying_why(c, s, ps, caplog):
    ds = await distribute(dds.Dataset.range(10), "parallel_epochs", c)
    with caplog.at_level(logging.WARNING, logger="dask_dataservice.service.client._reader"):
        with pytest.raises(DataServiceError, match="1 workers present, all with resource ps"):
            await read(ds)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no data worker" in m and "resource ps" in m for m in warnings), warnings


@gen_cluster(client=True, nthreads=[], config=FAST_NO_WORKERS)
async def test_no_worker_at_all_fails_saying_so(c, s):
    ds = await distribute(dds.Dataset.range(10), "parallel_epochs", c)
    with pytest.raises(DataServiceError, match="no worker is connected to the scheduler"):
        await read(ds)


def _hung_generator():
    yield 0
    GATE.wait()  # hangs until the test lets it go
    yield 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={"dataservice.client.stall-warning": "300ms",
                     "dataservice.client.stall-timeout": "2s"})
async def test_hung_pipeline_warns_naming_task_and_worker_then_fails(c, s, a, caplog):
    GATE.clear()
    ds = await distribute(dds.Dataset.from_generator(_hung_generator), "parallel_epochs", c)
    try:
        with caplog.at_level(logging.WARNING, logger="dask_dataservice.service.client._reader"):
            with pytest.raises(DataServiceError, match=f"on worker {a.address} has produced no "
                               "element .* gave up after dataservice.client.stall-timeout"):
                await read(ds)
    finally:
        GATE.set()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("task" in m and a.address in m and "may be hung" in m for m in warnings), warnings


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)],
             config={"dataservice.client.stall-warning": "200ms"})
async def test_slow_pipeline_only_warns_by_default(c, s, a, caplog):
    """No stall timeout by default: a slow pipeline is legal, it is only reported."""
    GATE.clear()
    ds = await distribute(dds.Dataset.from_generator(_hung_generator), "parallel_epochs", c)
    hit = threading.Event()

    class Release(logging.Handler):
        def emit(self, record):
            if "may be hung" in record.getMessage():
                hit.set()
                GATE.set()

    handler = Release()
    logger = logging.getLogger("dask_dataservice.service.client._reader")
    logger.addHandler(handler)
    try:
        assert await read(ds) == [0, 1]
    finally:
        logger.removeHandler(handler)
        GATE.set()
    assert hit.is_set()


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def _to_unpicklable(x):
    return _Unpicklable() if x == 3 else x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_unpicklable_element_names_its_type_task_and_pipeline(c, s, a):
    ds = await distribute(dds.Dataset.range(5).map(_to_unpicklable), "parallel_epochs", c)
    with pytest.raises(TypeError) as info:
        await read(ds)
    message = str(info.value)
    assert "test_silent_waits._Unpicklable" in message
    assert "this object refuses to be pickled" in message
    assert "_to_unpicklable" in message and "range" in message.lower(), message
    assert "task" in message
    assert "ElementBatch" not in message


def test_register_dataset_rides_out_a_dispatcher_restart():
    """The dispatcher stops and comes back on the same port while a registration retries:
    the registration answers, instead of raising a raw CommClosedError / OSError."""
    import dask

    first = dds.DispatchServer()
    port = int(first.target.rsplit(":", 1)[1])
    retrying = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record):
            if "dataset registration failed" in record.getMessage():
                retrying.set()

    handler = Watch()
    logger = logging.getLogger("dask_dataservice.service.client._connection")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    second = None
    result: dict = {}
    try:
        # the client waits 40 s for its scheduler to come back (Client(timeout=): with the
        # 1 s the test gives connection attempts, the client closed itself before the second
        # dispatcher was up in a fresh-clone CI run), while its requests' connection attempts
        # give up after 1 s (its pool's timeout), so the registration retries
        with dask.config.set({"distributed.comm.timeouts.connect": "1s",
                              "dataservice.client.dispatcher-timeout": "40s"}), \
                Client(first.target, set_as_default=False, timeout="40s") as client:
            client.rpc.timeout = 1
            first_id = dds.register_dataset(client, dds.Dataset.range(7))
            first.stop()

            def register():
                try:
                    result["id"] = dds.register_dataset(client, dds.Dataset.range(8))
                except BaseException as e:  # noqa: BLE001 - asserted below
                    result["error"] = e

            thread = threading.Thread(target=register)
            thread.start()
            try:
                assert retrying.wait(30), "the registration never retried"
                second = dds.DispatchServer(dds.DispatcherConfig(port=port))
            finally:
                thread.join(60)
            assert "error" not in result, repr(result.get("error"))
            assert isinstance(result["id"], str) and isinstance(first_id, str)
            # idempotent: the same pipeline again gets the same id from the new dispatcher
            assert dds.register_dataset(client, dds.Dataset.range(8)) == result["id"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        first.stop()
        if second is not None:
            second.stop()


def test_restarted_dispatcher_whose_plain_workers_did_not_come_back(tmp_path):
    """A fault-tolerant dispatcher restarted; its plain workers exited with the old scheduler:
    the reader's error says so (instead of waiting forever for workers)."""
    import asyncio

    import dask
    from _helpers import poll
    from distributed import Scheduler, Worker

    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin

    def dispatcher():
        return DispatcherPlugin(fault_tolerant_mode=True, work_dir=str(tmp_path))

    async def main():
        async with Scheduler(port=0, dashboard_address=":0") as s:
            plugin = dispatcher()
            await s.register_scheduler_plugin(plugin, idempotent=False)
            port = s.port
            async with Worker(s.address, nthreads=1), \
                    Client(s.address, asynchronous=True) as c:
                await poll(lambda: plugin.state.list_workers(), what="a data worker")
                dataset_id = await dds.register_dataset(c, dds.Dataset.range(10))
                # a named job read once: its iteration (kept for job-gc-timeout) names the worker
                assert [x async for x in dds.from_dataset_id(
                    "parallel_epochs", c, dataset_id, job_name="j")] == list(range(10))
        async with Scheduler(port=port, dashboard_address=":0") as s:
            await s.register_scheduler_plugin(dispatcher(), idempotent=False)
            async with Client(s.address, asynchronous=True) as c:
                ds = dds.from_dataset_id("parallel_epochs", c, dataset_id)
                with pytest.raises(DataServiceError, match="did not come back .* supervised"):
                    async for _ in ds:
                        pass

    with dask.config.set(FAST_NO_WORKERS):
        asyncio.run(main())


def test_register_dataset_against_a_dispatcher_that_stays_away_says_so():
    import dask

    server = dds.DispatchServer()
    try:
        # the client keeps trying to reconnect for longer than the registration waits
        # (Client(timeout=)); a client that gave up first would be a closed client, whose
        # error says so (tests/service/client/test_dead_scheduler.py)
        with dask.config.set({"distributed.comm.timeouts.connect": "500ms",
                              "dataservice.client.dispatcher-timeout": "1s"}), \
                Client(server.target, set_as_default=False, timeout="30s") as client:
            dds.register_dataset(client, dds.Dataset.range(3))
            server.stop()
            with pytest.raises(DataServiceError, match="dataset registration: the data service "
                               "at .* did not come back within dataservice.client.dispatcher"):
                dds.register_dataset(client, dds.Dataset.range(4))
    finally:
        server.stop()


def _big(x):
    import numpy as np

    return np.full(1 << 20, x, dtype=np.float64)  # 8 MiB: a two-element batch is offloaded


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_big_batches_are_serialized_off_the_loop_and_arrive(c, s, a):
    ds = await distribute(dds.Dataset.range(6).map(_big), "parallel_epochs", c)
    out = await read(ds)
    assert sorted(float(x[0]) for x in out) == [0, 1, 2, 3, 4, 5]
    assert all(x.shape == (1 << 20,) for x in out)
