"""Small parts of the data worker (:mod:`.plugin`): bounded memories, request order,
and the serialization of element batches with an error that names the culprit."""

from __future__ import annotations

import asyncio
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import dask.config
from dask.utils import parse_bytes
from distributed.protocol.serialize import Serialized, serialize

from ..protocol._frames import compress_frames
from ..protocol._messages import ElementBatch

__all__ = ["Recent", "Turns", "offload_bytes", "serialized_batch"]


class Recent:
    """A set that remembers only its ``capacity`` most recent members."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[int, None] = OrderedDict()

    def add(self, item: int) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)


class Turns:
    """Runs requests numbered 0, 1, 2, ... one after the other, in number order, and keeps
    each reply until the consumer acknowledges it, so that a request sent again (its reply
    was lost on the way: a broken connection) gets the same reply, not the next elements."""

    def __init__(self) -> None:
        self.next = 0
        self._waiters: dict[int, asyncio.Future[None]] = {}
        #: ``{seq: reply}`` of the requests not acknowledged yet (consumers that send acks).
        self._replies: dict[int, asyncio.Future[Any]] = {}

    async def wait_turn(self, seq: int, timeout: float) -> None:
        if seq <= self.next:
            return
        fut = self._waiters[seq] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:  # an earlier request never came: go on rather than hang
            self._waiters.pop(seq, None)

    def done(self, seq: int) -> None:
        self.next = max(self.next, seq + 1)
        fut = self._waiters.pop(self.next, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def acknowledge(self, ack: int) -> None:
        """The consumer received every reply up to ``ack``: forget them."""
        for seq in [s for s in self._replies if s <= ack]:
            del self._replies[seq]

    def replay(self, seq: int) -> asyncio.Future[Any] | None:
        """The reply to request ``seq`` if it was (or is being) answered already."""
        return self._replies.get(seq)

    def keep(self, seq: int) -> asyncio.Future[Any]:
        """The future that will hold the reply to request ``seq``, kept until acknowledged."""
        fut = self._replies[seq] = asyncio.get_running_loop().create_future()
        return fut

    def forget(self, seq: int) -> None:
        self._replies.pop(seq, None)

    @property
    def kept(self) -> int:
        """Replies kept, waiting for their acknowledgement."""
        return len(self._replies)


def offload_bytes() -> int:
    value = dask.config.get("distributed.comm.offload")
    return int(parse_bytes(value) if isinstance(value, str) else value or 0)


def serialized_batch(runner: Any, items: list[Any], codec: str | None = None) -> Serialized:
    """``items`` serialized now, so that an element that cannot travel is an error naming
    its type, its task and its pipeline (serialized by the comm, it would only say "Could
    not serialize object of type ElementBatch", and the consumer would see a closed comm).

    ``codec``: compress the frames with it where it pays (see :mod:`._frames`); distributed's
    ``loads`` decompresses them on the reader."""
    try:
        header, frames = serialize(ElementBatch(items), serializers=("dask",), on_error="raise")
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


