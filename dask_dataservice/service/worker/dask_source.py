"""The cluster side of ``Dataset.from_dask``: everything that needs ``distributed``.

:class:`~dask_dataservice.data.dask_source.FromDask` (the pipeline library's source, which
imports no ``distributed``) calls this module for what needs a cluster: the Futures of a
collection's graph (:func:`futures`, :func:`resolve`, :func:`graph_state`), and computing a
partition (:func:`partition`): on a data worker, in place from its memory or in one task
pinned to it, waiting unless the data-service task is cancelled; in a Dask task through
``worker_client()``; elsewhere as Dask computes it. See the theory of operation in
:mod:`dask_dataservice.data.dask_source`.

Importing this module installs it (:func:`~dask_dataservice.data.dask_source.set_cluster`);
the data-worker plugin imports it, and the package root loads it on first use elsewhere.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ...data import dask_source as _dask_source
from ...data.dask_source import (
    FromDask,
    ScatteredArray,
    _cull,
    _FutureRef,
    _gather_keys,
    _other_cluster,
    _partition_of,
    _read_only,
    _scheduler_id,
)
from ...errors import DaskPartitionLostError

__all__ = ["chunk_values", "current_worker", "graph_for", "graph_futures", "graph_state", "partition", "resolve"]


def graph_futures(graph: dict[Any, Any]) -> list[Any]:
    """The Futures in ``graph`` (a persisted or partly persisted collection's)."""
    from distributed import Future

    return [v for v in graph.values() if isinstance(v, Future)]


def resolve(graph: dict[Any, Any], key: Any) -> Any | None:
    """The key of the Future that ``key`` stands for (through aliases), or None."""
    from dask._task_spec import Alias
    from distributed import Future

    seen = 0
    value = graph.get(key)
    while isinstance(value, Alias) and seen < 64:
        key = value.target
        value = graph.get(key)
        seen += 1
    if isinstance(value, Future):
        return value.key
    return None


def graph_state(collection: Any) -> dict[Any, Any] | None:
    """The collection's graph with its Futures as :class:`_FutureRef`, or None when it holds
    no Future (then the collection pickles as it is)."""
    from dask._task_spec import convert_legacy_graph
    from distributed import Future

    graph = dict(collection.__dask_graph__())
    futures = {k: _FutureRef(v.key) for k, v in graph.items() if isinstance(v, Future)}
    if not futures:
        return None
    nodes = convert_legacy_graph({k: v for k, v in graph.items() if k not in futures})
    return {**nodes, **futures}


def partition(self: FromDask, i: int) -> Any:
    """Partition ``i`` of ``self`` (a :class:`FromDask`), computed where this thread runs."""
    found = _current_runner()
    if found is None:  # not a data-service pipeline thread
        return _partition_here(self, i)
    worker = found[0]
    client = worker._get_client()
    if self.scheduler_id is not None and _scheduler_id(client) != self.scheduler_id:
        raise ValueError(_other_cluster(self.scheduler_id, _scheduler_id(client),
                                        "this data worker's scheduler"))
    if self.partition_keys is not None:
        keys = self.partition_keys[i]
        values = _local_values(worker, keys)
        if values is None:
            _check_known(client, keys)
            values = _run_here(worker, client, _gather_keys, list(keys), client_keys=keys)
        # read in place: the pipeline must not change the persisted data
        return self._assemble([_read_only(v) for v in values])
    if self._collection is not None:
        return _run_here(worker, client, None, _partition_of(self._collection, self.kind, i))
    keys = self.split_keys[i]  # a graph holding Futures: compute the split's keys here
    futures = client.get(_cull(self._graph_for(client), keys), list(keys), sync=False,
                         workers=[worker.address], allow_other_workers=False)
    try:
        return self._assemble(_run_here(worker, client, _gather_keys, list(keys),
                                        client_keys=keys))
    finally:
        for future in futures:
            future.release()


def chunk_values(ref: ScatteredArray, keys: Sequence[Any]) -> list[Any]:
    """The chunks ``keys`` of a ``from_tensor_slices`` array scattered at registration
    (read-only): in place when this data worker holds them, else gathered by one task pinned
    to it; outside a data worker, through the process's client (or ``worker_client()``)."""
    import distributed

    def lost(key: Any) -> str:
        return (f"from_tensor_slices(): the chunk {key!r} of an array of shape {ref.shape} "
                "that was scattered to the cluster when the dataset was registered is no "
                f"longer on the cluster (published as {ref.pin_name!r}: the scheduler "
                "restarted, the dataset was freed, or the name was unpublished); register "
                "the dataset again")

    found = _current_runner()
    if found is None:
        in_task = current_worker() is not None
        clients = (distributed.worker_client() if in_task
                   else contextlib.nullcontext(distributed.get_client()))
        with clients as client:
            _check_known(client, keys, lost)
            values = client.gather([distributed.Future(k, client) for k in keys])
        return [_read_only(v) for v in values]
    worker = found[0]
    client = worker._get_client()
    if _scheduler_id(client) != ref.scheduler_id:
        raise ValueError(
            f"from_tensor_slices(): this pipeline's arrays were scattered to another Dask "
            f"cluster (scheduler {ref.scheduler_id}); this data worker's scheduler is "
            f"{_scheduler_id(client)}: register the dataset with the cluster that reads it")
    values = _local_values(worker, keys)
    if values is None:
        _check_known(client, keys, lost)
        values = _run_here(worker, client, _gather_keys, list(keys), client_keys=keys)
    return [_read_only(v) for v in values]


def _partition_here(self: FromDask, i: int) -> Any:
    """Outside a data worker (iterating the dataset locally, or in a Dask task): as Dask
    computes it. In a task, through ``worker_client()``, which secedes from the worker's
    thread pool: the computation may need the thread this task holds."""
    in_task = current_worker() is not None
    if not in_task and self._collection is not None:
        return _partition_of(self._collection, self.kind, i).compute()
    import distributed

    clients = (distributed.worker_client() if in_task
               else contextlib.nullcontext(distributed.get_client()))
    with clients as client:
        if self.partition_keys is not None:
            keys = self.partition_keys[i]
            _check_known(client, keys)
            return self._assemble(client.gather([distributed.Future(k, client) for k in keys]))
        if self._collection is not None:
            return client.compute(_partition_of(self._collection, self.kind, i)).result()
        keys = self.split_keys[i]
        return self._assemble(client.get(_cull(self._graph_for(client), keys), list(keys)))


def graph_for(self: FromDask, client: Any) -> dict[Any, Any]:
    """The pickled graph with its Futures re-resolved against ``client`` (once per
    process; the Futures keep their keys wanted while this pipeline is loaded)."""
    with self._cache_lock:
        if self._resolved is None:
            assert self._graph is not None
            from distributed import Future

            self._resolved = {k: Future(v.key, client) if isinstance(v, _FutureRef) else v
                              for k, v in self._graph.items()}
        return self._resolved


def current_worker() -> Any | None:
    """The Dask worker running this thread's Dask task or data-service task, or None."""
    try:
        from distributed import get_worker
    except ImportError:
        return None
    try:
        return get_worker()
    except ValueError:
        pass
    found = _current_runner()
    return None if found is None else found[0]


def _current_runner() -> tuple[Any, Any] | None:
    """``(worker, task runner)`` of the data-service task running in this thread, or None."""
    try:
        from distributed.worker import Worker
    except ImportError:
        return None

    me = threading.current_thread()
    for worker in list(Worker._instances):
        ext = getattr(worker, "extensions", {}).get("dataservice")
        for runner in list(getattr(ext, "_runners", ()) or ()):
            if getattr(runner, "thread", None) is me:
                return worker, runner
    return None


def _wait_unless_cancelled(fut: Any) -> None:
    """Wait for ``fut``; give up when this thread's data-service task is cancelled (its
    consumers left), so that teardown does not wait for a long partition computation."""
    from distributed import wait

    found = _current_runner()
    while True:
        try:
            wait([fut], timeout=0.5)
            return
        except TimeoutError:
            if found is not None and getattr(found[1], "cancelled", False):
                from ._buffers import TaskCancelled  # the task runner's own signal

                raise TaskCancelled from None


def _on_loop(worker: Any, fn: Callable[[], Any]) -> Any:
    from distributed.utils import sync

    async def call() -> Any:
        return fn()

    return sync(worker.loop, call)


def _local_values(worker: Any, keys: Sequence[Any]) -> list[Any] | None:
    """The values of ``keys`` if all are in this worker's memory (read on its loop), else None."""
    def read() -> list[Any] | None:
        data = worker.data
        if not all(k in data for k in keys):
            return None
        return [data[k] for k in keys]

    return _on_loop(worker, read)  # type: ignore[no-any-return]


def _lost_partition(key: Any) -> str:
    return (f"from_dask(): the persisted partition {key!r} is no longer on the cluster "
            "(its futures were released, or its worker died after they were); keep the "
            "persisted collection (or its published copy) alive while the dataset is read, "
            "or pass the collection before persisting it so that partitions are computed "
            "from the graph")


def _check_known(client: Any, keys: Sequence[Any],
                 lost: Callable[[Any], str] = _lost_partition) -> None:
    """Raise :class:`DaskPartitionLostError` naming a key the scheduler has forgotten."""
    holders = client.sync(client.scheduler.who_has, keys=list(keys))
    missing = [k for k in keys if not holders.get(k)]
    if not missing:
        return
    known = client.run_on_scheduler(_known_keys, keys=missing)
    gone = [k for k in missing if not known.get(repr(k))]
    if gone:
        raise DaskPartitionLostError(lost(gone[0]))


def _known_keys(dask_scheduler: Any, keys: list[Any]) -> dict[str, bool]:
    out = {}
    for key in keys:
        key = tuple(key) if isinstance(key, list) else key
        ts = dask_scheduler.tasks.get(key)
        out[repr(key)] = ts is not None and (ts.state in ("memory", "processing", "waiting",
                                                          "queued", "no-worker")
                                             or ts.run_spec is not None)
    return out


def _run_here(worker: Any, client: Any, fn: Callable[..., Any] | None, arg: Any,
              client_keys: Sequence[Any] = ()) -> Any:
    """Run ``fn(*futures of client_keys)`` or compute the collection ``arg`` in one task on
    this worker; read its result from this worker's memory."""
    from distributed import Future

    if fn is not None:
        fut = client.submit(fn, *[Future(k, client) for k in client_keys],
                            workers=[worker.address], allow_other_workers=False, pure=False)
    else:
        fut = client.compute(arg, workers=[worker.address], allow_other_workers=False)
    try:
        _wait_unless_cancelled(fut)  # the value stays where it was computed (this worker)
        if fut.status != "finished":
            fut.result()  # raises the task's error
        key = fut.key
        value = _on_loop(worker, lambda: worker.data[key] if key in worker.data else _MISSING)
        if value is _MISSING:
            value = fut.result()
        return value
    finally:
        fut.release()


_MISSING = object()


_dask_source.set_cluster(sys.modules[__name__])
