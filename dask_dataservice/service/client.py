"""The consumer side of the data service: register, read, distribute.

``register_dataset`` sends a pipeline (cloudpickled once, on the client) and its splits
(enumerated once, on the client) to the dispatcher and returns a dataset id.
``from_dataset_id`` and ``distribute`` return a :class:`DistributedDataset`: a
:class:`~dask_dataservice.data.Dataset` whose source streams elements from the service, so
it can be iterated many times and transformed further locally (``.map``, ``.prefetch``...).

Reading: each iteration of a ``DistributedDataset`` acquires an iteration of its job at the
dispatcher, then one coroutine per task on the client's event loop pulls batches of
elements from the task's worker (a count- and byte-bounded batch per request, numpy buffers
as zero-copy frames) into a bounded local channel. The user's thread only takes batches
from that channel, so a ``next()`` costs no round trip.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import cloudpickle
from distributed import Client
from distributed.utils import sync

from .. import config
from ..data import Dataset
from ..data._base import UNKNOWN, IterContext, Op
from ._messages import raise_for_status
from ._sharding import ShardingPolicy, parse_processing_mode
from ._exceptions import DataServiceError
from .worker import worker_host

__all__ = [
    "ShardingPolicy",
    "CrossTrainerCache",
    "DistributedDataset",
    "register_dataset",
    "from_dataset_id",
    "distribute",
    "install",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CrossTrainerCache:
    """Share a job's elements between trainers through a sliding-window cache.

    Parameters
    ----------
    trainer_id
        Identifies the trainer; trainers with different ids read the same elements.
    """

    trainer_id: str

    def __post_init__(self):
        if not isinstance(self.trainer_id, str) or not self.trainer_id:
            raise ValueError(f"trainer_id must be a non-empty string, got {self.trainer_id!r}")


# ---------------------------------------------------------------------------------------
# clients and installation
# ---------------------------------------------------------------------------------------

_CLIENTS: dict[str, Client] = {}
#: Clients this module opened itself (closed at exit or by close_clients()).
_OWN_CLIENTS: dict[str, Client] = {}
_CLIENTS_LOCK = threading.Lock()
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _normalise_address(address: str) -> str:
    address = address.strip()
    return address if "://" in address else f"tcp://{address}"


def _service_address(service: Any) -> str:
    if isinstance(service, Client):
        return service.scheduler.address
    if isinstance(service, str) and service.strip():
        return _normalise_address(service)
    raise TypeError(
        "service must be a distributed.Client or a scheduler address such as "
        f"'tcp://host:8786', got {type(service).__name__} {service!r:.60}"
    )


def _check_not_on_event_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"{what} blocks, and was called from a running event loop (that would deadlock); call it "
        "from a thread instead, e.g. await asyncio.to_thread(...)"
    )


def _client_for(service: Any) -> Client:
    """A connected client for ``service`` (a Client, or an address: reuse or connect)."""
    if isinstance(service, Client):
        if service.status in ("closed", "closing"):
            raise DataServiceError("the distributed.Client given as service is closed")
        with _CLIENTS_LOCK:
            cached = _CLIENTS.get(service.scheduler.address)
            if cached is None or cached.status in ("closed", "closing"):
                _CLIENTS[service.scheduler.address] = service
        return service
    address = _service_address(service)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(address)
        if client is not None and client.status not in ("closed", "closing"):
            return client
    try:  # inside a Dask task: use the worker's client
        from distributed import get_worker

        worker = get_worker()
        if worker.scheduler.address == address:
            client = worker._get_client()
    except ValueError:
        client = None
    if client is None:
        _check_not_on_event_loop("connecting to the data service")
        try:
            client = Client(address, set_as_default=False,
                            timeout=config.get_seconds("client.connect-timeout"))
        except OSError as e:
            raise DataServiceError(f"cannot reach the data service at {address}: {e}") from e
        with _CLIENTS_LOCK:
            _OWN_CLIENTS[address] = client
    with _CLIENTS_LOCK:
        _CLIENTS[address] = client
    return client


def close_clients(address: str | None = None) -> None:
    """Close the clients this module opened (for one scheduler address, or all; also at exit)."""
    with _CLIENTS_LOCK:
        own = [(a, c) for a, c in _OWN_CLIENTS.items() if address is None or a == address]
        for a, _ in own:
            _OWN_CLIENTS.pop(a, None)
            _CLIENTS.pop(a, None)
    for _, client in own:
        try:
            client.close(timeout=5)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


atexit.register(close_clients)


def _run(client: Client, coro_fn, *args, **kwargs):
    """Run ``coro_fn`` on the client's event loop from a user thread."""
    loop = client.loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not None and running is loop.asyncio_loop:
        raise RuntimeError(
            "dask_dataservice's blocking API was called from the client's event loop; call it "
            "from a thread (e.g. await asyncio.to_thread(list, dataset))"
        )
    return sync(loop, coro_fn, *args, **kwargs)


