"""TensorFlow's service addresses and server configs (issue 24, section 2, second bullet).

A TensorFlow program moves over with its addresses unchanged: ``service="grpc://host:port"``
(``FLAGS.tf_data_service_address``), a bare ``"host:port"`` and the ``(protocol, address)``
tuple, wherever ``service=`` is taken; ``WorkerConfig(worker_address="host:%port%")``;
``dispatcher_timeout_ms``; ``DispatcherConfig`` with TF's fields in TF's order; and TF's rule
for a ``dataset_id`` registered again (no new dataset). Each cluster test starts one
in-process dispatcher and one worker (servers in threads of this process, as TF's tests use
in-process servers; the leak checks allow no server to outlive its test).
"""

from __future__ import annotations

import dataclasses
import time

import dask
import pytest
from _helpers import free_port, wait

import dask_dataservice as dds
from dask_dataservice.errors import DataServiceError
from dask_dataservice.service.client import _connection
from dask_dataservice.service.client._address import dask_protocol
from dask_dataservice.service.dispatcher.plugin import PLUGIN_NAME

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

#: TensorFlow's ``tf.data.experimental.service.DispatcherConfig`` fields, in its order.
TF_DISPATCHER_FIELDS = ["port", "protocol", "work_dir", "fault_tolerant_mode",
                        "worker_addresses", "job_gc_check_interval_ms", "job_gc_timeout_ms",
                        "worker_timeout_ms", "worker_max_concurrent_snapshots"]
#: TensorFlow's ``WorkerConfig`` fields, in its order.
TF_WORKER_FIELDS = ["dispatcher_address", "worker_address", "port", "protocol",
                    "heartbeat_interval_ms", "dispatcher_timeout_ms", "data_transfer_protocol",
                    "data_transfer_address"]


@pytest.fixture
def servers():
    """A dispatcher built from a positional, TF-ordered DispatcherConfig, and a worker that
    names it by ``grpc://`` and advertises ``localhost:%port%``."""
    config = dds.DispatcherConfig(0, "grpc", None, False, None, 200, 60_000, 4321, 2)
    dispatcher = dds.DispatchServer(config)
    worker = dds.WorkerServer(dds.WorkerConfig(
        dispatcher_address=f"grpc://{dispatcher._address}", worker_address="localhost:%port%"))
    try:
        yield dispatcher, worker
    finally:
        worker.stop()
        dispatcher.stop()


def test_service_addresses_as_tensorflow_writes_them(servers):
    """TF: data_service_ops_test.py testDistributeExplicitProtocol (``"grpc://" + address``),
    testRegisteringDatasetAsTfFunction (a ``(protocol, address)`` tuple) and testFromDatasetId
    (register, then read by id): each form reaches the same cluster, the elements exactly."""
    dispatcher, _ = servers
    location = dispatcher._address  # "127.0.0.1:port", TF's dispatcher._address
    for service in (f"grpc://{location}", location, ("grpc", location), ("tcp", location),
                    f"grpc+local://{location}"):
        assert _connection.service_address(service) == f"tcp://{location}", service
    ds = dds.Dataset.range(10).apply(dds.distribute("parallel_epochs", f"grpc://{location}"))
    assert list(ds) == list(range(10))
    dataset_id = dds.register_dataset(("grpc", location), dds.Dataset.range(5).map(lambda x: -x))
    key, _, secret = dataset_id.rpartition(":")  # TF's ids are strings; ours hold a secret
    assert key.isdigit() and secret
    for service in (f"grpc://{location}", location, ("grpc", location)):
        read = dds.from_dataset_id("parallel_epochs", service, dataset_id)
        assert list(read) == [0, -1, -2, -3, -4]
    # an integer id is taken (TF's older ids), and refused as any bare id: it holds no secret
    with pytest.raises(dds.DatasetNotFoundError, match=f"no dataset has the id '{key}' with "
                       "this secret"):
        list(dds.from_dataset_id("parallel_epochs", location, int(key)))


@pytest.mark.pure
def test_bad_service_values():
    """TF: data_service_ops_test.py testDistributeNonStringAddresses,
    testDistributeEmptyAddress and testDistributeInvalidProtocol. Differences on purpose: a
    non-string is a TypeError (Python's type for a wrong type; TF raises ValueError), and an
    unknown protocol fails at once, naming the ones that work (TF: NotFoundError at the read)."""
    ds = dds.Dataset.range(10)
    with pytest.raises(TypeError, match="service must be a distributed.Client or a scheduler "
                       "address such as 'grpc://host:8786'"):
        ds.apply(dds.distribute("parallel_epochs", service=1))
    with pytest.raises(ValueError, match="^service must not be empty"):
        ds.apply(dds.distribute("parallel_epochs", service=""))
    with pytest.raises(ValueError, match="^unknown protocol 'grp': use 'grpc'"):
        ds.apply(dds.distribute("parallel_epochs", service="grp://localhost:5000"))
    with pytest.raises(ValueError, match="more than one '://'"):
        dds.from_dataset_id("parallel_epochs", "grpc://tcp://localhost:5000", "1000:x")
    with pytest.raises(ValueError, match=r"must be \(protocol, address\), two strings"):
        dds.from_dataset_id("parallel_epochs", ("grpc",), "1000:x")
    with pytest.raises(ValueError, match="has no protocol of its own"):
        dds.from_dataset_id("parallel_epochs", ("grpc", "tcp://localhost:5000"), "1000:x")
    with pytest.raises(ValueError, match="names no address"):
        dds.from_dataset_id("parallel_epochs", "grpc://", "1000:x")


