"""Helpers shared by the test modules (imported as ``_helpers``: tests/ is on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any, NoReturn

import numpy as np
import pytest
from _logs import unexpected_tracebacks
from hypothesis import settings

#: Set (to anything but ``0``) by .ci/run: a test that would skip because an optional
#: dependency or tool is missing fails instead, so CI runs every test (it installs ``.[dev]``).
REQUIRE_ALL_TESTS = "DASK_DATASERVICE_REQUIRE_ALL_TESTS"


def require_all_tests() -> bool:
    return os.environ.get(REQUIRE_ALL_TESTS, "") not in ("", "0")


def unavailable(reason: str) -> NoReturn:
    """Skip the test (or the module, at import time) for ``reason``; under
    :data:`REQUIRE_ALL_TESTS`, fail it instead."""
    if require_all_tests():
        pytest.fail(f"{reason} ({REQUIRE_ALL_TESTS} is set: every test must run)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def needs(module: str, extra: str) -> Any:
    """``import module``, or skip naming the extra that installs it (see :func:`unavailable`);
    the only way tests import an optional dependency (tests/project/test_packaging.py checks)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        unavailable(f"needs {module!r} ({e}): the [{extra}] extra, pip install -e '.[{extra}]'")


#: Hypothesis settings for the pipeline-library tests: quick, no deadline.
FAST = settings(max_examples=60, deadline=None)

#: gen_cluster worker specs: a parameter server (resource ``ps``) and a training worker.
PS = ("127.0.0.1", 1, {"resources": {"ps": 1}})
WK = ("127.0.0.1", 1)


