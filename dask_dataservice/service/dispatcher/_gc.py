"""Which idle named iterations the dispatcher's garbage collection may remove, and the
queues of idle jobs and datasets it collects after their timeout.

The collection itself (releasing clients that stopped sending heartbeats, dropping silent
data workers, collecting idle named iterations after ``dispatcher.job-gc-timeout``, jobs
that never got an iteration after the same, datasets without jobs after
``dispatcher.dataset-gc-timeout``) is :meth:`~.core.DispatcherCore.gc_tick`, run by the
plugin's ``dataservice-gc`` periodic callback. Pure.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ...errors import DataServiceError
from ._entities import Iteration, Job
from ._quotas import Limits, dataset_size, field_bytes
from ._updates import GarbageCollectDataset, GarbageCollectIteration, GarbageCollectJob

if TYPE_CHECKING:
    from .core import CoreConfig, DispatcherCore
    from .state import DispatcherState

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")

__all__ = ["IdleQueue", "PublishedNames", "collect_idle", "collect_iteration", "collectable",
           "collected_job_error", "idle_queues", "job_gc_seconds", "job_gone"]


class IdleQueue:
    """Ids idle since a time (microseconds), oldest first, all under one timeout.

    :meth:`expired` walks from the oldest and stops at the first that is not, so a GC tick
    costs O(1 + ids expired), whatever the number of idle ids (a scan over every dataset
    each tick would not). An id becomes idle with the time it did (:meth:`add`; ``None``:
    "now", stamped by the next :meth:`expired` with that tick's time, so it is never
    collected early) and stops being idle with :meth:`discard`; both are O(1). Idle times
    come from the dispatcher's clock, which only moves forward in practice; if it stepped
    back, an id behind a younger one waits for it (collected late, never early).
    Not journaled: after a restart every idle id starts its timer again.
    """

    def __init__(self) -> None:
        #: ``{id: idle since}``, in the order the ids became idle (ordered: a plain dict's
        #: iteration skips the slots of removed ids, see ``_deadlines.LastSeen``).
        self._since: OrderedDict[int, int] = OrderedDict()
        #: Ids that became idle "now", stamped by the next tick.
        self._unstamped: dict[int, None] = {}

    def add(self, key: int, since_micros: int | None) -> None:
        """``key`` is idle from ``since_micros`` (``None``: from the next tick) on."""
        self.discard(key)
        if since_micros is None:
            self._unstamped[key] = None
        else:
            self._since[key] = since_micros

    def discard(self, key: int) -> None:
        """``key`` is in use again (or gone)."""
        self._since.pop(key, None)
        self._unstamped.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._since or key in self._unstamped

    def __len__(self) -> int:
        return len(self._since) + len(self._unstamped)

    def __iter__(self) -> Iterator[int]:
        yield from self._since
        yield from self._unstamped

    def since(self, key: int) -> int | None:
        """When ``key`` became idle (``None``: not stamped yet, or not idle)."""
        return self._since.get(key)

    def expired(self, now_micros: int, timeout_micros: int) -> list[int]:
        """The ids idle for ``timeout_micros`` or longer at ``now_micros``, oldest first
        (they stay queued: the caller discards each it collects or finds in use)."""
        for key in self._unstamped:
            self._since[key] = now_micros
        self._unstamped.clear()
        out = []
        for key, since in self._since.items():
            if now_micros - since < timeout_micros:
                break
            out.append(key)
        return out


class PublishedNames:
    """Which live datasets use each Dask dataset published on the scheduler for them.

    ``register_dataset`` publishes a large array's chunks (a persisted collection's
    partitions) under ``dask-dataservice-<digest>`` and lists the names in the dataset's
    metadata (``"published"``). Several datasets may share a name (the same array in two
    pipelines), so a name is unpublished once the last live dataset using it is collected:
    :meth:`release` queues it, the shell takes the queue (:meth:`take`) and unpublishes
    once the collection is durable. Rebuilt from the live datasets at a start (not
    journaled): a collection replayed from the journal has dropped its metadata, so it
    names nothing to unpublish again. Add and release cost O(names of the dataset).
    """

    def __init__(self) -> None:
        self._users: dict[str, set[int]] = {}
        self._pending: list[str] = []

    @staticmethod
    def names(metadata: dict[str, object] | None) -> list[str]:
        """The published names a dataset's metadata lists (none for older registrations)."""
        names = (metadata or {}).get("published")
        if not isinstance(names, list | tuple):
            return []
        return [n for n in names if isinstance(n, str)]

    def add(self, dataset_id: int, metadata: dict[str, object] | None) -> None:
        for name in self.names(metadata):
            self._users.setdefault(name, set()).add(dataset_id)

    def release(self, dataset_id: int, metadata: dict[str, object] | None) -> None:
        """``dataset_id`` was collected: queue the names no other live dataset uses."""
        for name in self.names(metadata):
            users = self._users.get(name)
            if users is None:
                continue
            users.discard(dataset_id)
            if not users:
                del self._users[name]
                self._pending.append(name)

    def users(self, name: str) -> frozenset[int]:
        return frozenset(self._users.get(name, ()))

    def take(self) -> list[str]:
        """The names to unpublish now (the queue is emptied)."""
        out, self._pending = self._pending, []
        return out

    @classmethod
    def of(cls, state: DispatcherState) -> PublishedNames:
        """The names the live datasets of a replayed state use (O(datasets), per start)."""
        published = cls()
        for dataset in state.list_datasets():  # collected ones are not listed
            published.add(dataset.dataset_id, dataset.metadata)
        return published


