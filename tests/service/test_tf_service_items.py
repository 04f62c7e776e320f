"""Items of docs/tf-compatibility.yaml that no other test checked: TensorFlow's server and
reader fields that are accepted here, each with what it does on Dask."""

from __future__ import annotations

import pytest
from _helpers import wait
from distributed import Client

import dask_dataservice as dds
from dask_dataservice.service.worker import PLUGIN_NAME as WORKER_PLUGIN

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


def test_worker_config_fields_and_data_transfer_protocol():
    """Re-expresses data_service_ops_test.testExplicitProtocolFromDatasetId: a worker started
    with ``data_transfer_protocol="grpc"`` and a reader that asks for it read ``range(10)``
    (elements travel over Dask's comms whatever the field says, and ``distribute`` takes the
    field too). ``heartbeat_interval_ms`` reaches the data worker's plugin: the default plugin the
    dispatcher pushes to a registering worker used to replace it (the interval was lost).
    ``DispatcherConfig``'s ``job_gc_check_interval_ms`` / ``job_gc_timeout_ms`` collect a named
    job whose iterator is gone, as data_service_ops_test.testGcUnusedJob (which sets them).
    An empty ``job_name`` is a ValueError, as data_service_ops_test.testEmptyJobName."""
    dispatcher = dds.DispatchServer(dds.DispatcherConfig(job_gc_check_interval_ms=50,
                                                         job_gc_timeout_ms=20))
    config = dds.WorkerConfig(dispatcher_address=dispatcher.target.split("://")[1],
                              heartbeat_interval_ms=250, data_transfer_protocol="grpc",
                              data_transfer_address="localhost:%port%")
    worker = dds.WorkerServer(config)
    try:
        range_ds = dds.Dataset.range(10)
        dataset_id = dds.register_dataset(dispatcher.target, range_ds)
        ds = dds.from_dataset_id(dataset_id=dataset_id, processing_mode="parallel_epochs",
                                 element_spec=range_ds.element_spec,
                                 service=dispatcher.target, data_transfer_protocol="grpc")
        assert list(ds.as_numpy_iterator()) == list(range(10))
        ds = range_ds.apply(dds.distribute(processing_mode="parallel_epochs",
                                           service=dispatcher.target,
                                           data_transfer_protocol="grpc"))
        assert list(ds.as_numpy_iterator()) == list(range(10))
        with pytest.raises(ValueError, match="job_name must be a non-empty string or None"):
            dds.from_dataset_id(dataset_id=dataset_id, processing_mode="parallel_epochs",
                                service=dispatcher.target, job_name="")
        tasks = worker.server.worker.extensions["dataservice"].tasks
        it = iter(range_ds.apply(dds.distribute("parallel_epochs", dispatcher.target,
                                                job_name="test")))
        assert next(it) == 0 and len(tasks) == 1
        it.close()
        wait(lambda: not tasks, timeout=10, what="the unused job's task to be dropped")
        with Client(dispatcher.target, set_as_default=False) as c:
            state = c.sync(c.scheduler.dataservice_state)
            assert list(state["workers"]) == [worker.worker_address]
        # the dispatcher pushed its own data-worker plugin at registration: the worker's,
        # with the configured interval, is the one that runs
        assert worker.server.worker.plugins[WORKER_PLUGIN].heartbeat_interval == 0.25
    finally:
        worker.stop()
        dispatcher.stop()
