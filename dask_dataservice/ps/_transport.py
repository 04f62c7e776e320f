"""How variable handles reach parameter servers, from wherever they run.

- In a scheduled function on a training worker, the runner thread installs a
  :class:`Pipeline`: every PS gets one ordered connection (:class:`Channel`) from the worker.
  Updates are sent *without waiting* for their reply; a read waits for its own reply, which
  the PS sends only after every earlier message on that connection, so a step reads its own
  writes. The runner waits for all replies at the end of the batch (and whenever too many
  bytes are unacknowledged) and charges a failed update to the function that sent it.
- In any other Dask task: the worker's RPC pool, driven on the worker's event loop with
  ``distributed.utils.sync``. Requests go straight to the PS, never via the scheduler.
- On the coordinator: the strategy's client (its RPC pool and event loop).

Every blocking call here must come from a thread that is not the event loop it drives.
The "function context" (:class:`FunctionContext`) tags updates for exactly-once delivery.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections import deque
from typing import Any

from distributed import get_worker
from distributed.comm import connect
from distributed.core import clean_exception
from distributed.utils import sync

from ._exceptions import ParameterServerError, ParameterServerUnavailableError

#: Per-thread state: ``worker`` (the runner thread's worker), ``fn`` (FunctionContext).
_thread = threading.local()

#: The client of the most recently created strategy (coordinator-side fallback).
_default_client: weakref.ref | None = None


class FunctionContext:
    """The scheduled function running in this thread: its id and its update counter."""

    __slots__ = ("fn_id", "seq")

    def __init__(self, fn_id: int):
        self.fn_id = fn_id
        self.seq = 0


def set_default_client(client) -> None:
    global _default_client
    _default_client = weakref.ref(client)


def tag() -> dict:
    """Exactly-once tag for the next update: ``{"fn_id", "seq"}``, or ``{}`` outside a function."""
    ctx = getattr(_thread, "fn", None)
    if ctx is None:
        return {}
    ctx.seq += 1
    return {"fn_id": ctx.fn_id, "seq": ctx.seq}


def _route(client=None):
    worker = getattr(_thread, "worker", None)
    if worker is None:
        try:
            worker = get_worker()
        except ValueError:
            worker = None
    if worker is not None:
        return worker.loop, worker.rpc
    if client is None and _default_client is not None:
        client = _default_client()
    if client is None or client.status in ("closed", "closing"):
        raise ParameterServerError(
            "cannot reach the parameter servers from here: use the variable inside a function "
            "scheduled with ClusterCoordinator.schedule (or a Dask task), or on the "
            "coordinator while its ParameterServerStrategy's client is open")
    return client.loop, client.rpc


def check(response: Any, address: str, op: str) -> dict:
    """The response if OK; else raise the error it carries."""
    if response is None:
        raise ParameterServerError(
            f"{address} did not answer {op}: the parameter-server plugin is not installed there")
    if response.get("status") == "OK":
        return response
    _, exc, tb = clean_exception(**response)
    raise exc.with_traceback(tb)


async def call_async(rpc, address: str, op: str, kwargs: dict) -> dict:
    try:
        response = await getattr(rpc(address), op)(**kwargs)
    except (OSError, TimeoutError) as e:  # CommClosedError is an OSError
        raise ParameterServerUnavailableError(
            f"parameter server {address} is unreachable ({op}): {type(e).__name__}: {e}") from e
    return check(response, address, op)


async def _gather(rpc, calls):
    if len(calls) == 1:
        address, op, kwargs = calls[0]
        return [await call_async(rpc, address, op, kwargs)]
    return await asyncio.gather(*(call_async(rpc, a, op, kw) for a, op, kw in calls))


def call_many(calls: list[tuple[str, str, dict]], client=None) -> list[dict]:
    """Send ``[(address, op, kwargs)]`` in parallel and wait for all replies (in order)."""
    if not calls:
        return []
    pipeline = getattr(_thread, "pipeline", None)
    if pipeline is not None:
        return pipeline.call_many(calls)
    loop, rpc = _route(client)
    return sync(loop, _gather, rpc, calls)


def send_updates(calls: list[tuple[str, str, dict]], client=None, nbytes: int = 0) -> None:
    """Send updates; inside a scheduled function, without waiting for the replies."""
    if not calls:
        return
    pipeline = getattr(_thread, "pipeline", None)
    if pipeline is not None:
        pipeline.send(calls, nbytes)
    else:
        call_many(calls, client)


class Channel:
    """One ordered connection from a worker to one parameter server.

    Threads :meth:`submit` messages and get a ``concurrent.futures.Future`` of the reply; on
    the worker's event loop one writer sends them in order and one reader matches replies to
    futures in the same order (a server answers the messages of one comm one by one). A
    broken connection fails every waiting future; the next message reconnects.
    """

    def __init__(self, worker, address: str):
        self.worker = worker
        self.address = address
        self._loop = worker.loop.asyncio_loop
        self._lock = threading.Lock()
        self._inbox: deque = deque()
        self._scheduled = False
        self._pending: deque = deque()
        self._comm = None
        self._wlock: asyncio.Lock | None = None
        self._closed = False

    # -- any thread ----------------------------------------------------------------------
    def submit(self, op: str, kwargs: dict) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._inbox.append(({"op": op, "reply": True, **kwargs}, fut))
            wake = not self._scheduled
            self._scheduled = True
        if wake:
            self._loop.call_soon_threadsafe(self._kick)
        return fut

    # -- event loop ----------------------------------------------------------------------
    def _kick(self) -> None:
        asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        if self._wlock is None:
            self._wlock = asyncio.Lock()
        async with self._wlock:
            while True:
                with self._lock:
                    if not self._inbox:
                        self._scheduled = False
                        return
                    batch = list(self._inbox)
                    self._inbox.clear()
                sent = 0
                try:
                    if self._closed:
                        raise ParameterServerUnavailableError("the channel is closed")
                    if self._comm is None or self._comm.closed():
                        self._comm = await connect(self.address, deserialize=True,
                                                   **self.worker.connection_args)
                        self._comm.name = "dataservice-ps-channel"
                        # Messages here are small dicts and to_serialize'd arrays, cheap to
                        # (de)serialise at any size: skip the per-message sizeof() walk
                        # that decides whether to offload (de)serialisation to a thread.
                        self._comm.allow_offload = False
                        asyncio.ensure_future(self._read(self._comm))
                    for msg, fut in batch:
                        self._pending.append(fut)
                        sent += 1
                        await self._comm.write(msg)
                except Exception as e:  # noqa: BLE001 - fail what was sent and what waits
                    for _, fut in batch[sent:]:
                        self._pending.append(fut)
                    self._fail(e)

    async def _read(self, comm) -> None:
        try:
            while not comm.closed():
                reply = await comm.read()
                fut = self._pending.popleft()
                if not fut.done():
                    fut.set_result(reply)
        except Exception as e:  # noqa: BLE001
            if comm is self._comm:
                self._fail(e)

    def _fail(self, e: BaseException) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()
        err = ParameterServerUnavailableError(
            f"parameter server {self.address} is unreachable: {type(e).__name__}: {e}")
        while self._pending:
            fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(err)

    def close(self) -> None:
        self._closed = True
        if self._comm is not None:
            self._comm.abort()
            self._comm = None


class Pipeline:
    """The runner thread's view of its channels for one batch of scheduled functions."""

    def __init__(self, channels: dict[str, Channel], worker, max_bytes: int, max_messages: int):
        self._channels = channels
        self._worker = worker
        self._max_bytes = max_bytes
        self._max_messages = max_messages
        #: ``(future, address, op, function index, nbytes)`` of unacknowledged updates.
        self._outstanding: deque = deque()
        self._bytes = 0
        #: The function (index in the batch) now running, and errors charged to functions.
        self.current = 0
        self.errors: dict[int, BaseException] = {}

    def _channel(self, address: str) -> Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = Channel(self._worker, address)
        return ch

    def call_many(self, calls) -> list[dict]:
        futs = [self._channel(a).submit(op, kw) for a, op, kw in calls]
        out = []
        for fut, (address, op, _) in zip(futs, calls, strict=True):
            out.append(check(fut.result(), address, op))
        return out

    def send(self, calls, nbytes: int = 0) -> None:
        for address, op, kw in calls:
            fut = self._channel(address).submit(op, kw)
            self._outstanding.append((fut, address, op, self.current, nbytes))
            self._bytes += nbytes
        if len(self._outstanding) > self._max_messages or self._bytes > self._max_bytes:
            self.drain(keep=len(self._outstanding) // 2)

    def drain(self, keep: int = 0) -> None:
        """Wait for unacknowledged updates (all but the newest ``keep``)."""
        while len(self._outstanding) > keep:
            fut, address, op, index, nbytes = self._outstanding.popleft()
            self._bytes -= nbytes
            try:
                check(fut.result(), address, op)
            except Exception as e:  # noqa: BLE001 - charged to the function that sent it
                self.errors.setdefault(index, e)


def call(address: str, op: str, client=None, kwargs: dict | None = None) -> dict:
    return call_many([(address, op, kwargs or {})], client)[0]
