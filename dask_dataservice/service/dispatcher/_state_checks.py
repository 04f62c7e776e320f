"""The read-only half of :class:`~dask_dataservice.service.dispatcher.state.DispatcherState`: lookups
that raise the typed errors, and one ``_check_*`` per update kind (raise if illegal, never
mutate). A mixin: it reads the state's private maps and holds none of its own."""

from __future__ import annotations

import typing
from collections import deque

from ...errors import (
    DatasetNotFoundError,
    IllegalUpdateError,
    IterationClientNotFoundError,
    IterationNotFoundError,
    JobNameInUseError,
    JobNotFoundError,
    StaleEpochError,
    TaskNotFoundError,
    WorkerNotFoundError,
)
from ..protocol._job_checks import names_a_host
from ._entities import (
    PROCESSING_MODES,
    STATIC_MODES,
    TARGET_WORKERS,
    Dataset,
    Iteration,
    IterationClient,
    Job,
    SplitCursor,
    Task,
    Worker,
)
from ._updates import (
    ITERATION_ACCEPTS,
    JOB_ACCEPTS,
    TASK_TRANSITIONS,
    WORKER_ACCEPTS,
    AckSplits,
    AcquireIterationClient,
    ClientHeartbeat,
    CreateIteration,
    CreateJob,
    CreateTask,
    FinishTask,
    GarbageCollectDataset,
    GarbageCollectIteration,
    GarbageCollectJob,
    ProduceSplit,
    ProduceSplits,
    RegisterDataset,
    RegisterWorker,
    ReleaseIterationClient,
    RemoveWorker,
    Update,
)