async def _install_async(client: Client) -> None:
    from distributed.protocol.pickle import dumps

    from ._dispatcher_plugin import PLUGIN_NAME as DISPATCHER
    from ._dispatcher_plugin import DispatcherPlugin
    from .worker import PLUGIN_NAME as WORKER
    from .worker import DataWorkerPlugin

    await client.scheduler.register_scheduler_plugin(
        plugin=dumps(DispatcherPlugin()), name=DISPATCHER, idempotent=True
    )
    responses = await client.scheduler.register_worker_plugin(
        plugin=dumps(DataWorkerPlugin()), name=WORKER, idempotent=True
    )
    for response in (responses or {}).values():
        raise_for_status(response, "worker plugin installation")


def install(service: Any) -> None:
    """Install the dispatcher and data-worker plugins on a cluster (idempotent).

    Called automatically on first use; call it yourself to pay the cost up front. Clusters
    started with ``--preload dask_dataservice`` already have both plugins.
    """
    client = _client_for(service)
    _run(client, _install_async, client)
    _INSTALLED[client] = True


def _ensure_installed(client: Client) -> None:
    if _INSTALLED.get(client):
        return
    _run(client, _install_async, client)
    _INSTALLED[client] = True


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------


def register_dataset(service: Any, dataset: Dataset, compression: str | None = "AUTO",
                     dataset_id: str | None = None) -> int:
    """Register ``dataset`` with the data service and return its dataset id.

    The pipeline is pickled here (so an unpicklable function fails now, with a message
    naming it) and, when the source is splittable, its splits are enumerated here, once.
    Registering the same pipeline again returns the same id.

    Parameters
    ----------
    service
        A ``distributed.Client`` or the scheduler's address.
    dataset
        The pipeline to register.
    compression
        ``"AUTO"`` or None. Elements travel uncompressed on the fast paths measured so far;
        accepted for compatibility with tf.data service.
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"dataset must be a dask_dataservice Dataset, got {type(dataset).__name__}")
    if compression not in ("AUTO", None):
        raise ValueError(f"compression must be 'AUTO' or None, got {compression!r}")
    if isinstance(dataset, DistributedDataset):
        raise TypeError("dataset already reads from the data service; register its source pipeline")
    try:
        pipeline = cloudpickle.dumps(dataset)
    except Exception as e:
        raise TypeError(
            f"the dataset cannot be pickled, so it cannot run on workers: {type(e).__name__}: {e}. "
            "Functions in a pipeline must be picklable by cloudpickle (no open files, locks, "
            "sockets or clients in their closures)"
        ) from e
    why_not = dataset.why_not_splittable()
    if why_not is None:
        splits_list = dataset.splits()
        splits = cloudpickle.dumps(splits_list)
        num_splits = len(splits_list)
    else:
        splits, num_splits = b"", -1
    fingerprint = dataset_id or dataset.fingerprint()
    _check_not_on_event_loop("register_dataset()")
    client = _client_for(service)
    _ensure_installed(client)

    async def go():
        return await client.scheduler.dataservice_register_dataset(
            fingerprint=fingerprint, pipeline=pipeline, splits=splits, num_splits=num_splits,
            compression=compression, metadata={
                "why_not_splittable": why_not, "file_based": dataset.is_file_based,
                "cardinality": dataset.cardinality(), "has_shard_hint": dataset.has_shard_hint,
            },
        )

    return raise_for_status(_run(client, go), "dataset registration")["dataset_id"]


# ---------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ReadSpec:
    address: str
    dataset_id: int
    processing_mode: int
    job_name: str | None
    consumer_index: int | None
    num_consumers: int | None
    max_outstanding_requests: int | None
    target_workers: str
    cross_trainer_cache: CrossTrainerCache | None


class ServiceSource(Op):
    """A source op that streams elements of a registered dataset from the service."""

    name = "from_dataset_id"
    is_source = True
    splittable = False
    file_based = False

    def __init__(self, spec: _ReadSpec):
        self.spec = spec
        # How many times this object started reading a named job (its repetition).
        self._repetitions = 0
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"spec": self.spec}

    def __setstate__(self, state):
        self.spec = state["spec"]
        self._repetitions = 0
        self._lock = threading.Lock()

    def params(self):
        return (dataclasses.astuple(self.spec),)

    def cardinality(self):
        return UNKNOWN

    def why_not(self) -> str:
        return "the dataset already reads from the data service"

    def iterate(self, ctx: IterContext) -> Iterator:
        with self._lock:
            repetition = self._repetitions
            if self.spec.job_name is not None:
                self._repetitions += 1
        return _read(self.spec, repetition)


class DistributedDataset(Dataset):
    """A dataset that reads from the data service (see :func:`from_dataset_id`).

    Iterate it like any ``Dataset``; each iteration reads one pass of its job. Further
    transformations (``.map``, ``.batch``, ``.prefetch``...) run locally, on the consumer.
    """

    __slots__ = ()

    @property
    def dataset_id(self) -> int:
        return self.source.spec.dataset_id

    @property
    def processing_mode(self) -> ShardingPolicy:
        return ShardingPolicy(self.source.spec.processing_mode)

    @property
    def job_name(self) -> str | None:
        return self.source.spec.job_name


def from_dataset_id(processing_mode: Any, service: Any, dataset_id: int, element_spec: Any = None,
                    job_name: str | None = None, consumer_index: int | None = None,
                    num_consumers: int | None = None, max_outstanding_requests: int | None = None,
                    data_transfer_protocol: str | None = None, cross_trainer_cache: Any = None,
                    target_workers: str = "AUTO") -> DistributedDataset:
    """A dataset that reads the registered dataset ``dataset_id`` from the service.

    Parameters
    ----------
    processing_mode
        A :class:`ShardingPolicy` (or its name), or ``"parallel_epochs"`` (OFF) /
        ``"distributed_epoch"`` (DYNAMIC).
    service
        A ``distributed.Client`` or the scheduler's address.
    dataset_id
        From :func:`register_dataset`.
    job_name
        Consumers using the same name share one job (they split its elements between them);
        without a name every iteration is a private job.
    max_outstanding_requests
        Batches buffered on the consumer before reading pauses (default: config
        ``dataservice.client.max-outstanding-batches``).
    element_spec, data_transfer_protocol
        Accepted for compatibility with tf.data service; not needed here.
    """
    mode = parse_processing_mode(processing_mode)
    if isinstance(dataset_id, bool) or not isinstance(dataset_id, int):
        raise TypeError(f"dataset_id must be an int, got {type(dataset_id).__name__} {dataset_id!r:.40}")
    if job_name is not None and (not isinstance(job_name, str) or not job_name):
        raise ValueError(f"job_name must be a non-empty string or None, got {job_name!r}")
    if (consumer_index is None) != (num_consumers is None):
        raise ValueError("consumer_index and num_consumers must be given together, or neither")
    if consumer_index is not None:
        for name, value in (("consumer_index", consumer_index), ("num_consumers", num_consumers)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
        if num_consumers < 1 or not 0 <= consumer_index < num_consumers:
            raise ValueError(
                f"need 0 <= consumer_index < num_consumers, got consumer_index={consumer_index}, "
                f"num_consumers={num_consumers}"
            )
        if job_name is None:
            raise ValueError("coordinated reads need a job_name (the consumers share a job)")
    if cross_trainer_cache is not None:
        if not isinstance(cross_trainer_cache, CrossTrainerCache):
            raise TypeError(
                "cross_trainer_cache must be a dds.CrossTrainerCache, got "
                f"{type(cross_trainer_cache).__name__}"
            )
        if job_name is None:
            raise ValueError("the cross-trainer cache needs a job_name (trainers share a job)")
    if max_outstanding_requests is not None and (
        isinstance(max_outstanding_requests, bool) or not isinstance(max_outstanding_requests, int)
        or max_outstanding_requests < 1
    ):
        raise ValueError(f"max_outstanding_requests must be a positive int, got {max_outstanding_requests!r}")
    target = str(target_workers).upper()
    if target not in ("AUTO", "ANY", "LOCAL"):
        raise ValueError(f"target_workers must be 'AUTO', 'ANY' or 'LOCAL', got {target_workers!r}")
    address = _service_address(service)
    if isinstance(service, Client):
        _client_for(service)  # remember it, so iteration in this process reuses it
    spec = _ReadSpec(address, dataset_id, int(mode), job_name, consumer_index, num_consumers,
                     max_outstanding_requests, target, cross_trainer_cache)
    return DistributedDataset(ServiceSource(spec))


def distribute(processing_mode: Any, service: Any, job_name: str | None = None,
               consumer_index: int | None = None, num_consumers: int | None = None,
               max_outstanding_requests: int | None = None, data_transfer_protocol: str | None = None,
               compression: str | None = "AUTO", cross_trainer_cache: Any = None,
               target_workers: str = "AUTO"):
    """A transformation that moves a pipeline onto the data service.

    Use with ``Dataset.apply``: ``ds.apply(distribute("distributed_epoch", client))``
    registers ``ds`` and returns a :class:`DistributedDataset` reading it.
    """
    mode = parse_processing_mode(processing_mode)
    _service_address(service)

    def _apply(dataset: Dataset) -> DistributedDataset:
        if mode == ShardingPolicy.DYNAMIC:
            dataset.check_splittable()  # say why now, before anything is sent
        dataset_id = register_dataset(service, dataset, compression=compression)
        return from_dataset_id(
            processing_mode, service, dataset_id, job_name=job_name, consumer_index=consumer_index,
            num_consumers=num_consumers, max_outstanding_requests=max_outstanding_requests,
            cross_trainer_cache=cross_trainer_cache, target_workers=target_workers,
        )

    return _apply


# ---------------------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------------------

_END = object()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Channel:
    """Batches from the event loop to the user's thread, bounded in batches.

    The loop side awaits space; the thread side wakes it only when it is waiting.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._size = 0
        self._capacity = capacity
        self._loop = loop
        self._space = asyncio.Event()
        self._lock = threading.Lock()
        self._want_space = False

    async def put(self, item: Any) -> None:
        while True:
            with self._lock:
                if self._size < self._capacity:
                    self._size += 1
                    self._q.put(item)
                    return
                self._want_space = True
                self._space.clear()
            await self._space.wait()

    def put_nowait(self, item: Any) -> None:
        with self._lock:
            self._size += 1
            self._q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        item = self._q.get(timeout=timeout)
        with self._lock:
            self._size -= 1
            wake = self._want_space
            self._want_space = False
        if wake:
            self._loop.call_soon_threadsafe(self._space.set)
        return item


