"""Lookup tables for training workers (TensorFlow's StaticHashTable / DistributedTable).

::

    with strategy.scope():
        vocab = dds.ps.tables.StaticHashTable(keys=np.array(["a", "b"]), values=np.array([0, 1]),
                                              default_value=-1)

    def step(iterator):
        ids = vocab.lookup(next(iterator)["words"])     # vectorised, local to the worker

Theory of operation
-------------------
- Created in ``strategy.scope()``, the table's keys and values are put once into the
  cluster, on the first parameter server (``client.scatter``, held by the table object on
  the coordinator). Outside a scope, the table is a plain local table.
- A table pickles small: its id, the data's key and where it is. A training worker that
  looks it up for the first time fetches the data from that PS (``get_data``) and builds
  its index: a sorted copy of the keys, so that ``lookup`` is one ``np.searchsorted`` over
  the batch (no Python loop per key). Later lookups on that worker are local. This is
  TensorFlow's lazy replication of a DistributedTable to each worker.
- A worker process that restarted is a new worker object without the index: it fetches
  the data again on its first lookup (TensorFlow re-creates the resource there).
- A table read from a file (``StaticHashTable.from_file``) is read by each worker itself
  from the path (which every worker must see), on first use.
- Keys missing from the table map to ``default_value``. Duplicate keys are refused.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from typing import Any

import numpy as np

from . import _routing
from .variables import current_strategy

__all__ = ["StaticHashTable", "DistributedTable"]

#: ``{worker: {table id: index}}``: a restarted worker is a new object, so it starts empty.
_INDEXES: weakref.WeakKeyDictionary[Any, dict[str, _Index]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class _Index:
    """Sorted keys and their values: vectorised lookups with ``np.searchsorted``."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, default: Any) -> None:
        keys, values = np.asarray(keys), np.asarray(values)
        if keys.ndim != 1 or values.shape[:1] != keys.shape:
            raise ValueError(f"a table needs 1-d keys and as many values: got keys of shape "
                             f"{keys.shape} and values of shape {values.shape}")
        order = np.argsort(keys, kind="stable")
        self.keys, self.values = keys[order], values[order]
        if len(keys) > 1:
            same = self.keys[1:] == self.keys[:-1]
            if same.any():
                raise ValueError(f"duplicate keys in a table: {self.keys[1:][same][:5].tolist()}")
        self.default = np.asarray(default, dtype=values.dtype)

    def lookup(self, keys: Any) -> np.ndarray:
        query = np.asarray(keys)
        flat = query.reshape(-1)
        out = np.empty((len(flat), *self.values.shape[1:]), dtype=self.values.dtype)
        out[...] = self.default
        if (self.keys.dtype.kind in "USO") != (flat.dtype.kind in "USO") and len(flat):
            raise TypeError(f"table keys are {self.keys.dtype}, looked up with {flat.dtype}")
        if len(self.keys):
            pos = np.searchsorted(self.keys, flat)
            pos = np.minimum(pos, len(self.keys) - 1)
            hit = self.keys[pos] == flat
            out[hit] = self.values[pos[hit]]
        return out.reshape(query.shape + self.values.shape[1:])


