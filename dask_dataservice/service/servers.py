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

from distributed.comm.addressing import get_address_host, parse_address, unparse_address
from distributed.utils import LoopRunner, sync

from .._async import TaskGroup
from .._rpc import normalize_address, strip_protocol

if TYPE_CHECKING:
    from distributed import Scheduler

    from .worker._reconnect import ReconnectingWorker

logger = logging.getLogger(__name__)

__all__ = ["DispatcherConfig", "DispatchServer", "WorkerConfig", "WorkerServer"]


@dataclasses.dataclass
class DispatcherConfig:
    """Configuration of a :class:`DispatchServer` (tf.data's field names).

    Parameters
    ----------
    port
        Port to listen on; 0 picks a free one.
    protocol
        ``"tcp"`` (tf.data's ``"grpc"`` is accepted as an alias).
    work_dir, fault_tolerant_mode
        Journal directory and whether to journal state updates (fault tolerance).
    worker_addresses
        The fixed worker list that static sharding policies need.
    job_gc_check_interval_ms, job_gc_timeout_ms, client_timeout_ms
        Liveness and garbage collection (defaults from ``dataservice.dispatcher.*``).
    worker_timeout_ms
        A data worker silent (no heartbeat) this long is dropped from its jobs like a dead
        one, also when its Dask comms stay open (a frozen process); default: config
        ``dataservice.dispatcher.worker-timeout``.
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
    client_timeout_ms: int | None = None
    worker_timeout_ms: int | None = None
    host: str = "127.0.0.1"


@dataclasses.dataclass
class WorkerConfig:
    """Configuration of a :class:`WorkerServer` (tf.data's field names).

    Parameters
    ----------
    dispatcher_address
        ``host:port`` (or ``tcp://host:port``) of the dispatcher.
    worker_address, port, protocol
        Where this worker listens (default: 127.0.0.1, a free port, tcp).
    heartbeat_interval_ms
        How often the worker reconciles its tasks with the dispatcher.
    dispatcher_timeout_ms, data_transfer_protocol, data_transfer_address
        Accepted for compatibility and ignored (a supervised worker waits for its
        dispatcher indefinitely; elements travel over Dask's own comms).
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


def _protocol(protocol: str | None) -> str:
    if protocol in (None, "", "grpc", "tcp"):
        return "tcp"
    if protocol in ("tls", "grpc+tls"):
        return "tls"
    raise ValueError(f"protocol must be 'tcp' (or 'grpc'), got {protocol!r}")


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
        self._protocol = _protocol(self.config.protocol)
        if start:
            self.start()

    def start(self) -> None:
        """Start the scheduler and its dispatcher plugin."""
        if self.server is not None:
            return
        cfg = self.config

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
                worker_addresses=cfg.worker_addresses,
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
        cfg = self.config
        address = cfg.dispatcher_address.strip()
        _, location = parse_address(address, strict=False)
        if location == address:  # no protocol given: the config's
            address = unparse_address(self._protocol, location)
        address = normalize_address(address)
        host = (get_address_host(normalize_address(cfg.worker_address)) if cfg.worker_address
                else "127.0.0.1")
        kwargs = dict(nthreads=cfg.nthreads, host=host, port=cfg.port, protocol=self._protocol,
                      dashboard=False, resources=cfg.resources, name=cfg.name)

        async def make() -> WorkerSupervisor:
            supervisor = WorkerSupervisor(address, heartbeat_interval=(
                None if cfg.heartbeat_interval_ms is None else cfg.heartbeat_interval_ms / 1000
            ), **kwargs)
            await supervisor.start()
            return supervisor

        self._start(make)

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
                 **worker_kwargs: Any) -> None:
        self.scheduler_address = scheduler_address
        self.heartbeat_interval = heartbeat_interval
        self.worker_kwargs = worker_kwargs
        self.worker: ReconnectingWorker | None = None
        self.restarts = 0
        self._closing = False
        self._group: TaskGroup | None = None

    def _new_worker(self) -> ReconnectingWorker:
        from .worker._reconnect import ReconnectingWorker
        from .worker.plugin import DataWorkerPlugin

        plugin = DataWorkerPlugin(heartbeat_interval=self.heartbeat_interval)
        # rides out a scheduler restart with its data tasks; a new worker only when it closed
        worker = ReconnectingWorker(self.scheduler_address, plugins={plugin},
                                    **self.worker_kwargs)
        # the dispatcher pushes its own (default) data-worker plugin to every worker that
        # registers: the first push must not replace this one, which carries the config's
        # heartbeat interval (WorkerConfig.heartbeat_interval_ms)
        worker._plugins_to_keep = {plugin.name}
        return worker

    async def start(self) -> WorkerSupervisor:
        self.worker = worker = self._new_worker()
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
