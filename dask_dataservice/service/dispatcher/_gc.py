"""Which idle named iterations the dispatcher's garbage collection may remove.

The collection itself (releasing clients that stopped sending heartbeats, dropping silent
data workers, collecting idle named iterations after ``dispatcher.job-gc-timeout``) is
:meth:`~.core.DispatcherCore.gc_tick`, run by the plugin's ``dataservice-gc``
periodic callback. Pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._entities import Iteration

if TYPE_CHECKING:
    from .state import DispatcherState

__all__ = ["collectable"]


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