def py(x):
    """A comparable plain-Python form of an element (arrays become lists)."""
    if isinstance(x, dict):
        return {k: py(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(py(v) for v in x)
    if isinstance(x, (np.ndarray, np.generic)):
        return x.tolist()
    return x


def elements(ds):
    """Every element of a dataset, in plain-Python form."""
    return [py(x) for x in ds]


def train_counter(client, steps: int):
    """``steps`` scheduled steps that add 1 to a PS variable, joined: ``(coordinator,
    variable)`` (a training worker's runner now has counted them)."""
    import dask_dataservice as dds

    strategy = dds.ParameterServerStrategy(client)
    coordinator = dds.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = dds.Variable(0, dtype="i8", name="counter")

    def step():
        counter.assign_add(1)

    for _ in range(steps):
        coordinator.schedule(step)
    coordinator.join()
    return coordinator, counter


def in_thread(s, body):
    """Run ``body(client)`` in a thread with a synchronous client of scheduler ``s``."""
    from distributed import Client

    def run():
        with Client(s.address, set_as_default=False) as c:
            return body(c)

    return asyncio.to_thread(run)


async def poll(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Wait (without blocking the loop) until ``cond()`` is true, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def wait(cond, timeout: float = 20.0, what: str = "condition") -> None:
    """Block until ``cond()`` is true, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def read(ds) -> list:
    """Iterate a (data-service) dataset to the end, in a thread: the loop stays free."""
    return await asyncio.to_thread(list, ds)


async def distribute(ds, mode, client, **kwargs):
    """``ds.apply(dds.distribute(mode, client, ...))`` from a thread (it registers: blocking)."""
    import dask_dataservice as dds

    return await asyncio.to_thread(ds.apply, dds.distribute(mode, client, **kwargs))


def invoke(*argv: str):
    """Run the command line in this process; ``(exit code, stdout, stderr)``."""
    from click.testing import CliRunner

    from dask_dataservice import cli

    result = CliRunner().invoke(cli.dataservice, list(argv), prog_name="dask-dataservice")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


#: distributed logs a stopped worker's closed batched stream at INFO with its traceback,
#: one or two of them (the ``CommClosedError`` raised from a ``StreamClosedError`` or
#: alone, as the close races the write): not a failure of the process that logs it.
class Servers:
    """Processes started by a test, stopped (SIGTERM, then SIGKILL) at the end.

    Their output goes to files, not pipes: nobody reads a pipe while the test runs, and a
    process whose stderr pipe is full blocks on its next log line (a worker logging its
    reconnection attempts froze that way, and never came back).
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self._stderr: dict[int, IO[str]] = {}

    def start(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` in its own session (``env``: variables added to this process's)."""
        err = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.DEVNULL, stderr=err, text=True,
            start_new_session=True, env=None if env is None else {**os.environ, **env},
        )
        self.procs.append(proc)
        self._stderr[proc.pid] = err
        return proc

    def read_stderr(self, proc: subprocess.Popen) -> str:
        f = self._stderr[proc.pid]
        f.seek(0)
        return f.read()

    def stop(self, proc: subprocess.Popen, timeout: float = 20, clean: bool = True) -> str:
        """SIGTERM; wait for an exit with code 0 (and no traceback if ``clean``); return stderr."""
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)
        err = self.read_stderr(proc)
        assert proc.returncode == 0, err
        if clean:
            assert not unexpected_tracebacks(err), err
        return err

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        for f in self._stderr.values():
            f.close()


@contextlib.asynccontextmanager
async def ft_dispatcher(work_dir, **config) -> AsyncIterator[Any]:
    """A fault-tolerant DispatcherPlugin on a fresh in-process scheduler (no workers);
    ``config``: ``dataservice.dispatcher.*`` settings (``snapshot_records=...`` is spelt
    ``**{"snapshot-records": ...}``)."""
    import dask
    from distributed import Scheduler

    from dask_dataservice.service.dispatcher.plugin import DispatcherPlugin

    with dask.config.set({f"dataservice.dispatcher.{k}": v for k, v in config.items()}):
        plugin = DispatcherPlugin(fault_tolerant_mode=True, work_dir=str(work_dir))
        async with Scheduler(dashboard_address=":0", port=0) as s:
            s.add_plugin(plugin)
            await plugin.start(s)
            try:
                yield plugin
            finally:
                await plugin.close()


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    """``reply``, asserting that a dispatcher handler answered OK."""
    assert reply["status"] == "OK", reply
    return reply


def write_certs(directory: Path, security: Any) -> dict[str, str]:
    """A ``distributed.Security``'s CA, certificate and key as files (0600) in ``directory``:
    ``{"ca": ..., "cert": ..., "key": ...}`` (for ``--tls-*`` options of real processes)."""
    files = {"ca": security.tls_ca_file, "cert": security.tls_scheduler_cert,
             "key": security.tls_scheduler_key}
    paths = {}
    for name, contents in files.items():
        path = directory / f"{name}.pem"
        path.write_text(contents)
        path.chmod(0o600)
        paths[name] = str(path)
    return paths


#: Where :func:`free_port` draws from: below the kernel's ephemeral range
#: (``net.ipv4.ip_local_port_range``, 32768-60999 by default), split between the suite's
#: xdist processes.
_OWN_PORTS = range(20_000, 32_768)
_given_ports: set[int] = set()


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a server a test starts at an address it must know
    first (a restarted scheduler at the same address, a ``TF_CONFIG``, a worker list).

    Not ``bind(("127.0.0.1", 0))``: that port comes from the ephemeral range, which every
    outgoing connection of the machine draws from too, so another test's client could take it
    between this check and the server's bind (a doctest failed so once: "Address already in
    use"). These come from below that range, where only explicit binds go, each xdist process
    from its own part, never the same port twice in one process.
    """
    import random
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    share = len(_OWN_PORTS) // count
    ports = _OWN_PORTS[(index % count) * share:(index % count + 1) * share]
    start = random.randrange(len(ports))
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        if port in _given_ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given_ports.add(port)
        return port
    raise RuntimeError(f"no free port in {ports}")



@contextlib.contextmanager
def s3_emulator(bucket: str):
    """An S3 emulator (moto's server, in a process of its own on 127.0.0.1) with ``bucket``;
    yields ``s3://<bucket>``. fsspec's configuration gives every ``s3://`` filesystem the
    emulator's endpoint, as a user's would give theirs (or ``AWS_ENDPOINT_URL``). s3fs runs its
    requests on fsspec's process-wide I/O thread, started here (before the tests that use it)."""
    import socket

    import fsspec

    needs("moto.server", "test")
    s3fs = needs("s3fs", "test")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {"key": "testing", "secret": "testing",
                                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    try:
        deadline = time.monotonic() + 30
        while True:  # until the emulator answers
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        s3fs.S3FileSystem.clear_instance_cache()
        fsspec.filesystem("s3").mkdir(bucket)
        yield f"s3://{bucket}"
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
        s3fs.S3FileSystem.clear_instance_cache()
        proc.terminate()
        proc.wait(20)
