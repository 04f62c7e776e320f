"""A consumer's connections to data workers' element ports (issue 25, target 1).

A fetch (one task's read, :mod:`._reader`) sends its element requests on a connection of its
own to the worker's element port (``service/worker/_element_port.py``, the wire format of
:mod:`dask_dataservice._wire`) instead of through distributed's comms. The worker answers a
connection's requests one after the other, so replies come back in the order they were asked:
each request is a future, resolved by the next reply.

- **Where.** ``dataservice_element_port`` (a Dask message to the worker) says the port; it is
  remembered per worker address for this process, and asked again after a lost connection (a
  worker restarted at its address listens on another port).
- **Falling back.** A worker with no port (TLS or in-process clusters, ``worker.fast-path``
  false, an older worker) or whose port cannot be reached when a read starts (only Dask's own
  ports are open) is read through distributed's comms, as before; a connect waits at most
  :data:`CONNECT_TIMEOUT`, and an unreachable port is remembered for ten minutes, so each read
  does not wait for a connect to time out.
- **Receive buffers.** Replies are received into the process's
  :class:`~dask_dataservice._wire.BufferPool`: a buffer comes back for the next reply once the
  consumer let go of every element made of it, so a steady read does not fault in fresh pages
  for each reply. At most ``client.receive-buffers`` bytes wait there between reads.
- **Failures.** A lost connection fails every request waiting on it with ``ConnectionError``:
  the fetch sends them again with their ``seq`` as it does after a broken comm, so the worker
  answers with the replies it kept (nothing lost, nothing twice). A reconnect that fails gives
  a stream whose requests fail at once, so the fetch's retry rules (back-off, the dispatcher's
  word on a lost task, ``client.dispatcher-timeout``) decide, as for comms.
- **Errors.** A reply ``{"status": "error"}`` (the handler's exception) fails its request with
  that exception and its traceback, as distributed's ``rpc`` raises it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from distributed.comm.addressing import get_address_host
from distributed.core import clean_exception

from ... import config
from ..._wire import BufferPool, StreamProtocol, encode

logger = logging.getLogger(__name__)

__all__ = ["ElementStream", "open_stream", "reopen"]

#: ``{worker address: (until, (host, port) or None)}``: where each worker's element port is
#: (None: read through the comms, until the time given).
_PORTS: dict[str, tuple[float, tuple[str, int] | None]] = {}
#: How long a worker whose element port could not be reached is read through the comms.
UNREACHABLE_FOR = 600.0
#: Longest wait for a connection to an element port (a firewall that drops the packets would
#: hold the first read for ``client.connect-timeout`` otherwise).
CONNECT_TIMEOUT = 2.0
#: Worker addresses remembered (the oldest is forgotten past this: a cluster that scales keeps
#: seeing new ones).
_MAX_PORTS = 4096
OP = "dataservice_get_elements"


class ElementStream:
    """One connection to a data worker's element port; :meth:`request` sends at once."""

    def __init__(self, address: str, error: BaseException | None = None,
                 pool: BufferPool | None = None) -> None:
        self.address = address
        self._pending: deque[asyncio.Future[Any]] = deque()
        #: The receive buffers of this fetch's replies (kept across reconnects).
        self.pool = pool
        self._protocol = StreamProtocol(self._got, self._lost, "element port", pool)
        #: Set once the connection is lost (or never came: a stream that fails every request).
        self.error = error

    @property
    def broken(self) -> bool:
        return self.error is not None

    @classmethod
    async def connect(cls, address: str, where: tuple[str, int], timeout: float,
                      pool: BufferPool | None = None) -> ElementStream:
        self = cls(address, pool=pool)
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.create_connection(lambda: self._protocol, *where), timeout)
        return self

    def request(self, **kwargs: Any) -> asyncio.Future[Any]:
        """``get_elements(**kwargs)`` sent now; the future resolves to its reply."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        transport = self._protocol.transport
        if self.error is not None or transport is None or transport.is_closing():
            fut.set_exception(ConnectionError(f"no connection to {self.address}'s element "
                                              f"port: {self.error!r}"))
            return fut
        transport.writelines(encode({"op": OP, **kwargs}))
        self._pending.append(fut)
        return fut

    def _got(self, msg: Any) -> None:
        if not self._pending:
            return
        fut = self._pending.popleft()
        if fut.done():  # cancelled: the fetch gave up on it
            return
        if isinstance(msg, dict) and msg.get("status") == "error":
            _, exc, tb = clean_exception(**msg)
            assert exc is not None, msg
            fut.set_exception(exc.with_traceback(tb))
        else:
            fut.set_result(msg)

    def _lost(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        error = ConnectionError(f"the connection to {self.address}'s element port was lost: "
                                f"{exc!r}")
        while self._pending:
            fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(error)

    def close(self) -> None:
        transport = self._protocol.transport
        if transport is not None:
            transport.abort()  # replies on the way are not wanted any more
        self._lost(ConnectionError("closed"))


def wanted(address: str) -> bool:
    """Whether to look for ``address``'s element port (``client.fast-path``, ``tcp://``)."""
    return bool(config.get("client.fast-path")) and address.startswith("tcp://")


