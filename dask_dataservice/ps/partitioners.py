"""Variable partitioners: how many shards a variable is split into along axis 0.

A partitioner is called with the variable's full ``shape`` and ``dtype`` and answers a list
with one entry per axis: ``[k, 1, 1, ...]`` means "split axis 0 into ``k`` shards". These
are TensorFlow's ``tf.distribute.experimental.partitioners`` with the same arithmetic, so a
model moves over with the same shard counts::

    >>> FixedShardsPartitioner(num_shards=2)((10, 3), "float32")
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), "float32")
    [6, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
    [6, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), "float32")
    [2, 1]
    >>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), "float32")
    [1, 1]

The rows of axis 0 are then dealt out with the "div" strategy (:func:`div_offsets`): shards
are contiguous, and when the rows do not divide evenly the first shards get one row more
(13 rows over 5 shards → sizes ``[3, 3, 3, 2, 2]``).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "div_offsets",
    "check_partitions",
]


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, int | np.integer):
        shape = (shape,)
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as e:
        raise ValueError(f"shape must be a sequence of non-negative ints, got {shape!r}") from e
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must be a sequence of non-negative ints, got {shape!r}")
    return dims


def _element_bytes(dtype: Any, bytes_per_string: int) -> int:
    dt = np.dtype(dtype)
    if dt.kind in "OSUT":  # strings (and objects, which is how numpy holds them) are estimated
        return bytes_per_string
    return int(dt.itemsize)


def _axis(shape: tuple[int, ...], axis: int) -> int:
    if axis != 0:
        raise ValueError(f"only axis 0 can be partitioned, got axis={axis}")
    if not shape:
        raise ValueError("a rank-0 (scalar) variable cannot be partitioned")
    return axis


def _positive(name: str, value: Any, integer: bool = True) -> Any:
    """``value`` if it is a number >= 1 (an int when ``integer``), else a TypeError or
    ValueError naming the argument (``FixedShardsPartitioner(0)`` is refused at once)."""
    kinds = (int, np.integer) if integer else (int, np.integer, float, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"Argument `{name}` must be {'an int' if integer else 'a number'}, "
                        f"got {value!r}")
    if not value >= 1 or (not integer and math.isinf(value)):
        raise ValueError(f"Argument `{name}` must be positive. Received: {value}")
    return int(value) if integer else value


class Partitioner(abc.ABC):
    """Decides how to shard a variable: ``partitioner(shape, dtype) -> [k, 1, ...]``."""

    @abc.abstractmethod
    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        """The number of partitions of each axis of a variable of this shape and dtype."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k.lstrip('_')}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))


class FixedShardsPartitioner(Partitioner):
    """Split axis 0 into ``num_shards`` shards (fewer if the axis has fewer rows)."""

    def __init__(self, num_shards: int) -> None:
        self._num_shards = _positive("num_shards", num_shards)

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        del dtype
        dims = _shape(shape)
        axis = _axis(dims, axis)
        result = [1] * len(dims)
        result[axis] = min(self._num_shards, dims[axis])
        return result


class MinSizePartitioner(Partitioner):
    """As many shards as possible, each at least ``min_shard_bytes``, at most ``max_shards``.

    The shard count is ``ceil(total_bytes / min_shard_bytes)``, capped by ``max_shards`` and
    by the number of rows, and at least 1. String elements count ``bytes_per_string`` bytes.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
                 bytes_per_string: int = 16) -> None:
        self._min_shard_bytes = _positive("min_shard_bytes", min_shard_bytes, False)
        self._max_shards = _positive("max_shards", max_shards)
        self._bytes_per_string = _positive("bytes_per_string", bytes_per_string)

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape)
        axis = _axis(dims, axis)
        total = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        wanted = int(math.ceil(total / self._min_shard_bytes))
        result = [1] * len(dims)
        result[axis] = max(1, min(dims[axis], self._max_shards, wanted))
        return result


class MaxSizePartitioner(Partitioner):
    """As few shards as possible, each at most ``max_shard_bytes`` (unless ``max_shards`` caps).

    A shard holds ``max(1, floor(max_shard_bytes / row_bytes))`` rows; the shard count is the
    number of such shards needed for all rows, capped by ``max_shards`` when given (then
    shards may exceed ``max_shard_bytes``).
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
                 bytes_per_string: int = 16) -> None:
        self._max_shard_bytes = _positive("max_shard_bytes", max_shard_bytes, False)
        self._max_shards = None if max_shards is None else _positive("max_shards", max_shards)
        self._bytes_per_string = _positive("bytes_per_string", bytes_per_string)

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape)
        axis = _axis(dims, axis)
        result = [1] * len(dims)
        rows = dims[axis]
        if rows == 0:  # nothing to split (TensorFlow divides by zero here)
            return result
        row_bytes = (math.prod(dims) / rows) * _element_bytes(dtype, self._bytes_per_string)
        rows_per_shard = max(1, math.floor(self._max_shard_bytes / row_bytes)) if row_bytes else rows
        shards = int(math.ceil(rows / rows_per_shard))
        if self._max_shards:
            shards = min(self._max_shards, shards)
        result[axis] = shards
        return result


def check_partitions(partitions: Any) -> int:
    """Validate a partitioner's answer and return the shard count of axis 0.

    The answer must be a list or tuple ``[k, 1, 1, ...]`` with ``k >= 1``.
    """
    ok = isinstance(partitions, list | tuple) and len(partitions) > 0
    if ok:
        try:
            values = [int(v) for v in partitions]
        except (TypeError, ValueError):
            ok = False
        else:
            ok = values[0] >= 1 and all(v == 1 for v in values[1:]) and all(
                float(v) == float(p) for v, p in zip(values, partitions, strict=True))
    if not ok:
        raise ValueError(
            "variable_partitioner must return a list/tuple whose elements are 1 besides the "
            f"first element (non-zero), got: {partitions!r}"
        )
    return int(partitions[0])


def div_offsets(rows: int, num_shards: int) -> list[int]:
    """Row offsets of "div" partitioning: ``num_shards + 1`` boundaries from 0 to ``rows``.

    >>> div_offsets(13, 5)
    [0, 3, 6, 9, 11, 13]
    >>> div_offsets(10, 4)
    [0, 3, 6, 8, 10]
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    num_shards = min(num_shards, rows) if rows else 1
    base, extra = divmod(rows, num_shards)
    offsets = [0]
    for i in range(num_shards):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets
