"""Wire types of parameter-server training: what travels between handles and servers.

Rules
-----
- Every request is a :class:`Call` ``(address, op, kwargs)``; every reply is a dict, OK
  replies are the TypedDicts below, failures are ``error_message(e)`` values turned back into
  exceptions by :func:`dask_dataservice._rpc.raise_for_status` (see ``_routing.check``).
- Arrays travel with :func:`wire`: tiny numeric arrays inline in the msgpack message (for a
  scalar that halves the cost of an update), larger ones as ``to_serialize`` frames.
  :func:`unwire` turns either form back into an ndarray.
- Updates sent from a scheduled function carry a :class:`Tag` (function id and sequence),
  so a parameter server applies each at most once.

This module is a leaf: it imports nothing else of the package but its errors.
"""

from __future__ import annotations

from typing import Any, NamedTuple, NotRequired, TypedDict

import numpy as np
from distributed.protocol.serialize import to_serialize

from ..errors import ParameterServerUnavailableError

__all__ = [
    "Call",
    "IndexedSlices",
    "INLINE_BYTES",
    "SCATTER_KINDS",
    "ShardInfo",
    "Tag",
    "UPDATE_KINDS",
    "unwire",
    "wire",
]

#: Arrays up to this many bytes travel inline in the message rather than as a frame.
INLINE_BYTES = 256

#: Whole-value updates (``ps_update`` ``kind``).
UPDATE_KINDS = ("assign", "assign_add", "assign_sub")

#: Row updates (``ps_scatter`` ``kind``).
SCATTER_KINDS = ("add", "sub", "update", "mul", "div", "max", "min")


class Call(NamedTuple):
    """One request to one parameter server."""

    address: str
    op: str
    kwargs: dict[str, Any]


class Tag(TypedDict, total=False):
    """Exactly-once tag of an update sent from a scheduled function."""

    fn_id: int
    seq: int


class IndexedSlices(NamedTuple):
    """A sparse gradient: ``values[i]`` is the gradient of row ``indices[i]`` of a variable."""

    values: Any
    indices: Any
    dense_shape: Any = None


class ShardInfo(NamedTuple):
    """TensorFlow's ``ShardInfo``: the shape of one partition and its offset on every axis."""

    shape: tuple[Any, ...]
    offset: tuple[Any, ...]


# -- replies (status "OK") ------------------------------------------------------------------


class CreateReply(TypedDict):
    status: str
    #: The initializer built the whole value and the PS sliced its rows out.
    sliced: bool
    existed: bool


class ValueReply(TypedDict):
    status: str
    value: Any


class UpdateReply(TypedDict):
    status: str
    #: False when the PS had already applied this (fn_id, seq): a re-run function.
    applied: bool
    value: NotRequired[Any]


class ClosuresReply(TypedDict):
    status: str
    #: ``[(ok, pickled result or error)]``, one per closure that ran (a failure stops the batch).
    results: list[Any]
    #: The index from which the functions were given back (``ps_withdraw``): none of those ran.
    cut: NotRequired[int]


# -- arrays on the wire ---------------------------------------------------------------------


def wire(x: Any) -> Any:
    """``x`` as it should travel: inline for tiny numeric arrays, else a serialized frame."""
    x = np.asarray(x)
    if x.nbytes <= INLINE_BYTES and x.dtype.kind in "biuf":
        if x.size == 0:  # a list keeps no shape of an empty array, e.g. (0, 4)
            return {"__a": [], "dtype": x.dtype.str, "shape": list(x.shape)}
        return {"__a": x.tolist(), "dtype": x.dtype.str}
    if not x.flags.c_contiguous:
        x = x.copy(order="C")
    return to_serialize(x)


def unwire(x: Any) -> Any:
    """An array sent with :func:`wire` back as an ndarray (other values unchanged)."""
    if type(x) is dict and "__a" in x:
        if "shape" in x:
            return np.zeros(x["shape"], dtype=x["dtype"])  # empty (see wire)
        return np.asarray(x["__a"], dtype=x["dtype"])
    return x


def silent_server(address: str, op: str, limit: float) -> ParameterServerUnavailableError:
    """A PS that answered neither ``op`` nor a liveness probe within ``limit`` seconds."""
    return ParameterServerUnavailableError(
        f"parameter server {address} did not answer a liveness probe within {limit:g} s "
        f"during {op} (dataservice.ps.liveness-timeout): frozen, hung or unreachable")