async def _where(rpc: Any, address: str, timeout: float) -> tuple[str, int] | None:
    """Where ``address``'s element port listens, asked if not known (OSError: unreachable)."""
    now = time.monotonic()
    known = _PORTS.get(address)
    if known is not None and (known[1] is not None or known[0] > now):
        return known[1]
    reply = await asyncio.wait_for(rpc.dataservice_element_port(), timeout)
    port = reply.get("port") if isinstance(reply, dict) else None  # an older worker: a string
    where = (get_address_host(address), int(port)) if port else None
    _remember(address, float("inf"), where)
    return where


def _remember(address: str, until: float, where: tuple[str, int] | None) -> None:
    _PORTS.pop(address, None)
    _PORTS[address] = (until, where)
    while len(_PORTS) > _MAX_PORTS:
        del _PORTS[next(iter(_PORTS))]


_POOL: BufferPool | None = None


def receive_pool() -> BufferPool | None:
    """This process's receive buffers (``client.receive-buffers`` bytes of them wait to be
    reused at most; 0: none, each reply in fresh memory)."""
    global _POOL
    limit = config.get_bytes("client.receive-buffers")
    if not limit:
        return None
    if _POOL is None or _POOL.max_free != limit:
        _POOL = BufferPool(limit)
    return _POOL


async def open_stream(rpc: Any, address: str, timeout: float) -> ElementStream | None:
    """A connection to ``address``'s element port, or None: read through distributed's comms
    (no port, or it could not be reached: then not again for :data:`UNREACHABLE_FOR`)."""
    if not wanted(address):
        return None
    pool = receive_pool()
    remembered = address in _PORTS
    try:
        where = await _where(rpc, address, timeout)
    except OSError as e:  # the worker is unreachable: the fetch's retries deal with it
        return ElementStream(address, e, pool)
    except Exception as e:  # noqa: BLE001 - a worker that cannot say: read through the comms
        logger.debug("dataservice: no element port from %s: %r", address, e)
        return None
    if where is None:
        return None
    try:
        return await ElementStream.connect(address, where, min(timeout, CONNECT_TIMEOUT), pool)
    except OSError as e:
        if remembered:  # the worker may have restarted at its address: ask it again, once
            _PORTS.pop(address, None)
            return await open_stream(rpc, address, timeout)
        _remember(address, time.monotonic() + UNREACHABLE_FOR, None)
        logger.info("dataservice: cannot reach the element port of %s at %s:%s (%r): reading "
                    "through distributed's comms", address, *where, e)
        return None


async def reopen(rpc: Any, stream: ElementStream, timeout: float) -> ElementStream | None:
    """A new connection for ``stream``'s worker after it broke (its port is asked again): a
    stream that fails every request if it cannot connect now, None if the worker has no
    element port any more (restarted with ``worker.fast-path`` false)."""
    address = stream.address
    _PORTS.pop(address, None)
    try:
        where = await _where(rpc, address, timeout)
        if where is None:
            return None
        return await ElementStream.connect(address, where, min(timeout, CONNECT_TIMEOUT),
                                           stream.pool)
    except OSError as e:
        _PORTS.pop(address, None)
        return ElementStream(address, e, stream.pool)
