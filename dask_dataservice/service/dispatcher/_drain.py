"""Draining a data worker before it retires: the dispatcher core's part, sans I/O (issue 26).

:meth:`~.core.DispatcherCore.drain_worker` marks the worker draining (the core's volatile
``draining`` set: a restarted scheduler has no retirement under way): from then on it gets
no new task (``is_data_worker``) and its DYNAMIC tasks are handed no new split (``get_split``
answers ``drained``; the worker's pipeline ends once it made the splits it holds). This
module answers which tasks to wait for (:func:`drain`) and which are still producing
(:func:`pending`); the shell (:mod:`._retire`) waits, and asks the worker whether its
consumers took and acknowledged everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ...errors import (
    IterationNotFoundError,
    JobNotFoundError,
    TaskNotFoundError,
    WorkerNotFoundError,
)

if TYPE_CHECKING:
    from .core import DispatcherCore
    from .state import DispatcherState

__all__ = ["drain", "pending"]


def drain(core: DispatcherCore, address: str, held: Iterable[int]) -> list[int]:
    """Mark ``address`` draining; answer the tasks to wait for before it may go.

    ``held``: the tasks the worker says it holds. A finished task leaves the dispatcher's
    index of the worker's tasks, but may still hold elements its consumers have not read
    (found by the simulator's ``retire`` workload), so the worker's word counts too.

    The tasks waited for: of DYNAMIC iterations that are neither coordinated reads nor
    cross-trainer caches, producing or finished. The others follow TensorFlow's rule for a
    worker that leaves: an OFF or static task is its worker's share of the data, a
    coordinated read keeps the task list it started with, and a cross-trainer cache promises
    no element to anyone (a slow trainer skips); they end with the worker. O(the worker's
    tasks).
    """
    core.draining.add(address)
    state = core.state
    ids = set(held)
    try:
        ids.update(t.task_id for t in state.tasks_for_worker(address))
    except WorkerNotFoundError:  # never registered (or gone): only what it says it holds
        pass
    out: list[int] = []
    for tid in sorted(ids):
        try:
            task = state.task(tid)
            job = state.job(state.iteration(task.iteration_id).job_id)
        except (TaskNotFoundError, IterationNotFoundError, JobNotFoundError):
            continue
        if task.worker_address == address and task.status in ("active", "finished") \
                and job.processing_mode == "DYNAMIC" and job.num_consumers is None \
                and not job.cross_trainer_cache:
            out.append(tid)
    return out


def pending(state: DispatcherState, task_ids: Iterable[int], *,
            finished: bool = False) -> list[int]:
    """Of ``task_ids``, those still producing (active at the dispatcher), or with
    ``finished`` those that finished producing, of reads that have consumers (what a task
    makes for nobody is not waited for)."""
    out = []
    for tid in task_ids:
        try:
            task = state.task(tid)
            if (task.status == "active") != finished \
                    and state.iteration(task.iteration_id).num_clients > 0:
                out.append(tid)
        except (TaskNotFoundError, IterationNotFoundError):
            pass
    return out
