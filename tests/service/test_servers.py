"""The seed-compatible servers, preloads, and a dispatcher that goes away."""

from __future__ import annotations

import pytest
from _helpers import poll as _poll  # noqa: E402
from _helpers import wait
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.errors import DataServiceError
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME
from dask_dataservice.service.worker import PLUGIN_NAME as WORKER_PLUGIN
from dask_dataservice.testing import gen_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


def test_seed_example_as_written():
    """tf.data service's module example, with our names."""
    dispatcher = dds.DispatchServer()
    worker = dds.WorkerServer(
        dds.WorkerConfig(dispatcher_address=dispatcher.target.split("://")[1])
    )
    try:
        dataset = dds.Dataset.range(10)
        dataset = dataset.apply(
            dds.distribute(processing_mode=dds.ShardingPolicy.OFF, service=dispatcher.target)
        )
        assert list(dataset.as_numpy_iterator()) == list(range(10))
        assert dispatcher.target.startswith("tcp://127.0.0.1:")
        assert worker.worker_address.startswith("tcp://127.0.0.1:")
    finally:
        worker.stop()
        dispatcher.stop()
    dispatcher.join(timeout=1)  # stopped: returns at once


def test_servers_dynamic_two_workers_and_context_managers():
    with dds.DispatchServer(dds.DispatcherConfig(port=0)) as dispatcher:
        address = dispatcher._address
        with dds.WorkerServer(dds.WorkerConfig(address)), dds.WorkerServer(dds.WorkerConfig(address)):
            with Client(dispatcher.target) as c:
                c.wait_for_workers(2)
                ds = dds.Dataset.range(5000).apply(dds.distribute("distributed_epoch", c))
                assert sorted(ds) == list(range(5000))
                # a data worker registers with the dispatcher from its plugin, a moment after
                # Dask counts it (the read needs only one): wait for the dispatcher's count
                wait(lambda: len(c.sync(c.scheduler.dataservice_state)["workers"]) == 2,
                     what="both data workers registered with the dispatcher")


@pytest.mark.pure
def test_config_validation():
    with pytest.raises(ValueError, match="needs a work_dir"):
        dds.DispatchServer(dds.DispatcherConfig(fault_tolerant_mode=True))
    with pytest.raises(TypeError, match="must be a DispatcherConfig"):
        dds.DispatchServer({"port": 0})
    with pytest.raises(ValueError, match="dispatcher_address is required"):
        dds.WorkerServer(dds.WorkerConfig(dispatcher_address=""))
    with pytest.raises(ValueError, match="protocol must be"):
        dds.DispatchServer(dds.DispatcherConfig(protocol="udp"))


@gen_cluster(
    client=True,
    scheduler_kwargs={"preload": ["dask_dataservice"]},
    worker_kwargs={"preload": ["dask_dataservice"]},
)
async def test_preload_installs_both_halves(c, s, a, b):
    assert PLUGIN_NAME in s.plugins
    assert "dataservice_get_split" in s.handlers
    for w in (a, b):
        assert WORKER_PLUGIN in w.plugins
        assert "dataservice_get_elements" in w.handlers
    # an asynchronous client: registration is awaited, iteration is `async for`
    ds = await dds.distribute("parallel_epochs", c)(dds.Dataset.range(100))
    with pytest.raises(RuntimeError, match="use `async for"):
        list(ds)
    out = [x async for x in ds]
    assert sorted(out) == sorted(list(range(100)) * 2)


@gen_cluster(client=True, scheduler_kwargs={"preload": ["dask_dataservice"]})
async def test_scheduler_preload_alone_reaches_workers(c, s, a, b):
    """Workers started without the preload still get the data-worker plugin."""
    await c.wait_for_workers(2)
    for w in (a, b):
        await _poll(lambda w=w: WORKER_PLUGIN in w.plugins)
    assert s.plugins[PLUGIN_NAME].scheduler is s


def test_dispatcher_dies_mid_iteration_gives_clear_error():
    import dask

    with dask.config.set({"dataservice.client.connect-timeout": "2s",
                          "dataservice.client.dispatcher-timeout": "1s"}):
        _dispatcher_dies_mid_iteration()


def _dispatcher_dies_mid_iteration():
    dispatcher = dds.DispatchServer()
    worker = dds.WorkerServer(dds.WorkerConfig(dispatcher._address))
    ds = dds.Dataset.range(10**9).apply(dds.distribute("parallel_epochs", dispatcher.target))
    it = iter(ds)
    assert next(it) == 0
    worker.stop()
    dispatcher.stop()
    with pytest.raises(DataServiceError, match="lost contact with the data service"):
        for _ in it:
            pass


def test_stopped_dispatcher_then_a_new_one_at_the_same_address():
    """issue 9, 2.12: readers that connected by address string get a clear error after
    DispatchServer.stop(), and a later server at the same address works."""
    import dask

    with dask.config.set({"dataservice.client.connect-timeout": "2s"}):
        _stopped_then_new_server()


def _stopped_then_new_server():
    dispatcher = dds.DispatchServer()
    port = int(dispatcher._address.rsplit(":", 1)[1])
    worker = dds.WorkerServer(dds.WorkerConfig(dispatcher._address))
    ds = dds.Dataset.range(10).apply(dds.distribute("parallel_epochs", dispatcher.target))
    assert list(ds) == list(range(10))
    worker.stop()
    dispatcher.stop()
    with pytest.raises(DataServiceError, match="cannot reach the data service"):
        list(ds)
    dispatcher = dds.DispatchServer(dds.DispatcherConfig(port=port))
    worker = dds.WorkerServer(dds.WorkerConfig(dispatcher._address))
    try:
        again = dds.Dataset.range(5).apply(dds.distribute("parallel_epochs", dispatcher.target))
        assert list(again) == list(range(5))
    finally:
        worker.stop()
        dispatcher.stop()


def test_worker_timeout_ms_sets_the_dispatchers_data_worker_deadline():
    """TF's ``worker_timeout_ms`` is no longer ignored: it is the heartbeat deadline after
    which a silent data worker is dropped."""
    with dds.DispatchServer(dds.DispatcherConfig(worker_timeout_ms=1234)) as dispatcher:
        assert dispatcher.server.plugins[PLUGIN_NAME]._liveness.timeout == pytest.approx(1.234)
    with dds.DispatchServer() as dispatcher:
        assert dispatcher.server.plugins[PLUGIN_NAME]._liveness.timeout == pytest.approx(10.0)
