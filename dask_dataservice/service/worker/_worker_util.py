"""Small parts of the data worker (:mod:`.plugin`): the asyncio half of the request
order, the serialization of element batches with an error that names the culprit, and the
hand-offs between the worker's loop and its threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import cloudpickle
import dask.config
from dask.utils import parse_bytes
from distributed.protocol.serialize import Serialized, serialize

from ...data.splits import PipelineSplits
from ..protocol._frames import compress_frames
from ..protocol._messages import ElementBatch
from ..protocol._runs import Runs, join_runs

if TYPE_CHECKING:
    from .core import WorkerCore

__all__ = ["TurnFutures", "call_soon", "copy_outcome", "load_dataset", "noop", "offload_bytes",
           "serialized_batch"]

_Key = tuple[int, int | None]


class TurnFutures:
    """The futures of the request order that :class:`~.core.WorkerCore` decides: the
    replies kept until acknowledged, and the requests waiting for their turn (on the loop)."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self._kept: dict[_Key, dict[int, asyncio.Future[Any]]] = {}
        self._waiters: dict[tuple[_Key, int], asyncio.Future[None]] = {}

    def forget(self, key: _Key, seqs: Iterable[int]) -> None:
        replies = self._kept.get(key)
        if replies is not None:
            for seq in seqs:
                replies.pop(seq, None)

    def kept(self, key: _Key, seq: int) -> asyncio.Future[Any]:
        return self._kept[key][seq]

    def keep(self, key: _Key, seq: int) -> asyncio.Future[Any]:
        fut = self._kept.setdefault(key, {})[seq] = asyncio.get_running_loop().create_future()
        return fut

    def drop(self, key: _Key, seq: int, kept: asyncio.Future[Any] | None) -> None:
        """Request ``seq`` was cancelled: a request sent again computes its reply afresh."""
        if kept is None:
            return
        self.core.turn_abandoned(key, seq, kept=True)
        replies = self._kept.get(key)
        if replies is not None and replies.get(seq) is kept:
            del replies[seq]
        kept.cancel()

    async def wait_turn(self, key: _Key, seq: int, timeout: float) -> None:
        """Until request ``seq`` of ``key`` may run (the core said it waits), at most
        ``timeout`` (an earlier request never came: go on rather than hang)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[key, seq] = fut
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            if self._waiters.get((key, seq)) is fut:
                del self._waiters[key, seq]
            if not fut.done() or fut.cancelled():
                self.core.turn_abandoned(key, seq, waiting=True)

    def done(self, key: _Key, seq: int) -> None:
        nxt = self.core.turn_done(key, seq)
        if nxt is not None:
            fut = self._waiters.pop((key, nxt), None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def drop_task(self, task_id: int) -> None:
        """The task was cancelled: its kept replies go, its waiting requests go on."""
        for key in [k for k in self._kept if k[0] == task_id]:
            del self._kept[key]
        for waiter in [k for k in self._waiters if k[0][0] == task_id]:
            fut = self._waiters.pop(waiter)
            if not fut.done():
                fut.set_result(None)

    def clear(self) -> None:
        self._kept.clear()
        self._waiters.clear()


def offload_bytes() -> int:
    value = dask.config.get("distributed.comm.offload")
    return int(parse_bytes(value) if isinstance(value, str) else value or 0)


def serialized_batch(runner: Any, items: list[Any], codec: str | None = None,
                     runs: list[Runs | None] | None = None) -> Serialized:
    """``items`` serialized now, so that an element that cannot travel is an error naming
    its type, its task and its pipeline (serialized by the comm, it would only say "Could
    not serialize object of type ElementBatch", and the consumer would see a closed comm).

    ``codec``: compress the frames with it where it pays (see :mod:`._frames`); distributed's
    ``loads`` decompresses them on the reader. ``runs``: a tracking task's runs of each take
    that gave ``items`` (issue 25: one run list in the header, ``protocol._runs``)."""
    pieces = [r for r in runs or () if r is not None]
    joined = join_runs(pieces) if pieces else None
    try:
        header, frames = serialize(ElementBatch(items, joined), serializers=("dask",),
                                   on_error="raise")
    except Exception as e:
        raise _unpicklable_element(runner, items, e) from e
    if codec is not None:
        frames = compress_frames(header, frames, codec)
    return Serialized(header, frames)


def _unpicklable_element(runner: Any, items: list[Any], error: Exception) -> TypeError:
    """The error for a batch that failed to serialize: which element, of which pipeline."""
    cause: BaseException = error.__cause__ or error
    for x in items:
        try:
            pickle.dumps(x, protocol=5, buffer_callback=_drop)
        except Exception as e:  # noqa: BLE001 - this element is the culprit
            cause = e
            bad = f"an element of type {type(x).__module__}.{type(x).__qualname__}"
            break
    else:
        bad = "a batch of elements"
    pipeline = repr(runner.dataset)
    if len(pipeline) > 500:
        pipeline = pipeline[:500] + "...>"
    return TypeError(
        f"{bad} produced by task {runner.task_id} (dataset {runner.dataset_id}) cannot be "
        f"pickled to travel to the consumer: {type(cause).__name__}: {cause}. Pipeline: "
        f"{pipeline}. Elements must be picklable (no open files, locks, sockets or "
        "generators); convert them in a map() before they leave the worker")


def _drop(buffer: Any) -> None:
    return None


def copy_outcome(task: asyncio.Task[Any], out: concurrent.futures.Future[Any]) -> None:
    """Give ``out`` (a thread's future) the outcome of ``task`` (on the loop)."""
    if out.done():
        return
    if task.cancelled():
        out.cancel()
    elif task.exception() is not None:
        out.set_exception(task.exception())
    else:
        out.set_result(task.result())


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """``callback`` on ``loop`` from another thread; nothing once the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the loop is closed: the worker is gone
        pass


def noop() -> None:
    """A task for an executor's thread that does nothing (it is up)."""
    return None


def load_dataset(pipeline: bytes, splits: bytes | None) -> tuple[Any, list[Any] | None]:
    """A registered pipeline and its splits, unpickled (runs user code: a thread's job)."""
    dataset = cloudpickle.loads(pipeline)
    loaded: Any = cloudpickle.loads(splits) if splits else None
    if isinstance(loaded, PipelineSplits):  # the pipeline's own (its files): made here
        loaded = loaded.resolve(dataset)
    return dataset, loaded
