"""Dask collections as splittable sources: ``Dataset.from_dask``.

A ``dask.array.Array`` (its chunks along axis 0), a ``dask.dataframe.DataFrame`` (its
partitions) or a ``dask.bag.Bag`` (its partitions) is read one partition per split
(:class:`DaskPartition`). The partitions are computed **on the cluster, by the data worker
that reads them**, never on the client: the pipeline holds the collection's graph, or only the
keys of the partitions when the collection is persisted, so registering a 10 GB collection
sends kilobytes.

Theory of operation
-------------------
Client side. :class:`FromDask` keeps the user's collection (so iterating the dataset locally
computes it as Dask would). When it is pickled into a pipeline it keeps only:

- for a *persisted* collection (every partition is a Future in the graph): the keys of each
  partition (``partition_keys``), the id of the scheduler that holds them, and the name under
  which ``register_dataset`` publishes the futures on that scheduler (``pin_name``, see
  :func:`pin_persisted`: published data stays in memory while it is published, so it outlives
  the client objects that made it; ``client.unpublish_dataset(name)`` releases it, and so does
  the dispatcher when it frees the last dataset that lists the name in its metadata);
- a collection built on persisted ones (its graph holds Futures and tasks): the materialized
  graph with every Future replaced by its key (a Future cannot travel in a pickle: it belongs to
  a client; the worker re-resolves the keys against its own client) and each split's output
  keys, which the worker computes from the culled graph;
- otherwise the collection itself (its graph pickles by value).

Worker side. A data worker runs the pipeline in a thread of a Dask worker. For a persisted
partition whose keys are all in this worker's memory, the values are read in place (no
transfer, no task). Otherwise one small task pinned to this worker gathers the partition's
keys (Dask moves them between workers and counts the bytes in the workers' transfer logs) or
computes the partition from the graph; its result is read from this worker's memory (in place:
a persisted block is handed out as a read-only view). The wait gives up when the data-service
task is cancelled. In a Dask task (not a data-service thread) partitions are computed through
``worker_client()``, which secedes from the worker's thread pool. A key the
scheduler no longer knows is an error naming it (:class:`DaskPartitionLostError`); a key that is
being recomputed after a worker died is waited for (the scheduler recomputes persisted data
from its graph).

Locality. For a persisted collection, :func:`locality_metadata` gives the dispatcher each
split's keys; under DYNAMIC sharding it then hands every data worker the splits whose
partitions are in that worker's memory first (see ``service/dispatcher/_locality.py``).

Large in-memory inputs. A ``from_tensor_slices`` array larger than
``dataservice.client.scatter-threshold`` (and a collection that is not persisted whose
pickled graph is larger) does not travel in the pipeline: when the dataset is registered,
the array is scattered to the workers in row chunks (a collection is persisted) and the
pipeline carries :class:`ScatteredArray` references (or the persisted keys) instead, through
:func:`pickling_with` (``service/client/_scatter.py`` does the moving). The chunks are published
on the scheduler under the reference's ``pin_name``, so they live as long as the scheduler (or
until the dispatcher frees the dataset; see docs/sources-dask.md, "Large in-memory arrays").
A data worker reads a chunk as it reads a persisted partition: in place when it holds it, else
gathered by one task pinned to it.

``import dask_dataservice`` does not import Dask through this module: Dask is imported inside
the functions that need it, and everything that needs ``distributed`` (resolving Futures,
computing a partition on the data worker, in a task or locally) is the cluster side,
``dask_dataservice.service.worker.dask_source``, installed from above (:func:`set_cluster`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DaskPartitionLostError
from ._base import UNKNOWN
from ._pickling import pickling_with, replacement
from .sources import Source

__all__ = ["DaskPartition", "DaskPartitionLostError", "FromDask", "ScatteredArray",
           "locality_metadata", "pickling_with", "replacement", "SUPPORTED"]

#: The cluster side of this source (``dask_dataservice.service.worker.dask_source``): every
#: call that needs ``distributed`` (Futures, clients, the data worker running this thread).
#: The pipeline library imports no ``distributed``, so that side is installed from above: the
#: module registers itself when imported (the data-worker plugin imports it), and the package
#: root sets a loader that imports it on first use (a client, a local iteration).
_CLUSTER: Any = None
_CLUSTER_LOADER: list[Callable[[], object]] = []


def set_cluster(impl: Any) -> None:
    """Install the cluster side (``service.worker.dask_source`` passes itself)."""
    global _CLUSTER
    _CLUSTER = impl


def set_cluster_loader(loader: Callable[[], object]) -> None:
    """``loader()`` installs the cluster side when it is first needed (the package root's)."""
    _CLUSTER_LOADER[:] = [loader]


def _cluster() -> Any:
    if _CLUSTER is None and _CLUSTER_LOADER:
        _CLUSTER_LOADER[0]()
    if _CLUSTER is None:  # pragma: no cover - the package root sets the loader
        raise RuntimeError("from_dask() needs its cluster side: import dask_dataservice")
    return _CLUSTER


#: The collection types ``from_dask`` reads.
SUPPORTED = ("dask.array.Array", "dask.dataframe.DataFrame", "dask.bag.Bag")

#: Dataset metadata key of the locality hint (split index -> keys) sent to the dispatcher.
LOCALITY_KEY = "dask_locality"


@dataclass(frozen=True, slots=True)
class DaskPartition:
    """Partition ``index`` of a Dask collection (chunk ``index`` along axis 0 of an array)."""

    index: int


@dataclass(frozen=True, slots=True)
class _FutureRef:
    """A Future's key inside a pickled graph; resolved against the worker's client."""

    key: Any


@dataclass(frozen=True, slots=True)
class ScatteredArray:
    """An array of a ``from_tensor_slices`` source held by the cluster's workers in chunks of
    ``chunk_rows`` rows along axis 0 (``keys[i]``: rows ``i*chunk_rows`` on), published on the
    scheduler ``scheduler_id`` under ``pin_name``."""

    keys: tuple[str, ...]
    chunk_rows: int
    shape: tuple[int, ...]
    dtype: str
    scheduler_id: str
    pin_name: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (read-only), from the chunks that hold them."""
        first, last = start // self.chunk_rows, max(start, stop - 1) // self.chunk_rows
        keys = self.keys[first:last + 1]
        chunks = _CHUNK_CACHE.get(keys)
        if chunks is None:
            chunks = _cluster().chunk_values(self, keys)
            _CHUNK_CACHE.put(keys, chunks)
        block = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        offset = first * self.chunk_rows
        return block[start - offset:stop - offset]


class _ChunkCache:
    """The chunks this process read last (a chunk holds several splits, read one after the
    other), at most ``max_bytes``; thread-safe (pipelines run in threads)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: dict[tuple[Any, ...], list[Any]] = {}

    def get(self, keys: tuple[Any, ...]) -> list[Any] | None:
        with self._lock:
            value = self._items.pop(keys, None)
            if value is not None:
                self._items[keys] = value  # most recent last
            return value

    def put(self, keys: tuple[Any, ...], chunks: list[Any]) -> None:
        with self._lock:
            self._items[keys] = chunks
            total = sum(sum(getattr(c, "nbytes", 0) for c in v) for v in self._items.values())
            while len(self._items) > 1 and total > self.max_bytes:
                oldest = next(iter(self._items))
                total -= sum(getattr(c, "nbytes", 0) for c in self._items.pop(oldest))


_CHUNK_CACHE = _ChunkCache(64 << 20)


def _kind(collection: Any) -> str:
    """``"array"``, ``"dataframe"`` or ``"bag"``; TypeError naming the supported types."""
    module = type(collection).__module__ or ""
    if module.startswith("dask"):
        import dask.array as da

        if isinstance(collection, da.Array):
            return "array"
        import dask.bag as db

        if isinstance(collection, db.Bag):
            return "bag"
        if "dataframe" in module:  # dask.dataframe needs pandas: only imported for one
            import dask.dataframe as dd

            if isinstance(collection, dd.DataFrame):
                return "dataframe"
    kind = f"{module}.{type(collection).__qualname__}"
    raise TypeError(
        f"from_dask() reads a {', a '.join(SUPPORTED[:-1])} or a {SUPPORTED[-1]}; got {kind}"
        + (" (a dask.dataframe.Series: use series.to_frame())" if kind.endswith("Series") else ""))


def _flat(keys: Any) -> list[Any]:
    if isinstance(keys, list):
        return [k for sub in keys for k in _flat(sub)]
    return [keys]


def _pin_name(keys: Sequence[Any]) -> str:
    digest = hashlib.sha1(repr(sorted(map(repr, keys))).encode()).hexdigest()[:16]
    return f"dask-dataservice-{digest}"


class FromDask(Source):
    """The partitions of a Dask collection, one split each (see the module docstring)."""

    name = "from_dask"
    split_type = DaskPartition
    file_based = True  # a partition is a "file" for FILE sharding

    def __init__(self, collection: Any, rows: bool = True, locality: bool = True):
        if not isinstance(rows, bool):
            raise TypeError(f"rows must be a bool, got {type(rows).__name__}")
        if not isinstance(locality, bool):
            raise TypeError(f"locality must be a bool, got {type(locality).__name__}")
        self.locality = locality
        self.kind = _kind(collection)
        self.token = str(collection.__dask_tokenize__()) if hasattr(
            collection, "__dask_tokenize__") else str(collection.name)
        self.rows = rows
        self._collection: Any = collection
        #: A graph holding Futures (partly persisted), Futures as :class:`_FutureRef`: set
        #: when pickled; the worker computes a split's keys from it.
        self._graph: dict[Any, Any] | None = None
        self._cache_lock = threading.Lock()
        self._resolved: dict[Any, Any] | None = None
        if self.kind == "array":
            if collection.ndim < 1:
                raise ValueError("from_dask() needs an array with at least one dimension")
            if any(np.isnan(c) for c in collection.chunks[0]):
                raise ValueError("from_dask() needs known chunk sizes along axis 0: call "
                                 "array.compute_chunk_sizes() first")
            self.npartitions = int(collection.numblocks[0])
            self.block_grid: tuple[int, ...] = tuple(collection.numblocks[1:])
            self._length = int(collection.shape[0])
            self.dtype = str(collection.dtype)
        else:
            self.npartitions = int(collection.npartitions)
            self.block_grid = ()
            self._length = UNKNOWN
            self.dtype = ""
        graph = dict(collection.__dask_graph__())
        keys = collection.__dask_keys__()
        per_split = [_flat(keys[i]) for i in range(self.npartitions)]
        #: The output keys of each split (of the blocks of row block i, for an array).
        self.split_keys = tuple(tuple(ks) for ks in per_split)
        physical = [[_cluster().resolve(graph, k) for k in ks] for ks in per_split]
        self.partition_keys: tuple[tuple[Any, ...], ...] | None = None
        self.scheduler_id: str | None = None
        self.pin_name: str | None = None
        futures = self._futures(graph)
        if futures:
            client = futures[0].client
            self.scheduler_id = _scheduler_id(client)
            if all(k is not None for ks in physical for k in ks):
                self.partition_keys = tuple(tuple(ks) for ks in physical)
            self.pin_name = _pin_name([f.key for f in futures])

    @staticmethod
    def _futures(graph: dict[Any, Any]) -> list[Any]:
        return _cluster().graph_futures(graph)  # type: ignore[no-any-return]

    # -- pickling: keys or the graph, never Futures --------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        instead = replacement(self)
        if instead is not None:  # persisted at registration (see the module docstring)
            return instead.__getstate__()  # type: ignore[no-any-return]
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_collection", "_cache_lock", "_resolved")}
        state["_collection"] = None
        if self.partition_keys is None and self._collection is not None:
            graph = self._graph or _cluster().graph_state(self._collection)
            if graph is None:  # no Future in the graph: the collection pickles as it is
                state["_collection"] = self._collection
            state["_graph"] = graph
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache_lock = threading.Lock()
        self._resolved = None

    def params(self) -> tuple[Any, ...]:
        # persisted or not (same keys: another pipeline), and where
        return (self.kind, self.token, self.rows, self.npartitions, self.locality,
                self.partition_keys is not None, self.scheduler_id)

    def cardinality(self) -> int:
        return self._length if self.rows else (self.npartitions if self.kind == "array" else UNKNOWN)

    def splits(self, split_size: int | None = None) -> list[DaskPartition]:
        return [DaskPartition(i) for i in range(self.npartitions)]

    def read_split(self, split: DaskPartition) -> Iterator[Any]:
        if not 0 <= split.index < self.npartitions:
            raise IndexError(f"from_dask(): partition {split.index} out of range "
                             f"({self.npartitions} partitions)")
        return self._elements(self._partition(split.index))

    # -- elements of a computed partition ----------------------------------------------------
    def _elements(self, part: Any) -> Iterator[Any]:
        if self.kind == "array":
            block = np.asarray(part)
            return iter(block) if self.rows else iter((block,))
        if self.kind == "dataframe":
            cols = {name: _read_only(part[name].to_numpy()) for name in part.columns}
            if not self.rows:
                return iter((cols,))
            return ({name: col[j] for name, col in cols.items()} for j in range(len(part)))
        return iter(part)

    # -- computing a partition ------------------------------------------------------------------
    def _partition(self, i: int) -> Any:
        return _cluster().partition(self, i)

    def _assemble(self, values: list[Any]) -> Any:
        if self.kind != "array" or len(values) == 1:
            return values[0]
        grid = np.empty(self.block_grid, dtype=object)
        for pos, value in zip(np.ndindex(*self.block_grid), values, strict=True):
            grid[pos] = value
        return np.block(grid.tolist())

    def _graph_for(self, client: Any) -> dict[Any, Any]:
        return _cluster().graph_for(self, client)  # type: ignore[no-any-return]


def _cull(graph: dict[Any, Any], keys: Sequence[Any]) -> dict[Any, Any]:
    """The part of ``graph`` that ``keys`` need (Futures are leaves)."""
    out: dict[Any, Any] = {}
    work = list(keys)
    while work:
        key = work.pop()
        if key in out or key not in graph:
            continue
        node = out[key] = graph[key]
        work.extend(getattr(node, "dependencies", ()) or ())
    return out


def _partition_of(collection: Any, kind: str, i: int) -> Any:
    if kind == "array":
        return collection.blocks[i]
    if kind == "dataframe":
        return collection.partitions[i]
    return collection.to_delayed(optimize_graph=False)[i]


def _scheduler_id(client: Any) -> str:
    identity = getattr(client, "_scheduler_identity", None) or {}
    ident = identity.get("id")
    return str(ident) if ident else str(client.scheduler.address)


async def pin_persisted(client: Any, dataset_op: Any) -> dict[str, list[Any]]:
    """Registration hook (``register_dataset``, on the client's loop): the Futures of every
    persisted Dask-collection source, by the source's ``pin_name``, for ``register_dataset``
    to publish on the service's scheduler once the dataset is registered, so that their data
    stays in memory while the dataset is (until the dispatcher frees it); a collection
    persisted on another cluster is a ValueError naming both schedulers (before anything is
    sent)."""
    from ._base import walk

    pins: dict[str, list[Any]] = {}
    for op in walk(dataset_op):
        if not isinstance(op, FromDask) or op.scheduler_id is None:
            continue
        mine = _scheduler_id(client)
        if mine != op.scheduler_id:
            raise ValueError(_other_cluster(op.scheduler_id, mine, "the data service's scheduler"))
        if op._collection is not None and op.pin_name is not None:
            pins[op.pin_name] = op._futures(dict(op._collection.__dask_graph__()))
    return pins


def _other_cluster(theirs: str, mine: str, who: str) -> str:
    return (f"from_dask(): this collection was persisted on another Dask cluster (scheduler "
            f"{theirs}); {who} is {mine}. Persist it with a client of the cluster that runs "
            "the data service")


def _read_only(value: Any) -> Any:
    """A read-only view of an array (other values as they are)."""
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value = value.view()
        value.flags.writeable = False
    return value


def _gather_keys(*values: Any) -> list[Any]:
    return list(values)


def locality_metadata(dataset_op: Any) -> dict[str, Any]:
    """The dispatcher's locality hint for a pipeline whose source is a persisted Dask
    collection: ``{LOCALITY_KEY: [[key, ...] per split]}`` (keys as plain lists), else ``{}``."""
    from ._base import sources

    srcs = sources(dataset_op)
    if (len(srcs) != 1 or not isinstance(srcs[0], FromDask) or srcs[0].partition_keys is None
            or not srcs[0].locality):
        return {}
    return {LOCALITY_KEY: [[_plain_key(k) for k in ks] for ks in srcs[0].partition_keys]}


def _plain_key(key: Any) -> Any:
    if isinstance(key, tuple):
        return [_plain_key(k) for k in key]
    return key
