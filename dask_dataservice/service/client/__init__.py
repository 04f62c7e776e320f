"""The consumer side of the data service: register, read, distribute.

``register_dataset`` sends a pipeline (cloudpickled once, on the client) and its splits
(enumerated once, on the client) to the dispatcher and returns a dataset id.
``from_dataset_id`` and ``distribute`` return a :class:`DistributedDataset`: a
:class:`~dask_dataservice.data.Dataset` whose source streams elements from the service, so
it can be iterated many times and transformed further locally (``.map``, ``.prefetch``...).

Reading is :mod:`._reader`'s; clients and installation are :mod:`._connection`'s.

With an asynchronous client (``Client(asynchronous=True)``), ``register_dataset`` and
``install`` return awaitables, and a ``DistributedDataset`` supports ``async for``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import cloudpickle
from distributed import Client

from ...data import Dataset, _stats
from ...data._base import UNKNOWN, walk
from ...data._base import sources as sources_of
from ...data.dask_source import FromDask, locality_metadata, pickling_with, pin_persisted
from ...data.ops_more import AutoCache
from ...data.spec import check_element_spec
from ...data.splits import FileSplits, PipelineSplits
from ..protocol._frames import check_compression
from ..protocol._sharding import ShardingPolicy, parse_processing_mode
from . import _connection, _equal_reader, _fixed_readers, _scatter  # noqa: F401 - the readers install themselves
from ._cardinality import count_preserving
from ._connection import _install_async, close_clients, install  # noqa: F401 - _install_async: tests
from ._position_reader import PositionedSource, dataset_position, resume, source_for
from ._reader import aread
from ._scope import NAME_SCOPE, name_scope, scoped_fingerprint
from ._service_source import ReadSpec, ServiceSource

__all__ = [
    "ShardingPolicy",
    "CrossTrainerCache",
    "DistributedDataset",
    "register_dataset",
    "from_dataset_id",
    "distribute",
    "install",
    "close_clients",
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

    def __post_init__(self) -> None:
        if not isinstance(self.trainer_id, str) or not self.trainer_id:
            raise ValueError(f"trainer_id must be a non-empty string, got {self.trainer_id!r}")


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------


def register_dataset(service: Client | str | tuple[str, str], dataset: Dataset,
                     compression: str | None = "AUTO", dataset_id: str | None = None,
                     split_size: int | None = None) -> Any:
    """Register ``dataset`` with the data service and return its dataset id.

    The pipeline is pickled here (so an unpicklable function fails now, with a message
    naming it) and, when the source is splittable, its splits are enumerated here, once.
    Registering the same pipeline again returns the same id. With an asynchronous client,
    returns an awaitable of the id (``await dds.register_dataset(client, ds)``), which is
    why the return type is ``Any`` (a ``str``, or an awaitable of one).

    The id is a credential (as TensorFlow's, a string): ``"<n>:<secret>"``, or
    ``"<dataset_id>:<secret>"`` with a ``dataset_id`` of yours, where ``<secret>`` is drawn by
    the dispatcher when the pipeline is first registered. Whoever holds it may read the
    dataset and join its named jobs; the state view and the dashboard list no dataset or
    job to a caller without it (docs/security.md). Keep it as you would a password; every
    process that registers the same pipeline gets the same id, unless they use different
    registration keys (``dataservice.client.registration-key``): on a shared cluster, give
    your trainers one secret key, so that a stranger who rebuilds your pipeline gets another
    dataset, not yours.

    Parameters
    ----------
    service
        A ``distributed.Client`` or the scheduler's address: ``"tcp://host:port"``,
        TensorFlow's ``"grpc://host:port"`` or ``"host:port"``, or a ``(protocol, address)``
        tuple (``"grpc"`` is the cluster's own protocol, tcp or tls: docs/data-service.md,
        "Addresses").
    dataset
        The pipeline to register.
    compression
        ``"AUTO"`` (the default), None, or a codec: ``"lz4"``, ``"zstd"``, ``"snappy"``,
        ``"zlib"`` (installed here; ``pip install 'dask-dataservice[compression]'`` brings
        lz4). Workers compress a batch's frames for readers on other hosts, frame by frame
        where it pays (a sample of each must compress to 70%); ``"AUTO"`` uses lz4 (or zstd,
        snappy) when both sides have it, None never compresses. Readers on the worker's own
        host get raw frames (``dataservice.client.compression``; see docs/performance.md).
    dataset_id
        A name of your choice (a string, as TensorFlow's id): the returned id is then
        ``"<dataset_id>:<secret>"``, which :func:`from_dataset_id` takes (the bare name is
        not enough). As in TensorFlow, when a dataset is registered under that name already,
        no new dataset is registered and its id is returned, also for another pipeline, as
        long as its structure matches (same cardinality and compression; else a
        ``ValueError`` that names the difference), so that trainers re-using a name share its
        dataset and named jobs. With a registration key, only registrations with the same
        key share a name (another key's is a ``ValueError``; docs/security.md).
    split_size
        Elements per split of a splittable source (DYNAMIC sharding hands out splits):
        smaller splits balance workers more finely and lose less when a worker dies (at most
        once visitation), larger ones cost fewer dispatcher round trips. Default: about 256
        splits of at most 65,536 elements (see ``Dataset.splits``). A pipeline registered
        with another split size is another dataset.
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"dataset must be a dask_dataservice Dataset, got {type(dataset).__name__}")
    compression = check_compression(compression)
    # big arrays (and collections) go to the workers through Dask, not in the pickle
    large = _scatter.large_inputs(dataset._op)
    pipeline = b"" if large else _pickle(dataset, {})
    why_not = dataset.why_not_splittable()
    if why_not is None:
        splits_list = dataset.splits(split_size)
        num_splits = len(splits_list)
        # a file-based source's splits are its paths, in the pipeline already: sent once
        splits = cloudpickle.dumps(PipelineSplits(split_size) if isinstance(
            splits_list, FileSplits) else splits_list)
    else:
        splits, num_splits = b"", -1
    if dataset_id is not None and (not isinstance(dataset_id, str) or not dataset_id):
        raise TypeError(f"dataset_id must be a non-empty string or None, got {dataset_id!r}")
    fingerprint = dataset.fingerprint()
    if split_size is not None:
        fingerprint = f"{fingerprint}/split_size={split_size}"
    if compression != "AUTO":  # the same pipeline sent otherwise is another dataset
        fingerprint = f"{fingerprint}/compression={compression}"
    fingerprint = scoped_fingerprint(fingerprint)
    client = _connection.client_for(service)
    metadata = {
        "why_not_splittable": why_not, "file_based": dataset.is_file_based,
        "why_not_file_shardable": dataset.why_not_file_shardable(),  # FILE / FILE_OR_DATA
        "cardinality": dataset.cardinality(), "has_shard_hint": dataset.has_shard_hint,
        # from_dataset_id's cardinality() (service/client/_cardinality.py)
        "count_preserving": count_preserving(dataset._op),
        **locality_metadata(dataset._op),  # a persisted Dask collection: where its splits are
        # issue 26: DYNAMIC splits go first to the worker that cached them
        "autocache": any(isinstance(op, AutoCache) for op in walk(dataset._op)),
    }
    scope = name_scope(dataset_id)
    if scope is not None:  # a name in use is reused only under the same registration key
        metadata[NAME_SCOPE] = scope

    async def go() -> str:
        installing = _connection.ensure_installed(client)
        if installing is not None:
            await installing
        # Dask collections: keep their data alive (published once registered)
        pins = dict(await pin_persisted(client, dataset._op) or {})
        sent = pipeline
        if large:  # scattered (persisted) now; the pipeline holds their keys
            moved = await _scatter.move(client, large, split_size, pins)
            sent = await asyncio.to_thread(_pickle, dataset, moved)
            source = sources_of(dataset._op)
            if len(source) == 1 and isinstance(moved.get(id(source[0])), FromDask):
                # persisted now: the dispatcher may hand out its partitions where they are
                metadata.update(locality_metadata(moved[id(source[0])]))
        if pins:  # the dispatcher unpublishes them when it frees the last dataset using them
            metadata["published"] = sorted(pins)
        # registration is idempotent (by fingerprint): retried across a dispatcher restart
        resp = await _connection.call_dispatcher(
            client, "dataservice_register_dataset", "dataset registration",
            fingerprint=fingerprint, pipeline=sent, splits=splits, num_splits=num_splits,
            compression=compression, metadata=metadata, dataset_id=dataset_id,
            client_id=client.id,
        )
        dataset_id_: str = resp["dataset_id"]
        await _scatter.publish(client, pins)  # after: see service/client/_scatter.py
        return dataset_id_

    if client.asynchronous and _connection.on_loop_thread(client):
        return go()
    _connection.check_can_block(client, "register_dataset()")
    _connection.ensure_installed(client)
    return _connection.run_blocking(client, go)


def _pickle(dataset: Dataset, moved: dict[int, Any]) -> bytes:
    """The pipeline's pickle, with the sources in ``moved`` pickled as their replacements."""
    try:
        with pickling_with(moved):
            return cast(bytes, cloudpickle.dumps(dataset))
    except Exception as e:
        raise TypeError(
            f"the dataset cannot be pickled, so it cannot run on workers: {type(e).__name__}: {e}. "
            "Functions in a pipeline must be picklable by cloudpickle (no open files, locks, "
            "sockets or clients in their closures)"
        ) from e


class DistributedDataset(Dataset):
    """A dataset that reads from the data service (see :func:`from_dataset_id`).

    Iterate it like any ``Dataset``; each iteration reads one pass of its job. Further
    transformations (``.map``, ``.batch``, ``.prefetch``...) run locally, on the consumer.
    """

    __slots__ = ("_element_spec",)  # from_dataset_id(element_spec=...), else unset
    _element_spec: Any

    @property
    def element_spec(self) -> Any:
        """The ``element_spec`` given to :func:`from_dataset_id`, else found by reading."""
        spec = getattr(self, "_element_spec", None)
        return spec if spec is not None else Dataset.element_spec.fget(self)  # type: ignore[attr-defined]

    @property
    def _service(self) -> ServiceSource:
        return cast(ServiceSource, self.source)  # from_dataset_id built it on one

    @property
    def dataset_id(self) -> int | str:
        return self._service.spec.dataset_id

    @property
    def processing_mode(self) -> ShardingPolicy:
        return ShardingPolicy(self._service.spec.processing_mode)

    @property
    def job_name(self) -> str | None:
        return self._service.spec.job_name

    def total_cardinality(self) -> int:
        """The registered pipeline's own cardinality: the elements of one pass of all its
        consumers together (known to ``distribute``; a ``from_dataset_id`` dataset asks the
        dispatcher once, as ``cardinality()`` does). ``cardinality()`` is one consumer's
        pass, where it is determined (see docs/data-service.md, "Cardinality")."""
        self._service.cardinality()  # asks the dispatcher once, if needed
        total = self._service.total
        return UNKNOWN if total is None else total

    def stats(self) -> _stats.DatasetStats:
        """What reading this dataset cost so far, as plain data (Ray's ``Dataset.stats()``).

        Over every pass (``for``) of this object: ``elements``, ``passes``,
        ``elements_per_second`` (over the time from the first request to the last element),
        ``wait_seconds`` (the consumer waited for the service), ``compute_seconds`` (the
        consumer's own work between elements, local transformations included),
        ``wait_fraction``, and ``workers``: elements and batches received from each data
        worker (both for ``for`` and ``async for``; coordinated reads count no per-worker
        figures). Kept per batch the reader received (no cost per element): while a pass
        runs, ``elements`` lags by at most the batch being read.

        Also, as a local ``Dataset.stats()``: ``ops`` (this process's ops of the latest pass,
        the read from the service included), ``wait_per_batch_seconds`` (percentiles of the
        time a batch took to arrive), ``wait_fraction_history`` (the input-bound share per
        half second), and ``service_ops`` / ``service_bottleneck``: the per-op rows of the
        job's pipeline summed over its data workers, as of the dashboard's last poll (empty
        where the scheduler has no dashboard). ``print(ds.stats())`` shows a table.
        """
        source = self._service
        snapshot: dict[str, Any] = source.stats.snapshot()
        local = Dataset.stats(self)
        out = _stats.DatasetStats.of(local["ops"], local.get("wall_seconds"), **snapshot)
        out["service_ops"], out["service_bottleneck"] = _service_ops(
            source, source.stats.iteration_id)
        return out

    def __aiter__(self) -> AsyncIterator[Any]:
        """``async for x in dataset``: one pass, read on the client's own event loop.

        For asynchronous clients (``Client(asynchronous=True)``), in a coroutine on the
        client's loop. Transformations applied after ``from_dataset_id`` are not run by
        ``async for``: apply them to the elements yourself.
        """
        source = self._service
        batches = aread(source.spec, source.next_repetition(), source.reader_client(),
                        source.stats)
        if isinstance(source, PositionedSource):  # issue 13
            return source.aiterate(batches)
        return source.stats.awrap(batches)  # issue 14: DistributedDataset.stats()

    def input_position(self) -> dict[str, Any]:
        """Where this dataset's latest pass in this process is: a small JSON-able value.

        Read with ``track_position=True``. Which source elements this consumer was given,
        plus the position it started from (see docs/training.md, "Input position").
        """
        return dataset_position(self)

    def start_from(self, position: dict[str, Any] | list[dict[str, Any]],
                   nonce: str = "") -> DistributedDataset:
        """This dataset, reading a new job that resumes at ``position`` (or at the union of a
        list of positions of a shared job's consumers): what they were given is not read
        again. Consumers resuming with the same position (and ``nonce``) share the job."""
        ds = resume(self, position, nonce)
        assert isinstance(ds, DistributedDataset)  # no local ops on self
        return ds


def _service_ops(source: ServiceSource, iteration_id: int | None
                 ) -> tuple[list[dict[str, Any]], str | None]:
    """The job's per-op rows from the scheduler's dashboard (empty when it cannot tell)."""
    if iteration_id is None:
        return [], None
    client = source.reader_client()
    if _connection.on_loop_thread(client):
        return [], None  # a synchronous stats() cannot wait on its own loop

    async def go() -> Any:
        scheduler = client.scheduler
        return None if scheduler is None else await scheduler.dataservice_job_ops(
            iteration_id=iteration_id)

    try:
        reply = _connection.run_blocking(client, go)
    except Exception:  # noqa: BLE001 - no dashboard on that scheduler: no service rows
        return [], None
    if not isinstance(reply, dict):
        return [], None
    return [dict(r) for r in reply.get("ops", ())], reply.get("bottleneck")


def from_dataset_id(processing_mode: ShardingPolicy | str | int, service: Client | str | tuple[str, str],
                    dataset_id: int | str, element_spec: Any = None,
                    job_name: str | None = None, consumer_index: int | None = None,
                    num_consumers: int | None = None, max_outstanding_requests: int | None = None,
                    data_transfer_protocol: str | None = None,
                    cross_trainer_cache: CrossTrainerCache | None = None,
                    target_workers: str = "AUTO", track_position: bool = False,
                    start_from: dict[str, Any] | None = None,
                    equal: bool | str = False) -> DistributedDataset:
    """A dataset that reads the registered dataset ``dataset_id`` from the service.

    Parameters
    ----------
    processing_mode
        A :class:`ShardingPolicy` (or its name), or ``"parallel_epochs"`` (OFF) /
        ``"distributed_epoch"`` (DYNAMIC).
    service
        A ``distributed.Client`` or the scheduler's address (as :func:`register_dataset`'s:
        ``"grpc://host:port"`` and ``(protocol, address)`` tuples too).
    dataset_id
        From :func:`register_dataset`: the string ``"<id or name>:<secret>"``. A bare
        integer id or name is refused with ``DatasetNotFoundError`` (except for datasets
        journaled before ids held a secret).
    job_name
        Consumers using the same name share one job (they split its elements between them);
        without a name every iteration is a private job.
    max_outstanding_requests
        Batches buffered on the consumer before reading pauses (default: config
        ``dataservice.client.max-outstanding-batches``).
    element_spec
        The elements' :class:`~dask_dataservice.data.TensorSpec` structure (as
        ``Dataset.element_spec`` returns): the dataset's ``element_spec`` is then this, without
        reading an element (which would start a job). Not checked against the elements.
    data_transfer_protocol
        Accepted for compatibility with tf.data service; not needed here.
    track_position
        DYNAMIC and OFF: the job tracks which source elements each consumer was given, so
        that :meth:`DistributedDataset.input_position` can say where a pass is, exactly
        (and a ``Checkpoint`` can save it). A named job gets a suffix: tracking readers
        share a job only with tracking readers. See docs/training.md, "Input position".
    start_from
        A position (from ``input_position``, or a list of a shared job's consumers'
        positions is merged by ``DistributedDataset.start_from``): read a new job that skips
        what the position says was given. Implies ``track_position``.
    equal
        ``True`` (or ``"drop"``) or ``"pad"``: an equal split, as Ray Data's
        ``streaming_split(n, equal=True)``. The ``num_consumers`` consumers of the named
        DYNAMIC job (each with its own ``consumer_index``) get the same number of elements
        in every pass, still first come, first served (a faster consumer takes more of the
        work while it can) and each element at most once: what is left over at the end is
        dropped (``"drop"``: at most what the other consumers hold, see
        docs/data-service.md), or the short consumers repeat elements they delivered
        (``"pad"``, as torch's ``DistributedSampler`` pads). For data-parallel training
        (``DistributedDataParallel`` ranks must take the same number of steps).
    """
    mode = parse_processing_mode(processing_mode)
    remainder = _check_equal(equal, mode, job_name, consumer_index, num_consumers,
                             cross_trainer_cache, track_position or start_from is not None)
    if isinstance(dataset_id, bool) or not isinstance(dataset_id, (int, str)) or dataset_id == "":
        raise TypeError("dataset_id must be an int or a non-empty string (from register_dataset), "
                        f"got {type(dataset_id).__name__} {dataset_id!r:.40}")
    if job_name is not None and (not isinstance(job_name, str) or not job_name):
        raise ValueError(f"job_name must be a non-empty string or None, got {job_name!r}")
    if (consumer_index is None) != (num_consumers is None):
        raise ValueError("consumer_index and num_consumers must be given together, or neither")
    if consumer_index is not None:
        for name, value in (("consumer_index", consumer_index), ("num_consumers", num_consumers)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
        assert num_consumers is not None  # given together (checked above)
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
    address = _connection.service_address(service)
    if isinstance(service, Client):
        _connection.client_for(service)  # remember it, so iteration in this process reuses it
    spec = ReadSpec(address, dataset_id, int(mode), job_name, consumer_index, num_consumers,
                     max_outstanding_requests, target, cross_trainer_cache, equal=remainder)
    ds = DistributedDataset(source_for(  # issue 13: track_position / start_from
        spec, service if isinstance(service, Client) else None, track_position, start_from))
    if element_spec is not None:  # returned as is: no element is read to find it (TF's use)
        ds._element_spec = check_element_spec(element_spec)
    return ds


def _check_equal(equal: Any, mode: ShardingPolicy, job_name: str | None,
                 consumer_index: int | None, num_consumers: int | None,
                 cross_trainer_cache: Any, positions: bool) -> str | None:
    """``from_dataset_id(equal=...)`` checked: ``"drop"``, ``"pad"`` or None (no equal split)."""
    if equal is False:
        return None
    if equal is True:
        remainder = "drop"
    elif isinstance(equal, str) and equal in ("drop", "pad"):
        remainder = equal
    else:
        raise ValueError(f"equal must be False, True (same as 'drop'), 'drop' or 'pad', got "
                         f"{equal!r}")
    if mode != ShardingPolicy.DYNAMIC:
        raise ValueError(
            f"equal splits share a job's elements between its consumers: they need "
            f"processing_mode='distributed_epoch' (DYNAMIC), not {mode.name} (under OFF every "
            "consumer of a job reads it whole)")
    if consumer_index is None or num_consumers is None:
        raise ValueError(
            "an equal split needs consumer_index and num_consumers (e.g. the rank and the "
            "world size of torch.distributed: **dds.torch.ddp_split())")
    if isinstance(consumer_index, int) and isinstance(num_consumers, int) \
            and not 0 <= consumer_index < num_consumers:
        raise ValueError(
            f"need 0 <= consumer_index < num_consumers, got consumer_index={consumer_index}, "
            f"num_consumers={num_consumers}")
    if job_name is None:
        raise ValueError("an equal split needs a job_name (its consumers share one job)")
    if cross_trainer_cache is not None:
        raise ValueError("equal splits and the cross-trainer cache do not combine: trainers of "
                         "the cache read every element, an equal split divides them")
    if positions:
        raise ValueError("input positions (track_position, start_from) are not tracked for "
                         "equal splits")
    return remainder


def distribute(processing_mode: ShardingPolicy | str | int, service: Client | str | tuple[str, str],
               job_name: str | None = None,
               consumer_index: int | None = None, num_consumers: int | None = None,
               max_outstanding_requests: int | None = None, data_transfer_protocol: str | None = None,
               compression: str | None = "AUTO",
               cross_trainer_cache: CrossTrainerCache | None = None,
               target_workers: str = "AUTO",
               split_size: int | None = None, track_position: bool = False,
               start_from: dict[str, Any] | None = None,
               equal: bool | str = False) -> Callable[[Dataset], DistributedDataset]:
    """A transformation that moves a pipeline onto the data service.

    Use with ``Dataset.apply``: ``ds.apply(distribute("distributed_epoch", client))``
    registers ``ds`` and returns a :class:`DistributedDataset` reading it (with an
    asynchronous client, an awaitable of it: ``ds = await distribute(...)(dataset)``, since
    ``Dataset.apply`` needs a dataset at once). ``split_size`` is :func:`register_dataset`'s,
    ``equal`` (equal splits for data-parallel training) :func:`from_dataset_id`'s.
    """
    mode = parse_processing_mode(processing_mode)
    _check_equal(equal, mode, job_name, consumer_index, num_consumers, cross_trainer_cache,
                 track_position or start_from is not None)
    _connection.service_address(service)

    def _apply(dataset: Dataset) -> DistributedDataset:
        if mode == ShardingPolicy.DYNAMIC:
            dataset.check_splittable()  # say why now, before anything is sent
        def read(dataset_id: int | str) -> DistributedDataset:
            return from_dataset_id(
                processing_mode, service, dataset_id, job_name=job_name,
                consumer_index=consumer_index, num_consumers=num_consumers,
                max_outstanding_requests=max_outstanding_requests,
                cross_trainer_cache=cross_trainer_cache, target_workers=target_workers,
                track_position=track_position, start_from=start_from, equal=equal,
            )

        def read_known(dataset_id: int | str) -> DistributedDataset:
            ds = read(dataset_id)  # this process knows the pipeline: its cardinality too
            ds._service.total = dataset.cardinality()
            ds._service.preserving = count_preserving(dataset._op)
            return ds

        dataset_id = register_dataset(service, dataset, compression=compression,
                                      split_size=split_size)
        if isinstance(dataset_id, int | str):
            return read_known(dataset_id)

        async def registered() -> DistributedDataset:  # ``await ds.apply(distribute(...))``
            return read_known(await dataset_id)

        # an asynchronous client: an awaitable of the dataset (see the docstring)
        return registered()  # type: ignore[return-value]

    return _apply
