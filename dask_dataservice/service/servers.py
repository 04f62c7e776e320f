"""tf.data service's server classes, as Dask servers with the plugins installed.

``DispatchServer`` is a Dask scheduler carrying the dispatcher plugin; ``WorkerServer`` is a
Dask worker carrying the data-worker plugin. Each runs on its own event loop in a background
thread of this process, like tf.data's in-process servers:

>>> dispatcher = DispatchServer()                                     # doctest: +SKIP
>>> worker = WorkerServer(WorkerConfig(dispatcher.target))  # doctest: +SKIP

For production, run ``dask scheduler --preload dask_dataservice`` and ``dask worker
--preload dask_dataservice`` (or any Dask deployment) instead: these classes are a
convenience and a drop-in for code written against tf.data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Self

from distributed.utils import LoopRunner, sync

from .._async import TaskGroup
from .._rpc import strip_protocol
from ..errors import DataServiceError
from .protocol._job_checks import resolve_entry_hosts

if TYPE_CHECKING:
    from distributed import Scheduler

    from .worker._reconnect import ReconnectingWorker

logger = logging.getLogger(__name__)

__all__ = ["DispatcherConfig", "DispatchServer", "WorkerConfig", "WorkerServer"]


@dataclasses.dataclass
class DispatcherConfig:
    """Configuration of a :class:`DispatchServer`: TensorFlow's fields, in TensorFlow's order,
    then this project's own (``client_timeout_ms``, ``host``).

    Parameters
    ----------
    port
        Port to listen on; 0 picks a free one.
    protocol
        TensorFlow's ``"grpc"`` (the default: the cluster's own protocol, ``tcp``, or ``tls``
        when ``distributed.comm.require-encryption`` is set), ``"grpc+tls"``, ``"tcp"`` or
        ``"tls"``.
    work_dir, fault_tolerant_mode
        Journal directory and whether to journal state updates (fault tolerance).
    worker_addresses
        The fixed worker list that static sharding policies need.
    job_gc_check_interval_ms, job_gc_timeout_ms
        Liveness and garbage collection (defaults from ``dataservice.dispatcher.*``).
    worker_timeout_ms
        A data worker silent (no heartbeat) this long is dropped from its jobs like a dead
        one, also when its Dask comms stay open (a frozen process); default: config
        ``dataservice.dispatcher.worker-timeout``.
    worker_max_concurrent_snapshots
        TensorFlow's bound on the snapshots a worker writes at once (0: the default). Accepted
        and checked, not enforced: a ``distributed_save`` here is a DYNAMIC job whose tasks
        share the data workers' threads with every other job (docs/data-service.md).
    client_timeout_ms
        A consumer silent this long is released (config ``dataservice.dispatcher.client-timeout``;
        a field of TensorFlow's dispatcher proto, not of its Python ``DispatcherConfig``).
    host
        Interface to listen on (default 127.0.0.1).
    """

    port: int = 0
    protocol: str | None = None
    work_dir: str | None = None
    fault_tolerant_mode: bool = False
    worker_addresses: list[str] | None = None
    job_gc_check_interval_ms: int | None = None
    job_gc_timeout_ms: int | None = None
    worker_timeout_ms: int | None = None
    worker_max_concurrent_snapshots: int = 0
    # ours, after TensorFlow's fields
    client_timeout_ms: int | None = None
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        n = self.worker_max_concurrent_snapshots
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(
                f"worker_max_concurrent_snapshots must be an int >= 0 (0: the default), got {n!r}")


@dataclasses.dataclass
class WorkerConfig:
    """Configuration of a :class:`WorkerServer` (TensorFlow's fields, in its order).

    Parameters
    ----------
    dispatcher_address
        ``host:port`` of the dispatcher (with ``protocol``'s scheme), or a full address:
        ``tcp://host:port``, TensorFlow's ``grpc://host:port``.
    worker_address
        The address the worker gives the dispatcher (readers reach it there): ``"host"``,
        ``"host:port"`` or TensorFlow's ``"host:%port%"``, where ``%port%`` becomes the port
        the worker bound. The worker listens on its host. Default: ``127.0.0.1`` and the
        bound port.
    port, protocol
        The port to bind (0: a free one) and the protocol (TensorFlow's ``"grpc"``: the
        cluster's own, tcp or tls; ``"grpc+tls"``, ``"tcp"``, ``"tls"``).
    heartbeat_interval_ms
        How often the worker reconciles its tasks with the dispatcher.
    dispatcher_timeout_ms
        How long the worker tries to reach the dispatcher when it starts before
        ``WorkerServer`` fails with ``DataServiceError`` (default 30 s; TensorFlow's is one
        hour). Once started, a supervised worker waits for a lost dispatcher for as long as it
        runs (TensorFlow's heartbeats retry too).
    data_transfer_protocol, data_transfer_address
        Accepted for compatibility and ignored (elements travel over Dask's own comms).
    nthreads, resources, name
        Passed to the Dask worker.
    """

    dispatcher_address: str
    worker_address: str | None = None
    port: int = 0
    protocol: str | None = None
    heartbeat_interval_ms: int | None = None
    dispatcher_timeout_ms: int | None = None
    data_transfer_protocol: str | None = None
    data_transfer_address: str | None = None
    nthreads: int = 1
    resources: dict[str, float] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        ms = self.dispatcher_timeout_ms
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int | float) or ms <= 0):
            raise ValueError(f"dispatcher_timeout_ms must be a positive number of milliseconds "
                             f"or None, got {ms!r}")


#: A worker's start waits this long for its dispatcher without ``dispatcher_timeout_ms``.
DEFAULT_DISPATCHER_TIMEOUT = 30.0


def _protocol(protocol: str | None) -> str:
    """The Dask protocol a server uses for TensorFlow's (or Dask's) ``protocol`` name."""
    from .client._address import dask_protocol

    try:
        name = dask_protocol(protocol)
    except (TypeError, ValueError):
        name = ""
    if name not in ("tcp", "tls"):
        raise ValueError("protocol must be 'grpc' (TensorFlow's: the cluster's own, tcp or "
                         f"tls), 'grpc+tls', 'tcp' or 'tls', got {protocol!r}")
    return name


class _BackgroundServer:
    """Runs a Dask server on an event loop in a thread of this process.

    The loop and its thread are distributed's :class:`~distributed.utils.LoopRunner`'s;
    :meth:`stop` closes the server, then stops the loop and joins its thread.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._runner: LoopRunner | None = None
        self._stopped = threading.Event()
        self.server: Any = None

    def _start(self, make: Callable[[], Awaitable[Any]], timeout: float = 30) -> None:
        self._runner = LoopRunner()
        self._runner.start()
        try:
            self.server = sync(self._runner.loop, make, callback_timeout=timeout)
        except BaseException:
            self._runner.stop()
            self._runner = None
            raise

    def join(self, timeout: float | None = None) -> None:
        """Block until the server is stopped (from another thread, or by a signal)."""
        self._stopped.wait(timeout)

    def _before_close(self) -> None:
        """Hook run before the server closes."""

    def stop(self, timeout: float = 30) -> None:
        """Close the server and its event loop (idempotent)."""
        runner = self._runner
        if runner is None or self._stopped.is_set():
            return
        self._before_close()
        try:
            if self.server is not None:
                sync(runner.loop, self.server.close, callback_timeout=timeout)
        finally:
            runner.stop(timeout)
            self._runner = None
            self._stopped.set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        try:
            self.stop(timeout=5)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class DispatchServer(_BackgroundServer):
    """A data-service dispatcher: a Dask scheduler with the dispatcher plugin.

    Parameters
    ----------
    config
        A :class:`DispatcherConfig` (default: all defaults).
    start
        Start at once (default), or call :meth:`start` later.
    """

    def __init__(self, config: DispatcherConfig | None = None, start: bool = True) -> None:
        super().__init__("dds-dispatcher")
        self.config = config or DispatcherConfig()
        if not isinstance(self.config, DispatcherConfig):
            raise TypeError(f"config must be a DispatcherConfig, got {type(self.config).__name__}")
        if self.config.fault_tolerant_mode and not self.config.work_dir:
            raise ValueError("fault_tolerant_mode=True needs a work_dir for the journal")
        if self.config.fault_tolerant_mode and self.config.work_dir:
            from .dispatcher._journal_fs import location

            location(self.config.work_dir)  # a URL the journal cannot keep: refused here
        self._protocol = _protocol(self.config.protocol)
        if start:
            self.start()

    def start(self) -> None:
        """Start the scheduler and its dispatcher plugin."""
        if self.server is not None:
            return
        cfg = self.config

        # host names of "host:%port%" entries resolved here, in the caller's thread, as Dask
        # resolves the workers' own addresses (never on the scheduler's loop)
        worker_addresses = (None if cfg.worker_addresses is None
                            else resolve_entry_hosts(cfg.worker_addresses))

        async def make() -> Scheduler:
            from distributed import Scheduler

            from .dispatcher.plugin import DispatcherPlugin

            scheduler = Scheduler(
                host=cfg.host, port=cfg.port, protocol=self._protocol, dashboard_address=":0",
                dashboard=False, validate=False,
            )
            plugin = DispatcherPlugin(
                gc_interval=None if cfg.job_gc_check_interval_ms is None
                else cfg.job_gc_check_interval_ms / 1000,
                job_gc_timeout=None if cfg.job_gc_timeout_ms is None else cfg.job_gc_timeout_ms / 1000,
                client_timeout=None if cfg.client_timeout_ms is None else cfg.client_timeout_ms / 1000,
                fault_tolerant_mode=cfg.fault_tolerant_mode, work_dir=cfg.work_dir,
                worker_addresses=worker_addresses,
            )
            if cfg.worker_timeout_ms is not None:
                plugin.worker_timeout = cfg.worker_timeout_ms / 1000
            scheduler.add_plugin(plugin)
            await scheduler
            return scheduler

        self._start(make)

    def _before_close(self) -> None:
        # clients this process opened for our address would only retry and log errors
        from .client._connection import close_clients

        close_clients(self.server.address)

    @property
    def target(self) -> str:
        """The address clients and workers use, e.g. ``tcp://127.0.0.1:8786``."""
        return str(self.server.address)

    @property
    def _address(self) -> str:
        return strip_protocol(self.target)


class WorkerServer(_BackgroundServer):
    """A data-service worker: a Dask worker with the data-worker plugin.

    Parameters
    ----------
    config
        A :class:`WorkerConfig` naming the dispatcher.
    start
        Start at once (default), or call :meth:`start` later.
    """

    def __init__(self, config: WorkerConfig, start: bool = True) -> None:
        super().__init__("dds-worker")
        if not isinstance(config, WorkerConfig):
            raise TypeError(f"config must be a WorkerConfig, got {type(config).__name__}")
        if not config.dispatcher_address:
            raise ValueError("WorkerConfig.dispatcher_address is required")
        self.config = config
        self._protocol = _protocol(config.protocol)
        if start:
            self.start()

    def start(self) -> None:
        """Start the worker and connect it to the dispatcher.

        The worker is supervised: when its scheduler goes away (a Dask worker then closes
        itself), a new worker starts at once, waits for the scheduler to come back and
        registers again, so a restarted dispatcher gets its workers back by itself.
        """
        if self.server is not None:
            return
        from ._worker_address import advertised_address
        from .client._address import parse_service

        cfg = self.config
        address = cfg.dispatcher_address.strip()
        # no protocol given: the config's (TensorFlow's "grpc" names the cluster's own)
        address = parse_service(address if "://" in address
                                else (cfg.protocol or "grpc", address))
        host, template = "127.0.0.1", None
        if cfg.worker_address:
            host, template = advertised_address(cfg.worker_address, self._protocol)
        kwargs = dict(nthreads=cfg.nthreads, host=host, port=cfg.port, protocol=self._protocol,
                      dashboard=False, resources=cfg.resources, name=cfg.name)
        timeout = (DEFAULT_DISPATCHER_TIMEOUT if cfg.dispatcher_timeout_ms is None
                   else cfg.dispatcher_timeout_ms / 1000)

        async def make() -> WorkerSupervisor:
            supervisor = WorkerSupervisor(address, heartbeat_interval=(
                None if cfg.heartbeat_interval_ms is None else cfg.heartbeat_interval_ms / 1000
            ), contact_template=template, **kwargs)
            try:
                await supervisor.start(timeout)
            except TimeoutError:
                raise DataServiceError(
                    f"the data worker could not reach its dispatcher at {address} within "
                    f"dispatcher_timeout_ms={timeout * 1000:g}") from None
            return supervisor

        self._start(make, timeout=timeout + 30)

    @property
    def restarts(self) -> int:
        """How many times the worker was restarted after losing its scheduler."""
        return int(self.server.restarts)

    @property
    def reconnects(self) -> int:
        """How many times the worker registered again with a restarted scheduler, keeping its
        data tasks (:class:`~dask_dataservice.service.worker.ReconnectingWorker`)."""
        return getattr(self.server.worker, "reconnects", 0)

    @property
    def worker_address(self) -> str:
        """This worker's current address."""
        return str(self.server.worker.address)


class WorkerSupervisor:
    """Keeps a Dask worker with the data-worker plugin connected to a scheduler.

    Dask workers do not reconnect to a restarted scheduler: they close themselves (see
    dask/distributed#6361). The supervised worker is a
    :class:`~._reconnect.ReconnectingWorker`, which does, keeping its data tasks, buffers and
    server (readers keep reading). If it closes anyway (for any reason but :meth:`close`),
    the supervisor starts a fresh worker, which waits until the scheduler is reachable
    again, then registers, and the dispatcher gives it tasks.
    """

    #: Backoff between failed restarts: 0.1 s doubling to this many seconds.
    max_restart_delay = 5.0

    def __init__(self, scheduler_address: str, heartbeat_interval: float | None = None,
                 contact_template: str | None = None, **worker_kwargs: Any) -> None:
        self.scheduler_address = scheduler_address
        self.heartbeat_interval = heartbeat_interval
        #: ``WorkerConfig.worker_address`` as a template (``"tcp://host:%port%"``), or None.
        self.contact_template = contact_template
        self.worker_kwargs = worker_kwargs
        self.worker: ReconnectingWorker | None = None
        self.restarts = 0
        self._closing = False
        self._group: TaskGroup | None = None

    def _new_worker(self, death_timeout: float | None = None) -> ReconnectingWorker:
        from ._worker_address import AdvertisingWorker
        from .worker.plugin import DataWorkerPlugin

        plugin = DataWorkerPlugin(heartbeat_interval=self.heartbeat_interval)
        # rides out a scheduler restart with its data tasks; a new worker only when it closed
        worker = AdvertisingWorker(self.scheduler_address, plugins={plugin},
                                   contact_template=self.contact_template,
                                   death_timeout=death_timeout, **self.worker_kwargs)
        # the dispatcher pushes its own (default) data-worker plugin to every worker that
        # registers: the first push must not replace this one, which carries the config's
        # heartbeat interval (WorkerConfig.heartbeat_interval_ms)
        worker._plugins_to_keep = {plugin.name}
        return worker

    async def start(self, timeout: float | None = None) -> WorkerSupervisor:
        """Start the first worker: ``TimeoutError`` if it cannot register with the scheduler
        within ``timeout`` seconds (Dask's ``death_timeout``: the worker closes itself).
        Restarts wait for the scheduler for as long as the supervisor runs."""
        self.worker = worker = self._new_worker(timeout)
        await worker
        self._group = TaskGroup("worker supervisor")
        self._group.spawn(self._supervise)
        return self

    async def _supervise(self) -> None:
        """Start a new worker whenever the current one closes (not by :meth:`close`).

        A restart waits until the scheduler is reachable again (``await worker`` does); one
        that fails is retried with a backoff (0.1 s doubling to ``max_restart_delay``), for
        as long as the supervisor runs: waiting for its scheduler is its whole job.
        """
        while not self._closing:
            assert self.worker is not None  # started
            await self.worker.finished()  # type: ignore[no-untyped-call]  # distributed.Server
            if self._closing:
                return
            self.restarts += 1
            logger.info("dataservice: worker lost its scheduler; starting a new worker "
                        "(restart %d)", self.restarts)
            delay = 0.1
            while not self._closing:
                worker = self._new_worker()
                try:
                    await worker  # waits for the scheduler to be reachable again
                    self.worker = worker
                    break
                except asyncio.CancelledError:  # close() while restarting
                    await asyncio.shield(worker.close())
                    raise
                except Exception as e:  # noqa: BLE001 - keep trying
                    logger.info("dataservice: worker restart failed (%r); retrying in %.1fs",
                                e, delay)
                    await worker.close()
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, self.max_restart_delay)

    async def close(self) -> None:
        self._closing = True
        if self._group is not None:
            await self._group.stop()
        if self.worker is not None:
            await self.worker.close()

    @property
    def address(self) -> str:
        assert self.worker is not None  # started
        return str(self.worker.address)
