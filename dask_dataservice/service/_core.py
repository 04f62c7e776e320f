"""Types shared by the dispatcher, the data workers and the client.

- :class:`ShardingPolicy` and the processing-mode strings tf.data service accepts.
- :class:`ElementBatch`, the wire format of elements: one pickle (protocol 5) of the list of
  elements, with every numpy buffer out of band as its own zero-copy frame.
- Helpers to carry expected errors as values (``error_message`` / ``raise_for_status``).
"""

from __future__ import annotations

import enum
import pickle
from typing import Any

from distributed.core import clean_exception, error_message
from distributed.protocol import dask_deserialize, dask_serialize

__all__ = ["ShardingPolicy", "ElementBatch", "parse_processing_mode", "raise_for_status", "error_message"]


class ShardingPolicy(enum.IntEnum):
    """How the data service shards a dataset among its workers (tf.data's names).

    - ``OFF``: every worker runs the whole pipeline ("parallel_epochs").
    - ``DYNAMIC``: the dispatcher hands out splits of the source on demand; each element is
      produced once ("distributed_epoch").
    - ``FILE``, ``DATA``, ``FILE_OR_DATA``, ``HINT``: static sharding over a fixed worker list.
    """

    OFF = 0
    DYNAMIC = 1
    FILE = 2
    DATA = 3
    FILE_OR_DATA = 4
    HINT = 5


_MODE_ALIASES = {"parallel_epochs": ShardingPolicy.OFF, "distributed_epoch": ShardingPolicy.DYNAMIC}


def parse_processing_mode(mode: Any) -> ShardingPolicy:
    """Turn a ``ShardingPolicy``, its name, or a tf.data mode string into a ShardingPolicy."""
    if isinstance(mode, ShardingPolicy):
        return mode
    if isinstance(mode, int) and not isinstance(mode, bool):
        try:
            return ShardingPolicy(mode)
        except ValueError:
            pass
    if isinstance(mode, str):
        key = mode.strip()
        if key.lower() in _MODE_ALIASES:
            return _MODE_ALIASES[key.lower()]
        try:
            return ShardingPolicy[key.upper()]
        except KeyError:
            pass
    valid = ", ".join([p.name for p in ShardingPolicy] + list(_MODE_ALIASES))
    raise ValueError(f"processing_mode must be one of {valid}; got {mode!r}")


class ElementBatch:
    """A list of elements on the wire (see module docstring)."""

    __slots__ = ("items",)

    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)


@dask_serialize.register(ElementBatch)
def _serialize_batch(batch: ElementBatch) -> tuple[dict, list]:
    buffers: list = []
    data = pickle.dumps(batch.items, protocol=5, buffer_callback=buffers.append)
    return {"buffers": len(buffers)}, [data, *(b.raw() for b in buffers)]


@dask_deserialize.register(ElementBatch)
def _deserialize_batch(header: dict, frames: list) -> ElementBatch:
    return ElementBatch(pickle.loads(frames[0], buffers=frames[1:]))


class DispatcherUnavailableError(ConnectionError):
    """The dispatcher is shutting down (or restarting); retry against the next one."""


def raise_for_status(response: Any, what: str = "request") -> dict:
    """Return ``response`` if it is OK; re-raise the remote exception it carries otherwise.

    Handlers answer ``{"status": "OK", ...}`` or ``error_message(e)``; an unknown op answers
    ``None`` (the dispatcher plugin is not installed).
    """
    if response is None:
        raise RuntimeError(
            f"the data service did not answer the {what}: is dask_dataservice installed on "
            "this cluster? (dds.install(client), or start the scheduler and workers with "
            "--preload dask_dataservice)"
        )
    status = response.get("status")
    if status == "OK":
        return response
    if status == "closing":
        raise DispatcherUnavailableError(f"the dispatcher is shutting down ({what})")
    _, exc, tb = clean_exception(**response)
    raise exc.with_traceback(tb)
