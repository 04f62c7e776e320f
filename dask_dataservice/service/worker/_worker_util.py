"""Small parts of the data worker (:mod:`.plugin`): the serialization of element
batches with an error that names the culprit."""

from __future__ import annotations

import pickle
from typing import Any

import dask.config
from dask.utils import parse_bytes
from distributed.protocol.serialize import Serialized, serialize

from ..protocol._frames import compress_frames
from ..protocol._messages import ElementBatch

__all__ = ["offload_bytes", "serialized_batch"]


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


