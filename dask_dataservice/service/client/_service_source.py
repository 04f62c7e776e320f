"""What a distributed dataset reads: the job it names (:class:`ReadSpec`) and the pipeline
op that reads it (:class:`ServiceSource`, the source of ``from_dataset_id``): its
cardinality, repr and passes. The reading itself is in :mod:`._reader`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from distributed import Client

from ...data._base import REPR_ONLY, UNKNOWN, IterContext, Op
from ..protocol._metrics import ReadStats
from ..protocol._sharding import ShardingPolicy
from . import _connection
from ._cardinality import service_cardinality, why_unknown
from ._progress import progress_bar


@dataclasses.dataclass(frozen=True)
class ReadSpec:
    """What a ``DistributedDataset`` reads (the arguments of ``from_dataset_id``)."""

    address: str
    dataset_id: int | str
    processing_mode: int
    job_name: str | None
    consumer_index: int | None
    num_consumers: int | None
    max_outstanding_requests: int | None
    target_workers: str
    cross_trainer_cache: Any  # CrossTrainerCache | None
    #: A job tracking input positions: ``CreateJob.position`` (issue 13, ``_positions``).
    position: str | None = None
    #: An equal split (``from_dataset_id(equal=...)``): ``"drop"`` or ``"pad"``, else None.
    equal: str | None = None

    @property
    def job_request(self) -> tuple[str | None, int | None]:
        """The job name and ``num_consumers`` the dispatcher is asked for: the consumers of
        an equal split share a job of their own (never one read otherwise), and their
        ``num_consumers`` is the split's, not a coordinated read's."""
        if self.equal is None:
            return self.job_name, self.num_consumers
        return f"{self.job_name}#equal", None

    @property
    def dataset_label(self) -> str:
        """The dataset's id without its secret (``"<id or name>:<secret>"``), for messages."""
        key, sep, _ = str(self.dataset_id).rpartition(":")
        return key if sep else str(self.dataset_id)


