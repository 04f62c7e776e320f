"""The ordered channel: one connection from a training worker to one parameter server.

Theory of operation
-------------------
A scheduled function runs in the runner thread of a training worker. Its updates go out
without waiting for their replies; its reads wait for their own reply. Read-your-writes
holds because a Dask server answers the messages of one comm one after the other: a read
sent after an update on the same comm is answered after the update was applied.

- :class:`Channel`: threads :meth:`~Channel.submit` messages and get a
  ``concurrent.futures.Future`` of the reply. One writer task on the worker's event loop
  sends them in order (woken through one :class:`~dask_dataservice._async.LoopWaker`), one
  reader task matches replies to futures in the same order. Both tasks belong to the
  plugin's :class:`~dask_dataservice._async.TaskGroup`. A broken connection fails every
  waiting future; the next message reconnects. A connection attempt gives up after
  ``dataservice.ps.connect-timeout``.
- :class:`Pipeline`: the runner thread's view of its channels (a :class:`Channel`, or the
  runner thread's own socket to a PS's data path, ``_fastpath.SocketChannel``: any
  :class:`OrderedChannel`) for one batch of scheduled functions: unacknowledged updates,
  charged to the function that sent them, and a wait for each reply bounded by
  ``dataservice.ps.request-timeout`` (a hung parameter server fails the function instead of
  hanging the runner forever; the channel is reset so later replies cannot be matched to
  the wrong request). A reply that has not come for
  ``dataservice.ps.liveness-timeout`` makes the runner probe the PS: one that does not
  answer the probe either fails the wait at once (a frozen PS holds a runner for about two
  liveness timeouts, not the whole request timeout).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .._async import LoopWaker, TaskGroup
from ..errors import ParameterServerUnavailableError
from ._types import Call, silent_server

__all__ = ["Channel", "Pipeline"]

#: ``connect(address) -> comm``: opens one comm to a parameter server.
Connector = Callable[[str], Awaitable[Any]]


class Channel:
    """One ordered connection to the parameter server at ``address`` (see the module doc).

    Parameters
    ----------
    loop
        The event loop that runs the connection (the worker's).
    address
        The parameter server.
    connect
        Opens a comm (``distributed.comm.connect`` with the worker's connection args; tests
        pass a fake).
    group
        Owns the writer and reader tasks; stopping it stops the channel.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, address: str, connect: Connector,
                 group: TaskGroup) -> None:
        self.address = address
        self._loop = loop
        self._connect = connect
        self._group = group
        self._lock = threading.Lock()
        #: Messages submitted by threads, not yet written: ``(msg, future)``.
        self._inbox: deque[Any] = deque()
        #: Futures of written messages, in the order their replies will come.
        self._pending: deque[Any] = deque()
        self._comm: Any = None
        self._writing = False
        self._closed = False
        self._waker = LoopWaker(loop, self._kick)

    # -- any thread ----------------------------------------------------------------------
    def submit(self, op: str, kwargs: dict[str, Any]) -> concurrent.futures.Future[Any]:
        """Queue ``op(**kwargs)``; the future gets the reply (or a connection error)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._inbox.append(({"op": op, "reply": True, **kwargs}, fut))
        self._waker.wake()
        return fut

    def reset(self, error: BaseException) -> None:
        """Drop the connection and fail what waits (from any thread; e.g. a timed-out reply)."""
        try:
            self._loop.call_soon_threadsafe(self._fail, error)
        except RuntimeError:  # the loop is closed: nothing is left to fail
            pass

    # -- event loop ----------------------------------------------------------------------
    def _kick(self) -> None:
        if not self._writing and not self._group.closed:
            self._writing = True
            self._group.spawn(self._write)

    async def _write(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._inbox:
                        return
                    batch = list(self._inbox)
                    self._inbox.clear()
                sent = 0
                try:
                    if self._closed:
                        raise ParameterServerUnavailableError("the channel is closed")
                    if self._comm is None or self._comm.closed():
                        self._comm = await self._connect(self.address)
                        self._group.spawn(self._read, self._comm)
                    for msg, fut in batch:
                        self._pending.append(fut)
                        sent += 1
                        await self._comm.write(msg)
                except Exception as e:  # noqa: BLE001 - fail what was sent and what waits
                    for _, fut in batch[sent:]:
                        self._pending.append(fut)
                    self._fail(e)
        finally:
            self._writing = False
            with self._lock:
                more = bool(self._inbox)
            if more:
                self._kick()

    async def _read(self, comm: Any) -> None:
        try:
            while not comm.closed():
                reply = await comm.read()
                if comm is not self._comm or not self._pending:
                    return  # reset: the futures of this comm were failed already
                fut = self._pending.popleft()
                if not fut.done():
                    fut.set_result(reply)
            error: Exception = ConnectionError("the connection was closed")
        except Exception as e:  # noqa: BLE001
            error = e
        if comm is self._comm:  # whatever ended the reads, nothing waits forever
            self._fail(error)

    def _fail(self, e: BaseException) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()
        err = e if isinstance(e, ParameterServerUnavailableError) else \
            ParameterServerUnavailableError(
                f"parameter server {self.address} is unreachable: {type(e).__name__}: {e}")
        while self._pending:
            fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(err)

    def close(self) -> None:
        """Close the connection and fail what waits (on the loop, at teardown)."""
        self._closed = True
        self._fail(ParameterServerUnavailableError("the channel is closed"))
        with self._lock:
            waiting, self._inbox = list(self._inbox), deque()
        for _, fut in waiting:
            if not fut.done():
                fut.set_exception(ParameterServerUnavailableError("the channel is closed"))

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing waiting for a reply (cleanup checks use it)."""
        with self._lock:
            return not self._inbox and not self._pending


