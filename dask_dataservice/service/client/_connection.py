"""Clients of the data service: which ``distributed.Client`` talks to a scheduler, and how
blocking calls reach its event loop.

- :func:`client_for`: a connected client for a ``Client`` or an address (reused per address;
  inside a Dask task, the worker's own client).
- :func:`run`: run a coroutine on the client's loop. With a synchronous client it blocks the
  calling thread and returns the result, from any thread, also one with a running event loop
  that is not the client's (a Jupyter cell); it refuses only a blocking call *on the
  client's own loop thread*, the one real deadlock. With an asynchronous client
  (``Client(asynchronous=True)``) it returns an awaitable instead.
- :func:`install` / :func:`ensure_installed`: the dispatcher and data-worker plugins, through
  ``Client.register_plugin``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from distributed import Client
from distributed.utils import LoopRunner, sync

from ... import config
from ..._rpc import normalize_address
from ...errors import DataServiceError
from ..protocol._hooks import new_plugins
from ..protocol._messages import raise_for_status
from ._address import parse_service

__all__ = ["client_for", "close_clients", "ensure_installed", "install", "run", "service_address"]

logger = logging.getLogger(__name__)

_CLIENTS: dict[str, Client] = {}
#: Clients this module opened itself (closed at exit or by close_clients()).
_OWN_CLIENTS: dict[str, Client] = {}
_CLIENTS_LOCK = threading.Lock()
_INSTALLED: weakref.WeakKeyDictionary[Client, bool] = weakref.WeakKeyDictionary()


def service_address(service: Any) -> str:
    """The scheduler address of ``service``: a Client, an address string or TensorFlow's
    ``(protocol, address)`` tuple (``"grpc://host:port"`` and ``"host:port"`` included:
    :mod:`._address`)."""
    if isinstance(service, Client):
        return str(service.scheduler.address)  # type: ignore[union-attr]  # a connected client
    return parse_service(service, _known_addresses)


def _known_addresses() -> list[str]:
    """The scheduler addresses of the ``distributed.Client``s open in this process (for
    ``grpc``: a client of ``tls://host:port`` makes it TLS). distributed tracks every client
    it creates in ``Client._instances`` (a weak set; private, so read defensively)."""
    clients: list[Client] = list(getattr(Client, "_instances", ()))
    with _CLIENTS_LOCK:
        clients += _CLIENTS.values()
    found = []
    for client in clients:
        scheduler = getattr(client, "scheduler", None) if _usable(client) else None
        address = getattr(scheduler, "address", None)
        if isinstance(address, str):
            found.append(address)
    return found


def _usable(client: Client | None) -> bool:
    return client is not None and client.status not in ("closed", "closing")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def on_loop_thread(client: Client) -> bool:
    """Whether the calling thread runs ``client``'s event loop."""
    running = _running_loop()
    return running is not None and running is client.loop.asyncio_loop  # type: ignore[union-attr]  # tornado AsyncIOLoop


def on_a_loop() -> bool:
    """Whether the calling thread runs any event loop (which a blocking call would stall)."""
    return _running_loop() is not None


def client_for(service: Any) -> Client:
    """A connected client for ``service`` (a Client, or an address: reuse one, this module's
    or a synchronous one the user opened for it, or connect)."""
    if isinstance(service, Client):
        if not _usable(service):
            raise _closed(service, "the distributed.Client given as service")
        address = service_address(service)
        with _CLIENTS_LOCK:
            if not _usable(_CLIENTS.get(address)):
                _CLIENTS[address] = service
        return service
    address = service_address(service)
    with _CLIENTS_LOCK:
        known = _CLIENTS.get(address)
        if known is not None and _usable(known):
            return known
    client = _worker_client(address) or _open_client(address)
    if client is None:
        timeout = config.get_seconds("client.connect-timeout")
        probe(address, timeout)
        try:
            client = Client(address, set_as_default=False, timeout=timeout)
        except OSError as e:
            raise DataServiceError(f"cannot reach the data service at {address}: {e}") from e
        with _CLIENTS_LOCK:
            _OWN_CLIENTS[address] = client
    with _CLIENTS_LOCK:
        _CLIENTS[address] = client
    return client


def _open_client(address: str) -> Client | None:
    """A synchronous ``distributed.Client`` of ``address`` the user opened in this process
    (with its own security, say), to reuse rather than connect again."""
    clients: list[Client] = list(getattr(Client, "_instances", ()))
    for client in clients:
        if _usable(client) and not client.asynchronous and \
                getattr(client.scheduler, "address", None) == address:
            return client
    return None


def probe(address: str, timeout: float) -> None:
    """Fail with a clear error if no scheduler can be reached at ``address``.

    A ``Client`` that cannot connect leaves its loop thread running (distributed 2026.8), so
    the address is tried first on a loop of our own, which we stop. The connection uses this
    process's Dask TLS configuration (``distributed.comm.tls.*``), as a ``Client`` would; a
    ``tls://`` address without it is an error that says what to configure.
    """
    from distributed.comm.addressing import parse_address
    from distributed.comm.core import connect
    from distributed.security import Security

    args = Security().get_connection_args("client")
    if parse_address(address)[0] == "tls" and args.get("ssl_context") is None:
        raise DataServiceError(
            f"{address} is a TLS scheduler, and this process has no TLS configuration: pass a "
            "distributed.Client created with security=Security(...) as service, or set "
            "distributed.comm.tls.ca-file, distributed.comm.tls.client.cert and "
            "distributed.comm.tls.client.key (DASK_DISTRIBUTED__COMM__TLS__... variables)")

    async def attempt() -> None:
        comm = await connect(address, timeout=timeout, **args)
        await comm.close()

    runner = LoopRunner()
    runner.start()
    try:
        sync(runner.loop, attempt)
    except OSError as e:
        raise DataServiceError(f"cannot reach the data service at {address}: {e}") from e
    finally:
        runner.stop()


def _worker_client(address: str) -> Client | None:
    """Inside a Dask task of a worker of ``address``: that worker's client."""
    from distributed import get_client, get_worker

    try:
        worker = get_worker()
    except ValueError:
        return None
    if worker.scheduler.address != address:
        return None
    return get_client()


def forget(address: str) -> None:
    """Forget the client remembered for ``address`` (its scheduler went away)."""
    with _CLIENTS_LOCK:
        _CLIENTS.pop(address, None)


def close_clients(address: str | None = None) -> None:
    """Close the clients this module opened (for one scheduler address, or all; also at exit)."""
    with _CLIENTS_LOCK:
        own = [(a, c) for a, c in _OWN_CLIENTS.items() if address is None or a == address]
        for a, _ in own:
            _OWN_CLIENTS.pop(a, None)
            _CLIENTS.pop(a, None)
    for _, client in own:
        try:
            client.close(timeout=5)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


atexit.register(close_clients)


def run(client: Client, coro_fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    """Run ``coro_fn(*args, **kwargs)`` on the client's loop (see the module docstring)."""
    if client.asynchronous:
        return coro_fn(*args, **kwargs)
    return run_blocking(client, coro_fn, *args, **kwargs)


def run_blocking(client: Client, coro_fn: Callable[..., Awaitable[Any]], *args: Any,
                 **kwargs: Any) -> Any:
    """Run ``coro_fn`` on the client's loop and wait for it, whatever the client's kind."""
    if on_loop_thread(client):
        raise RuntimeError(
            "dask_dataservice's blocking API was called on the event loop of its own "
            "distributed.Client (that would deadlock); call it from another thread (e.g. "
            "await asyncio.to_thread(list, dataset)), or use Client(asynchronous=True) and await it"
        )
    return sync(client.loop, coro_fn, *args, **kwargs)  # type: ignore[arg-type]  # connected


def check_can_block(client: Client, what: str) -> None:
    """Refuse a blocking call on ``client``'s own loop thread (the one real deadlock)."""
    if on_loop_thread(client):
        hint = ("with an asynchronous client, use `async for x in dataset`" if client.asynchronous
                else "call it from another thread instead, e.g. await asyncio.to_thread(...)")
        raise RuntimeError(
            f"{what} blocks, and was called on the event loop of its own distributed.Client "
            f"(that would deadlock); {hint}"
        )


async def call_dispatcher(client: Client, op: str, what: str, **kwargs: Any) -> dict[str, Any]:
    """``client.scheduler.<op>(**kwargs)``, checked, riding out a restarting dispatcher.

    A dispatcher that is shutting down or restarting answers "closing", or its comm closes
    under the call (``CommClosedError``), or its port refuses connections: the call is
    retried, with a backoff of 50 ms doubling to 1 s, for up to
    ``dataservice.client.dispatcher-timeout``. Only for calls that are idempotent at the
    dispatcher (registration is, by fingerprint). A scheduler that does not come back is a
    :class:`DataServiceError` naming its address after that timeout (each connection attempt
    is bounded by it, not by distributed's longer connect timeout), at once when the client
    has given up on it (a closed client).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.get_seconds("client.dispatcher-timeout")
    delay = 0.05
    while True:
        try:
            # a connection first, within what is left (and the pool's own timeout, so a
            # restart is retried), then the call on it
            await _reach(client, what, min(deadline - loop.time(), _pool_timeout(client)))
            return raise_for_status(await getattr(client.scheduler, op)(**kwargs), what)
        except OSError as e:  # CommClosedError, DispatcherUnavailableError, refused
            remaining = deadline - loop.time()
            if client.status in ("closed", "closing"):
                raise _closed(client, what) from e
            if remaining <= 0:
                raise DataServiceError(
                    f"{what}: the data service at {_known_address(client)} did not come back "
                    f"within dataservice.client.dispatcher-timeout: {e!r}") from e
            logger.info("dataservice: %s failed (%r); retrying", what, e)
            await asyncio.sleep(min(delay, remaining))
            delay = min(2 * delay, 1.0)


def _closed(client: Client, what: str) -> DataServiceError:
    """The error for a request through a closed client (it may have closed itself: it does
    when it cannot reconnect to its scheduler within its ``timeout``)."""
    address = _known_address(client)
    where = f"the data service at {address}" if address else "the data service"
    return DataServiceError(
        f"{what}: {where} cannot be reached: the distributed.Client is closed (a client "
        "closes itself when it cannot reconnect to its scheduler within its timeout)")


def _known_address(client: Client) -> str | None:
    """The scheduler address of ``client``, also once it is closed (then it has no
    ``scheduler`` any more: the address it was given, or the one it last knew)."""
    if client.scheduler is not None:
        return service_address(client)
    start = getattr(client, "_start_arg", None)
    if isinstance(start, str):
        return normalize_address(start)
    identity = getattr(client, "_scheduler_identity", None) or {}
    found = identity.get("address")
    return str(found) if found else None


def _pool_timeout(client: Client) -> float:
    timeout = getattr(client.rpc, "timeout", None)
    return float(timeout) if timeout else float("inf")


async def _reach(client: Client, what: str, timeout: float) -> None:
    """Make sure ``client`` has a connection to its scheduler, trying for at most ``timeout``
    seconds (an OSError if none), and leave it in the client's pool for the next call.

    distributed's own calls try for ``distributed.comm.timeouts.connect`` (30 s) whatever
    the caller's deadline, and raise ``CommClosedError`` when the client gives up; here the
    caller's deadline bounds the wait, and a closed client is a :class:`DataServiceError`.
    """
    if client.status in ("closed", "closing") or client.scheduler is None:
        raise _closed(client, what)
    address = service_address(client)
    pool = client.rpc
    try:
        comm = await pool.connect(address, timeout=max(timeout, 0.001))
    except RuntimeError as e:  # "ConnectionPool is closed": the client closed meanwhile
        raise _closed(client, what) from e
    pool.reuse(address, comm)


async def _reach_or_fail(client: Client, what: str) -> None:
    """:func:`_reach` within ``dataservice.client.dispatcher-timeout``; a
    :class:`DataServiceError` naming the scheduler's address if it cannot be reached."""
    timeout = config.get_seconds("client.dispatcher-timeout")
    try:
        await _reach(client, what, timeout)
    except OSError as e:
        if client.status in ("closed", "closing"):
            raise _closed(client, what) from e
        raise DataServiceError(
            f"{what}: the data service at {_known_address(client)} cannot be reached "
            f"(tried for dataservice.client.dispatcher-timeout, {timeout:g} s): {e}") from e


def _plugins() -> tuple[Any, ...]:
    return new_plugins()  # (DispatcherPlugin(), DataWorkerPlugin()): set by the wiring


def _check_worker_replies(responses: dict[str, Any] | None) -> None:
    for response in (responses or {}).values():
        raise_for_status(response, "worker plugin installation")


async def _install_async(client: Client) -> None:
    """Install both plugins, on the client's loop (any client: there it is asynchronous).

    The scheduler is reached first, within ``dataservice.client.dispatcher-timeout``; a
    scheduler that cannot be reached, or a connection lost during the installation, is a
    :class:`DataServiceError` naming its address (not distributed's ``OSError`` after its
    30 s connect timeout). The installation itself is not retried (a scheduler plugin
    registered twice would replace the dispatcher)."""
    what = "plugin installation"
    await _reach_or_fail(client, what)
    dispatcher, worker = _plugins()
    try:
        await client.register_plugin(dispatcher)
        _check_worker_replies(await client.register_plugin(worker))
    except OSError as e:
        if client.status in ("closed", "closing"):
            raise _closed(client, what) from e
        raise DataServiceError(f"{what}: lost the connection to the data service at "
                               f"{_known_address(client)}: {e!r}") from e
    _INSTALLED[client] = True


def install(service: Client | str) -> Awaitable[None] | None:
    """Install the dispatcher and data-worker plugins on a cluster (idempotent).

    Called automatically on first use; call it yourself to pay the cost up front. Clusters
    started with ``--preload dask_dataservice`` already have both plugins. With an
    asynchronous client, returns an awaitable.
    """
    client = client_for(service)
    if client.asynchronous and on_loop_thread(client):
        return _install_async(client)
    check_can_block(client, "install()")
    run_blocking(client, _install_async, client)  # on the client's loop, wait for it here
    return None


def ensure_installed(client: Client) -> Awaitable[None] | None:
    """:func:`install` once per client (an awaitable, or None, as :func:`install`)."""
    if _INSTALLED.get(client):
        return _done() if client.asynchronous and on_loop_thread(client) else None
    return install(client)


async def _done() -> None:
    return None
