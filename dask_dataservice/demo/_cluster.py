"""Where the demo runs: an embedded cluster or an existing one, quiet logs, clean signals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from ..errors import DemoError, DemoUsageError

__all__ = [
    "DEFAULT_WORKERS",
    "DemoError",
    "DemoUsageError",
    "connect",
    "demo_logging",
    "local_cluster",
    "parameter_servers",
    "sigterm_exits",
    "wait_for_data_workers",
]

#: Data workers of the embedded cluster when ``workers`` is not given.
DEFAULT_WORKERS = 2


@contextlib.contextmanager
def connect(address: str, say: Callable[[str], None]) -> Iterator[Any]:
    """A ``distributed.Client`` of the cluster at ``address``, closed on exit.

    The scheduler is reached once with a plain comm first (``_connection.probe``, with this
    process's TLS settings): a ``Client`` that fails to connect leaves its IO loop thread
    running, so an unreachable address fails there, on a loop that function owns.
    """
    from distributed import Client

    from dask_dataservice import config
    from dask_dataservice._rpc import normalize_address
    from dask_dataservice.errors import DataServiceError
    from dask_dataservice.service.client._connection import probe

    address = normalize_address(address)
    timeout = config.get_seconds("client.connect-timeout")
    try:
        probe(address, timeout)
    except DataServiceError as e:
        reason = e.__cause__ if isinstance(e.__cause__, OSError) else e
        raise DemoError(f"cannot connect to the scheduler at {address}: {reason}") from None
    with Client(address, timeout=timeout, set_as_default=False) as client:
        say(f"connected to {address}")
        yield client


@contextlib.contextmanager
def local_cluster(*, nworkers: int, n_ps: int, processes: bool, verbose: bool) -> Iterator[Any]:
    """A client of an embedded cluster: ``nworkers`` data workers and ``n_ps`` parameter
    servers (workers with the ``ps`` resource), one thread each, on 127.0.0.1; both closed on
    exit."""
    from distributed import Client, Nanny, Scheduler, SpecCluster, Worker

    cls = Nanny if processes else Worker
    common: dict[str, Any] = {"nthreads": 1, "host": "127.0.0.1"}
    if cls is Nanny:
        common["dashboard_address"] = None
        if not verbose:
            common["silence_logs"] = logging.WARNING
    else:
        common["dashboard"] = False
    workers = {f"ps{i}": {"cls": cls, "options": {**common, "resources": {"ps": 1}}}
               for i in range(n_ps)}
    workers.update({f"w{i}": {"cls": cls, "options": dict(common)} for i in range(nworkers)})
    # tcp:// also for in-process workers (which would pick inproc://). The scheduler serves
    # HTTP (health, metrics) even without a dashboard: keep it on loopback, off the default
    # port, which another cluster may hold.
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "protocol": "tcp://",
                                               "dashboard_address": "127.0.0.1:0"}}
    with _children_ignore_sigint():
        cluster = SpecCluster(workers=workers, scheduler=scheduler,
                              silence_logs=False if verbose else logging.WARNING)
    try:
        with cluster, Client(cluster, set_as_default=False) as client:
            client.register_plugin(_QuietClose(), name="dataservice-demo-quiet-close")
            yield client
    finally:
        _remove_quiet_filters()  # in-process workers: the filters are in this process


class _HeartbeatRaceFilter(logging.Filter):
    """Drops the one error a closing worker logs when its last heartbeat to the scheduler was
    still in flight: ``Worker.close`` closes its connection pool under it (a race inside
    distributed, harmless: the worker is going away, and the scheduler knows it)."""

    def __init__(self, worker: Any) -> None:
        super().__init__()
        import weakref

        self._worker = weakref.ref(worker)

    def filter(self, record: logging.LogRecord) -> bool:
        from distributed.core import Status

        worker = self._worker()
        return not (
            record.getMessage().startswith("Failed to communicate with scheduler during heartbeat")
            and (worker is None or worker.status in (Status.closing, Status.closed,
                                                     Status.closing_gracefully))
        )


class _ClosedCommNoTraceback(logging.Filter):
    """Keeps the line, drops the traceback, of INFO records about a closed comm (e.g.
    "Batched Comm Closed" while a cluster shuts down): distributed logs them at INFO because
    they are expected."""

    def filter(self, record: logging.LogRecord) -> bool:
        from distributed.comm.core import CommClosedError

        if (record.levelno <= logging.INFO and record.exc_info
                and isinstance(record.exc_info[1], CommClosedError)):
            record.exc_info, record.exc_text = None, None
        return True


#: Where the filters go: the loggers the records start from (logger filters do not apply to
#: records propagated from child loggers).
_QUIET_LOGGERS = ("distributed.batched", "distributed.core")


def _add_quiet_filters(worker: Any | None = None) -> None:
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).addFilter(_ClosedCommNoTraceback())
    if worker is not None:
        logging.getLogger("distributed.worker").addFilter(_HeartbeatRaceFilter(worker))


def _remove_quiet_filters() -> None:
    for name in (*_QUIET_LOGGERS, "distributed.worker"):
        log = logging.getLogger(name)
        for f in [f for f in log.filters
                  if isinstance(f, _HeartbeatRaceFilter | _ClosedCommNoTraceback)]:
            log.removeFilter(f)


class _QuietClose(WorkerPlugin):
    """Worker plugin of the embedded cluster: a normal shutdown prints no traceback (with
    ``-v``, workers log to stderr)."""

    def setup(self, worker: Any) -> None:
        _add_quiet_filters(worker)


def parameter_servers(client: Any) -> tuple[int, int]:
    """``(parameter servers, other workers)`` of the client's cluster."""
    from dask_dataservice.ps import strategy

    ps, workers = strategy.cluster_roles(client)
    return len(ps), len(workers)


class _NotYet(Exception):
    pass


def wait_for_data_workers(client: Any, want: int | None, timeout: float = 30.0) -> int:
    """Install the data service; wait until ``want`` data workers registered; return how many.

    ``want=None``: every worker without an excluded resource (parameter servers are not data
    workers). After ``timeout`` seconds it goes on with the workers registered by then, and
    fails if there are none.
    """
    from distributed.utils_comm import retry

    import dask_dataservice as dds
    from dask_dataservice import config

    dds.install(client)
    if want is None:
        excluded = tuple(config.get("dispatcher.worker-resource-excluded") or ())
        workers = client.scheduler_info(n_workers=-1)["workers"].values()
        want = max(1, sum(1 for w in workers
                          if not any((w.get("resources") or {}).get(r) for r in excluded)))
    registered: list[Any] = []

    async def enough() -> None:
        registered[:] = (await client.scheduler.dataservice_state())["workers"]
        if len(registered) < want:
            raise _NotYet

    async def wait() -> None:
        # the dispatcher has no "workers changed" event to wait on: ask again with backoff,
        # until the deadline (not the count) ends it
        with contextlib.suppress(TimeoutError, _NotYet):
            await asyncio.wait_for(retry(enough, count=sys.maxsize, delay_min=0.01, delay_max=0.5,
                                         retry_on_exceptions=(_NotYet,)), timeout)

    client.sync(wait)
    if not registered:
        raise DemoError(f"no data worker registered with the data service in {timeout:.0f} s")
    return len(registered)


@contextlib.contextmanager
def sigterm_exits(prog: str) -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit(143)``, so the cluster is closed on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        print(f"{prog}: terminated", file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Start worker processes with SIGINT ignored (it survives their exec).

    Ctrl-C on a terminal signals the whole process group: without this, each worker process
    would raise KeyboardInterrupt wherever it is and print a traceback, while this process
    closes the cluster anyway. Ctrl-C during the start itself is ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def demo_logging(verbose: bool) -> Iterator[None]:
    """Quiet Dask in this process (WARNING and up) unless verbose; then show ours too."""
    dist = logging.getLogger("distributed")
    ours = logging.getLogger("dask_dataservice")
    saved = dist.level, ours.level
    handler = None
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
    else:
        dist.setLevel(logging.WARNING)
    _add_quiet_filters()  # the embedded scheduler runs in this process
    try:
        yield
    finally:
        _remove_quiet_filters()
        dist.setLevel(saved[0])
        ours.setLevel(saved[1])
        if handler is not None:
            ours.removeHandler(handler)