_STATIC_NAMES = {"FILE", "DATA", "FILE_OR_DATA", "HINT"}


def _local_host(scheduler_address: str) -> str:
    """This machine's address as seen on the route to the scheduler."""
    from distributed.utils import get_ip

    host = worker_host(scheduler_address)
    try:
        return get_ip(host)
    except OSError:
        return host


def _done_future() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


class _IterationReader:
    """Reads one iteration: heartbeats with the dispatcher, one fetch loop per task."""

    def __init__(self, client: Client, spec: _ReadSpec, iteration_id: int, client_id: int,
                 channel: _Channel):
        self.client = client
        self.spec = spec
        self.iteration_id = iteration_id
        self.client_id = client_id
        self.channel = channel
        self.fetchers: dict[int, asyncio.Task] = {}
        self.lost: dict[int, bool] = {}
        #: Reading only the tasks on this host: done when they are (the others are
        #: other consumers' business).
        self.local_only = False
        self.local_host = _local_host(spec.address)
        cache = spec.cross_trainer_cache
        self.trainer_id = cache.trainer_id if cache is not None else None
        self.task_done = asyncio.Event()
        self.stopped = False
        self.max_elements = int(config.get("client.request-elements"))
        self.max_bytes = config.get_bytes("client.request-bytes")
        self.long_poll = config.get_seconds("client.long-poll")
        self.depth = max(1, int(config.get("client.requests-per-task")))
        self.dispatcher_timeout = config.get_seconds("client.dispatcher-timeout")
        self.linger = config.get_seconds("client.linger")
        self.heartbeat_interval = config.get_seconds("client.heartbeat-interval")

    async def run(self, view: dict) -> None:
        """Read the iteration into the channel; end it with _END, or the first error."""
        try:
            await self._read(view)
            if not self.stopped:
                self.channel.put_nowait(_END)
            self.stop()
        except asyncio.CancelledError:
            self.stop()
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._fail(e)

    async def _read(self, view: dict) -> None:
        self._update_tasks(view)
        while not self.stopped:
            if view.get("garbage_collected"):
                raise DataServiceError(f"iteration {self.iteration_id} was garbage collected")
            ended = bool(self.fetchers) and all(f.done() for f in self.fetchers.values())
            if ended and (view["finished"] or self.local_only):
                break
            self.task_done.clear()
            if not ended:  # when every known task ended, the dispatcher already knows: ask now
                try:
                    await asyncio.wait_for(self.task_done.wait(), self.heartbeat_interval)
                except TimeoutError:
                    pass
            view = await self._heartbeat()
            self._update_tasks(view)
            if ended and not view["finished"]:
                # tasks ended but the dispatcher has not seen all of them yet (lost
                # workers, or new tasks being created): wait a little before asking again
                await asyncio.sleep(min(0.01, self.heartbeat_interval))

    def _fail(self, e: BaseException) -> None:
        self.channel.put_nowait(_Failure(e))
        self.stop()

    async def _heartbeat(self) -> dict:
        """Ask the dispatcher for the iteration's tasks; ride out a dispatcher restart.

        A fault-tolerant dispatcher comes back with the same iteration (its journal holds
        it), so the consumer keeps asking for up to ``client.dispatcher-timeout``.
        """
        deadline = None
        while True:
            scheduler = self.client.scheduler
            if scheduler is None or self.client.status in ("closed", "closing"):
                raise DataServiceError(
                    f"lost contact with the data service at {self.spec.address}: the client "
                    f"is {self.client.status} (it gave up reconnecting)"
                )
            try:
                resp = await scheduler.dataservice_client_heartbeat(
                    iteration_client_id=self.client_id)
                if resp is not None:
                    return raise_for_status(resp, "client heartbeat")
                error: BaseException = RuntimeError("the dispatcher plugin is not installed")
            except (TimeoutError, OSError) as e:
                error = e
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.dispatcher_timeout
                logger.info("dataservice: dispatcher unreachable (%r); retrying", error)
            if loop.time() >= deadline or self.stopped:
                raise DataServiceError(
                    f"lost contact with the data service at {self.spec.address}: {error!r}"
                ) from error
            await asyncio.sleep(0.05)

    def _select(self, view: dict) -> list:
        """The tasks this consumer reads, by ``target_workers`` (see :func:`from_dataset_id`)."""
        tasks = view["tasks"]
        target = self.spec.target_workers
        if target == "ANY" or not tasks:
            return tasks
        local = [t for t in tasks if worker_host(t[1]) == self.local_host]
        if target == "LOCAL":
            if not local:
                hosts = sorted({worker_host(t[1]) for t in tasks})
                raise DataServiceError(
                    f"target_workers='LOCAL', but no data worker of this job runs on this "
                    f"host ({self.local_host}); its workers are on {hosts}"
                )
            self.local_only = True
            return local
        if view.get("processing_mode") in _STATIC_NAMES and local:  # AUTO
            self.local_only = True
            return local
        return tasks

    def _update_tasks(self, view: dict) -> None:
        for task_id, address, status in self._select(view):
            if status == "lost":
                # its worker left: what it had buffered is gone, stop waiting on it
                self.lost[task_id] = True
                fetcher = self.fetchers.get(task_id)
                if fetcher is not None and not fetcher.done():
                    fetcher.cancel()
                elif fetcher is None:
                    self.fetchers[task_id] = _done_future()
            elif task_id not in self.fetchers:
                self.fetchers[task_id] = asyncio.ensure_future(self._fetch(task_id, address))

    async def _fetch(self, task_id: int, address: str) -> None:
        """Read one task: keep ``requests-per-task`` requests in flight, take them in order."""
        rpc = self.client.rpc(address)
        pending: collections.deque = collections.deque()
        seq = 0
        try:
            while not self.stopped:
                while len(pending) < self.depth:
                    pending.append(asyncio.ensure_future(rpc.dataservice_get_elements(
                        task_id=task_id, max_elements=self.max_elements, max_bytes=self.max_bytes,
                        wait=self.long_poll, consumer=self.client_id, seq=seq,
                        trainer_id=self.trainer_id,
                        # the head request answers at once; the ones queued behind it may
                        # gather a slow pipeline's elements for a moment
                        linger=self.linger if pending else 0.0,
                    )))
                    seq += 1
                try:
                    resp = await pending.popleft()
                except (TimeoutError, OSError) as e:
                    logger.info("dataservice: lost task %s on %s: %r", task_id, address, e)
                    return
                if resp is None or resp.get("closing"):  # the worker is shutting down
                    logger.info("dataservice: task %s on %s: worker closing", task_id, address)
                    return
                if resp.get("status") != "OK":
                    raise_for_status(resp, "element request")
                batch = resp.get("elements")
                if batch is not None:
                    await self.channel.put(batch.items)
                elif resp.get("end_of_sequence"):
                    return
                elif resp.get("unknown") and self.lost.get(task_id):
                    return  # its worker left (and came back without it)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the first error ends the iteration
            if not self.stopped:
                self.stopped = True
                self.channel.put_nowait(_Failure(e))
        finally:
            for f in pending:
                f.cancel()
            self.task_done.set()

    def stop(self) -> None:
        self.stopped = True
        for f in self.fetchers.values():
            if not f.done():
                f.cancel()


