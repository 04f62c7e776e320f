"""ParameterServerStrategy: variables on parameter servers, functions on training workers.

Roles come from Dask worker resources: workers with ``dataservice.ps.resource`` (default
``ps``) are parameter servers (PS); the others train (or, when any worker has
``dataservice.ps.worker-resource``, only those); the process holding the client is the
coordinator. Like TensorFlow, at least one PS and one training worker are required::

    strategy = dds.ParameterServerStrategy(client, variable_partitioner=
        dds.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2))
    with strategy.scope():
        w = dds.Variable(np.zeros(10, "f4"), name="w")           # on PS 0
        emb = dds.Variable(lambda shape, dtype, partition_offset: np.zeros(shape, dtype),
                           shape=(100_000, 16), dtype="f4", name="emb")   # ShardedVariable

TensorFlow's cluster setup works too: ``ParameterServerStrategy(cluster_resolver=
dds.TFConfigClusterResolver())`` reads ``TF_CONFIG`` and maps its ``chief`` / ``ps`` /
``worker`` tasks onto a Dask scheduler and workers (see :mod:`.cluster_resolver`).

Placement is round-robin: each variable, and each shard of a partitioned variable, goes to
the next PS in turn. Partitioning follows TensorFlow: the partitioner decides the number of
shards of axis 0 (rank-0 variables are never partitioned), rows are dealt out with the
"div" strategy, and a callable ``initial_value`` given with ``shape`` and ``dtype`` is
called on each PS for its own partition only. An array ``initial_value`` (or a callable
without ``shape``/``dtype``) is built whole on the coordinator and sliced, and a warning
says so when the variable is large (``dataservice.ps.large-variable-elements``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import math
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle
import numpy as np
from distributed import Client, get_worker

from .. import config
from . import _kernels, _routing, _scope_hooks
from ._runner_plugin import TrainingWorkerPlugin
from ._types import Call, wire
from .cluster_resolver import ClusterResolver, Connection, connect, resolver_from_environment
from .partitioners import check_partitions, div_offsets
from .per_worker import PerWorkerVariable
from .server import ParameterServerPlugin
from .variables import ShardedVariable, Variable, current_strategy

logger = logging.getLogger(__name__)

__all__ = ["ParameterServerStrategy", "InputContext", "ReduceOp", "ValueContext", "cluster_roles"]

#: The variable new variables are colocated with (``strategy.extended.colocate_vars_with``).
_colocate: contextvars.ContextVar[Variable | None] = contextvars.ContextVar("dds_ps_colocate", default=None)

_INEFFICIENT_INIT = (
    "Large variable {name!r} is partitioned but was built whole on the coordinator and then "
    "sliced into its shards. To build each shard on its parameter server instead, give "
    "`shape` and `dtype` and a callable `initial_value(shape, dtype, partition_offset)`."
)


def _identity(client: Client) -> dict[str, Any]:
    # distributed.utils.sync (not client.sync): works from any thread but the client's loop,
    # also one running an event loop of its own (a Jupyter kernel)
    assert client.scheduler is not None  # a connected client
    identity: dict[str, Any] = _routing.run_sync(client.loop, client.scheduler.identity)
    workers: dict[str, Any] = identity.get("workers", {})
    return workers


def cluster_roles(client: Client) -> tuple[list[str], list[str]]:
    """``(ps_addresses, worker_addresses)`` of the cluster, each sorted by worker name."""
    return _roles(_identity(client))


def _names(client: Client) -> dict[str, str]:
    return {a: str(w.get("name", "")) for a, w in _identity(client).items()}


def _roles(workers: dict[str, Any]) -> tuple[list[str], list[str]]:
    ps_res, worker_res = config.get("ps.resource"), config.get("ps.worker-resource")

    def key(addr: str) -> tuple[str, str]:
        return (str(workers[addr].get("name", "")), addr)

    ps = sorted((a for a, w in workers.items() if (w.get("resources") or {}).get(ps_res)), key=key)
    rest = [a for a in workers if a not in ps]
    tagged = [a for a in rest if (workers[a].get("resources") or {}).get(worker_res)]
    return ps, sorted(tagged or rest, key=key)


class InputContext:
    """What a ``dataset_fn`` learns about its input pipeline (TensorFlow's InputContext)."""

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1) -> None:
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                             f"{self.num_replicas_in_sync} replicas")
        return global_batch_size // self.num_replicas_in_sync


class ReduceOp:
    """TensorFlow's ``tf.distribute.ReduceOp`` names (strings work as well)."""

    SUM = "SUM"
    MEAN = "MEAN"


class ValueContext:
    """What ``value_fn`` learns in ``experimental_distribute_values_from_function``
    (TensorFlow's ``tf.distribute.experimental.ValueContext``)."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


#: Logged (as TensorFlow logs it) when ``run`` or ``reduce`` is called outside a function
#: scheduled with ``ClusterCoordinator.schedule``.
NOT_SCHEDULED_WARNING = (
    "ParameterServerStrategy.{method}() was called outside a function scheduled with "
    "ClusterCoordinator.schedule, so it runs right here (on the coordinator, most likely), "
    "which can be slow: call `run` and `reduce` inside the function you pass to "
    "`coordinator.schedule` to run them on the training workers.")


def _warn_unless_scheduled(method: str) -> None:
    if getattr(_routing._thread, "fn", None) is None:
        logger.warning(NOT_SCHEDULED_WARNING.format(method=method))


def _map_structure(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to each leaf of a structure of tuples, lists, dicts and namedtuples."""
    if isinstance(value, dict):
        return type(value)((k, _map_structure(fn, v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_map_structure(fn, v) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_map_structure(fn, v) for v in value)
    return fn(value)


def _on_worker() -> bool:
    if getattr(_routing._thread, "worker", None) is not None:
        return True
    try:
        get_worker()
    except ValueError:
        return False
    return True


class _DatasetFromFunction:
    """``dataset_fn(InputContext())``, built on each worker by ``create_per_worker_dataset``.

    It is both the ``dataset_fn`` given to ``create_per_worker_dataset`` and, on a worker,
    an iterable (so ``lambda: strategy.distribute_datasets_from_function(fn)`` works too).
    Iterating it on the coordinator is a ValueError, as in TensorFlow.
    """

    def __init__(self, dataset_fn: Callable[[InputContext], Any]) -> None:
        self._dataset_fn = dataset_fn

    def __call__(self) -> Any:
        # Each worker runs one input pipeline and there is one replica per worker, so
        # every worker sees the same context (TensorFlow does the same).
        return self._dataset_fn(InputContext())

    def __iter__(self) -> Iterator[Any]:
        if not _on_worker():
            raise ValueError(
                "a distributed dataset of ParameterServerStrategy is built on the training "
                "workers: pass it (or a function returning it) to "
                "ClusterCoordinator.create_per_worker_dataset and iterate the result inside "
                "scheduled functions")
        return iter(self())


class _Extended:
    """``strategy.extended``: what TensorFlow keeps on ``StrategyExtended``."""

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        self._strategy = strategy

    @contextlib.contextmanager
    def colocate_vars_with(
        self, colocate_with_variable: Variable | ShardedVariable
    ) -> Iterator[None]:
        """Variables created in this context go to the PS of ``colocate_with_variable``,
        never partitioned (TensorFlow's rule)."""
        var = colocate_with_variable
        first = var.variables[0] if hasattr(var, "variables") else None
        if first is None or first.ps_address is None:
            raise ValueError(f"{var!r} is not a variable on a parameter server")
        token = _colocate.set(first)
        try:
            yield
        finally:
            _colocate.reset(token)

    def variable_created_in_scope(self, v: object) -> bool:
        return any(v is w for w in self._strategy._variables)


def _strategy_by_ref(uid: str, ps: list[str], ps_names: list[str],
                     partitioner: Callable[..., Sequence[int]] | None) -> ParameterServerStrategy:
    """Unpickle a strategy: the live one of this process, or a client-less stand-in."""
    live = _routing.owner(uid)
    if live is not None:
        return live  # type: ignore[no-any-return]
    stand_in = object.__new__(ParameterServerStrategy)
    stand_in.__dict__.update(_client=None, _connection=None, _cluster_resolver=None, _uid=uid,
                             _ps=list(ps), _ps_names=list(ps_names),
                             _variable_partitioner=partitioner, _variables=[], _per_worker={},
                             _cluster_coordinator=None, _lock=threading.Lock())
    return stand_in


class ParameterServerStrategy:
    """Parameter-server training on a Dask cluster (``tf.distribute.ParameterServerStrategy``).

    Parameters
    ----------
    client : distributed.Client or ClusterResolver, optional
        A synchronous client of the cluster; this process becomes the coordinator. A
        cluster resolver may be given here too (TensorFlow's first argument).
    variable_partitioner : callable, optional
        ``partitioner(shape, dtype) -> [k, 1, ...]`` (see :mod:`.partitioners`). ``None``:
        variables are not partitioned.
    cluster_resolver : ClusterResolver, optional
        TensorFlow's cluster setup instead of a client: a
        :class:`~.cluster_resolver.TFConfigClusterResolver` (``TF_CONFIG``) or a
        :class:`~.cluster_resolver.SimpleClusterResolver`. The chief's address is the Dask
        scheduler's (started here when this process is the chief and none listens there),
        the ``ps`` and ``worker`` tasks are the Dask workers at their addresses; the strategy
        waits ``dataservice.ps.cluster-timeout`` for all of them (see
        :mod:`.cluster_resolver`). With neither a client nor a resolver, ``TF_CONFIG`` is
        read; without it, ValueError.
    """

    def __init__(self, client: Client | ClusterResolver | None = None,
                 variable_partitioner: Callable[..., Sequence[int]] | None = None, *,
                 cluster_resolver: ClusterResolver | None = None) -> None:
        if isinstance(client, ClusterResolver):
            if cluster_resolver is not None:
                raise TypeError("give the cluster resolver once (client or cluster_resolver)")
            client, cluster_resolver = None, client
        if client is not None and cluster_resolver is not None:
            raise TypeError("give a client or a cluster_resolver, not both")
        if client is None and cluster_resolver is None:
            cluster_resolver = resolver_from_environment()
            if cluster_resolver is None:
                raise ValueError(
                    "ParameterServerStrategy needs a cluster: a distributed.Client of it, or "
                    "cluster_resolver=TFConfigClusterResolver() with the TF_CONFIG environment "
                    "variable set (TF_CONFIG is not set), or a SimpleClusterResolver")
        #: What this strategy opened itself (a resolver's client and scheduler): close() closes it.
        self._connection: Connection | None = None
        self._cluster_resolver = cluster_resolver
        self._variable_partitioner = variable_partitioner
        if cluster_resolver is None:
            self._start(client, None)
            return
        self._connection = connect(cluster_resolver, config.get_seconds("ps.cluster-timeout"))
        try:
            self._start(self._connection.client, self._connection.ps)
        except BaseException:
            self.close()
            raise

    def _start(self, client: Any, ordered_ps: list[str] | None) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"client must be a distributed.Client, got {type(client).__name__}")
        if client.asynchronous:
            raise TypeError(
                "ParameterServerStrategy needs a synchronous Client: its API (schedule, join, "
                "variable reads) blocks, like TensorFlow's. In async code, open a second, "
                "synchronous client of the same cluster, Client(address), and run the "
                "training loop in a thread: `await asyncio.to_thread(train)`")
        self._client = client
        ps, workers = cluster_roles(client)
        if ordered_ps is not None:  # TensorFlow's task order: ps task i is /job:ps/task:i
            ps = ordered_ps
        if len(ps) < 1:
            raise ValueError(
                f"There must be at least one ps: no worker has the {config.get('ps.resource')!r} "
                "resource (start one with `dask worker --resources ps=1`).")
        if len(workers) < 1:
            raise ValueError("There must be at least one worker: every worker is a parameter server.")
        self._ps = ps
        #: TensorFlow's counts: the tasks of the cluster spec, or the workers found now.
        self._num_ps = len(ps)
        self._num_workers = len(self._connection.workers) if self._connection else len(workers)
        names = _names(client)
        #: Worker names of the parameter servers: a PS restarted by its nanny keeps its name.
        self._ps_names = [names[a] for a in ps]
        self._uid = secrets.token_hex(4)
        self._variable_count = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._cluster_coordinator: Any = None
        #: Every variable created in scope, in creation order (checkpoints use them).
        self._variables: list[Variable | ShardedVariable] = []
        #: ``{uid: PerWorkerVariable}`` created in scope (a handle coming back finds its own).
        self._per_worker: weakref.WeakValueDictionary[str, PerWorkerVariable] = \
            weakref.WeakValueDictionary()
        client.register_plugin(ParameterServerPlugin())
        client.register_plugin(TrainingWorkerPlugin())
        _routing.register_owner(self._uid, self)
        logger.info("ParameterServerStrategy: %d parameter servers, %d workers", len(ps), len(workers))

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The resolver the strategy was built from (None: from a client)."""
        return self._cluster_resolver

    def close(self) -> None:
        """Close what the strategy opened itself: the client (and the scheduler, on the
        chief) of a cluster resolver. A client you passed stays yours: nothing is closed."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def __enter__(self) -> ParameterServerStrategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        # by reference: the coordinator gets its live strategy back, a worker a stand-in
        # without a client (enough for distribute_datasets_from_function, scope, reduce)
        return (_strategy_by_ref, (self._uid, self._ps, self._ps_names,
                                   self._variable_partitioner))

    # -- cluster -------------------------------------------------------------------------
    @property
    def client(self) -> Client:
        return self._client

    @property
    def extended(self) -> _Extended:
        return _Extended(self)

    @property
    def ps_addresses(self) -> list[str]:
        """The parameter servers, in placement order (task 0, 1, ...)."""
        return list(self._ps)

    @property
    def worker_addresses(self) -> list[str]:
        """The training workers now (they may come and go)."""
        return cluster_roles(self._client)[1]

    def _workers_by_index(self) -> list[str]:
        """The training workers now, in TensorFlow's worker-index order (the coordinator's
        ``get_current_worker_index``), then by name."""
        names = _names(self._client)
        index: dict[str, int] = dict(getattr(self._cluster_coordinator, "_worker_index", {}))

        def key(address: str) -> tuple[int, str]:
            name = names.get(address, address)
            return index.get(name, len(index)), name

        return sorted(self.worker_addresses, key=key)

    @property
    def num_ps(self) -> int:
        """The number of parameter servers (``ps`` tasks)."""
        return len(self._ps)

    @property
    def num_workers(self) -> int:
        """The number of training workers: the cluster spec's ``worker`` tasks when built
        from a resolver (as TensorFlow counts them), else the training workers now."""
        if self._connection is not None:
            return self._num_workers
        return len(self.worker_addresses)

    @property
    def variable_partitioner(self) -> Callable[..., Sequence[int]] | None:
        return self._variable_partitioner

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @contextlib.contextmanager
    def scope(self) -> Iterator[ParameterServerStrategy]:
        """Variables created in this context are placed on the parameter servers."""
        token = current_strategy.set(self)
        try:
            with contextlib.ExitStack() as stack:
                _scope_hooks.enter(self, stack)  # e.g. the Keras adapter's (from above)
                yield self
        finally:
            current_strategy.reset(token)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any],
                                          options: Any = None) -> _DatasetFromFunction:
        """A dataset to build on each training worker: pass it to
        ``ClusterCoordinator.create_per_worker_dataset``. ``dataset_fn(input_context)``
        gets an :class:`InputContext` (one input pipeline per worker, as in TensorFlow)."""
        return _DatasetFromFunction(dataset_fn)

    def experimental_distribute_dataset(self, dataset: Any,
                                        options: Any = None) -> _DatasetFromFunction:
        """The same ``dataset`` on each training worker (see ``create_per_worker_dataset``)."""
        return _DatasetFromFunction(lambda input_context: dataset)

    def run[T](self, fn: Callable[..., T], args: Sequence[Any] = (),
               kwargs: dict[str, Any] | None = None) -> T:
        """Run ``fn`` here (one replica per worker); use it inside scheduled functions.

        Called anywhere else (on the coordinator, say) it still runs ``fn`` and logs
        TensorFlow's warning that the call is not inside ``ClusterCoordinator.schedule``."""
        _warn_unless_scheduled("run")
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: Any, value: Any,
               axis: int | tuple[int, ...] | None = None) -> Any:
        """TensorFlow's ``strategy.reduce``: one replica per worker, so across replicas the
        value is unchanged; with ``axis`` it is then summed or averaged along that axis.

        ``value`` may be a nested structure (tuples, lists, dicts, namedtuples) of arrays,
        variables and ``None``: each leaf is reduced and the structure kept, as TensorFlow
        maps the reduction over the structure. Outside a scheduled function it logs
        TensorFlow's warning (see :meth:`run`)."""
        op = str(getattr(reduce_op, "value", reduce_op)).upper().rsplit(".", 1)[-1]
        if op not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise ValueError(f"reduce_op must be ReduceOp.SUM or ReduceOp.MEAN, got {reduce_op!r}")
        _warn_unless_scheduled("reduce")

        def leaf(x: Any) -> Any:
            if x is None:
                return None
            x = np.asarray(x.read_value() if hasattr(x, "read_value") else x)
            if axis is None:
                return x
            return x.sum(axis=axis) if op == ReduceOp.SUM else x.mean(axis=axis)

        return _map_structure(leaf, value)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``value_fn(ValueContext())``: the value of the one replica of this worker.

        TensorFlow calls ``value_fn`` once per replica and wraps the results; with one
        replica per worker (as TensorFlow's PS strategy without GPUs) that is one call, and
        the value is given as it is: pass it to :meth:`run`, read it with
        :meth:`experimental_local_results`."""
        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}")
        return value_fn(ValueContext(replica_id_in_sync_group=0, num_replicas_in_sync=1))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of the local replicas as a tuple: ``(value,)`` (one replica per worker)."""
        return (value,)

    def reconnect(self, timeout: float = 30.0) -> dict[str, str]:
        """Point every variable at the current address of its parameter server.

        A PS whose process restarted (under a nanny) comes back with the same worker name at
        a new address; with ``dataservice.ps.work-dir`` set it reloads the shards it flushed.
        Waits up to ``timeout`` seconds for every PS to be back; returns ``{old: new}``.
        """
        deadline = time.monotonic() + timeout
        while True:
            by_name = {n: a for a, n in _names(self._client).items()}
            # the scheduler may still list a dead PS for a moment: a PS is back once the
            # address under its name answers
            if all(n in by_name and self._answers(by_name[n]) for n in self._ps_names):
                break
            if time.monotonic() > deadline:
                missing = [n for n in self._ps_names
                           if n not in by_name or not self._answers(by_name[n])]
                raise TimeoutError(f"parameter servers {missing} did not come back")
            time.sleep(0.05)
        moved = {old: by_name[n] for old, n in zip(self._ps, self._ps_names, strict=True)
                 if by_name[n] != old}
        self._repoint({n: by_name[n] for n in self._ps_names})
        return moved

    def _repoint(self, addresses: dict[str, str]) -> None:
        """Point the variables of the PSs named in ``{name: address}`` at their address."""
        with self._lock:
            self._ps = [addresses.get(n, a) for n, a in zip(self._ps_names, self._ps, strict=True)]
            for var in self._variables:
                for v in var.variables:
                    assert v._ps_index is not None  # a variable on a PS
                    v._address = self._ps[v._ps_index]

    async def _answers_async(self, address: str, timeout: float = 2.0) -> bool:
        try:
            reply = await asyncio.wait_for(self._client.rpc(address).ps_info(), timeout)
        except (OSError, TimeoutError):
            return False
        return bool(reply and reply.get("status") == "OK" and reply.get("is_ps"))

    def _answers(self, address: str, timeout: float = 2.0) -> bool:
        return _routing.run_sync(self._client.loop, self._answers_async, address, timeout)

    def flush(self) -> dict[str, Any]:
        """Write every PS's working copies to its zarr store; ``{ps address: keys written}``."""
        replies = _routing.call_many([Call(a, "ps_flush", {}) for a in self._ps], self._client)
        return {a: list(r["written"]) for a, r in zip(self._ps, replies, strict=True)}

    # -- variable creation -------------------------------------------------------------------
    def _next_ps(self) -> int:
        with self._lock:
            i = self._variable_count % len(self._ps)
            self._variable_count += 1
            return i

    def _create_variable(self, initial_value: Any = None, trainable: bool = True,
                         name: str | None = None, dtype: Any = None, shape: Any = None,
                         **kwargs: Any) -> Variable | ShardedVariable:
        name = name or "Variable"
        if self._client is None and getattr(_routing._thread, "fn", None) is None:
            raise ValueError(
                "variables of a ParameterServerStrategy are created on the coordinator or "
                "inside a function scheduled with ClusterCoordinator.schedule, in "
                "strategy.scope(); not in a dataset_fn or another Dask task")
        if initial_value is None:
            raise ValueError("initial_value must be given to create a variable in scope")
        init_from_fn = callable(initial_value)
        if init_from_fn and (shape is None or dtype is None):
            init_from_fn = False
            initial_value = initial_value()
        if init_from_fn:
            shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
            value = None
        else:
            value = _kernels.cast_value(initial_value, dtype, f"variable {name!r}")
            if shape is not None and value.shape != tuple(shape):
                raise ValueError(f"initial_value has shape {value.shape}, expected {tuple(shape)}")
            shape, dtype = value.shape, value.dtype
        var: Variable | ShardedVariable
        num = 1
        colocate = _colocate.get()
        if colocate is not None:  # never partitioned, placed with the other variable
            var = self._create_shards(name, [0, shape[0]] if shape else None, shape, dtype,
                                      trainable, initial_value, value, partitioned=False,
                                      ps_index=colocate._ps_index)[0]
            if getattr(_routing._thread, "fn", None) is None:
                with self._lock:
                    self._variables.append(var)
            return var
        # a variable without rows has nothing to split: one shard of zero rows, whatever the
        # partitioner (TensorFlow's partitioners answer 0 shards and the strategy refuses)
        if self._variable_partitioner is not None and len(shape) > 0 and shape[0] > 0:
            num = check_partitions(self._variable_partitioner(shape=shape, dtype=dtype))
        if num == 1:
            var = self._create_shards(name, [0, shape[0]] if shape else None, shape, dtype,
                                      trainable, initial_value, value, partitioned=False)[0]
        else:
            offsets = div_offsets(shape[0], min(num, shape[0]))
            if value is not None:
                self._warn_if_large(name, shape)
            shards = self._create_shards(name, offsets, shape, dtype, trainable, initial_value,
                                         value, partitioned=True)
            var = ShardedVariable(shards, name=name)
        if getattr(_routing._thread, "fn", None) is None:  # not in a scheduled function
            with self._lock:
                self._variables.append(var)
        return var

    def _create_per_worker_variable(self, initial_value: Any, name: str | None, dtype: Any,
                                    shape: Any) -> PerWorkerVariable:
        if self._client is None or getattr(_routing._thread, "fn", None) is not None:
            raise ValueError("a per-worker variable is created on the coordinator, in "
                             "strategy.scope(), not inside a scheduled function")
        if initial_value is None:
            raise ValueError("initial_value must be given to create a variable in scope")
        var = PerWorkerVariable._create(self, initial_value, name, dtype, shape)
        self._per_worker[var.uid] = var
        return var

    def _warn_if_large(self, name: str, shape: tuple[int, ...]) -> None:
        if math.prod(shape) > float(config.get("ps.large-variable-elements")):
            warnings.warn(_INEFFICIENT_INIT.format(name=name), UserWarning, stacklevel=4)

    def _create_shards(self, name: str, offsets: list[int] | None, shape: tuple[int, ...],
                       dtype: np.dtype[Any], trainable: bool, initial_value: Any,
                       value: np.ndarray | None, partitioned: bool, ps_index: int | None = None) -> list[Variable]:
        fn = getattr(_routing._thread, "fn", None)
        if fn is not None:
            # Inside a scheduled function (this is the strategy's stand-in on a training
            # worker): the key and the PS follow from the function's id and the variable's
            # rank in it, so a function re-run after its worker died finds the variables its
            # first run created (exist_ok) instead of making new ones.
            # ``{fn id: [variables made, shards placed round-robin]}`` of this thread
            made = _routing._thread.__dict__.setdefault("created", {})
            for old in [f for f in made if f != fn.fn_id]:
                del made[old]  # only the running function's counts matter
            counts = made.setdefault(fn.fn_id, [0, 0])
            stem = f"fn{fn.fn_id}.{counts[0]}"
            counts[0] += 1
        else:
            stem, counts = str(next(self._ids)), None
        pieces = [(0, None)] if offsets is None else list(zip(offsets, offsets[1:], strict=False))
        init = cloudpickle.dumps(initial_value) if value is None else None
        handles, calls = [], []
        for i, (a, b) in enumerate(pieces):
            if counts is not None and (ps_index is None or partitioned):
                ps_index = counts[1] % len(self._ps)  # round-robin within the function
                counts[1] += 1
            elif ps_index is None or partitioned:
                ps_index = self._next_ps()
            address = self._ps[ps_index]
            part_name = f"{name}/part_{i}" if partitioned else name
            key = f"{self._uid}/{stem}/{part_name}"
            part_shape = tuple(shape) if b is None else (b - a, *shape[1:])
            kw: dict[str, Any] = {"key": key, "shape": list(part_shape), "dtype": dtype.str,
                                  "offset": a, "full_shape": list(shape),
                                  "exist_ok": counts is not None}
            if value is None:
                kw["init"] = init
            else:
                kw["value"] = wire(value if b is None else value[a:b])
            calls.append(Call(address, "ps_create", kw))
            handles.append(Variable._remote(part_name, part_shape, dtype, trainable, address, key,
                                            ps_index, self._client, self._uid))
        if fn is None:
            replies = _routing.call_many(calls, self._client)
        else:  # not on the function's channels (they carry reads and updates): Dask's comms
            pipeline, _routing._thread.pipeline = _routing._thread.pipeline, None
            try:
                replies = _routing.call_many(calls, None)
            finally:
                _routing._thread.pipeline = pipeline
        if partitioned and any(r.get("sliced") for r in replies):
            self._warn_if_large(name, shape)
        return handles

    def __repr__(self) -> str:
        return (f"<dds.ParameterServerStrategy ps={self._ps} "
                f"partitioner={self._variable_partitioner!r}>")
