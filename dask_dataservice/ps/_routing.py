"""How variable handles reach parameter servers, from wherever they run.

- In a scheduled function on a training worker, the runner thread installs a
  :class:`~._channel.Pipeline` (``_thread.pipeline``): ordered channels, updates not waited
  for (see :mod:`._channel`).
- In any other Dask task: the worker's RPC pool, driven on the worker's event loop.
- On the coordinator: the client of the strategy that created the handle. Handles name
  their strategy by id (``owner``); :func:`register_owner` maps live strategies' ids to
  their clients, weakly. There is no "most recent strategy": two strategies in one process
  never cross, and a handle whose strategy is gone says so.

Every blocking call here must come from a thread that is not the event loop it drives; any
other thread works, including one that runs an event loop of its own (a Jupyter kernel).
Every request is bounded by ``dataservice.ps.request-timeout``, except the bulk ones
(:data:`BULK_OPS`: creating, flushing, saving and restoring shards take as long as the data
needs). Every request, bulk ones included, is also guarded by liveness: when no reply came
for ``dataservice.ps.liveness-timeout``, the parameter server is probed (its event loop
answers while its threads do the work), and a PS that does not answer the probe within the
liveness timeout fails the request with ParameterServerUnavailableError (a frozen PS is
reported within two liveness timeouts, not after the request timeout, nor never).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from distributed import get_worker
from distributed.utils import sync

from .. import config
from .._rpc import raise_for_status
from ..errors import ParameterServerError, ParameterServerUnavailableError
from ._types import Call, Tag, silent_server

if TYPE_CHECKING:
    from distributed import Client
    from tornado.ioloop import IOLoop

__all__ = ["FunctionContext", "call", "call_many", "check", "client_of", "coalescing", "register_owner",
           "run_sync", "send_updates", "tag"]

#: Per-thread state: ``worker`` (the runner thread's worker), ``pipeline``, ``fn``.
_thread = threading.local()

#: ``{strategy id: strategy}`` of the live strategies of this process (weak values).
_owners: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class FunctionContext:
    """The scheduled function running in this thread: its id, its update counter, its worker."""

    __slots__ = ("fn_id", "seq", "worker_index")

    def __init__(self, fn_id: int, worker_index: int | None = None) -> None:
        self.fn_id = fn_id
        self.seq = 0
        self.worker_index = worker_index


def register_owner(uid: str, strategy: Any) -> None:
    """Let handles created by ``strategy`` (``owner=uid``) find its client here."""
    _owners[uid] = strategy


def owner(uid: str | None) -> Any:
    """The live strategy ``uid`` of this process, or None."""
    return None if uid is None else _owners.get(uid)


def client_of(uid: str | None, client: Client | None = None) -> Client | None:
    """The client to use on the coordinator for a handle of strategy ``uid``."""
    if client is not None:
        return client
    strategy = owner(uid)
    return None if strategy is None else cast("Client", strategy.client)


def tag() -> Tag:
    """Exactly-once tag for the next update: ``{"fn_id", "seq"}``, or ``{}`` outside a function."""
    ctx = getattr(_thread, "fn", None)
    if ctx is None:
        return {}
    ctx.seq += 1
    return {"fn_id": ctx.fn_id, "seq": ctx.seq}


#: Requests whose duration grows with the data (building, writing or reading whole shards):
#: not bounded by ``dataservice.ps.request-timeout``.
BULK_OPS = frozenset({"ps_create", "ps_flush", "ps_save", "ps_restore"})


def timeout() -> float:
    return config.get_seconds("ps.request-timeout")


def liveness() -> float:
    return config.get_seconds("ps.liveness-timeout")


async def answers(rpc: Callable[[str], Any], address: str, limit: float) -> bool:
    """Whether the server at ``address`` answers a probe (its event loop) within ``limit``."""
    try:
        await asyncio.wait_for(rpc(address).identity(), limit)
    except (OSError, TimeoutError):
        return False
    return True


def check(response: Any, call: Call) -> dict[str, Any]:
    """The response if OK; else raise the error it carries."""
    return raise_for_status(
        response, f"{call.op} request to {call.address}",
        missing="the parameter-server plugin is not installed there",
        missing_error=ParameterServerError, closing_error=ParameterServerUnavailableError)


def _route(client: Client | None = None,
           uid: str | None = None) -> tuple[IOLoop | None, Callable[[str], Any]]:
    worker = getattr(_thread, "worker", None)
    if worker is None:
        try:
            worker = get_worker()
        except ValueError:
            worker = None
    if worker is not None:
        return worker.loop, worker.rpc
    client = client_of(uid, client)
    if client is None or client.status in ("closed", "closing"):
        raise ParameterServerError(
            "cannot reach the parameter servers from here: use the variable inside a function "
            "scheduled with ClusterCoordinator.schedule (or a Dask task), or on the "
            "coordinator while its ParameterServerStrategy's client is open")
    return client.loop, client.rpc


async def _guarded(rpc: Callable[[str], Any], call: Call) -> Any:
    """The reply to ``call``; while none came, probe the PS every liveness timeout."""
    limit = liveness()
    request = asyncio.ensure_future(getattr(rpc(call.address), call.op)(**call.kwargs))
    try:
        while True:
            done, _ = await asyncio.wait({request}, timeout=limit)
            if done:
                return request.result()
            if not await answers(rpc, call.address, limit):
                raise silent_server(call.address, call.op, limit)
    finally:
        if not request.done():
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)


async def call_async(rpc: Callable[[str], Any], call: Call, limit: float | None) -> dict[str, Any]:
    if call.op in BULK_OPS:
        limit = None
    try:
        response = await asyncio.wait_for(_guarded(rpc, call), limit)
    except ParameterServerUnavailableError:
        raise
    except (OSError, TimeoutError) as e:  # CommClosedError is an OSError
        what = f"did not answer within {limit:g} s" if isinstance(e, TimeoutError) and limit \
            else f"is unreachable: {type(e).__name__}: {e}"
        raise ParameterServerUnavailableError(
            f"parameter server {call.address} {what} ({call.op})") from e
    return check(response, call)


async def _gather(rpc: Callable[[str], Any], calls: list[Call], limit: float | None) -> list[dict[str, Any]]:
    if len(calls) == 1:
        return [await call_async(rpc, calls[0], limit)]
    return list(await asyncio.gather(*(call_async(rpc, c, limit) for c in calls)))


def run_sync[T](loop: IOLoop | None, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on ``loop`` from this thread (any thread but the loop's own)."""
    return sync(loop, fn, *args, **kwargs)  # type: ignore[arg-type]  # a live client's loop


