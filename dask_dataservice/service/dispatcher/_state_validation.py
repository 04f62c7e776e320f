"""``DispatcherState.validate_state``: every invariant of the dispatcher's state, for tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..protocol._job_checks import names_a_host
from . import _split_order
from ._entities import (
    DATASET_ID_BASE,
    ITERATION_CLIENT_ID_BASE,
    ITERATION_ID_BASE,
    JOB_ID_BASE,
    PROCESSING_MODES,
    STATIC_MODES,
    TARGET_WORKERS,
    TASK_ID_BASE,
    derived_finished,
    expand_runs,
)

if TYPE_CHECKING:
    from .state import DispatcherState


def validate_state(state: DispatcherState) -> None:
    """Check every invariant of ``state``; O(size of the state).

    Raises
    ------
    AssertionError
        Naming the first invariant that does not hold.
    """
    for name, counter, base, ids in (
        ("dataset", state._next_dataset_id, DATASET_ID_BASE,
         [*state._datasets, *state._collected_datasets]),
        ("iteration", state._next_iteration_id, ITERATION_ID_BASE, state._iterations),
        (
            "iteration client",
            state._next_iteration_client_id,
            ITERATION_CLIENT_ID_BASE,
            state._iteration_clients,
        ),
        ("task", state._next_task_id, TASK_ID_BASE, state._tasks),
        ("job", state._next_job_id, JOB_ID_BASE, state._jobs),
    ):
        if counter < base:
            raise _broken(f"next {name} id {counter} below its base {base}")
        for used in ids:
            if not (base <= used < counter):
                raise _broken(f"{name} id {used} outside [{base}, {counter})")

    # Unnamed datasets and the fingerprint index are a bijection, and so are named datasets
    # and the name index.
    for dataset_id, dataset in state._datasets.items():
        if dataset.dataset_id != dataset_id:
            raise _broken(f"dataset {dataset_id} stored under another id")
        if dataset.num_splits < -1:
            raise _broken(f"dataset {dataset_id} has num_splits {dataset.num_splits}")
        if dataset.dataset_name is None:
            if state._dataset_by_fingerprint.get(dataset.fingerprint) != dataset_id:
                raise _broken(f"dataset {dataset_id} missing from the fingerprint index")
        else:
            if state._dataset_by_name.get(dataset.dataset_name) != dataset_id:
                raise _broken(f"dataset {dataset_id} missing from the name index")
    if len(state._dataset_by_fingerprint) + len(state._dataset_by_name) != len(state._datasets):
        raise _broken("fingerprint or name index has entries for unknown datasets")
    if not state._collected_datasets.isdisjoint(state._datasets):
        raise _broken("a dataset is both registered and collected")
    live_jobs: dict[int, int] = {}
    for job in state._jobs.values():
        if not job.garbage_collected:
            live_jobs[job.dataset_id] = live_jobs.get(job.dataset_id, 0) + 1
    if state._live_jobs_by_dataset != live_jobs:
        raise _broken(f"live jobs by dataset {state._live_jobs_by_dataset} disagree with the jobs "
                      f"({live_jobs})")

    # Workers: tasks_by_worker has exactly the registered ones; a departed worker is kept
    # only while a task names it, and num_tasks counts those tasks.
    num_tasks = dict.fromkeys(state._workers, 0)
    for task in state._tasks.values():
        if task.worker_address in num_tasks:
            num_tasks[task.worker_address] += 1
    for address, worker in state._workers.items():
        if worker.address != address:
            raise _broken(f"worker {address!r} stored under another address")
        if worker.num_tasks != num_tasks[address]:
            raise _broken(f"worker {address!r} counts {worker.num_tasks} tasks, "
                          f"{num_tasks[address]} name it")
        if not (worker.registered or worker.num_tasks > 0):
            raise _broken(f"departed worker {address!r} is kept although no task names it")
        if (address in state._tasks_by_worker) != worker.registered:
            raise _broken(f"worker {address!r}: registered={worker.registered} but index disagrees")
    if not (state._tasks_by_worker.keys() <= state._workers.keys()):
        raise _broken("tasks_by_worker has unknown workers")
    for address, by_iteration in state._tasks_by_worker.items():
        for iteration_id, task_id in by_iteration.items():
            task = state._tasks.get(task_id)  # type: ignore[assignment]  # None: invariant fails
            if task is None:
                raise _broken(f"worker {address!r} lists unknown task {task_id}")
            if not (task.status == "active"
                    and task.worker_address == address
                    and task.iteration_id == iteration_id):
                raise _broken(f"worker {address!r} lists task {task_id} wrongly: {task}")

    # Jobs and the name index.
    for job_id, job in state._jobs.items():
        if job.job_id != job_id:
            raise _broken(f"job {job_id} stored under another id")
        if not (job.dataset_id in state._datasets
                or (job.dataset_id in state._collected_datasets and job.garbage_collected)):
            raise _broken(f"job {job_id} reads an unknown dataset, or is live on a collected one")
        if job.processing_mode not in PROCESSING_MODES:
            raise _broken(f"job {job_id} has a bad mode")
        if job.target_workers not in TARGET_WORKERS:
            raise _broken(f"job {job_id} has bad target_workers")
        if not (bool(job.worker_addresses) == (job.processing_mode in STATIC_MODES)
                and len(set(named := [a for a in job.worker_addresses if not names_a_host(a)]))
                == len(named)):
            raise _broken(f"job {job_id}: a worker list iff static sharding, without repeats of an "
                          "entry that names one worker")
        if job.processing_mode == "DYNAMIC" and job.dataset_id in state._datasets:
            if not state._datasets[job.dataset_id].splittable:
                raise _broken(f"DYNAMIC job {job_id} reads a dataset without splits")
        if not (job.garbage_collected == (job.num_live_iterations == 0)
                if job.num_iterations else job.num_live_iterations == 0):
            raise _broken(f"job {job_id}: garbage_collected flag disagrees with its iteration "
                          "counts")
        if job.job_name is None:
            if job.num_iterations > 1:
                raise _broken(f"anonymous job {job_id} has several iterations")
        else:
            if not ((state._jobs_by_name.get((job.dataset_id, job.job_name)) == job_id)
                    != job.garbage_collected):
                raise _broken(f"job {job_id}: name index disagrees with "
                              f"garbage_collected={job.garbage_collected}")
    for (dataset_id, job_name), job_id in state._jobs_by_name.items():
        job = state._jobs.get(job_id)  # type: ignore[assignment]  # None: invariant fails
        if not (job is not None
                and (job.dataset_id, job.job_name) == (dataset_id, job_name)
                and not job.garbage_collected):
            raise _broken(f"job name {job_name!r} of dataset {dataset_id} indexes job {job_id} "
                          "wrongly")

    # Iterations, their keys, their counts and derived flags.
    num_iterations = dict.fromkeys(state._jobs, 0)
    num_live = dict.fromkeys(state._jobs, 0)
    num_clients = dict.fromkeys(state._iterations, 0)
    for client_id, client in state._iteration_clients.items():
        if client.iteration_client_id != client_id:
            raise _broken(f"client {client_id} stored under another id")
        iteration = state._iterations.get(client.iteration_id)
        if not (iteration is not None and not iteration.garbage_collected):
            raise _broken(f"client {client_id} reads unknown or collected iteration "
                          f"{client.iteration_id}")
        num_clients[client.iteration_id] += 1
    for iteration_id, iteration in state._iterations.items():
        if iteration.iteration_id != iteration_id:
            raise _broken(f"iteration {iteration_id} stored under another id")
        job = state._jobs.get(iteration.job_id)  # type: ignore[assignment]  # None: invariant fails
        if job is None:
            raise _broken(f"iteration {iteration_id} of unknown job {iteration.job_id}")
        num_iterations[iteration.job_id] += 1
        num_live[iteration.job_id] += not iteration.garbage_collected
        if not (state._iterations_by_key.get((iteration.job_id, iteration.repetition))
                == iteration_id):
            raise _broken(f"iteration {iteration_id} missing from the key index")
        if job.job_name is None:
            if iteration.repetition != 0:
                raise _broken(f"anonymous iteration {iteration_id} repeats")
        if iteration.num_clients != num_clients[iteration_id]:
            raise _broken(f"iteration {iteration_id} counts {iteration.num_clients} clients, "
                          f"has {num_clients[iteration_id]}")
        dynamic = job.processing_mode == "DYNAMIC"
        if not ((iteration_id in state._split_cursors) == dynamic
                and (iteration_id in state._lost_splits) == dynamic):
            raise _broken(f"iteration {iteration_id}: split cursor present iff DYNAMIC")
        if iteration.garbage_collected:
            if not iteration.finished:
                raise _broken(f"collected iteration {iteration_id} not finished")
            if iteration_id in state._tasks_by_iteration:
                raise _broken(f"collected iteration {iteration_id} still has tasks")
            continue
        task_ids = state._tasks_by_iteration.get(iteration_id)
        if task_ids is None:
            raise _broken(f"iteration {iteration_id} has no task index")
        assert task_ids is not None
        statuses = [state._tasks[task_id].status for task_id in task_ids]
        if not ((iteration.num_tasks, iteration.num_finished_tasks, iteration.num_lost_tasks)
                == (len(statuses), statuses.count("finished"), statuses.count("lost"))):
            raise _broken(f"iteration {iteration_id}: task counts disagree with its tasks")
        # Static sharding: every task has a shard of the job's list; the finished shards
        # are those of the finished tasks.
        if iteration.num_shards != len(job.worker_addresses):
            raise _broken(f"iteration {iteration_id}: {iteration.num_shards} shards, job lists "
                          f"{len(job.worker_addresses)} workers")
        shards = [state._tasks[task_id].shard_index for task_id in task_ids]
        if not (all(i is None for i in shards) if not iteration.num_shards
                else all(i is not None and 0 <= i < iteration.num_shards for i in shards)):
            raise _broken(f"iteration {iteration_id}: task shard indices {shards} outside its "
                          f"{iteration.num_shards} shards")
        if not (iteration.finished_shards
                == {i for i, status in zip(shards, statuses, strict=True) if status == "finished"}
                - {None}):
            raise _broken(f"iteration {iteration_id}: finished shards "
                          f"{sorted(iteration.finished_shards)} disagree with its finished tasks")
        if iteration.finished != derived_finished(iteration):
            raise _broken(f"iteration {iteration_id}: finished={iteration.finished} disagrees with "
                          "its tasks")
    if len(state._iterations_by_key) != len(state._iterations):
        raise _broken("key index has unknown iterations")
    for job_id, job in state._jobs.items():
        if not ((job.num_iterations, job.num_live_iterations)
                == (num_iterations[job_id], num_live[job_id])):
            raise _broken(f"job {job_id}: iteration counts disagree with its iterations")
    if not (state._split_cursors.keys() <= state._iterations.keys()
            and state._lost_splits.keys() <= state._iterations.keys()):
        raise _broken("split cursors of unknown iterations")

    # Tasks and their iteration index.
    for iteration_id, task_ids in state._tasks_by_iteration.items():
        if iteration_id not in state._iterations:
            raise _broken(f"task index of unknown iteration {iteration_id}")
        for task_id in task_ids:
            task = state._tasks.get(task_id)  # type: ignore[assignment]  # None: invariant fails
            if not (task is not None and task.iteration_id == iteration_id):
                raise _broken(f"iteration {iteration_id} lists task {task_id} wrongly")
    by_shard: dict[tuple[int, int], list[int]] = {}
    for task_id, task in state._tasks.items():
        if task.shard_index is not None:
            by_shard.setdefault((task.iteration_id, task.shard_index), []).append(task_id)
    if {k: sorted(v) for k, v in state._tasks_by_shard.items()} != by_shard:
        raise _broken("the shard index disagrees with the tasks")
    for task_id, task in state._tasks.items():
        if task.task_id != task_id:
            raise _broken(f"task {task_id} stored under another id")
        if task.finished and task.lost:
            raise _broken(f"task {task_id} is finished and lost")
        if task_id not in state._tasks_by_iteration.get(task.iteration_id, ()):
            raise _broken(f"task {task_id} missing from its iteration's index")
        if task.worker_address not in state._workers:
            raise _broken(f"task {task_id} on unknown worker")
        if task.status == "active":
            if not (state._tasks_by_worker.get(task.worker_address, {}).get(task.iteration_id)
                    == task_id):
                raise _broken(f"active task {task_id} missing from its worker's index")

    # Splits: each handed out at most once, in flight only on active tasks, behind the
    # cursor, ascending per task, and never both in flight and lost.
    seen: dict[int, set[tuple[int, int]]] = {}
    runs: Sequence[tuple[int, int, int]]
    for iteration_id, runs in state._lost_splits.items():
        lost = expand_runs(runs)
        if not (all(start < stop for _, start, stop in runs) and len(set(lost)) == len(lost)):
            raise _broken(f"iteration {iteration_id}'s lost runs are empty or overlap: {runs}")
        seen[iteration_id] = set(lost)
    for iteration_id, cursor in state._split_cursors.items():
        if cursor.iteration_id != iteration_id:
            raise _broken(f"cursor {iteration_id} stored wrongly")
        job = state._jobs[state._iterations[iteration_id].job_id]
        live_dataset = state._datasets.get(job.dataset_id)  # None: collected (the job too)
        if not ((live_dataset is None or cursor.num_splits == live_dataset.num_splits)
                and 0 <= cursor.next_index <= cursor.num_splits
                and cursor.repetition >= 0):
            raise _broken(f"cursor of iteration {iteration_id} out of range: {cursor}")
        for split in seen[iteration_id]:
            if split >= (cursor.repetition, cursor.next_index):
                raise _broken(f"lost split {split} of iteration {iteration_id} is not behind the "
                              "cursor")
    for task_id, runs in state._splits_in_flight.items():
        task = state._tasks.get(task_id)  # type: ignore[assignment]  # None: invariant fails
        if not (task is not None and task.status == "active"):
            raise _broken(f"task {task_id} holds splits but is not active")
        if not runs:
            raise _broken(f"task {task_id} has an empty in-flight entry")
        if not all(start < stop for _, start, stop in runs):
            raise _broken(f"task {task_id} holds an empty run of splits: {list(runs)}")
        if not all((r1, b1) < (r2, a2)
                   for (r1, _, b1), (r2, a2, _) in zip(runs, list(runs)[1:], strict=False)):
            raise _broken(f"task {task_id}'s runs of splits are not ascending and merged: "
                          f"{list(runs)}")
        held = expand_runs(runs)
        cursor = state._split_cursors.get(task.iteration_id)  # type: ignore[assignment]  # None: invariant fails
        if cursor is None:
            raise _broken(f"task {task_id} holds splits of a non-DYNAMIC iteration")
        if held[-1] >= (cursor.repetition, cursor.next_index):
            raise _broken(f"task {task_id} holds a split that was not handed out yet")
        handed_out = seen[task.iteration_id]
        if handed_out.intersection(held):
            raise _broken(f"task {task_id} holds a split twice handed out")
        handed_out.update(held)
    _split_order.validate(state)  # explicit orders (locality hand-out)


def _broken(message: str) -> AssertionError:
    # An explicit raise rather than ``assert``, so that ``python -O`` still validates. Each
    # message is formatted only once its invariant failed: the simulator validates after every
    # step, and formatting every message took most of that time.
    return AssertionError(f"DispatcherState invariant broken: {message}")
