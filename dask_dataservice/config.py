"""Package configuration: ``dataservice.*`` keys in dask's config.

Defaults live in ``dataservice.yaml`` beside this file and are merged with
``dask.config.update_defaults`` at import, so users override them the dask way::

    dask.config.set({"dataservice.dispatcher.work-dir": "/var/lib/dds"})
    # or: DASK_DATASERVICE__DISPATCHER__WORK_DIR=/var/lib/dds

"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

_fn = os.path.join(os.path.dirname(__file__), "dataservice.yaml")
with open(_fn) as _f:
    _defaults = yaml.safe_load(_f)

dask.config.update_defaults(_defaults)


_MISSING = object()


def _default(key: str) -> Any:
    node: Any = _defaults["dataservice"]
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def get(key: str, default: Any = None) -> Any:
    """``dask.config.get("dataservice." + key)``, falling back to the packaged default.

    The fallback matters where dask's config was reset after import (test harnesses do).
    """
    value = dask.config.get(f"dataservice.{key}", default=_MISSING)
    if value is _MISSING:
        value = _default(key)
    return default if value is _MISSING else value


def get_int(key: str, minimum: int | None = None) -> int:
    """An integer key, at least ``minimum``; anything else is a ``ValueError`` naming it."""
    value = get(key)
    try:
        number = int(value)
        ok = number == value or isinstance(value, str) and value.strip() == str(number)
    except (TypeError, ValueError):
        ok = False
    if not ok or (minimum is not None and number < minimum):
        at_least = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"config dataservice.{key} must be an integer{at_least}, got {value!r}")
    return number


def get_seconds(key: str) -> float:
    """A duration key in seconds."""
    return float(parse_timedelta(get(key), default="s"))


def get_bytes(key: str) -> int:
    """A size key in bytes."""
    value = get(key)
    return int(parse_bytes(value) if isinstance(value, str) else value)
