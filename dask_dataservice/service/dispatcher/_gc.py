"""Which idle named iterations the dispatcher's garbage collection may remove, and the
queues of idle jobs and datasets it collects after their timeout.

The collection itself (releasing clients that stopped sending heartbeats, dropping silent
data workers, collecting idle named iterations after ``dispatcher.job-gc-timeout``, jobs
that never got an iteration after the same, datasets without jobs after
``dispatcher.dataset-gc-timeout``) is :meth:`~.core.DispatcherCore.gc_tick`, run by the
plugin's ``dataservice-gc`` periodic callback. Pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._entities import Iteration

if TYPE_CHECKING:
    from .state import DispatcherState

__all__ = ["IdleQueue", "collectable"]


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
        #: ``{id: idle since}``, in the order the ids became idle.
        self._since: dict[int, int] = {}
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