class _CoordinatedReader(_IterationReader):
    """Coordinated reads: round ``r`` comes from task ``r mod T``, element ``consumer_index``.

    Every consumer of the job walks the same fixed list of tasks (sorted by id), so in each
    round all consumers read from the same worker. Rounds are fetched ``rounds-per-request``
    at a time from every task, and the next block is requested while this one is handed
    over.
    """

    async def _read(self, view: dict) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.dispatcher_timeout
        while not [t for t in view["tasks"] if t[2] == "active"]:
            if loop.time() > deadline:
                raise DataServiceError("coordinated reads: the job has no data workers")
            await asyncio.sleep(0.05)
            view = await self._heartbeat()
        tasks = sorted((t[0], t[1]) for t in view["tasks"] if t[2] == "active")
        heartbeat = asyncio.ensure_future(self._heartbeats())
        k = max(1, int(config.get("client.rounds-per-request")))
        c, n = self.spec.consumer_index, self.spec.num_consumers

        def request(first):
            return [asyncio.ensure_future(self.client.rpc(addr).dataservice_get_rounds(
                task_id=tid, first_round=first, count=k, consumer_index=c, num_consumers=n,
            )) for tid, addr in tasks]

        pending = request(0)
        first = 0
        try:
            while not self.stopped:
                replies = await asyncio.gather(*pending)
                first += k
                pending = request(first)
                columns = [raise_for_status(r, "coordinated read")["elements"].items
                           for r in replies]
                await self.channel.put([x for row in zip(*columns, strict=True) for x in row])
        finally:
            for f in pending:
                f.cancel()
            heartbeat.cancel()

    async def _heartbeats(self) -> None:
        while not self.stopped:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                await self._heartbeat()
            except DataServiceError as e:
                logger.info("dataservice: coordinated reader heartbeat failed: %r", e)