class StateChecks:
    """Lookups and preconditions of the dispatcher's state (mixed into ``DispatcherState``)."""

    # The maps this mixin (and StateQueries) read, created by DispatcherState.__init__
    # (annotations only, for type checkers).
    _next_dataset_id: int
    _next_iteration_id: int
    _next_iteration_client_id: int
    _next_task_id: int
    _next_job_id: int
    _datasets: dict[int, Dataset]
    _dataset_by_fingerprint: dict[str, int]
    _dataset_by_name: dict[str, int]
    _collected_datasets: set[int]
    _live_jobs_by_dataset: dict[int, int]
    _workers: dict[str, Worker]
    _tasks_by_worker: dict[str, dict[int, int]]
    _jobs: dict[int, Job]
    _jobs_by_name: dict[tuple[int, str], int]
    _iterations: dict[int, Iteration]
    _iterations_by_key: dict[tuple[int, int], int]
    _split_cursors: dict[int, SplitCursor]
    _lost_splits: dict[int, list[tuple[int, int, int]]]
    _tasks: dict[int, Task]
    _tasks_by_iteration: dict[int, dict[int, None]]
    _tasks_by_shard: dict[tuple[int, int], list[int]]
    _splits_in_flight: dict[int, deque[tuple[int, int, int]]]
    _iteration_clients: dict[int, IterationClient]

    # -- lookups that raise the typed errors --------------------------------------------------

    def _get_dataset(self, dataset_id: int) -> Dataset:
        try:
            return self._datasets[dataset_id]
        except KeyError:
            if dataset_id in self._collected_datasets:
                raise DatasetNotFoundError(
                    f"Dataset {dataset_id} was garbage collected (it had no job for the "
                    "dispatcher's dataset-gc-timeout)") from None
            raise DatasetNotFoundError(f"Dataset {dataset_id} not found") from None

    def _get_worker(self, address: str) -> Worker:
        try:
            return self._workers[address]
        except KeyError:
            raise WorkerNotFoundError(f"Worker {address!r} not found") from None

    def _get_job(self, job_id: int) -> Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise JobNotFoundError(f"Job {job_id} not found") from None

    def _get_iteration(self, iteration_id: int) -> Iteration:
        try:
            return self._iterations[iteration_id]
        except KeyError:
            raise IterationNotFoundError(f"Iteration {iteration_id} not found") from None

    def _get_task(self, task_id: int) -> Task:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise TaskNotFoundError(f"Task {task_id} not found") from None

    def _get_iteration_client(self, iteration_client_id: int) -> IterationClient:
        try:
            return self._iteration_clients[iteration_client_id]
        except KeyError:
            raise IterationClientNotFoundError(
                f"Iteration client {iteration_client_id} not found"
            ) from None

    # -- checks: raise on an illegal update, never mutate -------------------------------------

    @staticmethod
    def _check_fresh(update: Update, kind: str, new_id: int, next_id: int) -> None:
        if new_id < next_id:
            _illegal(update, f"{kind} id {new_id} is not fresh (the next {kind} id is {next_id})")

    @staticmethod
    def _check_time(update: Update, time_micros: int) -> None:
        if time_micros < 0:
            _illegal(update, f"time_micros must be >= 0, got {time_micros}")

    @staticmethod
    def _require_task(task: Task, update: Update) -> None:
        if type(update) not in TASK_TRANSITIONS[task.status]:
            _illegal(update, f"task {task.task_id} is {task.status}")

    @staticmethod
    def _require_iteration(iteration: Iteration, update: Update) -> None:
        if type(update) not in ITERATION_ACCEPTS[iteration.status]:
            _illegal(update, f"iteration {iteration.iteration_id} is {iteration.status}")

    def _require_worker(self, address: str, update: Update) -> None:
        worker = self._workers.get(address)
        status = "unknown" if worker is None else worker.status
        if type(update) not in WORKER_ACCEPTS[status]:
            if status == "unknown":
                self._get_worker(address)  # raises WorkerNotFoundError
            _illegal(update, f"worker {address!r} is {status}")

    def _check_register_dataset(self, u: RegisterDataset) -> None:
        self._check_fresh(u, "dataset", u.dataset_id, self._next_dataset_id)
        if u.dataset_name is not None:
            if not u.dataset_name:
                _illegal(u, "dataset_name must be a non-empty string or None")
            existing = self._dataset_by_name.get(u.dataset_name)
            if existing is not None:
                _illegal(u, f"dataset name {u.dataset_name!r} is already dataset {existing}")
        else:
            existing = self._dataset_by_fingerprint.get(u.fingerprint)
            if existing is not None:
                _illegal(
                    u, f"fingerprint {u.fingerprint!r} is already registered as dataset {existing}"
                )
        if u.num_splits < -1:
            _illegal(u, f"num_splits must be >= 0, or -1 if not splittable; got {u.num_splits}")

    def _check_register_worker(self, u: RegisterWorker) -> None:
        self._require_worker(u.address, u)

    def _check_remove_worker(self, u: RemoveWorker) -> None:
        self._require_worker(u.address, u)

    def _check_create_job(self, u: CreateJob) -> None:
        self._check_fresh(u, "job", u.job_id, self._next_job_id)
        dataset = self._get_dataset(u.dataset_id)  # a collected one raises (DATASET_ACCEPTS)
        if u.processing_mode not in PROCESSING_MODES:
            _illegal(
                u,
                f"processing_mode must be one of {sorted(PROCESSING_MODES)}, got {u.processing_mode!r}",
            )
        if u.target_workers not in TARGET_WORKERS:
            _illegal(
                u,
                f"target_workers must be one of {sorted(TARGET_WORKERS)}, got {u.target_workers!r}",
            )
        if u.processing_mode == "DYNAMIC" and not dataset.splittable:
            _illegal(u, f"DYNAMIC sharding needs splits, and dataset {u.dataset_id} has none")
        if u.processing_mode in STATIC_MODES:
            if not u.worker_addresses:
                _illegal(u, f"static sharding ({u.processing_mode}) needs a worker list")
            # a host entry ("host", "host:%port%": any worker of that host) may repeat, one
            # per worker of the host, as in TensorFlow; an entry naming one worker may not
            named = [a for a in u.worker_addresses if not names_a_host(a)]
            if not all(u.worker_addresses) or len(set(named)) != len(named):
                _illegal(u, f"worker_addresses must be distinct and non-empty: {u.worker_addresses}")
        elif u.worker_addresses:
            _illegal(u, f"worker_addresses is only for static sharding, not {u.processing_mode}")
        if u.num_consumers is not None and u.target_workers == "LOCAL":
            _illegal(u, "coordinated reads (num_consumers) cannot use target_workers LOCAL")
        if u.processing_mode in STATIC_MODES and u.target_workers == "ANY":
            _illegal(u, f"static sharding ({u.processing_mode}) cannot use target_workers ANY")
        if u.num_consumers is not None and u.num_consumers < 1:
            _illegal(u, f"num_consumers must be >= 1 or None, got {u.num_consumers}")
        if u.job_name is None:
            if u.num_consumers is not None:
                _illegal(u, "coordinated reads (num_consumers) need a job_name")
            if u.cross_trainer_cache:
                _illegal(u, "cross_trainer_cache needs a job_name")
        elif not u.job_name:
            _illegal(u, "job_name must be a non-empty string or None")
        elif (u.dataset_id, u.job_name) in self._jobs_by_name:
            raise JobNameInUseError(
                f"Job name {u.job_name!r} is in use by job "
                f"{self._jobs_by_name[(u.dataset_id, u.job_name)]} of dataset {u.dataset_id}"
            )

    def _check_create_iteration(self, u: CreateIteration) -> None:
        self._check_fresh(u, "iteration", u.iteration_id, self._next_iteration_id)
        job = self._get_job(u.job_id)
        if type(u) not in JOB_ACCEPTS[job.status]:
            _illegal(u, f"job {u.job_id} is {job.status}")
        if u.repetition < 0:
            _illegal(u, f"repetition must be >= 0, got {u.repetition}")
        if job.job_name is None and (u.repetition != 0 or job.num_iterations):
            _illegal(u, f"anonymous job {u.job_id} has exactly one iteration, with repetition 0")
        existing = self._iterations_by_key.get((u.job_id, u.repetition))
        if existing is not None:
            _illegal(
                u, f"job {u.job_id} already has iteration {existing} for repetition {u.repetition}"
            )

    def _check_create_task(self, u: CreateTask) -> None:
        self._check_fresh(u, "task", u.task_id, self._next_task_id)
        iteration = self._get_iteration(u.iteration_id)
        self._require_iteration(iteration, u)
        self._require_worker(u.worker_address, u)
        if iteration.num_shards:
            if u.shard_index is None or not 0 <= u.shard_index < iteration.num_shards:
                _illegal(
                    u,
                    f"iteration {u.iteration_id} shards over {iteration.num_shards} workers; "
                    f"shard_index must be in [0, {iteration.num_shards}), got {u.shard_index}",
                )
        elif u.shard_index is not None:
            _illegal(u, f"iteration {u.iteration_id} is not statically sharded (no shard_index)")
        existing = self._tasks_by_worker[u.worker_address].get(u.iteration_id)
        if existing is not None:
            _illegal(
                u,
                f"worker {u.worker_address!r} already runs task {existing} "
                f"of iteration {u.iteration_id}",
            )

    def _check_finish_task(self, u: FinishTask) -> None:
        self._require_task(self._get_task(u.task_id), u)

    def _check_produce_split(self, u: ProduceSplit) -> None:
        self._check_split_range(u, u.iteration_id, u.repetition, u.index,
                                0 if u.finished else 1, u.task_id, u.finished)

    def _check_produce_splits(self, u: ProduceSplits) -> None:
        if u.count < 0 or (u.count == 0 and not u.end_of_splits):
            _illegal(u, f"count must be >= 1, or 0 with end_of_splits; got {u.count}")
        self._check_split_range(u, u.iteration_id, u.repetition, u.index, u.count, u.task_id,
                                u.end_of_splits)

    def _check_split_range(self, u: Update, iteration_id: int, repetition: int, index: int,
                           count: int, task_id: int, end_of_splits: bool) -> None:
        """Splits ``index .. index + count - 1`` of ``repetition`` to ``task_id``, then maybe the end."""
        self._require_iteration(self._get_iteration(iteration_id), u)
        cursor = self._split_cursors.get(iteration_id)
        if cursor is None:
            _illegal(u, f"iteration {iteration_id} is not DYNAMIC and has no split cursor")
        task = self._get_task(task_id)
        if task.iteration_id != iteration_id:
            _illegal(
                u,
                f"task {task_id} belongs to iteration {task.iteration_id}, not {iteration_id}",
            )
        self._require_task(task, u)
        if repetition < cursor.repetition:
            raise StaleEpochError(
                f"{type(u).__name__}: repetition {repetition} of iteration {iteration_id} is "
                f"stale; the split cursor is at repetition {cursor.repetition}"
            )
        if repetition > cursor.repetition:
            _illegal(
                u,
                f"repetition {repetition} is ahead of the split cursor of iteration "
                f"{iteration_id} (repetition {cursor.repetition})",
            )
        if index != cursor.next_index:
            _illegal(u, f"split index {index} is not the next index {cursor.next_index}")
        remaining = cursor.num_splits - cursor.next_index
        if count > remaining:
            if remaining == 0:
                _illegal(
                    u, f"all {cursor.num_splits} splits were handed out; finished must be True"
                )
            _illegal(u, f"{count} splits asked, only {remaining} of {cursor.num_splits} remain")
        if end_of_splits and count < remaining:
            _illegal(
                u,
                f"finished=True but {remaining - count} of "
                f"{cursor.num_splits} splits of repetition {cursor.repetition} remain",
            )

    def _check_ack_splits(self, u: AckSplits) -> None:
        self._require_task(self._get_task(u.task_id), u)
        held = self._splits_in_flight.get(u.task_id)
        if not held or held[0][:2] > (u.repetition, u.index):
            _illegal(u, f"task {u.task_id} holds no split at or before ({u.repetition}, {u.index})")

    def _check_acquire_iteration_client(self, u: AcquireIterationClient) -> None:
        self._check_fresh(
            u, "iteration client", u.iteration_client_id, self._next_iteration_client_id
        )
        self._check_time(u, u.time_micros)
        self._require_iteration(self._get_iteration(u.iteration_id), u)

    def _check_release_iteration_client(self, u: ReleaseIterationClient) -> None:
        self._get_iteration_client(u.iteration_client_id)
        self._check_time(u, u.time_micros)

    def _check_client_heartbeat(self, u: ClientHeartbeat) -> None:
        self._get_iteration_client(u.iteration_client_id)
        self._check_time(u, u.time_micros)

    def _check_garbage_collect_iteration(self, u: GarbageCollectIteration) -> None:
        iteration = self._get_iteration(u.iteration_id)
        self._require_iteration(iteration, u)
        if iteration.num_clients:
            _illegal(u, f"iteration {u.iteration_id} still has {iteration.num_clients} client(s)")

    def _check_garbage_collect_job(self, u: GarbageCollectJob) -> None:
        job = self._get_job(u.job_id)
        if type(u) not in JOB_ACCEPTS[job.status]:
            _illegal(u, f"job {u.job_id} is {job.status}")
        if job.num_iterations:
            _illegal(u, f"job {u.job_id} has {job.num_iterations} iteration(s); it is collected "
                        "with its last one")

    def _check_garbage_collect_dataset(self, u: GarbageCollectDataset) -> None:
        # unknown, or collected (it accepts nothing: DATASET_ACCEPTS): DatasetNotFoundError
        self._get_dataset(u.dataset_id)
        live = self._live_jobs_by_dataset.get(u.dataset_id, 0)
        if live:
            _illegal(u, f"dataset {u.dataset_id} still has {live} live job(s)")



def _illegal(update: Update, message: str) -> typing.NoReturn:
    raise IllegalUpdateError(f"{type(update).__name__}: {message}")
