"""The consumer's half of input positions (issue 13, section 2; see :mod:`._positions`).

:class:`PositionedSource` is the source of a distributed dataset read with
``track_position=True``: each reply of its job carries the run list of its elements
(issue 25, :mod:`..protocol._runs`), and a :class:`~._positions.PositionTracker` keeps the
runs of the batch being handed out with the batch's cursor (no work per element). :func:`dataset_position` reads the position of a dataset (that source, maybe
under lazy local transformations), :func:`resume` builds the same dataset reading a new job
that starts from a position.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

from distributed import Client

from ...data import Dataset
from ...data._base import IterContext, Op
from ...data.ops import Batch, Filter, Map
from ..protocol._positions import (
    POLICIES,
    InputPositionError,
    PositionTracker,
    check_position,
    job_field,
    job_suffix,
    merge_positions,
)
from ..protocol._sharding import ShardingPolicy
from . import _connection
from ._service_source import ReadSpec, ServiceSource

__all__ = ["PositionedSource", "dataset_position", "positioned_spec", "resume"]


def positioned_spec(spec: ReadSpec, start: dict[str, Any] | None, nonce: str = "") -> ReadSpec:
    """``spec`` reading a job that tracks input positions, from ``start`` (None: the beginning).

    A named job gets a suffix (:func:`~._positions.job_suffix`): readers that track and
    readers that do not never share a job, nor do jobs started from different positions.
    """
    policy = ShardingPolicy(spec.processing_mode).name
    if policy not in POLICIES:
        raise InputPositionError(
            f"input positions are tracked for DYNAMIC and OFF reads, not {policy}")
    if spec.num_consumers is not None or spec.cross_trainer_cache is not None:
        raise InputPositionError(
            "input positions are not tracked for coordinated reads (num_consumers) or the "
            "cross-trainer cache: their elements are not each read once")
    if start is not None:
        start = check_position(start, policy=policy)
    field = job_field(start, nonce)
    name = spec.job_name
    if name is not None and spec.position is not None:  # already tracking: the user's name
        name = name.split("#position-", 1)[0]
    if name is not None:
        name += job_suffix(field)
    return dataclasses.replace(spec, job_name=name, position=field)


class PositionedSource(ServiceSource):
    """A :class:`ServiceSource` whose job tags its elements with their provenance."""

    def __init__(self, spec: ReadSpec, client: Client | None = None,
                 start: dict[str, Any] | None = None) -> None:
        super().__init__(spec, client)
        self.start = start
        #: The position tracker of the latest pass (None before the first).
        self.tracker: PositionTracker | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "start": self.start}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.start = state["start"]
        self.tracker = None

    def _check(self, client: Client) -> PositionTracker:
        """Ask the dispatcher for the dataset's fingerprint (and check the start against it)."""
        _connection.check_can_block(client, "iterating a distributed dataset")
        _connection.ensure_installed(client)
        policy = ShardingPolicy(self.spec.processing_mode).name
        resp = _connection.run_blocking(
            client, _connection.call_dispatcher, client, "dataservice_check_position",
            "input position check", dataset_id=self.spec.dataset_id, processing_mode=policy,
            start=self.start)
        return PositionTracker(policy, resp["fingerprint"], self.start)

    def iterate(self, ctx: IterContext) -> Iterator[Any]:
        tracker = self.tracker = self._check(self.reader_client())
        return self.elements(ctx, tracker.batch)  # no per-element work (issue 25)

    def position_of(self, dataset: Dataset) -> dict[str, Any]:
        """The input position of ``dataset`` (read from this source): ps/ calls this."""
        return dataset_position(dataset)

    def resumed(self, dataset: Dataset, saved: dict[str, dict[str, Any]], worker: str,
                nonce: str) -> Dataset:
        """A checkpoint's restore on training worker ``worker`` (``CountingIterator``): a
        named (shared) job resumes from the union of every worker's saved position, a
        private one from this worker's own."""
        if self.spec.job_name is not None:
            return resume(dataset, list(saved.values()), nonce) if saved else dataset
        mine = saved.get(worker)
        return dataset if mine is None else resume(dataset, mine, nonce)

    async def aiterate(self, batches: AsyncIterator[list[Any]]) -> AsyncIterator[Any]:
        """``async for``: the pass's elements, from its batches (see ``__aiter__``)."""
        client = self.reader_client()
        policy = ShardingPolicy(self.spec.processing_mode).name
        resp = await _connection.call_dispatcher(
            client, "dataservice_check_position", "input position check",
            dataset_id=self.spec.dataset_id, processing_mode=policy, start=self.start)
        tracker = self.tracker = PositionTracker(policy, resp["fingerprint"], self.start)
        async for x in self.stats.awrap(batches, tracker.batch):
            yield x