@pytest.mark.pure
def test_grpc_is_the_clusters_own_protocol():
    """TF's ``"grpc"`` (and a bare address, TF's default protocol) is tcp, or tls where this
    process talks TLS to the scheduler: Dask requires encryption, or a client of
    ``tls://host:port`` is open (``tests/service/test_tls.py`` reads a TLS cluster so)."""
    assert dask_protocol("grpc") == dask_protocol(None) == "tcp"
    assert dask_protocol("grpc+tls") == dask_protocol("tls") == "tls"
    assert dask_protocol("grpc", "h:1", known=["tls://h:1"]) == "tls"
    assert dask_protocol("grpc", "h:1", known=["tls://h:2", "tcp://h:1"]) == "tcp"
    with dask.config.set({"distributed.comm.require-encryption": True}):
        assert dask_protocol("grpc") == "tls"
        assert _connection.service_address("h:1") == "tls://h:1"
        assert _connection.service_address(("grpc", "h:1")) == "tls://h:1"
        assert _connection.service_address("tcp://h:1") == "tcp://h:1"  # as written


def test_dispatcher_config_fields_are_tensorflows_in_its_order(servers):
    """TF: server_lib_test.py testStartDispatcherWithPortConfig and its siblings build
    ``DispatcherConfig`` by keyword; TF's own code (and users) also build it positionally, so
    the fields are TF's, in TF's order (``worker_max_concurrent_snapshots`` included), ours
    after. The fixture's dispatcher was built positionally: each value landed in its field."""
    names = [f.name for f in dataclasses.fields(dds.DispatcherConfig)]
    assert names[:len(TF_DISPATCHER_FIELDS)] == TF_DISPATCHER_FIELDS
    assert names[len(TF_DISPATCHER_FIELDS):] == ["client_timeout_ms", "host"]
    names = [f.name for f in dataclasses.fields(dds.WorkerConfig)]
    assert names[:len(TF_WORKER_FIELDS)] == TF_WORKER_FIELDS
    dispatcher, _ = servers
    config = dispatcher.config
    assert (config.protocol, config.job_gc_check_interval_ms, config.job_gc_timeout_ms,
            config.worker_timeout_ms, config.worker_max_concurrent_snapshots) == \
        ("grpc", 200, 60_000, 4321, 2)
    plugin = dispatcher.server.plugins[PLUGIN_NAME]
    assert (plugin.gc_interval, plugin.job_gc_timeout, plugin.worker_timeout) == \
        pytest.approx((0.2, 60.0, 4.321))
    assert dispatcher.target.startswith("tcp://127.0.0.1:")  # "grpc": the cluster's tcp
    for bad in (-1, "2", True, 1.5):
        with pytest.raises(ValueError, match="worker_max_concurrent_snapshots must be an int "
                           r">= 0 \(0: the default\), got"):
            dds.DispatcherConfig(worker_max_concurrent_snapshots=bad)


def test_worker_address_port_placeholder(servers):
    """TF: ``WorkerConfig(worker_address="localhost:%port%")`` (TF's default worker address;
    server_lib_test.py testStartWorkerWithPortConfig checks the address a worker reports):
    ``%port%`` becomes the port the worker bound, and the dispatcher, the scheduler and
    readers know the worker by that address (its host resolved, as Dask's scheduler does)."""
    dispatcher, worker = servers
    bound = worker.server.worker.listener.contact_address
    assert bound.startswith("tcp://127.0.0.1:")
    assert worker.worker_address == bound  # "localhost:<bound port>", resolved
    assert worker.server.worker.contact_address == bound
    assert list(dispatcher.server.workers) == [bound]
    plugin = dispatcher.server.plugins[PLUGIN_NAME]
    wait(lambda: plugin.state.list_workers(), what="the worker's first heartbeat")
    assert [w.address for w in plugin.state.list_workers()] == [bound]
    with pytest.raises(ValueError, match="cannot parse worker_address 'h:x': use 'host', "
                       "'host:port' or 'host:%port%'"):
        dds.WorkerServer(dds.WorkerConfig(dispatcher._address, worker_address="h:x"))


