"""Messages on plain asyncio streams: the data paths of the PS (``ps/_fastpath.py``) and of
the data service's elements (``service/client/_data_plane.py``).

Theory of operation
-------------------
A message through distributed's comms costs ~300-400 µs of CPU at each end (tornado streams,
per-message metrics, ``sizeof``, handler dispatch), and each reply's frames are received into
fresh memory. The hot requests of this package (a training step's PS requests, a consumer's
element requests) travel instead on asyncio connections of their own:

- **Wire format.** ``<u4 header bytes><u4 frames><u8 frame bytes> x frames``, the msgpack
  header, then the frames. Arrays (bare or wrapped by ``to_serialize``) are frames, described
  in the header by ``{"__f": index, "dtype", "shape"}``; ``to_serialize``'d bytes (the pickled
  exceptions of ``error_message``) travel inline; a :class:`~distributed.protocol.serialize.
  Serialized` (a batch of elements as the worker serialized it, compressed frames included)
  travels as its header and frames (``{"__s": first frame, "n": frames, "h": header}``) and
  is deserialized (decompressed first) as distributed's ``loads`` would; anything else msgpack
  cannot encode (arrays of Python objects, ...) travels pickled in a frame (``{"__p": index}``),
  as on Dask comms.
- **Receiving** (:class:`StreamProtocol`, an ``asyncio.BufferedProtocol``): frames of 64 KiB
  or more are received straight into the ndarray the handler (or the reader) gets, writable and
  owned (from a :class:`BufferPool` where the receiver gives one: the element ports' readers);
  smaller pieces go through one staging buffer. A message whose prefix announces more
  than the limits below closes the connection before anything is allocated. Each connection's
  socket gets distributed's TCP keepalive and user timeout (``distributed.comm.timeouts.tcp``):
  a peer behind a partition fails the connection as it fails a Dask comm.
- **Server** (:class:`StreamServer`): each connection's messages are answered one after the
  other by the handler of their ``op`` (the same coroutine as on Dask comms), so replies come
  back in the order of the requests. Connection tasks are owned and stopped at teardown.

These paths carry no encryption, like ``tcp://`` itself: TLS clusters keep distributed's comms.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import pickle
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np
from distributed._async_taskgroup import AsyncTaskGroup
from distributed.comm.tcp import set_tcp_timeout
from distributed.core import error_message
from distributed.protocol.compression import decompress
from distributed.protocol.serialize import Serialize, Serialized, merge_and_deserialize

logger = logging.getLogger(__name__)

__all__ = ["DIRECT", "BufferPool", "HIGH_WATER", "MAX_FRAMES", "MAX_HEADER", "MAX_MESSAGE", "PREFIX",
           "StreamProtocol", "StreamServer", "decode", "encode"]

PREFIX = struct.Struct("<II")
#: Frames at least this big are received in place; smaller pieces through the staging buffer.
DIRECT = 64 << 10
#: Bytes written but not yet sent above which a writer waits.
HIGH_WATER = 4 << 20
#: Bounds on a message, checked from its prefix before anything is allocated: a peer that
#: sends more (a stranger on the network, a corrupt stream) has its connection closed, so
#: it cannot make a server allocate gigabytes (a request or reply is far smaller).
MAX_HEADER = 64 << 20
MAX_FRAMES = 1 << 16
MAX_MESSAGE = 4 << 30



# -- codec ---------------------------------------------------------------------------------


def encode(msg: Any) -> list[Any]:
    """``msg`` as the buffers of one message (prefix and header first, then the frames)."""
    frames: list[memoryview] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, Serialized):  # e.g. a batch of elements: its frames as they are
            first = len(frames)
            frames.extend(memoryview(f) for f in obj.frames)
            return {"__s": first, "n": len(obj.frames), "h": obj.header}
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
    return [PREFIX.pack(len(header), len(frames)) + sizes + header, *frames]


def decode(header: bytes | memoryview, frames: list[np.ndarray]) -> Any:
    """The message of ``header`` whose arrays are views of ``frames`` (uint8 buffers)."""

    def hook(obj: dict[str, Any]) -> Any:
        if len(obj) == 3 and "__f" in obj:
            return frames[obj["__f"]].view(np.dtype(obj["dtype"])).reshape(obj["shape"])
        if len(obj) == 1 and "__p" in obj:
            return pickle.loads(frames[obj["__p"]])
        if len(obj) == 3 and "__s" in obj:
            first, header = obj["__s"], obj["h"]
            sub: list[Any] = frames[first:first + obj["n"]]
            if header.get("compression"):
                sub = decompress(header, sub)
            return merge_and_deserialize(header, sub)
        return obj

    return msgpack.unpackb(header, object_hook=hook, raw=False, use_list=True)



# -- receiving -----------------------------------------------------------------------------


class _Block:
    """A pooled receive buffer's owner: arrays made of it (``np.frombuffer``, and every view
    or unpickled element of those) keep it alive; once the last is gone its memory goes back
    to its pool (PEP 688 buffer protocol, Python 3.12)."""

    __slots__ = ("mem", "pool")

    def __init__(self, mem: np.ndarray, pool: BufferPool) -> None:
        self.mem = mem
        self.pool = pool

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self.mem)

    def __release_buffer__(self, view: memoryview) -> None:
        view.release()

    def __del__(self) -> None:
        try:
            self.pool._give_back(self.mem)
        except Exception:  # noqa: BLE001, S110 - at interpreter exit: the memory just goes
            pass


class BufferPool:
    """Receive buffers reused once whoever received them let go of them.

    A frame received in place becomes the memory of the arrays the receiver gets (the elements
    of a batch are views of it). Allocating each frame afresh costs a page fault per 4 KiB the
    first time it is written, which at a few GiB/s is much of a receiver's CPU. The pool hands
    out arrays over buffers of a size class (:meth:`size_class`), owned by a :class:`_Block`: when
    nothing made of an array is alive any more (in whichever thread lets go of the last
    element), the buffer goes back to the pool's free list, in O(1), for the next frame of its
    class. At most ``max_free`` bytes wait there; more are freed.
    """

    def __init__(self, max_free: int) -> None:
        self.max_free = max_free
        # reentrant: a block freed by a garbage collection that runs inside the lock (an
        # allocation under it) gives its buffer back from the same thread
        self._lock = threading.RLock()
        self._free: dict[int, list[np.ndarray]] = {}
        self.free_bytes = 0
        #: Buffers reused and made (tests and benchmarks).
        self.reused = 0
        self.made = 0

    @staticmethod
    def size_class(n: int) -> int:
        """The buffer size that holds ``n`` bytes: a multiple of a sixteenth of the next
        power of two (at most an eighth of ``n`` unused; 1 MiB frames take exactly 1 MiB)."""
        step = max((1 << max(n - 1, 1).bit_length()) >> 4, 4096)
        return -(-n // step) * step

    def get(self, n: int) -> np.ndarray:
        """A writable uint8 array of ``n`` bytes."""
        size = self.size_class(n)
        mem = None
        with self._lock:
            free = self._free.get(size)
            if free:
                mem = free.pop()
                self.free_bytes -= size
                self.reused += 1
            else:
                self.made += 1
        if mem is None:
            mem = np.empty(size, dtype=np.uint8)  # not zeroed: the frame overwrites it
        return np.frombuffer(_Block(mem, self), dtype=np.uint8, count=n)

    def _give_back(self, mem: np.ndarray) -> None:
        size = mem.nbytes
        with self._lock:
            if self.free_bytes + size <= self.max_free:
                self._free.setdefault(size, []).append(mem)
                self.free_bytes += size

    def clear(self) -> None:
        """Free every buffer that waits (those in use are freed when let go of)."""
        with self._lock:
            self._free.clear()
            self.free_bytes = 0


class _Comm:
    """What distributed's ``set_tcp_timeout`` reads of a comm."""

    def __init__(self, sock: Any) -> None:
        self.socket = sock

    def closed(self) -> bool:
        return False


