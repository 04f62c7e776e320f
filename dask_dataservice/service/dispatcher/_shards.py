"""Static sharding on the dispatcher: which shard of a job's worker list a worker takes.

A static job (``FILE``, ``DATA``, ``HINT``...) journals its worker list; each worker that gets
a task takes its position in it (:class:`~..protocol._job_checks.ShardMap` has the rules).
The lists are kept as lookups, built once per job, so a job of ``N`` listed workers starts in
O(N), not O(N²) (10,000 workers took about three minutes before, ``docs/scaling.md``); the
shards held come from the state's index by iteration and shard. Volatile: a cache of the
journaled lists.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..protocol._job_checks import ShardMap

if TYPE_CHECKING:
    from ._entities import Job
    from .core import ClusterView
    from .state import DispatcherState

__all__ = ["ShardMaps", "warn_changed_worker_lists"]

logger = logging.getLogger("dask_dataservice.service.dispatcher.plugin")


class ShardMaps:
    """The worker lists of static jobs as lookups, the ``size`` most recently built kept."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._maps: dict[int, ShardMap] = {}

    def _map(self, job: Job) -> ShardMap:
        shard_map = self._maps.get(job.job_id)
        if shard_map is None:
            if len(self._maps) >= self.size:
                del self._maps[next(iter(self._maps))]
            shard_map = self._maps[job.job_id] = ShardMap(job.worker_addresses)
        return shard_map

    def shard(self, state: DispatcherState, cluster: ClusterView, iteration_id: int, job: Job,
              address: str) -> int | None:
        """``address``'s shard of the job's list in this iteration; None if it is not listed.
        A host entry is taken when another worker of the iteration present in the cluster
        holds it. O(1 + entries of the worker's host)."""
        info = cluster.worker(address)

        def taken(shard: int) -> bool:
            return any(holder != address and cluster.worker(holder)
                       for holder in state.shard_holders(iteration_id, shard))

        return self._map(job).index(address, None if info is None else info.name, taken)


def warn_changed_worker_lists(state: DispatcherState, configured: Sequence[str] | None) -> None:
    """Say so when the config's worker list differs from what live static jobs journaled
    (at a start). Those jobs keep their own list (a shard is never reassigned by a config
    change); only new jobs use the new one."""
    config_list = tuple(configured or ())
    for job in state.list_jobs():
        if job.worker_addresses and not job.garbage_collected and \
                job.worker_addresses != config_list:
            gone = sorted(set(job.worker_addresses) - set(config_list))
            logger.warning(
                "dataservice: job %s keeps the worker list it was created with, %s; the "
                "dispatcher is now configured with %s (new jobs use it)%s",
                job.job_id, list(job.worker_addresses), list(config_list),
                f"; no longer configured: {gone}" if gone else "")
