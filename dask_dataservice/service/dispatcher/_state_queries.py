"""The read-only accessors of :class:`~dask_dataservice.service.dispatcher.state.DispatcherState`.

Each returns a detached copy (mutating it changes nothing in the state) or plain values. A
mixin, as :mod:`._state_checks`: it reads the state's private maps and holds none of its own.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ...errors import (
    DataServiceError,
    DatasetNotFoundError,
    IterationNotFoundError,
    JobNotFoundError,
)
from ._entities import (
    Dataset,
    Iteration,
    IterationClient,
    Job,
    SplitCursor,
    Task,
    Worker,
    expand_runs,
)

__all__ = ["StateQueries"]

if TYPE_CHECKING:  # the lookups and maps it reads come with StateChecks in DispatcherState
    from ._state_checks import StateChecks as _StateBase
else:
    _StateBase = object


class StateQueries(_StateBase):
    """Accessors of the dispatcher's state (mixed into ``DispatcherState``)."""

    # -- accessors (read-only: each returns a detached copy) ---------------------------------

    def dataset(self, dataset_id: int) -> Dataset:
        """The dataset with this id.

        Raises
        ------
        DatasetNotFoundError
        """
        dataset = self._get_dataset(dataset_id)
        return dataclasses.replace(dataset, metadata=copy.deepcopy(dataset.metadata))

    def dataset_by_fingerprint(self, fingerprint: str) -> Dataset:
        """The dataset registered with this fingerprint.

        Raises
        ------
        DatasetNotFoundError
        """
        dataset_id = self._dataset_by_fingerprint.get(fingerprint)
        if dataset_id is None:
            raise DatasetNotFoundError(f"Dataset with fingerprint {fingerprint!r} not found")
        return self.dataset(dataset_id)

    def dataset_by_name(self, dataset_name: str) -> Dataset:
        """The dataset registered under this user-chosen id.

        Raises
        ------
        DatasetNotFoundError
        """
        dataset_id = self._dataset_by_name.get(dataset_name)
        if dataset_id is None:
            raise DatasetNotFoundError(f"Dataset {dataset_name!r} not found")
        return self.dataset(dataset_id)

    def list_datasets(self) -> list[Dataset]:
        """All datasets not garbage collected, in registration order."""
        return [self.dataset(dataset_id) for dataset_id in self._datasets]

    def dataset_collected(self, dataset_id: int) -> bool:
        """Whether ``dataset_id`` names a dataset that was garbage collected (a tombstone)."""
        return dataset_id in self._collected_datasets

    def num_collected_datasets(self) -> int:
        """How many datasets were garbage collected (tombstones kept)."""
        return len(self._collected_datasets)

    def num_live_jobs(self, dataset_id: int) -> int:
        """The live jobs of a dataset (0 for an unknown or collected one); O(1)."""
        return self._live_jobs_by_dataset.get(dataset_id, 0)

    def worker(self, address: str) -> Worker:
        """The worker at this address, registered or departed (see ``Worker.registered``).

        Raises
        ------
        WorkerNotFoundError
            No worker ever registered at ``address``.
        """
        worker = self._get_worker(address)
        return dataclasses.replace(worker, resources=dict(worker.resources))

    def list_workers(self, *, include_departed: bool = False) -> list[Worker]:
        """The registered workers (and the departed ones if ``include_departed``)."""
        return [
            self.worker(address)
            for address, worker in self._workers.items()
            if include_departed or worker.registered
        ]

    def job(self, job_id: int) -> Job:
        """The job with this id, live or garbage collected.

        Raises
        ------
        JobNotFoundError
        """
        return copy.copy(self._get_job(job_id))

    def job_by_name(self, job_name: str, dataset_id: int | None = None) -> Job:
        """The live job named ``job_name`` for ``dataset_id``.

        Job names are scoped per dataset, as in TensorFlow: two datasets may each have a job
        named ``"shared"``. Without ``dataset_id`` (for tests and debugging; O(jobs)), the one
        live job with this name.

        Raises
        ------
        JobNotFoundError
            No live job has this name (there may be garbage-collected ones), or, without
            ``dataset_id``, several datasets have one.
        """
        if dataset_id is not None:
            job_id = self._jobs_by_name.get((dataset_id, job_name))
        else:
            ids = [i for (_, name), i in self._jobs_by_name.items() if name == job_name]
            if len(ids) > 1:
                raise JobNotFoundError(
                    f"Several datasets have a job named {job_name!r}: give the dataset_id")
            job_id = ids[0] if ids else None
        if job_id is None:
            where = "" if dataset_id is None else f" for dataset {dataset_id}"
            raise JobNotFoundError(f"Job named {job_name!r}{where} not found")
        return self.job(job_id)

    def list_jobs(self) -> list[Job]:
        """All jobs ever created, in creation order."""
        return [copy.copy(job) for job in self._jobs.values()]

    def iteration(self, iteration_id: int) -> Iteration:
        """The iteration with this id, including garbage-collected ones.

        Raises
        ------
        IterationNotFoundError
        """
        return copy.copy(self._get_iteration(iteration_id))

    def iteration_by_key(self, job_id: int, repetition: int) -> Iteration:
        """The iteration of ``job_id`` for ``repetition``.

        Raises
        ------
        IterationNotFoundError
        """
        iteration_id = self._iterations_by_key.get((job_id, repetition))
        if iteration_id is None:
            raise IterationNotFoundError(
                f"Iteration of job {job_id} for repetition {repetition} not found"
            )
        return self.iteration(iteration_id)

    def list_iterations(self) -> list[Iteration]:
        """All iterations ever created, in creation order."""
        return [copy.copy(iteration) for iteration in self._iterations.values()]

    def list_live_iterations(self) -> list[Iteration]:
        """The iterations not garbage collected, in creation order: O(live iterations), not
        O(every iteration ever created) (collected ones stay in the state)."""
        return [copy.copy(self._iterations[i]) for i in self._tasks_by_iteration]

    def task(self, task_id: int) -> Task:
        """The task with this id.

        Raises
        ------
        TaskNotFoundError
            Unknown id, or its iteration was garbage collected.
        """
        return copy.copy(self._get_task(task_id))

    def task_job_token(self, task_id: int) -> tuple[int, int, str]:
        """``(iteration_id, job_id, token)`` of the task's job, copying nothing: the split
        hand-out checks it on every request (a copy of the task, its iteration and its job
        took 14 % of range(10).repeat()'s DYNAMIC rate).

        Raises
        ------
        TaskNotFoundError
            Unknown id, or its iteration was garbage collected.
        """
        iteration_id = self._get_task(task_id).iteration_id
        job = self._get_job(self._get_iteration(iteration_id).job_id)
        return iteration_id, job.job_id, job.token

    def running_tasks(self, iteration_id: int) -> int:
        """How many tasks of the iteration are neither finished nor lost (no copy)."""
        it = self._get_iteration(iteration_id)
        return it.num_tasks - it.num_finished_tasks - it.num_lost_tasks

    def tasks_for_iteration(self, iteration_id: int) -> list[Task]:
        """All tasks of an iteration (active, finished and lost); none once collected.

        Raises
        ------
        IterationNotFoundError
        """
        self._get_iteration(iteration_id)
        return [
            copy.copy(self._tasks[task_id])
            for task_id in self._tasks_by_iteration.get(iteration_id, ())
        ]

    def iterations_by_worker(self, addresses: Iterable[str]) -> dict[str, set[int]]:
        """``{address: ids of the live iterations it has a task of (any status)}`` for each
        of ``addresses``: O(tasks), for a start (reviving a worker is then O(1) per iteration)."""
        out: dict[str, set[int]] = {address: set() for address in addresses}
        for task in self._tasks.values():
            if task.worker_address in out:
                out[task.worker_address].add(task.iteration_id)
        return out

    def shard_holders(self, iteration_id: int, shard_index: int) -> list[str]:
        """The workers of the tasks of one shard of a statically sharded iteration (any
        status; a worker once per task), without a copy or a scan of the iteration's tasks."""
        return [self._tasks[task_id].worker_address
                for task_id in self._tasks_by_shard.get((iteration_id, shard_index), ())]

    def tasks_for_worker(self, address: str) -> list[Task]:
        """The active tasks of a worker (none if it departed), in creation order.

        Raises
        ------
        WorkerNotFoundError
        """
        self._get_worker(address)
        task_ids = sorted(self._tasks_by_worker.get(address, {}).values())
        return [copy.copy(self._tasks[task_id]) for task_id in task_ids]

    def iteration_client(self, iteration_client_id: int) -> IterationClient:
        """An acquired iteration client.

        Raises
        ------
        IterationClientNotFoundError
            Unknown id, or the client was released.
        """
        return copy.copy(self._get_iteration_client(iteration_client_id))

    def list_iteration_clients(self) -> list[IterationClient]:
        """All acquired clients, in acquisition order (the dispatcher scans them for liveness)."""
        return [copy.copy(client) for client in self._iteration_clients.values()]

    def split_cursor(self, iteration_id: int) -> SplitCursor:
        """The split cursor of a DYNAMIC iteration.

        Raises
        ------
        IterationNotFoundError
        DataServiceError
            The iteration's job is not DYNAMIC, so it has no cursor.
        """
        iteration = self._get_iteration(iteration_id)
        cursor = self._split_cursors.get(iteration_id)
        if cursor is None:
            mode = self._jobs[iteration.job_id].processing_mode
            raise DataServiceError(
                f"Iteration {iteration_id} has no split cursor: its processing mode is {mode!r}"
            )
        return copy.copy(cursor)

    def split_position(self, iteration_id: int) -> tuple[int, int, int]:
        """``(repetition, next_index, num_splits)`` of a DYNAMIC iteration's cursor.

        The same facts as :meth:`split_cursor` without building a copy (the dispatcher's
        per-request path).
        """
        cursor = self._split_cursors.get(iteration_id)
        if cursor is None:
            self.split_cursor(iteration_id)  # raises the typed error (unknown, or not DYNAMIC)
        assert cursor is not None
        return cursor.repetition, cursor.next_index, cursor.num_splits

    def task_status(self, task_id: int) -> str:
        """``"active"``, ``"finished"`` or ``"lost"`` (:meth:`task` without the copy).

        Raises
        ------
        TaskNotFoundError
        """
        return self._get_task(task_id).status

    def splits_in_flight(self, iteration_id: int) -> dict[tuple[int, int], int]:
        """``{(repetition, index): task_id}``: the splits an iteration's tasks hold, unacknowledged.

        Raises
        ------
        IterationNotFoundError
        """
        self._get_iteration(iteration_id)
        return {
            split: task_id
            for task_id in self._tasks_by_iteration.get(iteration_id, ())
            for split in expand_runs(self._splits_in_flight.get(task_id, ()))
        }

    def task_splits(self, task_id: int) -> tuple[tuple[int, int], ...]:
        """The ``(repetition, index)`` splits a task holds, unacknowledged, ascending.

        Raises
        ------
        TaskNotFoundError
        """
        self._get_task(task_id)
        return tuple(expand_runs(self._splits_in_flight.get(task_id, ())))

    def first_split_held(self, task_id: int) -> tuple[int, int] | None:
        """The oldest ``(repetition, index)`` a task holds, or None; O(1) (the dispatcher's
        acknowledgement path; :meth:`task_splits` lists them all).

        Raises
        ------
        TaskNotFoundError
        """
        self._get_task(task_id)
        held = self._splits_in_flight.get(task_id)
        return held[0][:2] if held else None

    def lost_splits(self, iteration_id: int) -> tuple[tuple[int, int], ...]:
        """The ``(repetition, index)`` splits lost with departed workers, sorted.

        They were handed out once and will never be handed out again (at-most-once).

        Raises
        ------
        IterationNotFoundError
        """
        self._get_iteration(iteration_id)
        return tuple(sorted(expand_runs(self._lost_splits.get(iteration_id, ()))))

    def summary(self) -> dict[str, Any]:
        """A plain-data view of the state (``dataservice_state``): tests, dashboards, debugging."""
        return {
            "datasets": [d.dataset_id for d in self.list_datasets()],
            "workers": sorted(w.address for w in self.list_workers()),
            "jobs": {j.job_id: {"name": j.job_name, "dataset_id": j.dataset_id,
                                "mode": j.processing_mode, "status": j.status}
                     for j in self.list_jobs()},
            "iterations": {
                it.iteration_id: {
                    "job_id": it.job_id, "repetition": it.repetition, "status": it.status,
                    "num_clients": it.num_clients,
                    "tasks": [] if it.garbage_collected else [
                        {"task_id": t.task_id, "worker_address": t.worker_address,
                         "status": t.status}
                        for t in self.tasks_for_iteration(it.iteration_id)
                    ],
                    "lost_splits": [list(x) for x in self.lost_splits(it.iteration_id)],
                }
                for it in self.list_iterations()
            },
        }