class StreamProtocol(asyncio.BufferedProtocol):
    """Parses messages off a stream and hands each to ``on_message`` (or the error to
    ``on_lost`` when the connection ends)."""

    def __init__(self, on_message: Callable[[Any], None],
                 on_lost: Callable[[BaseException], None], label: str = "data path",
                 pool: BufferPool | None = None) -> None:
        self._on_message = on_message
        self.label = label
        #: Where frames received in place come from (None: a new array each).
        self.pool = pool
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
        transport.set_write_buffer_limits(high=HIGH_WATER)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # a peer that vanishes (a partition drops its packets) fails the connection after
            # distributed.comm.timeouts.tcp, as a Dask comm does, instead of never
            set_tcp_timeout(_Comm(sock))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._on_lost(exc or ConnectionError("the connection was closed"))

    def _direct(self) -> bool:
        """Whether the next bytes go straight into the current frame."""
        return self._have == 0 and self._header is not None \
            and self._frames[self._index].size - self._filled >= DIRECT

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
        pool = self.pool
        self._frames = [pool.get(n) if pool is not None and n >= DIRECT
                        else np.empty(n, dtype=np.uint8) for n in sizes]
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
                if self._have - pos < PREFIX.size:
                    break
                nheader, nframes = PREFIX.unpack_from(self._stage, pos)
                if nheader > MAX_HEADER or nframes > MAX_FRAMES:
                    self._refuse(f"a message announced a {nheader}-byte header and "
                                 f"{nframes} frames")
                    return
                need = PREFIX.size + 8 * nframes + nheader
                if self._have - pos < need:
                    if need > len(self._stage):
                        self._compact(pos)
                        pos = 0
                        self._grow(need)
                    break
                start = pos + PREFIX.size
                sizes = list(struct.unpack_from(f"<{nframes}Q", self._stage, start))
                if sum(sizes) > MAX_MESSAGE:
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
        logger.warning("dataservice: %s: closing the connection from %s: %s "
                       "(limits: %d-byte header, %d frames, %d bytes)", self.label, peer, why,
                       MAX_HEADER, MAX_FRAMES, MAX_MESSAGE)
        if self.transport is not None:
            self.transport.abort()

    def _compact(self, pos: int) -> None:
        if pos:
            rest = self._have - pos
            self._stage[:rest] = self._stage[pos:self._have]
            self._have = rest