def collectable(state: DispatcherState, iteration: Iteration, gc_dynamic_jobs: bool) -> bool:
    """Whether an idle named iteration may be collected once ``job-gc-timeout`` passed.

    A DYNAMIC job promises that every split is read once (TensorFlow's visitation
    guarantee): a consumer that comes back later under the job's name goes on where the job
    stopped. So, as in TensorFlow
    (``data_service_ops_test.testDontGcJobsWithVisitationGuarantees``), a DYNAMIC iteration is
    kept while it can still be read, unless
    ``dataservice.dispatcher.gc-dynamic-sharding-jobs`` (TF's ``gc_dynamic_sharding_jobs``,
    ``gc_dynamic_jobs``) says otherwise; it is collected once a consumer read it to its end
    (and it stayed idle). Its tasks finishing is not enough: they finish when their pipelines
    are exhausted, while their elements still wait in the workers' buffers (before, a DYNAMIC
    job of a thousand elements was collected with all but its first elements unread). Other
    modes are collected after the timeout; anonymous jobs never get here (they go as soon as
    their consumer leaves).
    """
    if iteration.read_to_end or gc_dynamic_jobs:
        return True
    return bool(state.job(iteration.job_id).processing_mode != "DYNAMIC")


def idle_queues(state: DispatcherState,
                since: int) -> tuple[IdleQueue, IdleQueue, set[int], PublishedNames]:
    """``(jobs without iterations, datasets never read without live jobs, datasets read,
    the names the live datasets published)`` of a state replayed at a start, the idle ones
    all idle ``since`` it (O(jobs + datasets), once per start, as the quotas' recount). A
    dataset is read once a job of it got an iteration (collected jobs and iterations stay in
    the state, so this survives restarts)."""
    jobs, datasets, read = IdleQueue(), IdleQueue(), set()
    for job in state.list_jobs():
        if job.num_iterations:
            read.add(job.dataset_id)
        elif not job.garbage_collected:
            jobs.add(job.job_id, since)
    for dataset in state.list_datasets():
        if dataset.dataset_id not in read and not state.num_live_jobs(dataset.dataset_id):
            datasets.add(dataset.dataset_id, since)
    return jobs, datasets, read, PublishedNames.of(state)


def job_gc_seconds(config: CoreConfig) -> float:
    """How long a job without an iteration is kept: ``job_gc_timeout``, and at least
    ``client_timeout``: the consumer that creates a job asks for its iteration in the same
    round trip (``start_read``), in fault-tolerant mode after the job's record is durable,
    so a tiny ``job_gc_timeout`` must not collect the job in between; a consumer silent for
    ``client_timeout`` counts as gone anyway."""
    return max(config.job_gc_timeout, config.client_timeout)


def collected_job_error(job: Job, config: CoreConfig) -> DataServiceError:
    """What a consumer asking for a new iteration of a collected job is told."""
    if job.num_iterations:
        return DataServiceError(f"job {job.job_id} was garbage collected")
    return DataServiceError(
        f"job {job.job_id} was garbage collected: it had no iteration for "
        f"dataservice.dispatcher.job-gc-timeout ({job_gc_seconds(config):g}s); create the "
        "job again")


