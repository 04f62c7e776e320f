"""Sharding policies: how the data service divides a dataset among its workers."""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["STATIC_POLICIES", "ShardingPolicy", "parse_processing_mode"]


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


#: Static sharding policies: they need a fixed list of workers (``worker_addresses``).
STATIC_POLICIES = frozenset({ShardingPolicy.FILE, ShardingPolicy.DATA, ShardingPolicy.FILE_OR_DATA,
                             ShardingPolicy.HINT})