def _read(spec: _ReadSpec, repetition: int) -> Iterator:
    """Generator: one pass over a job of the service."""
    client = _client_for(spec.address)
    _ensure_installed(client)
    capacity = spec.max_outstanding_requests or int(config.get("client.max-outstanding-batches"))

    async def start():
        job = raise_for_status(await client.scheduler.dataservice_get_or_create_job(
            dataset_id=spec.dataset_id, processing_mode=spec.processing_mode,
            job_name=spec.job_name, target_workers=spec.target_workers,
            num_consumers=spec.num_consumers,
            cross_trainer_cache=spec.cross_trainer_cache is not None,
        ), "job creation")
        view = raise_for_status(await client.scheduler.dataservice_get_or_create_iteration(
            job_id=job["job_id"], repetition=repetition,
        ), "iteration creation")
        channel = _Channel(asyncio.get_running_loop(), capacity)
        cls = _IterationReader if spec.num_consumers is None else _CoordinatedReader
        reader = cls(client, spec, view["iteration_id"], view["iteration_client_id"], channel)
        reader.future = asyncio.ensure_future(reader.run(view))
        return reader

    reader = _run(client, start)
    try:
        get = reader.channel.get
        while True:
            try:
                item = get(timeout=1.0)
            except queue.Empty:
                if reader.future.done():  # the reader ended without a word (cancelled)
                    raise DataServiceError(
                        f"lost contact with the data service at {spec.address}: the reader "
                        f"stopped (client status: {client.status})"
                    ) from None
                continue
            if item is _END:
                return
            if type(item) is _Failure:
                exc = item.exc
                item.exc = None
                raise exc
            yield from item
    finally:
        _close_reader(client, reader)


def _close_reader(client: Client, reader: _IterationReader) -> None:
    async def close():
        reader.stop()
        if not reader.future.done():
            reader.future.cancel()
        try:
            await client.scheduler.dataservice_release_iteration_client(
                iteration_client_id=reader.client_id)
        except Exception as e:  # noqa: BLE001 - the dispatcher releases silent clients itself
            logger.debug("dataservice: release failed: %r", e)

    try:
        client.loop.add_callback(close)
    except Exception:  # noqa: BLE001 - the client is closed
        pass