def collect_idle(core: DispatcherCore, now: float) -> None:
    """The collections of a GC tick (:meth:`~.core.DispatcherCore.gc_tick`), after its
    liveness checks: idle named iterations after ``job_gc_timeout`` (:func:`collectable`),
    jobs that never got an iteration after :func:`job_gc_seconds`, and datasets without live
    jobs after ``dataset_gc_timeout`` (issue 22: what a registration nobody reads holds is
    freed). Every timer runs from when the thing became idle (an iteration's last client
    left, a job was created, a dataset was registered or lost its last job), and at the
    earliest from this start (timers are not journaled). The job and dataset queues cost
    O(1 + collected) per tick (:class:`IdleQueue`). Equal splits whose consumers did not all
    join within ``client_timeout`` fail (:mod:`._equal`)."""
    state, config, now_us = core.state, core.config, int(now * 1_000_000)
    core.equal.tick(now, config.client_timeout)
    # O(1 + expired): idle since their last client left (after a restart, every timer
    # starts again at the start). One that may not be collected (a DYNAMIC job not read to
    # its end) leaves the queue: only a client's release, which queues it again, changes that.
    for iteration_id in core.idle_iterations.expired(now_us, int(config.job_gc_timeout * 1e6)):
        core.idle_iterations.discard(iteration_id)
        it = state.iteration(iteration_id)
        if it.garbage_collected or it.num_clients or it.last_client_released_micros is None:
            continue
        if collectable(state, it, config.gc_dynamic_sharding_jobs):
            collect_iteration(core, it.iteration_id, now)
    job_timeout = job_gc_seconds(config)
    for job_id in core.idle_jobs.expired(now_us, int(job_timeout * 1_000_000)):
        core.idle_jobs.discard(job_id)
        job = state.job(job_id)
        if job.garbage_collected or job.num_iterations:
            continue  # in use after all (an update built outside the core)
        logger.info("dataservice: collecting job %s of dataset %s: no iteration for %gs",
                    job_id, job.dataset_id, job_timeout)
        core._apply(GarbageCollectJob(job_id=job_id))
        job_gone(core, job.dataset_id, now)
    timeout = config.dataset_gc_timeout
    if timeout is None:
        return
    for dataset_id in core.idle_datasets.expired(now_us, int(timeout * 1_000_000)):
        core.idle_datasets.discard(dataset_id)
        if state.dataset_collected(dataset_id) or state.num_live_jobs(dataset_id):
            continue
        ds = state.dataset(dataset_id)
        size = dataset_size(ds.pipeline, ds.splits, ds.element_spec,
                            field_bytes(Limits(max_field_bytes=None), "metadata", ds.metadata))
        logger.info("dataservice: collecting dataset %s (%d bytes): no job for %gs",
                    dataset_id, size, timeout)
        metadata = ds.metadata
        core._apply(GarbageCollectDataset(dataset_id=dataset_id))
        core.published.release(dataset_id, metadata)  # its Dask data, unless shared
        core.quotas.datasets -= 1
        core.quotas.bytes -= size


def collect_iteration(core: DispatcherCore, iteration_id: int, now: float) -> None:
    """Collect an iteration nobody reads, and tell its present workers to drop its tasks."""
    core.idle_iterations.discard(iteration_id)
    tasks = core.state.tasks_for_iteration(iteration_id)
    core._apply(GarbageCollectIteration(iteration_id=iteration_id))
    job = core.state.job(core.state.iteration(iteration_id).job_id)
    if job.garbage_collected:
        job_gone(core, job.dataset_id, now)
    core._cancel(tasks)


def job_gone(core: DispatcherCore, dataset_id: int, now: float) -> None:
    """A job of ``dataset_id`` was collected: its quota slot is free, and a dataset never
    read is idle from ``now`` on if that was its last live job. A dataset that was read is
    kept for the dispatcher's life, as in TensorFlow: a ``distribute()``d dataset read again
    hours later (a notebook, an evaluation pass) must still be there."""
    core.quotas.live_jobs -= 1
    if dataset_id not in core.read_datasets and not core.state.num_live_jobs(dataset_id):
        core.idle_datasets.add(dataset_id, int(now * 1_000_000))
