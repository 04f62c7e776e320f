"""The PS data path: training workers' requests on plain asyncio streams (issue 16, target 1).

Theory of operation
-------------------
A training step sends its parameter servers a few messages, each a small dict plus numpy
arrays. Through distributed's comms such a message costs ~300-400 µs of CPU at each end,
several times what the numpy work of a 4,096-id embedding step costs. Here the same messages
travel on an asyncio connection of their own (the wire format, the receiving protocol and the
server are :mod:`dask_dataservice._wire`'s, shared with the data service's element path):

- **Server** (:class:`FastServer`): one per parameter server, on the host of its Dask address
  and a free port (``ps_fast_port`` tells it). Each connection's messages are answered one
  after the other by the same handlers as ``ps_*`` messages on Dask comms, so a worker reads
  its own writes.
- **Runner thread** (:class:`SocketChannel`): a training worker's runner thread writes its
  requests on a non-blocking socket of its own and reads the replies when it waits for one
  (no hop to the event loop and back); while a send waits for room it reads replies, so
  neither end blocks the other. A lost connection fails every waiting request; the next one
  reconnects (asking ``ps_fast_port`` again).

Used for ``tcp://`` parameter servers when ``dataservice.ps.fast-path`` is true; TLS clusters
keep distributed's comms (this path has no encryption, like ``tcp://`` itself), and so does a
training worker that cannot reach a PS's data port (only Dask's own ports may be open).
"""

from __future__ import annotations

import concurrent.futures
import logging
import select
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from .._wire import StreamProtocol, StreamServer, decode, encode
from ..errors import ParameterServerUnavailableError
from ._types import silent_server

logger = logging.getLogger(__name__)

__all__ = ["FastServer", "Reply", "SocketChannel", "decode", "encode"]


class FastServer(StreamServer):
    """A PS's data path (see the module docstring)."""

    def __init__(self, handler: Callable[[str], Callable[..., Awaitable[Any]] | None]) -> None:
        super().__init__(handler, "PS data path")


# -- the runner thread's blocking channel ----------------------------------------------------


class Reply:
    """The reply to one request on a :class:`SocketChannel`: :meth:`result` reads the socket
    (in the caller's thread) until it came, as ``concurrent.futures.Future.result`` waits."""

    __slots__ = ("_channel", "_done", "_value", "_error")

    def __init__(self, channel: SocketChannel) -> None:
        self._channel = channel
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        if not self._done:
            self._done, self._value, self._error = True, value, error

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._channel._wait(self, timeout)
        if self._error is not None:
            raise self._error
        return self._value