def _read_file(path: str, key_column: int, value_column: int, delimiter: str,
               key_dtype: Any, value_dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    keys, values = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            fields = line.split(delimiter)
            try:
                keys.append(fields[key_column] if key_column >= 0 else number - 1)
                values.append(fields[value_column] if value_column >= 0 else number - 1)
            except IndexError:
                raise ValueError(f"{path}:{number}: expected columns {key_column} and "
                                 f"{value_column}, got {len(fields)} fields") from None
    return np.asarray(keys, dtype=key_dtype), np.asarray(values, dtype=value_dtype)


class StaticHashTable:
    """An immutable table from keys to values (``tf.lookup.StaticHashTable``).

    Parameters
    ----------
    keys, values : array-like
        1-d keys (numbers or strings, no duplicates) and one value (row) per key.
    default_value :
        The value of keys that are not in the table.
    """

    def __init__(self, keys: Any, values: Any, default_value: Any) -> None:
        self._uid = secrets.token_hex(8)
        self._local: _Index | None = _Index(np.asarray(keys), np.asarray(values), default_value)
        self._default = default_value
        self._source: tuple[str, ...] | None = None
        #: ``(PS address, data key)`` of the table's data in the cluster (in a scope).
        self._remote: tuple[str, str] | None = None
        self._future: Any = None
        strategy = current_strategy.get()
        if strategy is not None and getattr(strategy, "_client", None) is not None:
            self._place(strategy)

    @classmethod
    def from_file(cls, path: str, key_column: int = 0, value_column: int = 1,
                  delimiter: str = "\t", key_dtype: Any = str, value_dtype: Any = np.int64,
                  default_value: Any = -1) -> StaticHashTable:
        """A table read from a text file by each worker on first use (TF's
        TextFileInitializer: a column index of -1 means the line number)."""
        table = cls.__new__(cls)
        table._uid = secrets.token_hex(8)
        table._default = default_value
        table._source = (str(path), str(key_column), str(value_column), delimiter,
                         np.dtype(key_dtype).str, np.dtype(value_dtype).str)
        table._remote, table._future, table._local = None, None, None
        return table

    def _place(self, strategy: Any) -> None:
        assert self._local is not None
        client, ps = strategy._client, strategy.ps_addresses[0]
        data = (self._local.keys, self._local.values)
        [self._future] = client.scatter([data], workers=[ps], hash=False)
        self._remote = (ps, self._future.key)

    # -- pickling: small, by reference ------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_future"] = None
        if self._remote is not None or self._source is not None:
            state["_local"] = None  # fetched (or read) on the worker
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- lookups --------------------------------------------------------------------------
    def lookup(self, keys: Any) -> np.ndarray:
        """Values of ``keys`` (any shape), ``default_value`` where a key is missing."""
        return self._index().lookup(keys)

    __getitem__ = lookup

    def size(self) -> int:
        return len(self._index().keys)

    def _index(self) -> _Index:
        if self._local is not None:
            return self._local
        worker = getattr(_routing._thread, "worker", None)
        with _LOCK:
            cached = _INDEXES.get(worker, {}).get(self._uid) if worker is not None else None
        if cached is not None:
            return cached
        index = self._build(worker)
        if worker is None:
            self._local = index
        else:
            with _LOCK:
                _INDEXES.setdefault(worker, {})[self._uid] = index
        return index

    def _build(self, worker: Any) -> _Index:
        if self._source is not None:
            path, kc, vc, delimiter, kd, vd = self._source
            keys, values = _read_file(path, int(kc), int(vc), delimiter, kd, vd)
            return _Index(keys, values, self._default)
        if self._remote is None or worker is None:
            raise RuntimeError("this table's data is in the cluster: look it up inside a "
                               "function scheduled on a training worker")
        address, key = self._remote
        keys, values = _routing.run_sync(worker.loop, _fetch, worker, address, key)
        return _Index(keys, values, self._default)

    def __repr__(self) -> str:
        where = "file" if self._source else "cluster" if self._remote else "local"
        return f"<dds.StaticHashTable {where} default={self._default!r}>"


async def _fetch(worker: Any, address: str, key: str) -> Any:
    """The table's ``(keys, values)`` from the worker that holds them (Dask's get_data
    handshake; a worker that answers "busy" is asked again, backing off, within the PS
    request timeout)."""
    import asyncio
    import time

    from distributed.worker import get_data_from_worker

    deadline, delay = time.monotonic() + _routing.timeout(), 0.01
    while True:
        reply = await get_data_from_worker(worker.rpc, [key], address, who=worker.address)
        if reply.get("status") != "busy" or time.monotonic() > deadline:
            break
        await asyncio.sleep(delay)  # Dask's own gather backs off the same way
        delay = min(2 * delay, 1.0)
    raw: Any = reply.get("data")
    data: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if key not in data:
        raise RuntimeError(f"the table's data {key!r} is not on {address} any more (the "
                           "parameter server restarted, or the table was deleted on the "
                           f"coordinator): {reply!r:.200}")
    return data[key]


#: TensorFlow's name for a table created in a ParameterServerStrategy's scope.
DistributedTable = StaticHashTable
