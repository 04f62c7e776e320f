"""Iteration views a consumer already has are not sent again (docs/scaling.md).

A consumer heartbeats every ``client.heartbeat-interval`` (250 ms) and the answer is its
iteration's *view*: every task with its worker and status. Building and sending it costs
O(tasks), about 4 µs per task on the scheduler (``benchmarks/dispatcher_scale.py``), so C
consumers of a job on W workers cost C × W per interval: 4.3 ms per heartbeat at 1,000 workers.
Most heartbeats change nothing. So:

- The dispatcher builds each iteration's view once per *view epoch* and keeps it
  (:class:`ViewCache`).
- The epoch moves on with every update that can change a view: a task created, finished
  or lost, a worker removed, an iteration collected, and anything not known to be harmless.
  Split hand-out, acknowledgements, consumers joining and leaving, and registrations
  leave it alone (:data:`VIEW_STABLE_UPDATES`). The frequent updates are the harmless ones.
- Each view carries a version ``"<start nonce>-<epoch>"``. A consumer sends the version it
  has with its heartbeat; if that is still the current version, the answer is
  ``{"unchanged": True}`` and nothing else. The nonce is new at every dispatcher start, so
  a version from before a restart never matches.

Costs, measured with 1,000 workers: a heartbeat with nothing new costs O(1), instead of
4.3 ms. A changed view costs what it did before, once per epoch per iteration.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..protocol._messages import IterationView, TaskInfo
from ._updates import (
    AckSplits,
    AcquireIterationClient,
    ClientHeartbeat,
    CreateJob,
    ProduceSplit,
    ProduceSplits,
    RegisterDataset,
    RegisterWorker,
    ReleaseIterationClient,
    Update,
)

if TYPE_CHECKING:
    from .state import DispatcherState

__all__ = ["VIEW_STABLE_UPDATES", "ViewCache"]

#: Updates that change no iteration view (tasks, their workers and statuses, finished,
#: collected, mode). Anything else starts a new view epoch, so an update type added later
#: is safe by default.
VIEW_STABLE_UPDATES: tuple[type, ...] = (
    ProduceSplit, ProduceSplits, AckSplits, AcquireIterationClient, ReleaseIterationClient,
    ClientHeartbeat, RegisterDataset, CreateJob, RegisterWorker,
)


class ViewCache:
    """The current view of each iteration, built at most once per view epoch."""

    def __init__(self, nonce: str | None = None) -> None:
        self._nonce = secrets.token_hex(4) if nonce is None else nonce
        self._epoch = 0
        self._views: dict[int, IterationView] = {}

    @property
    def version(self) -> str:
        """The current version of every view (consumers send it back with heartbeats)."""
        return f"{self._nonce}-{self._epoch}"

    def updated(self, update: Update) -> None:
        """Called with every applied update: start a new epoch unless it changes no view."""
        if not isinstance(update, VIEW_STABLE_UPDATES):
            self._epoch += 1
            self._views.clear()

    def get(self, iteration_id: int, build: Callable[[int], IterationView]) -> IterationView:
        """The iteration's view: built now if this epoch has none yet. Callers never mutate
        it (it is shared by every consumer of the iteration until the next epoch)."""
        view = self._views.get(iteration_id)
        if view is None:
            view = self._views[iteration_id] = build(iteration_id)
        return view


def build_view(state: DispatcherState, iteration_id: int) -> IterationView:
    """What a consumer of the iteration is told: its tasks, whether it finished, and (static
    sharding) how many listed workers have no task yet."""
    iteration = state.iteration(iteration_id)
    if iteration.garbage_collected:
        return IterationView(tasks=[], finished=True, garbage_collected=True)
    task_list = state.tasks_for_iteration(iteration_id)
    tasks = [TaskInfo(task_id=t.task_id, worker_address=t.worker_address, status=t.status)
             for t in task_list]
    job = state.job(iteration.job_id)
    shards = {t.shard_index for t in task_list if t.shard_index is not None}
    return IterationView(tasks=tasks, finished=iteration.finished, garbage_collected=False,
                         processing_mode=job.processing_mode, num_consumers=job.num_consumers,
                         pending_shards=max(0, iteration.num_shards - len(shards)))
