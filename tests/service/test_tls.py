"""The data service and parameter-server training on a TLS cluster (issue 11 s6).

Certificates are generated in the test: ``distributed.security.Security.temporary()`` makes
one self-signed key/certificate pair for every role (it needs ``cryptography``, in the test
extra); the command-line tests write it to files, as a deployment would have them.

- In-process clusters (``gen_cluster`` on ``tls://127.0.0.1``, every server with the same
  ``Security``): register, ``distribute`` DYNAMIC, read; a few scheduled PS steps.
- Real processes: ``dask-dataservice scheduler``, ``worker --supervise`` and a parameter
  server started with ``--tls-*`` options; a client with the files reads a DYNAMIC job and
  runs a few scheduled PS steps; ``ready`` and ``demo`` without certificates are usage
  errors, not distributed's TypeError.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import tempfile
from pathlib import Path

import pytest
from distributed import Client
from distributed.security import Security

import dask_dataservice as dds
from dask_dataservice.testing import gen_cluster
from dask_dataservice.testing._ps import warm_up_zarr

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(90)]

# zarr runs its I/O on process-wide daemon threads; start them before gen_cluster's
# thread-leak check takes its snapshot (the PS test uses zarr-backed shards).
warm_up_zarr()

from _helpers import Servers, distribute, read, write_certs  # noqa: E402

#: One generated certificate for every role (scheduler, worker, client).
SEC = Security.temporary()
TLS = "tls://127.0.0.1"


def _tls_cluster(*nthreads, **kwargs):
    return gen_cluster(scheduler=TLS, nthreads=[(TLS, *spec) for spec in nthreads],
                       security=SEC, **kwargs)


def _in_thread(s, body):
    """Run ``body(client)`` in a thread with a synchronous TLS client of scheduler ``s``."""

    def run():
        with Client(s.address, security=SEC, set_as_default=False) as c:
            return body(c)

    return asyncio.to_thread(run)


# ---------------------------------------------------------------------------------------
# in-process TLS clusters
# ---------------------------------------------------------------------------------------


@_tls_cluster((1,), (1,), client=True)
async def test_data_service_dynamic_on_tls(c, s, a, b):
    assert s.address.startswith("tls://") and a.address.startswith("tls://")
    ds = await distribute(dds.Dataset.range(3000).map(lambda x: 2 * x), "distributed_epoch", c)
    assert sorted(await read(ds)) == [2 * x for x in range(3000)]  # each element once
    # both workers produced over TLS (they registered with the dispatcher)
    plugin = s.plugins["dataservice-dispatcher"]
    assert {w.address for w in plugin.state.list_workers()} == {a.address, b.address}


@_tls_cluster((1,), (1,), client=False)
async def test_register_then_read_by_id_on_tls(s, a, b):
    def body(client):
        dataset_id = dds.register_dataset(client, dds.Dataset.range(500))
        # by the scheduler's tls:// address: the Client of this process is found by address
        ds = dds.from_dataset_id("parallel_epochs", client, dataset_id)
        return collections.Counter(ds)

    assert await _in_thread(s, body) == collections.Counter({i: 2 for i in range(500)})


@_tls_cluster((1,), client=False)
async def test_grpc_address_of_a_tls_scheduler(s, a):
    """TF's ``"grpc://host:port"`` and ``("grpc", "host:port")`` name the cluster's own
    protocol (issue 24; TF: data_service_ops_test.py testDistributeExplicitProtocol): with a
    TLS client of the scheduler open in this process, they reach it over TLS."""
    location = s.address.split("://")[1]

    def body(client):
        dataset_id = dds.register_dataset(f"grpc://{location}", dds.Dataset.range(50))
        ds = dds.from_dataset_id("parallel_epochs", ("grpc", location), dataset_id)
        return sorted(ds)

    assert await _in_thread(s, body) == list(range(50))


@_tls_cluster((1, {"resources": {"ps": 1}}), (1,), (1,), client=False)
async def test_parameter_server_training_on_tls(s, p0, w0, w1):
    def body(client):
        strategy = dds.ParameterServerStrategy(client)
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            counter = dds.Variable(0, dtype="i8", name="counter")
            weights = dds.Variable([0.0, 0.0], name="weights")

        def step(i):
            counter.assign_add(1)
            weights.assign_add([1.0, float(i)])
            return i

        rvs = [coord.schedule(step, args=(i,)) for i in range(20)]
        coord.join()
        return [rv.fetch() for rv in rvs], int(counter.numpy()), weights.numpy().tolist()

    results, count, weights = await _in_thread(s, body)
    assert results == list(range(20))
    assert count == 20
    assert weights == [20.0, float(sum(range(20)))]


@_tls_cluster((1,), client=False)
async def test_service_address_of_a_tls_scheduler_without_security_is_a_clear_error(s, a):
    def body():
        dds.register_dataset(s.address, dds.Dataset.range(3))  # no TLS config in this process

    with pytest.raises(Exception) as info:
        await asyncio.to_thread(body)
    assert not isinstance(info.value, TypeError), repr(info.value)
    assert "tls" in str(info.value).lower(), repr(info.value)


@_tls_cluster((1,), client=False)
async def test_demo_against_a_tls_scheduler_with_tls_options(s, a):
    with tempfile.TemporaryDirectory() as directory:
        certs = _write_certs(Path(directory))
        rc, out, err = await asyncio.to_thread(
            _invoke, "demo", "--scheduler", s.address, *_tls_args(certs), "--elements", "2000",
            "--quiet")
    assert rc == 0, err
    assert out.startswith("demo: 2000 elements in "), out  # no PS: it streams


# ---------------------------------------------------------------------------------------
# real processes: the command line with --tls-* options
# ---------------------------------------------------------------------------------------


def _write_certs(directory: Path) -> dict[str, str]:
    """The generated certificate as files (0600): ``{"ca": ..., "cert": ..., "key": ...}``."""
    return write_certs(directory, SEC)


def _tls_args(certs: dict[str, str]) -> list[str]:
    return ["--tls-ca-file", certs["ca"], "--tls-cert", certs["cert"], "--tls-key", certs["key"]]


def _invoke(*argv: str):
    """Run the command line in this process; ``(exit code, stdout, stderr)``."""
    from click.testing import CliRunner

    from dask_dataservice import cli

    result = CliRunner().invoke(cli.dataservice, list(argv), prog_name="dask-dataservice")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def _console_script() -> str:
    path = Path(sys.executable).parent / "dask-dataservice"
    assert path.exists(), f"console script not installed at {path}; run `pip install -e .`"
    return str(path)



@pytest.fixture
def servers():
    """Processes started by a test, stopped at its end (test_cli's helper)."""
    with Servers() as s:
        yield s

@pytest.mark.process
@pytest.mark.slow
def test_cli_scheduler_and_supervised_worker_with_tls_options(servers, tmp_path):
    certs = _write_certs(tmp_path)
    scheduler_file = tmp_path / "scheduler.json"
    exe = _console_script()
    scheduler = servers.start(exe, "scheduler", "--host", "127.0.0.1", "--port", "0",
                              "--no-dashboard", "--scheduler-file", str(scheduler_file),
                              *_tls_args(certs))
    # the workers find the scheduler by its file; --supervise passes every --tls-* option on
    worker = servers.start(exe, "worker", "--supervise", "--scheduler-file", str(scheduler_file),
                           "--host", "127.0.0.1", "--nthreads", "1", "--nworkers", "2",
                           "--no-dashboard", *_tls_args(certs))
    ps = servers.start(exe, "worker", "--scheduler-file", str(scheduler_file), "--host",
                       "127.0.0.1", "--nthreads", "1", "--no-nanny", "--no-dashboard",
                       "--resources", "ps=1", "--name", "ps", *_tls_args(certs))
    security = Security(tls_ca_file=certs["ca"], tls_client_cert=certs["cert"],
                        tls_client_key=certs["key"], require_encryption=True)
    with Client(scheduler_file=str(scheduler_file), security=security, timeout="30s",
                set_as_default=False) as client:
        address = client.scheduler.address
        assert address.startswith("tls://127.0.0.1:")
        client.wait_for_workers(3, timeout=60)
        workers = client.scheduler_info(n_workers=-1)["workers"]
        assert all(w.startswith("tls://") for w in workers), workers
        ds = dds.Dataset.range(2000).map(lambda x: 3 * x).apply(
            dds.distribute("distributed_epoch", client))
        assert sorted(ds) == [3 * x for x in range(2000)]  # the two data workers, not the PS

        # a few training steps: worker processes update the PS process over TLS
        strategy = dds.ParameterServerStrategy(client)
        coord = dds.ClusterCoordinator(strategy)
        with strategy.scope():
            total = dds.Variable(0, dtype="i8", name="total")

        def step(i):
            total.assign_add(i)
            return i

        rvs = [coord.schedule(step, args=(i,)) for i in range(10)]
        coord.join()
        assert [rv.fetch() for rv in rvs] == list(range(10))
        assert int(total.numpy()) == sum(range(10))

        # the readiness probe over TLS
        rc, out, err = _invoke("ready", address, *_tls_args(certs), "--min-workers", "2")
        assert rc == 0, err
        # the demo without certificates: a usage error naming the options, not a TypeError
        rc, _, err = _invoke("demo", "--scheduler", address, "--elements", "10")
        assert rc == 2 and "speaks TLS" in err, err

    for proc in (worker, ps, scheduler):
        # loopback, and TLS: no insecure-listen warning (distributed's own warnings, such as a
        # dashboard port taken by another process, do not count)
        assert "without tls" not in servers.stop(proc).lower()


def _get(url: str, certs: dict[str, str] | None = None, client_cert: bool = True,
         timeout: float = 10) -> tuple[int, bytes]:
    """GET ``url`` (``https://`` with the CA, and this client's certificate if
    ``client_cert``); ``(status, body)``."""
    import ssl
    import urllib.request

    context = None
    if url.startswith("https://"):
        assert certs is not None
        context = ssl.create_default_context(cafile=certs["ca"])
        context.check_hostname = False
        if client_cert:
            context.load_cert_chain(certs["cert"], certs["key"])
    with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
        return reply.status, reply.read()


def _listening(pid: int, port: int) -> set[str]:
    """The addresses process ``pid`` listens on at ``port``."""
    import psutil

    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.process
def test_a_tls_clusters_http_servers_need_a_certificate(servers, tmp_path):
    """Issue 22 item 2: on a TLS cluster started with the command line (``--host 127.0.0.1
    --no-dashboard``), the scheduler's and a worker's HTTP servers (``/metrics``,
    ``/dataservice/status.json``) listen on the listen host only and serve mutual TLS with the
    cluster's certificates: plain HTTP and HTTPS without a client certificate get nothing; a
    client with one gets the pages, and status.json names no job or dataset. Before, both
    served plain HTTP on 0.0.0.0: job names, worker addresses and 48 ``dataservice_*``
    metrics to anyone."""
    import ssl
    import urllib.error

    certs = _write_certs(tmp_path)
    scheduler_file = tmp_path / "scheduler.json"
    exe = _console_script()
    scheduler = servers.start(exe, "scheduler", "--host", "127.0.0.1", "--port", "0",
                              "--no-dashboard", "--scheduler-file", str(scheduler_file),
                              *_tls_args(certs))
    worker = servers.start(exe, "worker", "--scheduler-file", str(scheduler_file), "--host",
                           "127.0.0.1", "--nthreads", "1", "--no-nanny", "--no-dashboard",
                           *_tls_args(certs))
    security = Security(tls_ca_file=certs["ca"], tls_client_cert=certs["cert"],
                        tls_client_key=certs["key"], require_encryption=True)
    with Client(scheduler_file=str(scheduler_file), security=security, timeout="30s",
                set_as_default=False) as client:
        client.wait_for_workers(1, timeout=60)
        dataset_id = dds.register_dataset(client, dds.Dataset.range(100), dataset_id="secret-data")
        ds = dds.from_dataset_id("DYNAMIC", client, dataset_id, job_name="secret-job")
        assert sorted(ds) == list(range(100))
        info = client.scheduler_info(n_workers=-1)
        ports = {scheduler.pid: info["services"]["dashboard"]}
        [(_, w)] = info["workers"].items()
        ports[worker.pid] = w["services"]["dashboard"]
        for pid, port in ports.items():
            assert _listening(pid, port) == {"127.0.0.1"}  # not 0.0.0.0
            for path in ("metrics", "dataservice/status.json"):
                with pytest.raises((urllib.error.URLError, ConnectionError)):
                    _get(f"http://127.0.0.1:{port}/{path}")  # plain HTTP: no answer
                with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
                    _get(f"https://127.0.0.1:{port}/{path}", certs, client_cert=False)
        status, body = _get(f"https://127.0.0.1:{ports[scheduler.pid]}/dataservice/status.json",
                            certs)
        assert status == 200 and b'"installed": true' in body
        for name in (b"secret-data", b"secret-job"):
            assert name not in body
        status, body = _get(f"https://127.0.0.1:{ports[worker.pid]}/metrics", certs)
        assert status == 200 and b"dataservice_worker_" in body
    for proc in (worker, scheduler):
        servers.stop(proc)