# -- the server ----------------------------------------------------------------------------


class StreamServer:
    """A data path's server: answers requests with ``handler(op)`` (a function or coroutine
    function taking the request's fields, or None for an op it does not serve), one connection's
    messages one after the other (so its replies go back in the order of its requests).
    ``label`` names it in log lines."""

    def __init__(self, handler: Callable[[str], Callable[..., Awaitable[Any]] | None],
                 label: str = "data path") -> None:
        self._handler = handler
        self.label = label
        self._group = AsyncTaskGroup()
        self._server: asyncio.Server | None = None
        self._protocols: set[StreamProtocol] = set()
        self.port: int | None = None
        #: Connections accepted and requests answered (the dashboard's and tests' figures).
        self.connections = 0
        self.answered = 0

    async def start(self, host: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def _connection(self) -> StreamProtocol:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        protocol = StreamProtocol(queue.put_nowait, lambda exc: queue.put_nowait(None), self.label)
        self._protocols.add(protocol)
        self.connections += 1
        self._group.call_soon(self._serve, protocol, queue)
        return protocol

    async def _serve(self, protocol: StreamProtocol, queue: asyncio.Queue[Any]) -> None:
        try:
            while (msg := await queue.get()) is not None:
                reply = await self._answer(msg)
                self.answered += 1
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
        reply = handler(**{k: v for k, v in msg.items() if k not in ("op", "reply")})
        return await reply if inspect.isawaitable(reply) else reply

    def drop_connections(self) -> None:
        """Close every connection now (their peers see them lost)."""
        for protocol in list(self._protocols):
            if protocol.transport is not None:
                protocol.transport.abort()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_connections()
        await self._group.stop()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