def test_dispatcher_timeout_ms_bounds_a_workers_start():
    """TF's ``WorkerConfig.dispatcher_timeout_ms``: how long a worker tries to reach its
    dispatcher before it reports an error (TF has no test of it; its doc: "How long, in
    milliseconds, to retry requests to the dispatcher before giving up and reporting an
    error"). Nothing listens at the address: the start fails after the timeout, naming it."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(DataServiceError) as info:
        dds.WorkerServer(dds.WorkerConfig(f"127.0.0.1:{port}", dispatcher_timeout_ms=300))
    elapsed = time.monotonic() - start
    assert str(info.value) == (f"the data worker could not reach its dispatcher at "
                               f"tcp://127.0.0.1:{port} within dispatcher_timeout_ms=300")
    assert 0.3 <= elapsed < 10, elapsed
    for bad in (0, -5, "300", True):
        with pytest.raises(ValueError, match="dispatcher_timeout_ms must be a positive number"):
            dds.WorkerConfig("127.0.0.1:1", dispatcher_timeout_ms=bad)


def test_a_dataset_id_in_use_registers_nothing_new(servers):
    """TF's ``register_dataset(..., dataset_id=...)``: "If a dataset with a matching ID already
    exists, no new dataset is registered" (dispatcher_impl.cc GetOrRegisterDataset /
    FindDataset, and validate_utils.cc for the structure check; data_service_ops_test.py
    testRegisterEquivalentDatasets / testRegisterDifferentDatasets for registration without an
    id). Another pipeline under a name in use gets the name's id and reads the first
    pipeline's elements; one of another structure is refused, naming the difference; with
    registration keys, only the same key shares a name."""
    dispatcher, _ = servers
    service = dispatcher.target
    plugin = dispatcher.server.plugins[PLUGIN_NAME]
    before = len(plugin.state.list_datasets())
    first = dds.register_dataset(service, dds.Dataset.range(10), dataset_id="shared")
    assert first.startswith("shared:")
    other = dds.register_dataset(service, dds.Dataset.range(10).map(lambda x: x + 100),
                                 dataset_id="shared")
    assert other == first
    assert len(plugin.state.list_datasets()) == before + 1  # no new dataset
    assert list(dds.from_dataset_id("parallel_epochs", service, other)) == list(range(10))
    with pytest.raises(ValueError, match=r"^dataset_id 'shared' is registered for a dataset of "
                       r"another structure: cardinality 10 \(registered\) vs 11\. "):
        dds.register_dataset(service, dds.Dataset.range(11), dataset_id="shared")
    with pytest.raises(ValueError, match=r"compression 'AUTO' \(registered\) vs None"):
        dds.register_dataset(service, dds.Dataset.range(10), dataset_id="shared",
                             compression=None)
    with dask.config.set({"dataservice.client.registration-key": "team-a"}):
        keyed = dds.register_dataset(service, dds.Dataset.range(4), dataset_id="keyed")
        assert dds.register_dataset(service, dds.Dataset.range(4).map(lambda x: x * 2),
                                    dataset_id="keyed") == keyed
    with dask.config.set({"dataservice.client.registration-key": "team-b"}), \
            pytest.raises(ValueError, match="^dataset_id 'keyed' is already registered for a "
                          "different dataset, under another registration key"):
        dds.register_dataset(service, dds.Dataset.range(4).map(lambda x: x * 2),
                             dataset_id="keyed")
    with pytest.raises(ValueError, match="under another registration key"):  # no key at all
        dds.register_dataset(service, dds.Dataset.range(4), dataset_id="keyed")
    assert len(plugin.state.list_datasets()) == before + 2


@pytest.mark.pure
def test_worker_address_forms():
    """``WorkerConfig.worker_address`` as TF writes it: ``host:%port%`` (TF's default form), a
    bare host (the same), a fixed port (advertised as given, as TF does: a port forward's),
    TF's ``grpc://`` prefix (the worker's own protocol), an IPv6 host."""
    from dask_dataservice.service._worker_address import advertised_address

    assert advertised_address("localhost:%port%", "tcp") == ("localhost", "tcp://localhost:%port%")
    assert advertised_address("10.0.0.7", "tls") == ("10.0.0.7", "tls://10.0.0.7:%port%")
    assert advertised_address("10.0.0.7:6000", "tcp") == ("10.0.0.7", "tcp://10.0.0.7:6000")
    assert advertised_address("grpc://h:%port%", "tcp") == ("h", "tcp://h:%port%")
    assert advertised_address("[::1]:%port%", "tcp") == ("::1", "tcp://[::1]:%port%")
    for bad in ("", "h:x", "h:1:2:%port%x"):
        with pytest.raises(ValueError, match="worker_address"):
            advertised_address(bad, "tcp")