class OrderedChannel(Protocol):
    """What :class:`Pipeline` needs of a channel: :class:`Channel`, or the runner thread's
    own socket (``_fastpath.SocketChannel``). ``submit`` returns something with
    ``result(timeout)`` and ``done()``, as a ``concurrent.futures.Future``."""

    def submit(self, op: str, kwargs: dict[str, Any]) -> Any: ...

    def reset(self, error: BaseException) -> None: ...


#: The op of a message that carries several requests to one PS (see :class:`Pipeline`).
BATCH_OP = "ps_batch"


class Pipeline:
    """The runner thread's view of its channels for one batch of scheduled functions.

    ``channel(address)`` returns (and creates) the channel to a PS; ``timeout`` bounds every
    wait for a reply; ``check(reply, call)`` turns a reply into a value or an exception;
    ``probe(address, limit)``, when given, says whether a PS answers within ``limit`` and is
    asked after each ``liveness`` seconds without a reply.

    Requests to one PS made together travel as one message (``ps_batch``: one reply, the
    PS runs them in order). With ``hold`` > 0, updates are not sent at once: they wait for
    the next request to their PS and travel in its message (the update of a training step
    and the gather of the next one: one round trip), or for :meth:`drain`, or until more
    than ``hold`` bytes (or ``max_messages`` updates) wait. A read still follows every
    update sent before it to its PS, so read-your-writes holds per shard.
    """

    def __init__(self, channel: Callable[[str], OrderedChannel],
                 check: Callable[[Any, Call], dict[str, Any]],
                 max_bytes: int, max_messages: int, timeout: float,
                 probe: Callable[[str, float], bool] | None = None,
                 liveness: float | None = None, hold: int = 0) -> None:
        self._channel = channel
        self._check = check
        self._probe = probe
        self._liveness = liveness
        self._max_bytes = max_bytes
        self._max_messages = max_messages
        self._timeout = timeout
        self._hold = hold
        #: Requests to one PS travel as one message (``hold`` 0: each alone, as before).
        self.coalescing = hold > 0
        #: ``(future, [(call, function index)], nbytes)`` of unacknowledged update messages.
        self._outstanding: deque[Any] = deque()
        self._bytes = 0
        #: ``{address: [(call, function index)]}``: updates held for the next message.
        self._held: dict[str, list[tuple[Call, int]]] = {}
        self._held_bytes = 0
        self._held_count = 0
        #: The function (index in the batch) now running, and errors charged to functions.
        self.current = 0
        self.errors: dict[int, BaseException] = {}

    def _result(self, fut: Any, call: Call) -> dict[str, Any]:
        deadline = time.monotonic() + self._timeout
        while True:
            left = deadline - time.monotonic()
            step = left if self._probe is None or self._liveness is None \
                else min(left, self._liveness)
            try:
                reply = fut.result(max(0.0, step))
                break
            except concurrent.futures.TimeoutError:
                pass
            if time.monotonic() >= deadline:
                err = ParameterServerUnavailableError(
                    f"parameter server {call.address} did not answer {call.op} within "
                    f"{self._timeout:g} s (dataservice.ps.request-timeout)")
            elif self._probe is not None and self._liveness is not None \
                    and not self._probe(call.address, self._liveness):
                err = silent_server(call.address, call.op, self._liveness)
            else:
                continue
            self._channel(call.address).reset(err)
            raise err from None
        return self._check(reply, call)

    # -- messages ----------------------------------------------------------------------------
    def _submit(self, address: str, calls: list[Call]) -> Any:
        """One message to ``address`` with ``calls`` (a plain request when there is one)."""
        if len(calls) == 1:
            return self._channel(address).submit(calls[0].op, calls[0].kwargs)
        return self._channel(address).submit(
            BATCH_OP, {"ops": [{"op": c.op, **c.kwargs} for c in calls]})

    def _settle(self, fut: Any, calls: list[Call]) -> list[dict[str, Any] | Exception]:
        """The checked reply (or the error) of each of ``calls`` sent as one message.

        A lost message (timeout, broken connection, silent PS) raises for all of them."""
        if len(calls) == 1:
            try:
                return [self._result(fut, calls[0])]
            except ParameterServerUnavailableError:
                raise
            except Exception as e:  # noqa: BLE001 - the request's own error
                return [e]
        ops = "+".join(dict.fromkeys(c.op for c in calls))
        replies = self._result(fut, Call(calls[0].address, ops, {}))["replies"]
        out: list[dict[str, Any] | Exception] = []
        for reply, call in zip(replies, calls, strict=True):
            try:
                out.append(self._check(reply, call))
            except Exception as e:  # noqa: BLE001 - charged to its own request
                out.append(e)
        return out

    def _take_held(self, address: str) -> list[tuple[Call, int]]:
        held = self._held.pop(address, [])
        self._held_count -= len(held)
        if not self._held:
            self._held_bytes = 0
        return held

    def _charge(self, held: list[tuple[Call, int]],
                results: list[dict[str, Any] | Exception]) -> None:
        for (_, index), result in zip(held, results, strict=True):
            if isinstance(result, Exception):
                self.errors.setdefault(index, result)

    # -- the runner thread's API -------------------------------------------------------------
    def call_many(self, calls: list[Call]) -> list[dict[str, Any]]:
        """Send ``calls`` (one message per PS, after the updates held for it) and wait."""
        by_address: dict[str, list[int]] = {}
        for i, call in enumerate(calls):
            # each call alone when not coalescing (keys: addresses, or call indices)
            by_address.setdefault(call.address if self.coalescing else str(i), []).append(i)
        sent = []
        for indices in by_address.values():
            address = calls[indices[0]].address
            held = self._take_held(address)
            group = [c for c, _ in held] + [calls[i] for i in indices]
            sent.append((self._submit(address, group), group, held, indices))
        out: list[dict[str, Any]] = [{}] * len(calls)
        error: Exception | None = None
        for fut, group, held, indices in sent:
            try:
                results = self._settle(fut, group)
            except Exception as e:  # noqa: BLE001 - the message is lost: its updates too
                self._charge(held, [e] * len(held))
                error = error or e
                continue
            self._charge(held, results[:len(held)])
            for i, result in zip(indices, results[len(held):], strict=True):
                if isinstance(result, Exception):
                    error = error or result
                else:
                    out[i] = result
        if error is not None:
            raise error
        return out

    def send(self, calls: list[Call], nbytes: int = 0) -> None:
        """Send updates without waiting for their replies (or hold them: see the class)."""
        if self._hold > 0:
            for call in calls:
                self._held.setdefault(call.address, []).append((call, self.current))
            self._held_bytes += nbytes
            self._held_count += len(calls)
            if self._held_bytes > self._hold or self._held_count > self._max_messages:
                self._flush()
            return
        for i, call in enumerate(calls):
            self._post([(call, self.current)], nbytes if i == 0 else 0)

    def _post(self, members: list[tuple[Call, int]], nbytes: int) -> None:
        fut = self._submit(members[0][0].address, [c for c, _ in members])
        self._outstanding.append((fut, members, nbytes))
        self._bytes += nbytes
        if len(self._outstanding) > self._max_messages or self._bytes > self._max_bytes:
            self.drain(keep=len(self._outstanding) // 2)

    def _flush(self) -> None:
        """Send every held update (one message per PS)."""
        nbytes = self._held_bytes
        for address in list(self._held):
            held = self._take_held(address)
            self._post(held, nbytes)
            nbytes = 0

    def drain(self, keep: int = 0) -> None:
        """Wait for unacknowledged updates (all but the newest ``keep`` messages); with
        ``keep=0`` the held ones are sent first."""
        if keep == 0 and self._held:
            self._flush()
        while len(self._outstanding) > keep:
            fut, members, nbytes = self._outstanding.popleft()
            self._bytes -= nbytes
            try:
                results = self._settle(fut, [c for c, _ in members])
            except Exception as e:  # noqa: BLE001 - charged to the functions that sent them
                results = [e] * len(members)
            self._charge(members, results)