#: Transformations on the consumer that hand out what they took before taking more (so a
#: position read between two ``next`` calls counts exactly what the user was given).
_LAZY_LOCAL = (Filter, Batch)


def _source_of(dataset: Dataset) -> tuple[list[Op], ServiceSource]:
    """The local ops above a distributed dataset's source (top first) and the source."""
    chain: list[Op] = []
    op = dataset._op
    while not isinstance(op, ServiceSource):
        if len(op.inputs) != 1:
            raise InputPositionError(
                f"Dataset.{op.name}() combines several inputs: no input position")
        chain.append(op)
        op = op.inputs[0]
    return chain, op


def dataset_position(dataset: Dataset) -> dict[str, Any]:
    """The input position of ``dataset``'s latest pass in this process (see the module doc)."""
    chain, source = _source_of(dataset)
    if not isinstance(source, PositionedSource):
        raise InputPositionError(
            "this distributed dataset does not track its input position: read it with "
            "from_dataset_id(..., track_position=True) (or distribute(..., track_position=True))")
    for op in chain:
        lazy = isinstance(op, _LAZY_LOCAL) or (
            type(op) is Map and (op.num_parallel_calls or 1) <= 1)
        if not lazy:
            raise InputPositionError(
                f"the input position of this dataset is not exact: Dataset.{op.name}() "
                "applied on the consumer reads ahead of what it hands out (exact: map "
                "without num_parallel_calls, filter, batch); apply it before distribute")
    if source.tracker is None:
        if source.start is not None:
            return check_position(source.start)
        raise InputPositionError("this distributed dataset has not been read yet: it has "
                                 "no input position")
    return source.tracker.position()


def resume(dataset: Dataset, position: dict[str, Any] | list[dict[str, Any]],
           nonce: str = "") -> Dataset:
    """``dataset`` reading a new job that starts from ``position`` (or the union of a list of
    positions of one job's consumers). Readers that resume with the same position and
    ``nonce`` share the new job (a named one)."""
    chain, source = _source_of(dataset)
    if isinstance(position, list):
        position = merge_positions(position)
    spec = positioned_spec(source.spec, check_position(position), nonce)
    op: Op = PositionedSource(spec, source.client, position)
    if not chain:
        return type(dataset)(op) if isinstance(dataset, Dataset) else Dataset(op)
    for above in reversed(chain):
        new = copy.copy(above)
        new.input = op  # type: ignore[attr-defined]  # one input (checked above)
        new.inputs = (op,)
        op = new
    return Dataset(op)


def source_for(spec: ReadSpec, client: Client | None, track_position: bool,
               start_from: dict[str, Any] | None) -> ServiceSource:
    """``from_dataset_id``'s source: a tracking one when asked (or started from a position)."""
    if not isinstance(track_position, bool):
        raise TypeError(f"track_position must be a bool, got {track_position!r:.40}")
    if not track_position and start_from is None:
        return ServiceSource(spec, client)
    start = None if start_from is None else check_position(start_from)
    return PositionedSource(positioned_spec(spec, start), client, start)

