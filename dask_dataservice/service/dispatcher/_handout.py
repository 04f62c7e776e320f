"""Handing out a DYNAMIC iteration's splits (the dispatcher core's, sans I/O).

- :func:`hand_out`: the next splits for a task, what ``get_split`` answers. A task pushed to
  its worker when its iteration starts carries its first split this way too (issue 25: the
  first split travels with the task, so the first element waits for no split request).
- :func:`undelivered`: the splits handed to a task that it never got, answered again to the
  request that says how many it ``received``. A task's first split request always says it:
  the first split of a task whose push was lost (a dispatcher that crashed after journaling
  it, whose revived task then reaches its worker without the split) is handed out again
  then, not lost.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...errors import DataServiceError
from . import _locality, _split_order
from ._shares import fair_share
from ._updates import ProduceSplits

if TYPE_CHECKING:
    from .core import DispatcherCore
    from .state import DispatcherState

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")


def hand_out(core: DispatcherCore, iteration_id: int, task_id: int, repetition: int,
             count: int) -> tuple[list[int], bool]:
    """Up to ``count`` next split indices of ``repetition`` for ``task_id`` (applied as one
    ``ProduceSplits`` record), and whether the repetition has no split after them. O(count).
    None and the end for a task no longer active or a repetition already over."""
    state = core.state
    current, index, num_splits = state.split_position(iteration_id)
    if state.task_status(task_id) != "active" or repetition < current:
        return [], True
    if repetition > current:
        raise DataServiceError(
            f"task {task_id} asked for repetition {repetition} of iteration "
            f"{iteration_id}, which is only at repetition {current}"
        )
    left = num_splits - index
    count = min(max(1, int(count)), core.config.split_batch_max, left)
    # locality hint (persisted Dask collection): the worker's own splits first
    indices = _locality.pick(state, core.hints, core.cluster.holders, iteration_id, task_id,
                             count)
    count = len(indices) if indices else min(
        count, fair_share(left, state.running_tasks(iteration_id), repetition))
    end = count == num_splits - index  # nothing after these: say so now
    if index == num_splits:
        count, end = 0, True
    # One record for the whole call, however many splits it hands out.
    core._apply(ProduceSplits(iteration_id=iteration_id, repetition=repetition, index=index,
                              count=count, task_id=task_id, end_of_splits=end, indices=indices))
    return list(indices or range(index, index + count)), end


def undelivered(state: DispatcherState, iteration_id: int, task_id: int, repetition: int,
                received: int) -> tuple[list[int], bool] | None:
    """The splits of ``repetition`` handed to ``task_id`` beyond the ``received`` first ones
    (a reply that never arrived), with whether the repetition ended after them; ``None`` when
    there are none. O(runs the task holds): asked by retried requests and by a task's
    first one."""
    held = state._splits_in_flight.get(task_id)
    if not held:
        return None
    positions = [i for rep, start, stop in held if rep == repetition
                 for i in range(start, stop)]
    if len(positions) <= received:
        return None
    tail = positions[received:]
    current = state.split_position(iteration_id)[0]
    if current == repetition:
        order = list(_split_order.taken(state, iteration_id))
        indices = [order[p] for p in tail] if order else tail
    else:
        job = state.job(state.iteration(iteration_id).job_id)
        if _locality.ordered(state.dataset(job.dataset_id).metadata):
            # an explicit order: the last ended repetition's is kept; an older one's is
            # forgotten (its positions cannot be mapped back: they stay in flight)
            ended = _split_order.ended_split_at(state, iteration_id, repetition, tail)
            if ended is None:
                return None
            indices = ended
        else:
            indices = tail
    logger.info("dataservice: task %s never got %d splits of repetition %d handed to it (a "
                "reply lost with the previous dispatcher): handing them out again",
                task_id, len(tail), repetition)
    return indices, current > repetition