class ServiceSource(Op):
    """A source op that streams elements of a registered dataset from the service."""

    name = "from_dataset_id"
    is_source = True
    splittable = False
    file_based = False

    #: One pass over the job (``_reader.read``, which installs itself: it imports this module).
    read_pass: ClassVar[Callable[..., Iterator[Any]]]

    def __init__(self, spec: ReadSpec, client: Client | None = None) -> None:
        self.spec = spec
        #: The Client given as ``service`` (this process only: never pickled). Reads use it,
        #: not whichever client this process has for the address: an asynchronous client
        #: must be read on its own loop.
        self.client = client
        # How many times this object started reading a named job (its repetition).
        self._repetitions = 0
        self._lock = threading.Lock()
        self.stats = ReadStats()  # issue 14: DistributedDataset.stats()
        #: The registered pipeline's cardinality and whether its ops keep one element per
        #: element: known when this process registered it (``distribute``), else asked of
        #: the dispatcher on the first ``cardinality()`` (:meth:`_ask_metadata`); see
        #: ``_cardinality``.
        self.total: int | None = None
        self.preserving = False
        self._asked = False
        #: Why the cardinality is unknown when the dispatcher's answer leaves it so.
        self._note: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.spec = state["spec"]
        self.client = None
        self._repetitions = 0
        self._lock = threading.Lock()
        self.stats = ReadStats()  # issue 14: DistributedDataset.stats()
        self.total = None
        self.preserving = False
        self._asked = False
        self._note = None

    def reader_client(self) -> Client:
        """The client to read with: the one given as ``service`` while usable, else the one
        this process has (or opens) for the address."""
        client = self.client
        if client is not None and client.status not in ("closed", "closing"):
            return client
        return _connection.client_for(self.spec.address)

    def params(self) -> tuple[Any, ...]:
        return (dataclasses.astuple(self.spec),)

    def _ask_metadata(self) -> None:
        """Ask the dispatcher what the registration said of the dataset (its cardinality
        and whether its ops keep one element per element), once per object; not from a
        repr, nor on the client's event loop (where it cannot block)."""
        if self._asked or self.total is not None or REPR_ONLY.get():
            return
        client = self.reader_client()
        if _connection.on_loop_thread(client):
            self._note = ("from_dataset_id() asks the dispatcher for the dataset's cardinality, "
                          "which cannot be waited for on the client's event loop: call "
                          "cardinality() from another thread (await asyncio.to_thread(...))")
            return
        what = f"the cardinality of dataset {self.spec.dataset_label!r}"
        resp = _connection.run_blocking(
            client, _connection.call_dispatcher, client, "dataservice_dataset_metadata", what,
            dataset_id=self.spec.dataset_id)
        with self._lock:
            self._asked, self._note = True, None
            total, preserving = resp.get("cardinality"), resp.get("count_preserving")
            self.total = total if isinstance(total, int) else None
            self.preserving = bool(preserving)
            if self.total is None:
                self._note = ("the dataset was registered without its cardinality (by an older "
                              "version of dask_dataservice): register it again to know it")
            elif preserving is None:
                self._note = ("the dataset was registered without saying whether its ops keep "
                              "one element per element (by an older version of "
                              "dask_dataservice): register it again to know its cardinality")

    def cardinality(self) -> int:
        self._ask_metadata()
        spec = self.spec
        return service_cardinality(spec.processing_mode, spec.job_name,
                                   spec.consumer_index is not None, self.total, self.preserving)

    def repr_args(self) -> list[str]:
        """The job this source reads, as ``from_dataset_id``'s arguments (the dataset id
        without its secret: a repr ends up in logs)."""
        spec = self.spec
        args = [f"processing_mode={ShardingPolicy(spec.processing_mode).name}",
                f"service={spec.address!r}", f"dataset_id={spec.dataset_label!r}"]
        for name in ("job_name", "consumer_index", "num_consumers", "max_outstanding_requests"):
            value = getattr(spec, name)
            if value is not None:
                args.append(f"{name}={value!r}")
        if spec.target_workers != "AUTO":
            args.append(f"target_workers={spec.target_workers!r}")
        if spec.cross_trainer_cache is not None:
            args.append(f"cross_trainer_cache={spec.cross_trainer_cache!r}")
        if spec.position is not None:
            args.append("track_position=True")
        return args

    def cardinality_note(self) -> str | None:
        if self.cardinality() != UNKNOWN:
            return None
        spec = self.spec
        if self._note is not None and (self.total is None or (
                self.total > 0 and spec.job_name is None and not self.preserving
                and spec.processing_mode != ShardingPolicy.OFF)):
            return self._note
        return why_unknown(spec.processing_mode, spec.job_name, self.total, self.preserving)

    def why_not(self) -> str:
        return "the dataset already reads from the data service"

    def next_repetition(self) -> int:
        """The repetition of the job the next pass reads (named jobs count passes)."""
        with self._lock:
            repetition = self._repetitions
            if self.spec.job_name is not None:
                self._repetitions += 1
        self.check_repetition(repetition)
        return repetition

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        return self.elements(ctx)

    def elements(self, ctx: IterContext,
                 on_batch: Callable[[list[Any], Iterator[Any]], None] | None = None,
                 ) -> Iterator[Any]:
        """One pass's elements; ``on_batch``: see :meth:`ReadStats.wrap`."""
        figures = ctx.stats
        return self.stats.wrap(  # time waiting vs computing, elements per worker
            self.read_pass(self.spec, self.next_repetition(), self.reader_client(), self.stats),
            progress_bar(self.cardinality(), self.spec.dataset_label),
            None if figures is None else figures.record(self),
            figures if figures is not None and figures.take_ends(self) else None, on_batch)

    def check_repetition(self, repetition: int) -> None:
        """The cross-trainer cache serves one pass (TensorFlow refuses a second one too:
        it would be a new repetition of the job, which reuses nothing from the cache)."""
        if repetition > 0 and self.spec.cross_trainer_cache is not None:
            raise ValueError(
                "Cross-trainer caching requires infinite datasets and disallows multiple "
                "repetitions of the same dataset: iterate this distributed dataset once (it "
                "is infinite), or call from_dataset_id again for another pass")