def call_many(calls: list[Call], client: Client | None = None, uid: str | None = None,
              limit: float | None = None) -> list[dict[str, Any]]:
    """Send ``calls`` in parallel and wait for all replies (in order).

    Each reply is awaited at most ``limit`` seconds (default: ``dataservice.ps.request-timeout``).
    """
    if not calls:
        return []
    calls = [c if isinstance(c, Call) else Call(*c) for c in calls]
    pipeline = getattr(_thread, "pipeline", None)
    if pipeline is not None:
        return pipeline.call_many(calls)  # type: ignore[no-any-return]
    loop, rpc = _route(client, uid)
    return run_sync(loop, _gather, rpc, calls, timeout() if limit is None else limit)


def send_updates(calls: list[Call], client: Client | None = None, nbytes: int = 0, uid: str | None = None) -> None:
    """Send updates; inside a scheduled function, without waiting for the replies."""
    if not calls:
        return
    pipeline = getattr(_thread, "pipeline", None)
    if pipeline is not None:
        pipeline.send([c if isinstance(c, Call) else Call(*c) for c in calls], nbytes)
    else:
        call_many(calls, client, uid)


def coalescing() -> bool:
    """Whether requests to one server travel together (always, but in a scheduled function
    whose runner sends each alone: ``dataservice.ps.coalesce-bytes: 0``)."""
    pipeline = getattr(_thread, "pipeline", None)
    return pipeline is None or bool(pipeline.coalescing)


def call(address: str, op: str, client: Client | None = None, kwargs: dict[str, Any] | None = None,
         uid: str | None = None) -> dict[str, Any]:
    return call_many([Call(address, op, kwargs or {})], client, uid)[0]
