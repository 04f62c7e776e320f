"""The PS data path: training workers' requests on plain asyncio streams (issue 16, target 1).

Theory of operation
-------------------
A training step sends its parameter servers a few messages, each a small dict plus numpy
arrays. Through distributed's comms such a message costs ~300-400 µs of CPU at each end
(tornado streams, per-message metrics, ``sizeof``, handler dispatch), several times what the
numpy work of a 4,096-id embedding step costs. Here the same messages travel on an asyncio
connection of their own:

- **Wire format.** ``<u4 header bytes><u4 frames><u8 frame bytes> x frames``, the msgpack
  header, then the frames. Arrays (bare or wrapped by ``to_serialize``) are frames, described
  in the header by ``{"__f": index, "dtype", "shape"}``; ``to_serialize``'d bytes (the pickled
  exceptions of ``error_message``) travel inline; anything else msgpack cannot encode (arrays
  of Python objects, ...) travels pickled in a frame (``{"__p": index}``), as on Dask comms.
- **Receiving** (:class:`_Protocol`, an ``asyncio.BufferedProtocol``): frames of 64 KiB or
  more are received straight into the ndarray the handler (or the step) gets, writable and
  owned; smaller pieces go through one staging buffer.
- **Server** (:class:`FastServer`): one per parameter server, on the host of its Dask address
  and a free port (``ps_fast_port`` tells it). Each connection's messages are answered one
  after the other by the same handlers as ``ps_*`` messages on Dask comms, so a worker reads
  its own writes. Connection tasks are owned and stopped at teardown.
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

import asyncio
import concurrent.futures
import logging
import pickle
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np
from distributed.protocol.serialize import Serialize

from .._async import TaskGroup
from .._rpc import error_message
from ..errors import ParameterServerUnavailableError
from ._types import silent_server

logger = logging.getLogger(__name__)

__all__ = ["FastServer", "Reply", "SocketChannel", "decode", "encode"]

_PREFIX = struct.Struct("<II")
#: Frames at least this big are received in place; smaller pieces through the staging buffer.
_DIRECT = 64 << 10
#: Bytes written but not yet sent above which a writer waits.
_HIGH_WATER = 4 << 20
#: Bounds on a message, checked from its prefix before anything is allocated: a peer that
#: sends more (a stranger on the network, a corrupt stream) has its connection closed, so
#: it cannot make the PS allocate gigabytes (a PS request or reply is far smaller).
_MAX_HEADER = 64 << 20
_MAX_FRAMES = 1 << 16
_MAX_MESSAGE = 4 << 30


# -- codec ---------------------------------------------------------------------------------


def encode(msg: Any) -> list[Any]:
    """``msg`` as the buffers of one message (prefix and header first, then the frames)."""
    frames: list[memoryview] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, Serialize):
            obj = obj.data
            if isinstance(obj, (bytes, bytearray)):
                return bytes(obj)
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            arr = obj if obj.flags.c_contiguous else obj.copy(order="C")  # keeps 0-d arrays 0-d
            frames.append(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size
                          else memoryview(b""))
            return {"__f": len(frames) - 1, "dtype": arr.dtype.str, "shape": list(arr.shape)}
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, tuple):
            return list(obj)
        # anything else (arrays of Python objects, ...) travels pickled, as on Dask comms
        frames.append(memoryview(pickle.dumps(obj, protocol=5)))
        return {"__p": len(frames) - 1}

    header = msgpack.packb(msg, default=default, use_bin_type=True)
    sizes = struct.pack(f"<{len(frames)}Q", *(f.nbytes for f in frames))
    return [_PREFIX.pack(len(header), len(frames)) + sizes + header, *frames]


def decode(header: bytes | memoryview, frames: list[np.ndarray]) -> Any:
    """The message of ``header`` whose arrays are views of ``frames`` (uint8 buffers)."""

    def hook(obj: dict[str, Any]) -> Any:
        if len(obj) == 3 and "__f" in obj:
            return frames[obj["__f"]].view(np.dtype(obj["dtype"])).reshape(obj["shape"])
        if len(obj) == 1 and "__p" in obj:
            return pickle.loads(frames[obj["__p"]])
        return obj

    return msgpack.unpackb(header, object_hook=hook, raw=False, use_list=True)


# -- receiving -----------------------------------------------------------------------------


class _Protocol(asyncio.BufferedProtocol):
    """Parses messages off a stream and hands each to ``on_message`` (or the error to
    ``on_lost`` when the connection ends)."""

    def __init__(self, on_message: Callable[[Any], None],
                 on_lost: Callable[[BaseException], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._stage = bytearray(256 << 10)
        self._view = memoryview(self._stage)
        self._have = 0  # bytes in the staging buffer not parsed yet
        #: The message being received: its header (None: reading a prefix), its frames,
        #: the frame being filled and how many of its bytes came.
        self._header: bytes | None = None
        self._frames: list[np.ndarray] = []
        self._index = 0
        self._filled = 0
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        #: Set once a malformed message closed the connection: nothing more is parsed.
        self.refused: str | None = None

    # -- writing: flow control ---------------------------------------------------------------
    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Wait while more than the high-water mark waits to be sent."""
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    # -- reading ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_HIGH_WATER)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._on_lost(exc or ConnectionError("the connection was closed"))

    def _direct(self) -> bool:
        """Whether the next bytes go straight into the current frame."""
        return self._have == 0 and self._header is not None \
            and self._frames[self._index].size - self._filled >= _DIRECT

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct():
            return memoryview(self._frames[self._index])[self._filled:]
        if self._have == len(self._stage):  # never with a parsed prefix; kept safe
            self._grow(2 * len(self._stage))
        return self._view[self._have:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.refused is not None:
            return
        if self._direct():
            self._filled += nbytes
            self._advance()
        else:
            self._have += nbytes
            self._parse()

    def _grow(self, size: int) -> None:
        # a new buffer: the transport may still hold a view of the old one
        stage = bytearray(size)
        stage[:self._have] = self._stage[:self._have]
        self._stage, self._view = stage, memoryview(stage)

    def _start(self, sizes: list[int], header: bytes) -> None:
        self._header = header
        self._frames = [np.empty(n, dtype=np.uint8) for n in sizes]
        self._index = self._filled = 0
        self._advance()

    def _advance(self) -> None:
        """Past full (and empty) frames; deliver the message once every frame came."""
        assert self._header is not None
        while self._index < len(self._frames) and self._filled >= self._frames[self._index].size:
            self._index += 1
            self._filled = 0
        if self._index == len(self._frames):
            msg = decode(self._header, self._frames)
            self._header, self._frames = None, []
            self._on_message(msg)

    def _parse(self) -> None:
        pos = 0
        while True:
            if self._header is None:
                if self._have - pos < _PREFIX.size:
                    break
                nheader, nframes = _PREFIX.unpack_from(self._stage, pos)
                if nheader > _MAX_HEADER or nframes > _MAX_FRAMES:
                    self._refuse(f"a message announced a {nheader}-byte header and "
                                 f"{nframes} frames")
                    return
                need = _PREFIX.size + 8 * nframes + nheader
                if self._have - pos < need:
                    if need > len(self._stage):
                        self._compact(pos)
                        pos = 0
                        self._grow(need)
                    break
                start = pos + _PREFIX.size
                sizes = list(struct.unpack_from(f"<{nframes}Q", self._stage, start))
                if sum(sizes) > _MAX_MESSAGE:
                    self._refuse(f"a message announced {sum(sizes)} bytes of frames")
                    return
                start += 8 * nframes
                pos = start + nheader
                self._start(sizes, bytes(self._view[start:pos]))
                continue
            frame = self._frames[self._index]
            take = min(frame.size - self._filled, self._have - pos)
            if take == 0:
                break
            frame[self._filled:self._filled + take] = np.frombuffer(
                self._view[pos:pos + take], dtype=np.uint8)
            self._filled += take
            pos += take
            self._advance()
        self._compact(pos)

    def _refuse(self, why: str) -> None:
        """A malformed stream: close the connection (the peer sees it closed)."""
        self.refused = why
        self._have = 0
        peer = None if self.transport is None else self.transport.get_extra_info("peername")
        logger.warning("dataservice: PS data path: closing the connection from %s: %s "
                       "(limits: %d-byte header, %d frames, %d bytes)", peer, why,
                       _MAX_HEADER, _MAX_FRAMES, _MAX_MESSAGE)
        if self.transport is not None:
            self.transport.abort()

    def _compact(self, pos: int) -> None:
        if pos:
            rest = self._have - pos
            self._stage[:rest] = self._stage[pos:self._have]
            self._have = rest


# -- the server ----------------------------------------------------------------------------


class FastServer:
    """A PS's data path: answers requests with ``handler(op)`` (a coroutine function taking
    the request's fields, or None for an op it does not serve), one connection's messages
    one after the other."""

    def __init__(self, handler: Callable[[str], Callable[..., Awaitable[Any]] | None]) -> None:
        self._handler = handler
        self._group = TaskGroup("ps-fast-path")
        self._server: asyncio.Server | None = None
        self._protocols: set[_Protocol] = set()
        self.port: int | None = None

    async def start(self, host: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def _connection(self) -> _Protocol:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        protocol = _Protocol(queue.put_nowait, lambda exc: queue.put_nowait(None))
        self._protocols.add(protocol)
        self._group.spawn(self._serve, protocol, queue)
        return protocol

    async def _serve(self, protocol: _Protocol, queue: asyncio.Queue[Any]) -> None:
        try:
            while (msg := await queue.get()) is not None:
                reply = await self._answer(msg)
                transport = protocol.transport
                if transport is None or transport.is_closing():
                    return
                if msg.get("reply", True):
                    try:
                        frames = encode(reply)
                    except TypeError as e:  # a reply this path cannot carry: say so
                        frames = encode(error_message(e))
                    transport.writelines(frames)
                    await protocol.drain()
        finally:
            self._protocols.discard(protocol)
            if protocol.transport is not None:
                protocol.transport.abort()

    async def _answer(self, msg: dict[str, Any]) -> Any:
        op = msg.get("op")
        handler = self._handler(op) if isinstance(op, str) else None
        if handler is None:
            return None  # as a Dask server answers an unknown op
        return await handler(**{k: v for k, v in msg.items() if k not in ("op", "reply")})

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for protocol in list(self._protocols):
            if protocol.transport is not None:
                protocol.transport.abort()
        await self._group.stop()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


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
        self._protocol = _Protocol(self._got, self._gone)
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
        self._protocol = _Protocol(self._got, self._gone)
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