class SocketChannel:
    """One ordered connection from a training worker's runner thread to a PS's data path.

    The runner thread writes each request at once and reads replies when it waits for one
    (earlier replies on the way are kept for their requests), on a non-blocking socket of its
    own: no hop to the event loop and back. While a send waits for room, it reads replies,
    so neither end can block the other. ``locate(address)`` gives ``(host, port)`` of the PS's
    data path (asked again at each reconnect); a broken connection fails every waiting
    request and the next request reconnects, as :class:`~._channel.Channel` does.
    """

    def __init__(self, address: str, locate: Callable[[str], tuple[str, int] | None],
                 connect_timeout: float, send_timeout: float,
                 where: tuple[str, int] | None = None,
                 probe: Callable[[str, float], bool] | None = None,
                 liveness: float | None = None) -> None:
        self.address = address
        self._locate = locate
        #: ``probe(address, limit)``: whether the PS answers; asked when a send makes no
        #: progress for ``liveness`` seconds (a frozen PS fails the send, not after minutes).
        self._probe = probe
        self._liveness = liveness
        #: Where the data path listens, once known (asked again after a lost connection).
        self._where = where
        self._connect_timeout = connect_timeout
        self._send_timeout = send_timeout
        self._sock: Any = None
        self._pending: deque[Reply] = deque()
        self._protocol = StreamProtocol(self._got, self._gone, "PS data path")
        self._closed = False

    def _got(self, msg: Any) -> None:
        if self._pending:
            self._pending.popleft()._set(msg)

    def _gone(self, exc: BaseException) -> None:
        pass  # the socket's errors are raised where they happen

    # -- connection ---------------------------------------------------------------------------
    def open(self) -> None:
        """Connect now (else the first request does); OSError if the PS cannot be reached."""
        if self._sock is None:
            self._open()

    def _open(self) -> Any:
        if self._closed:
            raise ParameterServerUnavailableError("the channel is closed")
        where, self._where = self._where or self._locate(self.address), None
        if where is None:
            raise ParameterServerUnavailableError(
                f"parameter server {self.address} has no data path (dataservice.ps.fast-path)")
        host, port = where
        sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._sock = sock
        self._protocol = StreamProtocol(self._got, self._gone, "PS data path")
        return sock

    def reset(self, error: BaseException) -> None:
        """Drop the connection and fail what waits (the runner thread, or teardown)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        err = self._unavailable(error)
        while self._pending:
            self._pending.popleft()._set(error=err)

    def _unavailable(self, error: BaseException) -> ParameterServerUnavailableError:
        if isinstance(error, ParameterServerUnavailableError):
            return error
        return ParameterServerUnavailableError(
            f"parameter server {self.address} is unreachable: {type(error).__name__}: {error}")

    def close(self) -> None:
        self._closed = True
        self.reset(ParameterServerUnavailableError("the channel is closed"))

    @property
    def idle(self) -> bool:
        return not self._pending

    # -- requests -----------------------------------------------------------------------------
    def submit(self, op: str, kwargs: dict[str, Any]) -> Reply:
        """Send ``op(**kwargs)`` now; the returned :class:`Reply` reads its answer."""
        reply = Reply(self)
        try:
            buffers = encode({"op": op, "reply": True, **kwargs})
        except Exception as e:  # noqa: BLE001 - this request's own error (it cannot be sent)
            reply._set(error=e)
            return reply
        try:
            sock = self._sock if self._sock is not None else self._open()
            self._pending.append(reply)
            self._send(sock, buffers, op)
        except Exception as e:  # noqa: BLE001 - a lost connection fails what waits on it
            if reply not in self._pending:
                self._pending.append(reply)
            self.reset(e)
        return reply

    def _send(self, sock: Any, buffers: list[Any], op: str) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        deadline = time.monotonic() + self._send_timeout
        while views:
            try:
                sent = sock.sendmsg(views)
            except BlockingIOError:
                sent = 0
            while sent and views:
                n = views[0].nbytes
                if sent >= n:
                    sent -= n
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            if views:  # no room: read replies meanwhile, so the server never blocks on us
                self._room(sock, op, deadline)

    def _room(self, sock: Any, op: str, deadline: float) -> None:
        """Wait until ``sock`` can take more bytes (reading replies meanwhile), probing the
        PS after each liveness timeout without room; give up at ``deadline``."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"could not send {op} to {self.address} within "
                                   f"{self._send_timeout:g} s (dataservice.ps.request-timeout)")
            step = left if self._liveness is None else min(left, self._liveness)
            readable, writable, _ = select.select([sock], [sock], [], step)
            if readable:
                self._pump(sock)
            if writable:
                return
            if not readable and self._probe is not None and self._liveness is not None \
                    and not self._probe(self.address, self._liveness):
                raise silent_server(self.address, op, self._liveness)

    def _pump(self, sock: Any) -> None:
        """Parse whatever the socket holds (never blocks)."""
        while True:
            buf = self._protocol.get_buffer(-1)
            try:
                n = sock.recv_into(buf)
            except BlockingIOError:
                return
            if n == 0:
                raise ConnectionError("the connection was closed")
            self._protocol.buffer_updated(n)

    def _wait(self, reply: Reply, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not reply.done():
            sock = self._sock
            try:
                if sock is None:
                    raise ConnectionError("the connection was closed")
                self._pump(sock)
                if reply.done():
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise concurrent.futures.TimeoutError()
                readable, _, _ = select.select([sock], [], [], left)
                if not readable and deadline is not None and time.monotonic() >= deadline:
                    raise concurrent.futures.TimeoutError()
            except concurrent.futures.TimeoutError:
                raise
            except Exception as e:  # noqa: BLE001 - fails this reply and every other
                self.reset(e)
                reply._set(error=self._unavailable(e))  # if it was not waiting on this socket
